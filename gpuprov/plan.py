"""The Plan: the one input of every renderer (Terraform, Ansible, launch, report).

The planner fills it; renderers only read it and decide nothing (DESIGN.md). Serialised as
`plan.json` in the bundle with `Plan.model_dump_json(indent=2)`; `Plan.model_validate_json`
reads it back. Bytes are integers; bandwidths say their unit in the field name.
"""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gpuprov.sizing.types import PpSchedule
from gpuprov.spec import HostEntry, TrainingSpec

PLAN_SCHEMA_VERSION = 1
SHARED_MOUNT = "/shared"  # shared filesystem of multi-node plans; checkpoints under /shared/checkpoints

FabricName = Literal["efa", "infiniband", "roce", "tcpxo", "ethernet", "none"]
CloudName = Literal["aws", "gcp", "azure", "oci", "onprem"]
PurchaseOption = Literal["on-demand", "spot", "capacity-block", "reservation", "flex-start"]


def _empty() -> list:
    """A new empty list: the list fields' default. Pydantic reads a default factory's signature when it builds the
    model; the builtin `list` only has one as text, which inspect tokenizes (the first time, compiling tokenize's
    patterns: about 15M instructions of every `gpuprov` process), where a Python function's is at hand."""
    return []


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Strict):
    name: str  # preset slug, or the config.json path the user gave
    display_name: str  # e.g. "Llama 3.1 70B"
    hf_model_type: str  # a model_type of gpuprov/sizing/families.py (gemma3 sized as gemma3_text)
    params: int
    trainable_params: int
    hf_config: dict  # the config.json the trainer builds the model from (AutoConfig.for_model)
    source: str


class GpuInfo(_Strict):
    slug: str
    name: str
    architecture: str  # ampere, ada, hopper, blackwell
    memory_bytes: int  # usable as the driver reports it
    bf16_tflops: float  # dense
    fp8_tflops: float | None
    nvlink_gbytes_per_s: float | None  # per GPU, one direction; None = PCIe only
    pcie_gen: int
    source: str


class Memory(_Strict):
    per_gpu_bytes: int
    breakdown: dict[str, int]
    model_states_bytes: int  # weights + grads + optimizer (+ fp32 master), all GPUs
    rule_of_thumb_bytes: int  # the 18 bytes/param rule, for comparison
    gpu_memory_bytes: int
    safety_margin: float
    fits: bool
    headroom_bytes: int  # gpu_memory_bytes * (1 - margin) - per_gpu_bytes
    assumptions: list[str]


class InstanceInfo(_Strict):
    cloud: CloudName
    name: str  # instance/machine type, or on-prem template name
    region: str | None
    gpus: int
    vcpus: int
    ram_bytes: int
    local_nvme_count: int
    local_nvme_bytes_each: int
    network_cards: int  # AWS: maximum network cards (one EFA interface each); others: fabric NICs
    efa_interfaces: int  # AWS only; 0 elsewhere
    nvswitch: bool  # HGX baseboard: needs nvidia-fabricmanager
    pcie_gen: int
    price_per_hour_usd: float | None  # None for on-prem
    price_date: str | None
    source: str
    # on-prem: host facts nobody stated (ram, cores, nvme, fabric, pcie): never checked as met
    unknown: list[str] = Field(default_factory=_empty)


class FabricInfo(_Strict):
    """The node-to-node fabric and the one NCCL environment for it (Ansible and env.sh both read it)."""

    name: FabricName
    gbps_per_gpu: float  # Gb/s of fabric per GPU
    nccl_env: dict[str, str]  # variables to export, exactly as NCCL/libfabric read them
    nccl_env_profile: str | None = None  # a vendor script to source first (GCP gIB / TCPXO)
    # folders the job puts first on LD_LIBRARY_PATH (the gIB plugin's own libraries): the image adds
    # them in /etc/profile.d only, which a non-login shell (sbatch, srun) never reads
    nccl_lib_path: list[str] = Field(default_factory=_empty)
    hcas: list[str] = Field(default_factory=_empty)  # InfiniBand/RoCE HCA names, where fixed
    subnet_manager: Literal["managed", "opensm", "none"] = "none"
    mtu: int | None = None
    source: str
    gpu_nics: list[str] = Field(default_factory=_empty)  # GPU NIC interface names, where fixed (TCPXO)
    nccl_net: str | None = None  # regex of the network NCCL must log using ("IB", "gIB"...); None: sockets
    nccl_conf_managed_by_image: bool = False  # the image rewrites /etc/nccl.conf (Azure)
    rdma_ipv4_by: Literal["oci-rdma-configure"] | None = None  # image service numbering the RDMA NICs
    # the fabric nobody stated (on-prem hosts file): the time model assumes `name`, the bring-up
    # configures none (no subnet manager, no RDMA role) and says how to learn it
    probe: str | None = None


class Cluster(_Strict):
    cloud: CloudName
    region: str | None
    instance_type: str
    gpu: str  # slug
    gpus_per_node: int
    nodes: int
    total_gpus: int
    sharding: Literal["none", "ddp", "zero1", "zero2", "fsdp", "hsdp"]
    # GPUs one pipeline stage's model replica is sharded over (tp x cp x dp_shard; fsdp: total_gpus / pp;
    # ddp: 1) and the replicas of it (HSDP): pp x replicate x shard_group = total_gpus, train.yaml's mesh
    shard_group: int
    replicate: int  # total_gpus // (pp x shard_group)
    activation_checkpointing: Literal["none", "selective", "full"]
    micro_batch: int
    grad_accum: int
    seq_len: int
    global_batch_tokens: int  # micro_batch * seq_len * grad_accum * (total_gpus / (tp * cp * pp))
    precision: str
    optimizer: str
    offload: str
    tp: int = 1  # tensor-parallel degree (+ sequence parallel), inside one node's NVLink domain
    cp: int = 1  # context-parallel degree (ring attention), folded into FSDP's shard dimension
    pp: int = 1  # pipeline stages; grad_accum is then the pipeline micro-batches of a step (>= pp)
    pp_schedule: PpSchedule = "1F1B"  # torch.distributed.pipelining schedule (with pp > 1)

    @property
    def replica_gpus(self) -> int:
        """GPUs holding one whole model replica, every pipeline stage of it: the estimator's shard group."""
        return self.shard_group * self.pp


class Training(_Strict):
    task: Literal["full", "lora", "qlora"]
    # fine-tune the published weights, or from scratch; None: a plan from before gpuprov recorded it
    # (its trainer config then starts full training from random weights, adapters from pretrained)
    init: Literal["pretrained", "random"] | None = None
    base_weights: str | None = None  # where pretrained weights come from: a Hugging Face id or a local directory
    lora_rank: int | None
    lora_alpha: int | None
    lora_targets: list[str]
    tokens: int
    steps: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    checkpoint_every_steps: int
    log_every_steps: int
    export_merged: bool = False  # LoRA/QLoRA: the export also writes the merged model (spec export_merged)


class Throughput(_Strict):
    tokens_per_s: float  # whole cluster
    mfu: float  # model FLOPs utilisation the estimate implies (6N + attention, no recompute)
    mfu_assumed: float  # the per-GPU-class assumption it starts from
    mfu_source: str
    flops_per_token: float  # model FLOPs (6N + attention), what MFU counts
    attention_flops_per_token: float = 0.0  # its attention part (grows with seq_len)
    step_time_s: float
    compute_time_s: float
    comm_time_s: float  # exposed (not overlapped) communication per step
    bound: Literal["compute", "communication"]
    float8_gain: float = 1.0  # measured float8/bf16 speed-up the compute was timed with (1: bf16)
    gpu_power_w: int | None = None  # the power limit the GPUs were timed at (their TDP unless capped)
    # the step by kind of work, seconds (gpuprov.sizing.throughput.STEP_TERMS): gemm, attention, memory_bound,
    # launch, exposed_comm, optimizer, pipeline_bubble; they sum to step_time_s
    step_terms_s: dict[str, float] = Field(default_factory=dict)


class HostCheck(_Strict):
    rule: str
    required: str
    actual: str
    ok: bool  # False too when the fact is unknown (never a pass nobody verified)
    source: str
    known: bool = True  # False: nobody stated the fact (on-prem host without it): "unknown", not ok


class Host(_Strict):
    ram_bytes_required: int
    cpu_cores_required: int
    nvme_bytes_required: int
    checkpoint_bytes: int  # one full-state checkpoint
    checkpoints_kept: int
    checks: list[HostCheck]
    bill_of_materials: list[str] | None = None  # on-prem only


class ImageProfile(_Strict):
    """The image profile (catalog images.yaml) a plan assumes, and the facts the roles need from it."""

    name: str
    nccl_tests_dir: str | None = None  # the image's own nccl-tests build, used where present
    # how that build finds its MPI (an HPC-X build: {init: modules script, module: mpi/hpcx}); {} = none needed
    nccl_tests_mpi_env: dict[str, str] = Field(default_factory=dict)
    dcgm_version: str  # the DCGM 4 version installed (pinned) where the image has none
    dcgm_cuda_major_by_min_branch: dict[str, int]  # DCGM flavour by the driver's branch (580 -> 13)
    uncertain: dict[str, str] = Field(default_factory=dict)  # component -> what sources leave open
    source: str


class Software(_Strict):
    os: list[str]  # supported images, e.g. ["ubuntu-22.04", "ubuntu-24.04"]
    driver_branch: str  # e.g. "570"
    open_kernel_modules: bool
    cuda_version: str  # e.g. "12.8"
    nccl_version: str  # e.g. "2.26.2-1+cuda12.8"
    fabric_manager: bool
    efa_installer_version: str | None
    gds: bool
    source: str
    # "nvidia-fs": cuFile reads local NVMe through nvidia-fs (needs DOCA's GDS-enabled NVMe
    # driver); "compat": cuFile's POSIX compatibility mode (what GDS can do on the inbox NVMe driver)
    gds_mode: Literal["nvidia-fs", "compat"] = "compat"
    efa_installer_sha256: str | None = None
    nccl_gib_version: str | None = None  # Google's nccl-gib package (A3 Ultra / A4)
    # the image profile (catalog images.yaml) the roles' keep rules were checked against
    image_profile: ImageProfile | None = None
    # the training environment on every node: a venv at python_env_path with these pins
    python_env_path: str = "/opt/gpuprov/venv"
    python_index_url: str | None = None
    python_requirements: list[str] = Field(default_factory=_empty)


class Storage(_Strict):
    mount_point: str
    raid_name: str  # mdadm array name: /dev/md/<raid_name>
    device_glob: str | None  # where this cloud's local NVMe drives appear; None = discover from facts
    devices: int
    expected_bytes: int  # array size, before filesystem overhead
    filesystem: Literal["xfs"] = "xfs"


class Health(_Strict):
    nccl_allreduce_busbw_gbytes_per_s: float | None  # minimum on one node; None = no threshold
    source: str
    # minimum all-reduce bus bandwidth across all nodes over the fabric; None = report only
    fabric_allreduce_busbw_gbytes_per_s: float | None = None
    fabric_source: str | None = None


class Stack(_Strict):
    """The training software stack: what launch/train.yaml runs and what the memory estimate sized.

    gpuprov/stack.py fills it once; the planner hands it to the estimator and the launch
    renderer writes it into train.yaml, so the two cannot describe different runs.
    """

    param_dtype: str  # FSDP2 MixedPrecisionPolicy param_dtype (compute / all-gather)
    reduce_dtype: str  # gradient reduce-scatter dtype
    master_dtype: str  # sharded trainable weights and optimizer state
    frozen_dtype: str | None  # LoRA: the frozen base weights (bfloat16); QLoRA: nf4; full: None
    qlora_base_replicated: bool  # the NF4 base kept whole on every GPU (outside fully_shard)
    attention: Literal["sdpa", "flash_attention_2", "eager"]  # transformers attn_implementation
    # what computes attention on the bundle's packed data for the planned layout (catalog/data/trainer.yaml
    # attention_kernels): SDPA gets a dense per-document mask, so not the FlashAttention kernel
    attention_kernel: str = ""
    loss_impl: Literal["native", "hf", "hf-legacy"]  # native: logits freed before backward
    chunked_cross_entropy: bool
    compile: bool  # torch.compile per transformer block (CUDA)
    float8: bool  # torchao float8 linears with fp8 all-gather
    tf32: bool  # TF32 tensor cores for fp32 matmuls
    optimizer_impl: Literal["fused", "foreach"]
    lora_dropout: float
    activation_offloading: bool
    async_checkpoint: bool  # DCP async_save: training continues while shards are written
    min_torch: str  # the oldest torch the trainer supports
    source: str


class Alternative(_Strict):
    cloud: str
    instance_type: str
    gpu: str
    nodes: int
    total_gpus: int
    sharding: str
    time_hours: float | None
    cost_usd: float | None
    reason: str  # why it lost: too small, slower, dearer, over deadline
    purchase: PurchaseOption | None = None  # None: on-prem


class Purchase(_Strict):
    """How the nodes are bought (catalog purchase.yaml); Terraform renders exactly this option."""

    option: PurchaseOption = "on-demand"
    price_per_hour_usd: float | None = None
    preemptible: bool = False
    reservation_bound: bool = False  # GCP a3-ultra/a4: consumed with provisioning model RESERVATION_BOUND
    max_run_hours: float | None = None  # flex-start: the VM is deleted after this long
    held: str | None = None  # the reservation / Capacity Block id the user holds
    risk: str | None = None
    source: str = ""


class Image(_Strict):
    """The GPU-ready image the nodes boot (catalog bringup.yaml), pinned in Terraform at first apply."""

    name: str
    ref: dict[str, str]  # aws: ssm_parameter; gcp: image; azure: publisher/offer/sku/version; oci: {}
    user: str | None  # login user of the image; None: the operator's own (GCP OS Login)
    secure_boot: bool
    driver_preinstalled: bool
    source: str


class Head(_Strict):
    """The small VM the bundle creates as SSH jump host (ProxyJump) to the private nodes."""

    size: str  # VM size / shape
    price_per_hour_usd: float
    image: dict[str, str] = Field(default_factory=dict)  # azure: publisher/offer/sku/version; oci: os/version
    source: str


class Access(_Strict):
    """How Ansible reaches the nodes from outside their network."""

    method: Literal["ssm", "iap", "bastion", "ssh"]
    user: str | None
    proxy: str | None = None  # ProxyCommand template (%h host, %p port)
    head: Head | None = None  # method bastion: the jump host VM the bundle creates
    source: str


class SharedStorage(_Strict):
    """The shared filesystem multi-node checkpoints land on (node-local RAID0 stays scratch)."""

    kind: Literal["fsx-lustre", "filestore", "amlfs", "oci-fss", "nfs"]
    size_gib: int  # 0: elastic (no size to provision)
    need_bytes: int  # checkpoints kept + dataset share it was sized for
    mount_point: str = SHARED_MOUNT
    checkpoint_dir: str = SHARED_MOUNT + "/checkpoints"
    options: dict[str, str | int] = Field(default_factory=dict)  # tier / deployment type / throughput
    source: str


class CandidateRow(_Strict):
    """One row of `gpuprov plan`'s candidates table: the best layout per GPU type on one cloud."""

    cloud: str
    region: str | None
    instance_type: str
    gpu: str
    gpus_per_node: int
    nodes: int
    purchase: str  # purchase option of the offer (on-demand unless the candidate says otherwise)
    price_per_hour_usd: float | None  # the whole cluster
    time_hours: float
    cost_usd: float | None
    mfu: float
    time_hours_range: list[float] | None = None  # [low, high] from the model's hold-out error (sizing/time_error.py)
    per_gpu_bytes: int
    gpu_memory_bytes: int
    sharding: str
    layout: str  # how the GPUs split the work, e.g. "TP8 x FSDP 16", "FSDP 64", "HSDP 8x4" (shard x replicas)
    bound: str
    chosen: bool
    # on the cost/time Pareto front: no other priced row is both cheaper and faster (candidates.pareto_front)
    pareto: bool = False


class SlurmBuild(_Strict):
    """The Slurm one image gets (catalog scheduler.yaml `builds`, named by images.yaml) and the
    process tracking / task confinement that version supports on a cgroup v2 host."""

    name: str
    version: str
    packages: dict[str, list[str]]  # controller / compute
    nvml_plugin_package: str = ""  # "" = no separate package (gres.conf falls back to device files)
    cgroup_plugin: Literal["cgroup/v1", "cgroup/v2"] | None  # None: no cgroup plugin (21.08 on cgroup v2)
    proctrack: str  # ProctrackType
    task_plugin: str  # TaskPlugin
    plugin_dirs: list[str]
    source: str


class Scheduler(_Strict):
    """The batch scheduler (gpuprov/scheduler.py decides): installed Slurm, the site's, or none."""

    kind: Literal["slurm", "existing", "none"] = "none"
    # first-node: slurmctld on the first GPU node (no CPU controller VM is rendered yet); site: not ours
    controller: Literal["first-node", "site"] | None = None
    controller_host: str | None = None  # inventory name where known (on-prem)
    partition: str | None = None
    # OS id ("ubuntu-22.04") -> the Slurm build that image gets: one entry on a cloud (its image
    # profile), one per supported OS on-prem (each host reads its own)
    builds: dict[str, SlurmBuild] = Field(default_factory=dict)
    # every node's slurm.conf line, from the plan, not from gathered facts (so `--limit NEW_NODE`
    # renders it); None: the hosts file states none, the node's own facts stand in
    node_cpus: int | None = None
    node_real_memory_mb: int | None = None
    # the role names each node after its inventory name (cloud VMs: the inventory is keyed by the
    # name Terraform gave); on-prem the hosts keep theirs and the hosts file must use them
    set_hostname: bool = False
    max_requeues: int = 0  # times a failed job is requeued to resume from its newest checkpoint
    # consecutive requeues without a new checkpoint: more means a deterministic failure, not a lost node
    max_requeues_without_progress: int = 0
    state_save_location: str = ""  # slurmctld's state (shared filesystem where the bundle has one)
    jobcomp_loc: str = ""  # jobcomp/filetxt records: one line per ended job, read by `gpuprov status`
    health_check_interval: int = 0  # seconds between slurmd's node health checks (0: none)
    reason: str = ""
    source: str = ""


class Provisioning(_Strict):
    """What the target decided for bring-up (gpuprov/targets/): renderers read it, never decide it."""

    target: CloudName
    provisioner: Literal["terraform", "inventory"]  # Terraform creates the nodes, or the user's host list
    fabric_role: str | None  # the Ansible role that sets up the fabric; None: nothing beyond Ethernet
    gds: bool  # GPUDirect Storage configured (cuFile needs the local NVMe array)
    checkpoint_root: str  # several nodes: the shared filesystem; one node: its own NVMe array
    reboot_allowed: bool = True  # roles may reboot a node (driver, RDMA stack); on-prem: the owner's call


class Staging(_Strict):
    """What `up` puts on the cluster before the job starts (gpuprov/staging.py decides it): the base
    weights and the dataset, on the filesystem the job reads (several nodes: the shared one)."""

    weights_repo: str | None = None  # Hugging Face id fetched by launch/fetch_weights.sh
    # or a base folder on the machine running `up` (relative to the bundle, as plan.model's path), copied over
    weights_local: str | None = None
    weights_dir: str | None = None  # where it lands: train.yaml model.pretrained_path
    dataset_kind: Literal["local", "s3", "gs", "az", "hf"] | None = None  # None: no data source named
    dataset_source: str | None = None  # local: the absolute path on the machine running `up`; else the URI
    dataset_raw: str | None = None  # where the file (or folder, a URI ending in /) lands on the cluster; hf: None
    download_argv: list[str] = Field(default_factory=_empty)  # the node's command that copies a URI to dataset_raw
    download_env: dict[str, str] = Field(default_factory=dict)  # and its environment (no secret: node identity)
    download_source: str | None = None  # where the command and its authentication are documented
    data_dir: str | None = None  # prepare_data.py's output: train.yaml data.path (None: not prepared by `up`)
    dataset_prepared: bool = False  # the local dataset is prepare_data.py's output: copied into data_dir as it is
    seq_len: int = 0  # prepare_data.py --seq-len (the plan's)


class Infra(_Strict):
    """What the target decided for its Terraform templates (gpuprov/targets/<name>.py `terraform_inputs`):
    the Terraform renderer fills templates from it, never computes it. Empty for an inventory target."""

    target: CloudName
    inputs: dict[str, Any] = Field(default_factory=dict)  # template variable -> value (JSON scalars, lists, maps)


class RunBreakdown(_Strict):
    """What time_hours and cost_usd are made of (gpuprov/storage_cost.py, gpuprov/spot.py)."""

    train_hours: float  # optimizer steps x step time
    startup_hours: float  # nodes boot, the job loads its weights
    checkpoint_hours: float | None  # checkpoint writes training waits for (None: not modelled, see notes)
    preemption_hours: float  # spot: expected losses
    compute_usd: float | None  # nodes x hours x price
    storage_usd: float | None  # shared filesystem + boot disks over the run
    not_in_cost: list[str] = Field(default_factory=_empty)  # items with no recorded price


class Plan(_Strict):
    schema_version: int = PLAN_SCHEMA_VERSION
    gpuprov_version: str
    spec: TrainingSpec
    model: ModelInfo
    task: Literal["full", "lora", "qlora"]
    gpu: GpuInfo
    instance: InstanceInfo
    fabric: FabricInfo
    cluster: Cluster
    training: Training
    memory: Memory
    throughput: Throughput
    time_hours: float
    cost_usd: float | None
    host: Host
    # [low, high]: time_hours with the throughput model's extreme errors on its hold-out (sizing/time_error.py)
    time_hours_range: list[float] | None = None
    software: Software
    storage: Storage
    health: Health
    hosts: list[HostEntry] | None = None  # on-prem inventory
    alternatives: list[Alternative] = Field(default_factory=_empty)
    notes: list[str] = Field(default_factory=_empty)  # e.g. where the rule of thumb is wrong
    candidates: list[CandidateRow] = Field(default_factory=_empty)  # best per (cloud, GPU type), ranked
    warnings: list[str] = Field(default_factory=_empty)  # the chosen run looks pathological, and why
    purchase: Purchase = Field(default_factory=Purchase)
    image: Image | None = None  # None: on-prem
    access: Access | None = None
    shared_storage: SharedStorage | None = None  # None: one node, or a cloud without one
    bundle_id: str = ""  # short hash of the spec: makes resource names unique per bundle
    stack: Stack | None = None  # None only in plans written before the stack was recorded
    scheduler: Scheduler = Field(default_factory=Scheduler)  # none in plans written before it was decided
    provisioning: Provisioning | None = None  # None only in plans written before targets decided it
    infra: Infra | None = None  # None only in plans written before targets decided it
    staging: Staging | None = None  # None only in plans written before `up` staged weights and data
    run: RunBreakdown | None = None  # None only in plans written before the breakdown was recorded
