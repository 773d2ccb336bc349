"""The user's training spec: what `gpuprov plan`/`generate` take from flags or gpuprov.yaml.

One pydantic model is the single definition: the CLI flags, the YAML file and `gpuprov schema`
(JSON Schema) all come from it. Unknown keys are errors (a typo must not be ignored silently).
"""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PositiveInt, ValidationInfo, \
    field_validator, model_validator

from gpuprov import validators as v
from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import ActivationCheckpointing, Offload, Optimizer, PpSchedule, Precision, Task

Cloud = Literal["aws", "gcp", "azure", "oci", "onprem", "any"]
Objective = Literal["cost", "time", "gpus"]

# Every string that can reach a rendered file is checked here (gpuprov/validators.py has the patterns)
# (the JSON Schema carries the pattern too, so editors flag a bad value before gpuprov runs)
HostName = Annotated[str, AfterValidator(v.host_name), Field(json_schema_extra={"pattern": v.HOST_NAME_PATTERN})]
Address = Annotated[str, AfterValidator(v.address)]
UserName = Annotated[str, AfterValidator(v.user_name), Field(json_schema_extra={"pattern": v.USER_PATTERN})]
ModelRef = Annotated[str, AfterValidator(v.model_ref)]
DatasetRef = Annotated[str, AfterValidator(v.dataset_ref)]
Region = Annotated[str, AfterValidator(v.region), Field(json_schema_extra={"pattern": v.REGION_PATTERN})]
Slug = Annotated[str, AfterValidator(v.slug), Field(json_schema_extra={"pattern": v.SLUG_PATTERN})]
Cidr = Annotated[str, AfterValidator(v.cidr)]
AwsReservationId = Annotated[str, AfterValidator(v.aws_reservation_id)]
GcpReservation = Annotated[str, AfterValidator(v.gcp_reservation)]
NfsExport = Annotated[str, AfterValidator(v.nfs_export)]


class HostEntry(BaseModel):
    """An on-prem host the user owns (from `--hosts FILE`)."""

    model_config = ConfigDict(extra="forbid")

    name: HostName
    address: Address
    user: UserName | None = None
    port: int | None = Field(None, ge=1, le=65535, description="SSH port (default 22; Ansible's ansible_port)")
    # what the host holds (written by hand or by `gpuprov hosts probe`); gpu and gpus go together
    gpu: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$", description="GPU slug, e.g. a100-80gb")
    gpus: PositiveInt | None = Field(None, description="GPUs in this host")
    ram_gib: PositiveInt | None = None
    cores: PositiveInt | None = Field(None, description="physical CPU cores")
    nvme_count: int | None = Field(None, ge=0)
    nvme_gb_each: int | None = Field(None, ge=0)
    fabric: Literal["infiniband", "roce", "ethernet"] | None = None
    nic_gbps: PositiveInt | None = Field(None, description="fastest inter-node link of the host, Gb/s in total")
    power_limit_w: PositiveInt | None = Field(None, le=v.MAX_GPU_POWER_W,
                                              description="the GPUs' power limit in W where below their TDP "
                                                          "(nvidia-smi -pl); the plan times them at its clocks")

    @model_validator(mode="after")
    def _gpu_and_count(self) -> "HostEntry":
        if (self.gpu is None) != (self.gpus is None):
            raise ValueError("give gpu and gpus together (e.g. gpu: a100-80gb, gpus: 8)")
        return self


def _note_text(value: str) -> str:
    v.safe_text(value, "calibration text")
    return value


NoteText = Annotated[str, Field(max_length=400), AfterValidator(_note_text)]


class Calibration(BaseModel):
    """A measured run against its plan (`gpuprov calibrate`): plans on this GPU type scale their GEMMs' achieved
    throughput by gemm_efficiency_ratio, or without one their step time by 1 / speed_ratio
    (gpuprov/calibration.py RULE)."""

    model_config = ConfigDict(extra="forbid")

    gpu: Slug = Field(..., description="GPU type (slug) the run was measured on")
    speed_ratio: float = Field(..., ge=0.05, le=20.0, description="measured / predicted tokens/s")
    gemm_efficiency_ratio: float | None = Field(
        None, ge=0.05, le=20.0, description="the factor on achieved GEMM throughput that gives the measured speed")
    gpu_power_w: PositiveInt | None = Field(None, le=v.MAX_GPU_POWER_W, description="the power limit it ran at")
    model: NoteText | None = None
    layout: NoteText | None = None
    source: NoteText | None = None

    def power_w_text(self) -> str | None:
        return None if self.gpu_power_w is None else f"{self.gpu_power_w} W"


BACKEND_KEY = r"^[a-z][a-z0-9_]{0,63}$"


def _backend_value(value: str | int | bool) -> str | int | bool:
    if isinstance(value, str):
        v.safe_text(value, "terraform_backend value")
        if len(value) > 1024:
            raise ValueError("terraform_backend value is longer than 1024 characters")
    return value


class TerraformBackend(BaseModel):
    """Where Terraform keeps its state (rendered into terraform/backend.tf, so CI sees no drift)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["s3", "gcs", "azurerm", "oci", "http", "consul", "pg"] = Field(
        ..., description="Terraform backend type (s3 for AWS, gcs for GCP, azurerm for Azure)")
    config: dict[Annotated[str, Field(pattern=BACKEND_KEY)],
                 Annotated[str | int | bool, AfterValidator(_backend_value)]] = Field(
        default_factory=dict, max_length=32,
        description="The backend's arguments, e.g. {bucket: my-state, key: gpuprov/70b.tfstate, region: us-east-1, "
                    "use_lockfile: true}; no secrets (Terraform reads credentials from the environment)")


class TrainingSpec(BaseModel):
    """What to train and under which constraints; the planner decides everything else."""

    model_config = ConfigDict(extra="forbid")

    model: ModelRef = Field("llama-3.1-8b", description="Preset name (e.g. 70b, llama-3.1-8b), Hugging Face model id "
                                                        "(ORG/NAME) or path to a config.json")
    task: Task = Field("full", description="Fine-tune the pretrained weights: full, LoRA or QLoRA")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="pretrained: fine-tune the model's published weights; random: train from "
                                  "scratch (--from-scratch), full training only")
    recipe: Literal["torchtune", "axolotl", "trl"] | None = Field(
        None, description="Published fine-tuning recipe the batch, learning rate, warmup and epochs come from "
                          "(catalog/data/recipes.yaml; default torchtune)")
    seq_len: PositiveInt = Field(4096, le=v.MAX_SEQ_LEN, description="Tokens per sample")
    global_batch: PositiveInt | None = Field(None, le=v.MAX_BATCH_TOKENS,
                                             description="Sequences per optimizer step, all GPUs (default: the recipe's)")
    global_batch_tokens: PositiveInt | None = Field(None, le=v.MAX_BATCH_TOKENS,
                                                    description="Tokens per optimizer step, all GPUs (default: the "
                                                                "recipe's sequences x seq_len; from scratch 4M)")
    dataset: DatasetRef | None = Field(None, description="The training data: a token count (100M), a data directory "
                                                          "or meta.json from launch/prepare_data.py, or a text/JSONL file")
    dataset_tokens: PositiveInt | None = Field(None, le=v.MAX_TOKENS,
                                               description="Tokens in one pass over `dataset` (gpuprov fills it)")
    dataset_tokens_how: Literal["given", "meta.json", "measured", "estimated", "remote"] | None = Field(
        None, description="How dataset_tokens was counted (gpuprov fills it with the count): measured with the "
                          "model's tokenizer, estimated from the file's bytes, meta.json, or given")
    sample_tokens: float | None = Field(None, gt=0, le=v.MAX_SEQ_LEN,
                                        description="Mean tokens per sample of `dataset` (gpuprov fills it from "
                                                    "a local JSONL file)")
    sample_tokens_how: Literal["measured", "estimated"] | None = Field(
        None, description="measured: with the model's tokenizer on the file's first records; estimated: from "
                          "their bytes (no tokenizer on this machine)")
    epochs: float | None = Field(None, gt=0, le=1000, description="Passes over the dataset (default: the recipe's)")
    checkpoint_every_steps: PositiveInt | None = Field(
        None, le=v.MAX_TOKENS, description="Optimizer steps between checkpoints, what a lost node's job resumes from "
                                         "(default: about an hour of training at the plan's step time)")
    tokens: PositiveInt | None = Field(None, le=v.MAX_TOKENS,
                                       description="Training tokens to process in the run (default: dataset x "
                                                   "epochs; from scratch 10B)")
    deadline_hours: float | None = Field(None, gt=0, le=v.MAX_HOURS, description="Finish within this many hours")
    budget_usd: float | None = Field(None, gt=0, le=v.MAX_USD, description="Spend at most this much")
    cloud: Cloud = Field("any", description="Where to run; 'any' compares all clouds")
    region: Region | None = Field(None, description="Cloud region (default: the catalog's priced region; "
                                  "with a zone: the zone's region)")
    zone: Region | None = Field(None, description="Zone of the nodes (AWS, GCP): a reservation's zone; looked up "
                                "from the reservation when the cloud CLI is signed in")
    gpus: list[Slug] | None = Field(None, max_length=64, description="Allowed GPU types (slugs); default all")
    max_nodes: PositiveInt = Field(32, le=v.MAX_NODES, description="Largest node count to consider")
    objective: Objective = Field("cost", description="Rank by cost to train, time, or GPU count")
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    offload: Offload = "none"
    lora_rank: PositiveInt = Field(16, le=v.MAX_LORA_RANK)
    lora_targets: list[Slug] | Slug = Field("all-linear", description="qv, attention, all-linear or module names")
    safety_margin: float = Field(0.10, ge=0, lt=0.9, description="Fraction of GPU memory kept free")
    hosts: list[HostEntry] | None = Field(None, max_length=v.MAX_HOSTS, description="On-prem hosts (cloud: onprem)")
    ssh_cidr: Cidr | None = Field(None, description="CIDR allowed to SSH to the nodes; none = SSM only")
    capacity_reservation_id: AwsReservationId | None = Field(None, description="AWS capacity reservation / Capacity Block id")
    reservation: GcpReservation | None = Field(None, description="GCP reservation name (or projects/P/reservations/R)")
    shared_nfs: NfsExport | None = Field(None, description="On-prem: the NFS export (server:/path) every node mounts "
                                         "at /shared for multi-node checkpoints")

    purchase: list[Literal["on-demand", "spot", "capacity-block", "reservation", "flex-start"]] | None = Field(
        None, description="Purchase options allowed (default: on-demand, flex-start, plus the reservation "
                          "or Capacity Block given)")
    placement_group: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$",
                                        description="AWS: launch into this existing placement group")
    gpu_count: PositiveInt | None = Field(None, le=v.MAX_GPUS, description="Exactly this many GPUs in total (e.g. 2: the GPUs you have)")
    framework: str = Field("gpuprov", description="Training stack the memory is sized for (a preset of "
                           "catalog/data/frameworks.yaml); the bundle's launch files run gpuprov's own trainer")

    terraform_backend: TerraformBackend | None = Field(
        None, description="Remote Terraform state: rendered into terraform/backend.tf (default: local state)")

    tp: PositiveInt | None = Field(None, le=1024, description="Tensor-parallel degree (+ sequence parallel); default: the planner chooses")
    cp: PositiveInt | None = Field(None, le=1024, description="Context-parallel degree (keys and values all-gathered "
                                   "over the CP group for per-document attention); default: the planner chooses")
    pp: PositiveInt | None = Field(None, le=1024, description="Pipeline stages; default: the planner also tries 2, 4 and 8 where the "
                                 "trainer pipelines the run (full training, untied dense model); 1: no PP")
    pp_schedule: PpSchedule = Field(
        "1F1B", description="torch.distributed.pipelining schedule with pp > 1 (Interleaved1F1B: two stages per rank)")
    gpu_power_limit_w: PositiveInt | None = Field(
        None, le=v.MAX_GPU_POWER_W, description="The GPUs run under this power limit in W (nvidia-smi -pl; e.g. 500 "
                                                "for H100s at a 500 W site limit); the plan times them at its clocks")
    calibration: list[Calibration] | None = Field(
        None, max_length=64, description="Measured runs (`gpuprov calibrate ... -o FILE`, then --calibration FILE): "
                                         "plans on the same GPU type scale their step time by predicted/measured")
    # training settings a user fixes (as `gpuprov estimate` takes them); None: the planner chooses
    activation_checkpointing: ActivationCheckpointing | None = Field(
        None, description="Activation checkpointing none, selective or full (default: the planner chooses)")
    micro_batch: PositiveInt | None = Field(None, le=v.MAX_BATCH_TOKENS,
                                            description="Samples per GPU per forward (default: the planner chooses)")
    grad_accumulation: PositiveInt | None = Field(
        None, le=v.MAX_BATCH_TOKENS, description="Micro-batches per optimizer step (with pp > 1: the pipeline's "
                                                 "micro-batches per step; default: the planner chooses)")
    compile: bool | None = Field(None, description="torch.compile per decoder block (default: on for full and LoRA "
                                                   "training, off for QLoRA)")
    float8: bool = Field(False, description="Allow torchao float8 training where it has a measured speed-up "
                         "(Hopper; full bf16-mixed training, TP up to 8); the planner counts its gain and memory")

    export_merged: bool = Field(False, description="LoRA/QLoRA: the export also writes the base with the adapter "
                                "merged in (sharded safetensors transformers loads), beside the peft adapter")

    slurm: Literal["auto", "install", "existing", "none"] = Field(
        "auto", description="Batch scheduler: auto (Slurm on multi-node clusters), install (also on one node), "
                            "existing (on-prem: the site's Slurm; jobs only) or none (torchrun on every node)")

    @model_validator(mode="after")
    def _one_calibration_per_gpu(self) -> "TrainingSpec":
        slugs = [c.gpu for c in self.calibration or []]
        twice = sorted({s for s in slugs if slugs.count(s) > 1})
        if twice:
            raise ValueError(f"calibration: more than one for {', '.join(twice)}; give one measured run per GPU type")
        return self

    @model_validator(mode="after")
    def _compile_task(self) -> "TrainingSpec":
        from gpuprov.stack import compile_refusal

        why = compile_refusal(self.task) if self.compile else None
        if why:
            raise ValueError(why)
        return self

    @model_validator(mode="after")
    def _merged_adapter(self) -> "TrainingSpec":
        if self.export_merged and self.task == "full":
            raise ValueError("export_merged (--export-merged) folds a LoRA adapter into its base; a full fine-tune "
                             "exports the whole model already: leave it out")
        return self

    @model_validator(mode="after")
    def _existing_slurm_on_prem(self) -> "TrainingSpec":
        if self.slurm == "existing" and self.cloud != "onprem":
            raise ValueError("slurm: existing needs cloud: onprem (a cloud bundle installs its own Slurm)")
        return self


    @model_validator(mode="after")
    def _budget(self) -> "TrainingSpec":
        """Fill the batch and token budget the user left out from the task's recipe (gpuprov/recipes.py)."""
        from gpuprov import recipes

        if self.init == "random" and self.task != "full":
            raise ValueError(f"init: random (--from-scratch) trains every weight; {self.task} adapts pretrained "
                             "weights: use --task full")
        if self.init == "random" and self.recipe is not None:
            raise ValueError("recipe is a fine-tuning recipe; a from-scratch run takes the pre-training defaults")
        if self.dataset is not None and self.dataset_tokens is None:
            try:
                size = recipes.dataset_tokens(self.dataset, Path.cwd(), self.model)
            except GpuprovError as exc:
                raise ValueError(str(exc)) from None
            self.dataset_tokens = size.tokens
            if size.sample is not None and self.sample_tokens is None:
                self.sample_tokens, self.sample_tokens_how = round(size.sample.mean_tokens, 1), size.sample.how
        tokens, batch, _assumed = recipes.fill_budget(
            task=self.task, init=self.init, recipe_name=self.recipe, seq_len=self.seq_len, tokens=self.tokens,
            global_batch_tokens=self.global_batch_tokens, global_batch=self.global_batch,
            dataset_tokens=self.dataset_tokens, epochs=self.epochs,
            params=recipes.model_params(self.model) if self.init != "random" else None)
        if tokens > v.MAX_TOKENS or (batch or 0) > v.MAX_BATCH_TOKENS:
            raise ValueError(f"{tokens:,} tokens in batches of {batch:,} is past gpuprov's limits")
        # the sequences form is input only: the spec keeps the token count (one number, no disagreement);
        # None: the recipe's batch, decided by the plan for the data-parallel degree it picks
        self.tokens, self.global_batch_tokens, self.global_batch = tokens, batch, None
        return self

    @model_validator(mode="before")
    @classmethod
    def _gpu_names(cls, data: object) -> object:
        """`gpus:` lists GPU types (slugs or SkyPilot names, H100:8 = 8 GPUs in total); a number there is
        the other `--gpus` (the count, `gpu_count:`): say so instead of a type error."""
        if not isinstance(data, dict) or data.get("gpus") is None:
            return data
        from gpuprov.catalog.gpus import accelerator_name

        raw = data["gpus"]
        if isinstance(raw, int) and not isinstance(raw, bool):
            raise ValueError(f"gpus: lists GPU types (like --gpu h100-80gb); for {raw} GPUs in total write "
                             f"gpu_count: {raw} (the --gpus flag)")
        items, counts = ([raw] if isinstance(raw, str) else raw), set()
        if not isinstance(items, list):
            return data
        slugs = []
        for item in items:
            try:
                named = accelerator_name(item) if isinstance(item, str) else None
            except GpuprovError as exc:
                raise ValueError(str(exc)) from None
            slugs.append(named[0] if named else item)
            if named and named[1]:
                counts.add(named[1])
        if len(counts) > 1 or (counts and data.get("gpu_count") not in (None, *counts)):
            raise ValueError(f"gpus: {', '.join(map(str, items))} ask for different GPU counts "
                             f"(gpu_count {data.get('gpu_count')}); give one")
        out = dict(data, gpus=slugs)
        if counts:
            out["gpu_count"] = counts.pop()
        return out

    @field_validator("region")
    @classmethod
    def _region_of_cloud(cls, region: str | None, info: ValidationInfo) -> str | None:
        problem = v.region_for(info.data.get("cloud", ""), region) if region else None
        if problem:
            raise ValueError(problem)
        return region

    @model_validator(mode="after")
    def _zone_in_region(self) -> "TrainingSpec":
        """A zone fixes the region (a reservation lives in one zone: the nodes must be there)."""
        if self.zone is None:
            return self
        region, problem = v.zone_for(self.cloud, self.zone)
        if problem:
            raise ValueError(problem)
        if self.region is not None and self.region != region:
            raise ValueError(f"zone {self.zone} is in {region}, not in region {self.region}")
        self.region = region
        return self

    @field_validator("framework")
    @classmethod
    def _known_framework(cls, value: str) -> str:
        from gpuprov.sizing.frameworks import names

        if value not in names():
            raise ValueError(f"unknown framework {value!r}; one of {', '.join(names())}")
        return value
