"""Plain words for estimate results that surprise users (shown by `plan` and `estimate`, not only in
docstrings): each function returns the note, or None where the surprise does not arise."""

from __future__ import annotations

from typing import Any

GiB = 2**30


def lora_selective_ac(task: str, activation_checkpointing: str, activations_bytes: int) -> str | None:
    """LoRA/QLoRA under selective checkpointing keep more activations than full training would.

    torchtitan's op-level SAC saves every other `aten.mm` output of a block; each adapted linear
    runs three matmuls (base, lora_A, lora_B), which shifts the parity so about twice the matmul
    outputs are kept (sizing/activations.py selective_layer_bytes_per_token)."""
    if task == "full" or activation_checkpointing != "selective":
        return None
    return (f"Why {task} keeps more activations than full training here ({activations_bytes / GiB:,.1f} GiB): selective "
            "checkpointing (torchtitan's op-level policy) saves every other matmul output of a block, and each "
            "adapted linear runs three matmuls (base, lora_A, lora_B), so about twice the outputs are kept; full "
            "checkpointing (--activation-checkpointing full) keeps only each block's input")


def notes(task: str, activation_checkpointing: str, breakdown: dict[str, Any]) -> list[str]:
    """Every note that applies to this setup and its memory breakdown."""
    note = lora_selective_ac(task, activation_checkpointing, int(breakdown.get("activations", 0) or 0))
    return [note] if note else []
