"""The user's training spec: what `gpuprov plan`/`generate` take from flags or gpuprov.yaml.

One pydantic model is the single definition: the CLI flags, the YAML file and `gpuprov schema`
(JSON Schema) all come from it. Unknown keys are errors (a typo must not be ignored silently).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from gpuprov.sizing.types import Offload, Optimizer, Precision, Task

Cloud = Literal["aws", "gcp", "azure", "oci", "onprem", "any"]
Objective = Literal["cost", "time", "gpus"]


class HostEntry(BaseModel):
    """An on-prem host the user owns (from `--hosts FILE`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    address: str = Field(min_length=1)
    user: str | None = None
    # what the host holds (written by hand or by `gpuprov hosts probe`); gpu and gpus go together
    gpu: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9-]*$", description="GPU slug, e.g. a100-80gb")
    gpus: PositiveInt | None = Field(None, description="GPUs in this host")
    ram_gib: PositiveInt | None = None
    cores: PositiveInt | None = Field(None, description="physical CPU cores")
    nvme_count: int | None = Field(None, ge=0)
    nvme_gb_each: int | None = Field(None, ge=0)
    fabric: Literal["infiniband", "roce", "ethernet"] | None = None
    nic_gbps: PositiveInt | None = Field(None, description="fastest inter-node link of the host, Gb/s in total")

    @model_validator(mode="after")
    def _gpu_and_count(self) -> "HostEntry":
        if (self.gpu is None) != (self.gpus is None):
            raise ValueError("give gpu and gpus together (e.g. gpu: a100-80gb, gpus: 8)")
        return self


class TrainingSpec(BaseModel):
    """What to train and under which constraints; the planner decides everything else."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("7b", description="Preset name (e.g. 70b, llama-3.1-8b), Hugging Face model id (ORG/NAME) or path to a config.json")
    task: Task = Field("full", description="full fine-tune / pre-train, LoRA or QLoRA")
    seq_len: PositiveInt = Field(4096, description="Tokens per sample")
    global_batch_tokens: PositiveInt = Field(4_194_304, description="Tokens per optimizer step, all GPUs")
    tokens: PositiveInt = Field(10_000_000_000, description="Training tokens to process in the run")
    deadline_hours: float | None = Field(None, gt=0, description="Finish within this many hours")
    budget_usd: float | None = Field(None, gt=0, description="Spend at most this much")
    cloud: Cloud = Field("any", description="Where to run; 'any' compares all clouds")
    region: str | None = Field(None, description="Cloud region (default: the catalog's priced region)")
    gpus: list[str] | None = Field(None, description="Allowed GPU types (slugs); default all")
    max_nodes: PositiveInt = Field(32, description="Largest node count to consider")
    objective: Objective = Field("cost", description="Rank by cost to train, time, or GPU count")
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    offload: Offload = "none"
    lora_rank: PositiveInt = 16
    lora_targets: list[str] | str = Field("all-linear", description="qv, attention, all-linear or module names")
    safety_margin: float = Field(0.10, ge=0, lt=0.9, description="Fraction of GPU memory kept free")
    hosts: list[HostEntry] | None = Field(None, description="On-prem hosts (cloud: onprem)")
    ssh_cidr: str | None = Field(None, description="CIDR allowed to SSH to the nodes; none = SSM only")
    capacity_reservation_id: str | None = Field(None, description="AWS capacity reservation / Capacity Block id")
    reservation: str | None = Field(None, description="GCP reservation name")
    gpu_count: PositiveInt | None = Field(None, description="Exactly this many GPUs in total (e.g. 2: the GPUs you have)")
    tp: PositiveInt | None = Field(None, description="Tensor-parallel degree (+ sequence parallel); default: the planner chooses")
    cp: PositiveInt | None = Field(None, description="Context-parallel degree (ring attention); default: the planner chooses")
    pp: PositiveInt | None = Field(None, description="Pipeline stages (1F1B); default 1")
