"""What the bundle's trainer can run for a model family (catalog/data/trainer.yaml `model_families`)."""

from __future__ import annotations

from typing import Any

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError


def _facts() -> dict:
    return load_data("trainer.yaml")["model_families"]


def tensor_parallel_ok(arch: Any) -> bool:
    """Whether the trainer's TP plan shards this family's blocks correctly."""
    return arch.model_type in _facts()["tensor_parallel"]


def pipeline_ok(arch: Any) -> bool:
    """Whether the trainer's pipeline stages are tested on this family's blocks."""
    return arch.model_type in _facts()["pipeline"]


def check_family(spec: Any, arch: Any) -> None:
    """Refuse, in one line, what the trainer cannot run for this model's family."""
    facts = _facts()
    refused = facts.get("qlora_refused") or {}
    why = refused.get(arch.model_type) or refused.get(getattr(arch, "language_of", "") or "")
    if spec.task == "qlora" and why:
        raise GpuprovError(f"--task qlora is not planned for {arch.display_name} ({arch.model_type}): {why}")
    if (getattr(spec, "tp", None) or 1) > 1 and not tensor_parallel_ok(arch):
        raise GpuprovError(f"--tp: the trainer's tensor-parallel plan does not cover {arch.model_type} models "
                           f"({arch.display_name}); it shards {', '.join(facts['tensor_parallel'])}: drop --tp "
                           "(FSDP shards the whole model)")
    if (getattr(spec, "pp", None) or 1) > 1 and not pipeline_ok(arch):
        raise GpuprovError(f"--pp: the trainer's pipeline stages are tested on {', '.join(facts['pipeline'])} "
                           f"models, not {arch.model_type} ({arch.display_name}): drop --pp")
