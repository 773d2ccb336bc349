"""train.yaml as typed sections: every key known, every value checked once, at start.

A wrong or unknown key stops the run with one line naming it (`train.py: batch.seqlen: unknown
key (known: micro_batch, grad_accum, seq_len, global_batch_tokens)`), before any process group
or model exists. The rest of the trainer reads `cfg.batch.seq_len`, never a raw dict.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

DTYPE_NAMES = ("bfloat16", "float32", "float16")
Dtype = Literal["bfloat16", "float32", "float16"]


class ConfigError(SystemExit):
    """A wrong value in train.yaml: one clear line, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"train.py: {message}")


@dataclass
class LoraSection:
    rank: int | None = None  # null for full training
    alpha: int | None = None
    targets: Any = "all-linear"  # "all-linear" or a list of module names
    dropout: float = 0.0


@dataclass
class ModelSection:
    name: str
    hf_config: dict
    init: Literal["pretrained", "random"] = "pretrained"
    pretrained_path: str | None = None
    attn_implementation: Literal["sdpa", "flash_attention_2", "eager"] = "sdpa"
    # depth-scaled init of the residual-output projections (o_proj, down_proj), as torchtitan's
    # init_weights: std / sqrt(2 * layers). Only for model.init random.
    depth_init: bool = True


@dataclass
class TaskSection:
    kind: Literal["full", "lora", "qlora"]
    lora: LoraSection = field(default_factory=LoraSection)
    frozen_dtype: Literal["bfloat16", "float32", "float16", "nf4"] | None = None  # qlora: nf4


@dataclass
class ParallelSection:
    sharding: Literal["fsdp", "hsdp", "zero1", "zero2", "ddp", "none"]
    replicate: int = 1
    shard: int = 1
    nodes: int = 1
    gpus_per_node: int = 1
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    tp: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages (world = pp x replicate x shard); micro-batches per step = batch.grad_accum
    pp_schedule: Literal["1F1B", "Interleaved1F1B"] = "1F1B"
    offload: Literal["none", "optimizer", "full"] = "none"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class PrecisionSection:
    param_dtype: Dtype = "bfloat16"
    reduce_dtype: Dtype = "float32"
    master_dtype: Dtype = "float32"
    tf32: bool = False


@dataclass
class EfficiencySection:
    loss: str = "native"
    chunked_cross_entropy: bool = False
    compile: bool = False
    float8: bool = False


@dataclass
class OptimizerSection:
    lr: float
    name: Literal["adamw", "adamw-8bit"] = "adamw"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8


@dataclass
class ScheduleSection:
    steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class BatchSection:
    micro_batch: int
    grad_accum: int
    seq_len: int
    global_batch_tokens: int | None = None


@dataclass
class ValidationSection:
    every_steps: int = 0
    batches: int = 4


@dataclass
class DataSection:
    path: str | None = None
    dtype: Literal["uint16", "uint32"] = "uint16"
    synthetic: bool = False
    synthetic_samples: int | None = None
    # position ids restart after each EOS (meta.json's eos_token_id) and attention stays inside
    # each document; false: one causal sequence per window
    document_attention: bool = True
    validation: ValidationSection = field(default_factory=ValidationSection)


@dataclass
class TrainingSection:
    tokens: int | None = None
    seed: int = 0
    # a step whose loss or gradient norm is NaN/inf is skipped (no optimizer step) and counted;
    # this many in a row stop the run (the model or the data is broken, not one batch)
    max_consecutive_nonfinite: int = 10


@dataclass
class CheckpointSection:
    dir: str
    every_steps: int = 0
    keep: int = 2
    resume: bool = True
    async_save: bool = False  # "async" in train.yaml (a Python keyword)


@dataclass
class LoggingSection:
    every_steps: int = 1
    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    # optional trackers, imported only when set (never required): a Weights & Biases project
    # (WANDB_API_KEY / WANDB_MODE from the environment), an MLflow tracking URI ("file:/path" works offline)
    wandb_project: str | None = None
    mlflow_tracking_uri: str | None = None


@dataclass
class ExportSection:
    at_end: bool = True
    dir: str | None = None
    dtype: Dtype = "bfloat16"
    merged: bool = False
    # safetensors files of at most this many GB (1e9 bytes), index beside them: save_pretrained's
    # max_shard_size default through transformers 4.x, a tenth of the Hub's 50 GB file limit
    max_shard_gb: float = 5.0


@dataclass
class MfuSection:
    flops_per_token: float
    peak_tflops_per_gpu: float
    attention_flops_per_token: float = 0.0
    plan_seq_len: int | None = None


@dataclass
class RuntimeSection:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    min_torch: str = "2.7"
    pg_timeout_s: float = 1800.0
    flight_recorder_entries: int = 0
    flight_recorder_dir: str | None = None
    gc_every_steps: int = 0
    deterministic: bool = False
    profile_steps: list | None = None
    memory_snapshot_steps: int = 0
    trace_dir: str | None = None


@dataclass
class PlanEstimateSection:
    memory_per_gpu_bytes: int | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    step_time_s: float | None = None


@dataclass
class Config:
    model: ModelSection
    task: TaskSection
    parallel: ParallelSection
    optimizer: OptimizerSection
    schedule: ScheduleSection
    batch: BatchSection
    checkpoint: CheckpointSection
    mfu: MfuSection
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    efficiency: EfficiencySection = field(default_factory=EfficiencySection)
    data: DataSection = field(default_factory=DataSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    export: ExportSection = field(default_factory=ExportSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    plan_estimate: PlanEstimateSection = field(default_factory=PlanEstimateSection)

    @property
    def model_parallel(self) -> bool:
        return self.parallel.tp * self.parallel.cp * self.parallel.pp > 1


# YAML keys that are Python keywords
_RENAMED = {"async": "async_save"}
_UNRENAMED = {v: k for k, v in _RENAMED.items()}


def _check_value(where: str, hint: Any, value: Any) -> Any:
    """`value` as `hint` wants it (ints widen to floats), or a ConfigError naming `where`."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(where, option, value)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {' | '.join(map(str, allowed))}")
        return value
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            # PyYAML (YAML 1.1) reads 1e-5 without a dot as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # min_torch: 2.7 reads as a float
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if hint in (dict, list):
        if not isinstance(value, hint):
            raise ConfigError(f"{where}: expected a {'mapping' if hint is dict else 'list'}, got {value!r}")
        return value
    raise TypeError(f"unhandled config type {hint!r} at {where}")


def build(cls: type, raw: Any, where: str = ""):
    """One section from its mapping: unknown keys and missing required keys are refused by name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or 'train.yaml'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls, globalns=globals())  # this module's names, however it was loaded
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = [_UNRENAMED.get(n, n) for n in fields]
    kwargs = {}
    for key, value in raw.items():
        name = _RENAMED.get(key, key)
        path = f"{where}.{key}" if where else str(key)
        if name not in fields:
            raise ConfigError(f"{path}: unknown key (known: {', '.join(names)})")
        kwargs[name] = _check_value(path, hints[name], value)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            path = f"{where}.{_UNRENAMED.get(name, name)}" if where else name
            raise ConfigError(f"{path}: missing from train.yaml")
    return cls(**kwargs)


def check(cfg: Config) -> Config:
    """Relations between values that no single type expresses."""
    positive = {"batch.micro_batch": cfg.batch.micro_batch, "batch.grad_accum": cfg.batch.grad_accum,
                "batch.seq_len": cfg.batch.seq_len, "parallel.replicate": cfg.parallel.replicate,
                "parallel.shard": cfg.parallel.shard, "parallel.tp": cfg.parallel.tp, "parallel.cp": cfg.parallel.cp,
                "parallel.pp": cfg.parallel.pp,
                "logging.every_steps": cfg.logging.every_steps}
    for name, value in positive.items():
        if value < 1:
            raise ConfigError(f"{name}: must be at least 1, got {value}")
    if cfg.schedule.steps < 0 or cfg.schedule.warmup_steps < 0:
        raise ConfigError("schedule.steps and schedule.warmup_steps must not be negative")
    if not 0.0 <= cfg.schedule.min_lr_ratio <= 1.0:
        raise ConfigError(f"schedule.min_lr_ratio: must be in [0, 1], got {cfg.schedule.min_lr_ratio}")
    if not cfg.export.max_shard_gb > 0:
        raise ConfigError(f"export.max_shard_gb: must be above 0, got {cfg.export.max_shard_gb}")
    if len(cfg.optimizer.betas) != 2:
        raise ConfigError(f"optimizer.betas: two numbers, got {cfg.optimizer.betas!r}")
    if cfg.task.kind != "full" and not (cfg.task.lora.rank and cfg.task.lora.alpha):
        raise ConfigError(f"task.lora.rank and task.lora.alpha: needed for task {cfg.task.kind}")
    if "model_type" not in cfg.model.hf_config:
        raise ConfigError("model.hf_config: needs model_type (a Hugging Face config.json)")
    check_diagnostics(cfg.runtime)
    return cfg


def check_diagnostics(r: RuntimeSection) -> None:
    """runtime.profile_steps [first, last] (1-based, inclusive) and memory_snapshot_steps write to trace_dir."""
    steps = r.profile_steps
    if steps is not None and (len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                              or not 1 <= steps[0] <= steps[1]):
        raise ConfigError(f"runtime.profile_steps: [first, last] steps with 1 <= first <= last, got {steps!r}")
    if r.memory_snapshot_steps < 0:
        raise ConfigError(f"runtime.memory_snapshot_steps: must not be negative, got {r.memory_snapshot_steps}")
    if (steps is not None or r.memory_snapshot_steps) and not r.trace_dir:
        raise ConfigError("runtime.trace_dir: needed for runtime.profile_steps / memory_snapshot_steps")


def from_dict(raw: dict) -> Config:
    return check(build(Config, raw))


def load_config(path: str, overrides: list[str]) -> Config:
    """train.yaml plus --set section.key=value overrides (YAML values), validated."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a YAML mapping")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
        node[leaf] = yaml.safe_load(value)
    return from_dict(raw)
