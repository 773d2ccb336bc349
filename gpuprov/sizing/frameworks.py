"""Framework presets: the TrainSetup fields a training framework's own code sets (catalog/data/frameworks.yaml).

A preset is a plain mapping of TrainSetup field -> value, each with the file@commit that shows it,
plus `when:` entries that apply where the run's task, sharding or tensor parallelism (tensor_parallel:
true for TP > 1) matches. The user's explicit flags
win over a preset; a preset wins over gpuprov's defaults. Pure functions, no I/O beyond the catalog.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import TrainSetup

# Fields a preset may set: the software stack, not the run's shape (model, tokens, GPUs, layout, LoRA rank).
SHAPE_FIELDS = ("task", "seq_len", "micro_batch", "gpus", "gpus_per_node", "shard_group", "lora_rank",
                "lora_targets", "grad_accumulation_steps", "tp", "cp", "pp", "pp_schedule")
STACK_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TrainSetup) if f.name not in SHAPE_FIELDS)


@dataclass(frozen=True)
class Setting:
    """One setting a framework applies, with where that is written."""
    field: str
    value: Any
    source: str


def _catalog() -> dict[str, Any]:
    return load_data("frameworks.yaml")["frameworks"]


def names() -> tuple[str, ...]:
    return tuple(_catalog())


def title(name: str) -> str:
    return str(_entry(name)["title"])


def _entry(name: str) -> dict[str, Any]:
    cat = _catalog()
    if name not in cat:
        raise GpuprovError(f"unknown framework {name!r}; one of {', '.join(cat)}")
    return cat[name]


def _settings(block: dict[str, Any]) -> dict[str, Setting]:
    out = {}
    for field, item in (block or {}).items():
        if field not in STACK_FIELDS:
            raise GpuprovError(f"frameworks.yaml: {field!r} is not a stack field of TrainSetup")
        out[field] = Setting(field, item["value"], str(item["source"]))
    return out


def preset_settings(name: str, shape: dict[str, Any] | None = None) -> dict[str, Setting]:
    """The preset's settings (inherited ones first), with the `when:` entries that match `shape`."""
    entry = _entry(name)
    out = preset_settings(entry["inherits"], shape) if entry.get("inherits") else {}
    out.update(_settings(entry.get("settings", {})))
    for rule in entry.get("when", []) or []:
        if all((shape or {}).get(k) in v for k, v in rule["if"].items()):
            out.update(_settings(rule["settings"]))
    return out


def resolve(name: str | None, explicit: dict[str, Any], defaults: dict[str, Any],
            shape_of=None) -> tuple[dict[str, Any], dict[str, Setting]]:
    """Stack field values: explicit flags over the preset over `defaults`; and what the preset set.

    `shape_of(values)` gives the run's task/sharding from merged values (the sharding default depends
    on the GPU count), so `when:` rules see the run as it will be sized.
    """
    values = {**defaults, **{k: v for k, v in explicit.items() if v is not None}}
    if not name:
        return values, {}
    shape = shape_of(values) if shape_of else values
    applied = {}
    for field, setting in preset_settings(name, shape).items():
        if explicit.get(field) is None:
            values[field] = setting.value
            applied[field] = setting
    # the preset may have changed the sharding: re-evaluate `when:` on the final shape once
    final = shape_of(values) if shape_of else values
    if final != shape:
        for field, setting in preset_settings(name, final).items():
            if explicit.get(field) is None:
                values[field] = setting.value
                applied[field] = setting
    return values, applied


def preset_stack(name: str, task: str, sharding: str, tp: int = 1) -> dict[str, Any]:
    """A preset's TrainSetup fields for one task, sharding and tensor-parallel degree (what `gpuprov plan` sizes)."""
    return dict(_preset_stack(name, task, sharding, tp > 1))


def gpuprov_stack(task: str, sharding: str, tp: int = 1) -> dict[str, Any]:
    """The TrainSetup fields of gpuprov's own trainer (what the bundle runs)."""
    return preset_stack("gpuprov", task, sharding, tp)


@lru_cache(maxsize=None)
def _preset_stack(name: str, task: str, sharding: str, tensor_parallel: bool) -> tuple[tuple[str, Any], ...]:
    shape = {"task": task, "sharding": sharding, "tensor_parallel": tensor_parallel}
    return tuple((k, v.value) for k, v in preset_settings(name, shape).items())
