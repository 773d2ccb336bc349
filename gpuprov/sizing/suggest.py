"""What would make it fit: the smallest changes to a training setup that bring its peak under the GPU.

Each change is one step a user can take (activation checkpointing, a smaller micro-batch with more
gradient accumulation so the global batch stays, CPU offload, 8-bit AdamW, QLoRA instead of LoRA,
more GPUs, more sharding, a shorter sequence). Single changes and pairs of them are estimated with
the analytic model; the ones that fit the user's GPUs come first (more GPUs is hardware they may not
have), each group ranked by GPU-seconds per trained token from the planner's throughput model
(gpuprov.sizing.throughput), so "cheapest" means what the run would cost; each carries its flags.
Pure functions: (arch, setup, gpu) in, suggestions out.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import combinations
from typing import Any, Callable

from gpuprov.sizing.types import TrainSetup

# Changing what is trained on (the sequence) is a last resort: its cost is multiplied by this.
DATA_CHANGE_PENALTY = 2.0
MAX_GPU_FACTOR = 8


@dataclass(frozen=True)
class Change:
    kind: str  # one family per knob: a pair never sets the same knob twice
    summary: str
    fields: dict[str, Any]
    flags: dict[str, str]  # estimate flag -> value ("" for a bare flag)
    step: int = 1  # how far along its kind's ladder (1 = the smallest change of that kind)


@dataclass(frozen=True)
class Suggestion:
    changes: tuple[Change, ...]
    setup: TrainSetup
    per_gpu_bytes: int
    gpu_seconds_per_token: float
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def summary(self) -> str:
        return " + ".join(c.summary for c in self.changes)


def _ac_changes(s: TrainSetup) -> list[Change]:
    order = ["none", "selective", "full"]
    return [Change("ac", f"activation checkpointing {m}", {"activation_checkpointing": m},
                   {"--activation-checkpointing": m})
            for m in order[order.index(s.activation_checkpointing) + 1:]]


def _micro_batch_changes(s: TrainSetup) -> list[Change]:
    out, mb, accum = [], s.micro_batch, s.grad_accumulation_steps
    while mb % 2 == 0:
        mb, accum = mb // 2, accum * 2
        out.append(Change("micro_batch", f"micro-batch {mb} x {accum} accumulation (same global batch)",
                          {"micro_batch": mb, "grad_accumulation_steps": accum},
                          {"--micro-batch": str(mb), "--grad-accumulation": str(accum)}))
    return out


def _seq_changes(s: TrainSetup) -> list[Change]:
    out, seq = [], s.seq_len
    for _ in range(3):
        if seq < 1024:
            break
        seq //= 2
        out.append(Change("seq_len", f"sequence length {seq} (shorter samples: changes the data)",
                          {"seq_len": seq}, {"--seq-len": str(seq)}))
    return out


def _offload_changes(s: TrainSetup) -> list[Change]:
    order = ["none", "optimizer", "full"]
    return [Change("offload", f"CPU offload of {'optimizer states' if m == 'optimizer' else 'parameters, gradients and optimizer'}",
                   {"offload": m}, {"--offload": m})
            for m in order[order.index(s.offload) + 1:]]


def _optimizer_changes(s: TrainSetup) -> list[Change]:
    if s.optimizer == "adamw-8bit" or s.offload != "none":
        return []
    return [Change("optimizer", "8-bit AdamW (bitsandbytes)", {"optimizer": "adamw-8bit"}, {"--optimizer": "adamw-8bit"})]


def _task_changes(s: TrainSetup) -> list[Change]:
    if s.task != "lora":
        return []
    return [Change("task", "QLoRA instead of LoRA (NF4 base)", {"task": "qlora"}, {"--task": "qlora"})]


def _sharded(sharding: str) -> bool:
    return sharding in ("fsdp", "hsdp", "zero1", "zero2")


def _gpu_changes(s: TrainSetup) -> list[Change]:
    out, gpus = [], s.gpus
    sharding = s.sharding if _sharded(s.sharding) else "fsdp"
    while gpus * 2 <= s.gpus * MAX_GPU_FACTOR:
        gpus *= 2
        fields: dict[str, Any] = {"gpus": gpus, "sharding": sharding, "gpus_per_node": min(max(s.gpus_per_node, min(gpus, 8)), gpus)}
        flags = {"--gpus": str(gpus)}
        if sharding != s.sharding:
            flags["--sharding"] = sharding
        if s.sharding == "hsdp":
            fields["shard_group"] = s.shard_group  # the group stays: replicas do not shard states
        out.append(Change("gpus", f"{gpus} GPUs" + (f", {sharding}" if sharding != s.sharding else ""), fields, flags))
    return out


def _sharding_changes(s: TrainSetup) -> list[Change]:
    if s.gpus < 2:
        return []
    ladder = {"none": ["fsdp"], "ddp": ["zero2", "fsdp"], "zero1": ["zero2", "fsdp"], "zero2": ["fsdp"],
              "hsdp": ["fsdp"], "fsdp": []}[s.sharding]
    return [Change("sharding", f"{m} sharding" + (" (ZeRO-3 style: params sharded too)" if m == "fsdp" else ""),
                   {"sharding": m, "shard_group": None}, {"--sharding": m}) for m in ladder]


def candidate_changes(s: TrainSetup) -> list[Change]:
    families = (_ac_changes(s), _micro_batch_changes(s), _optimizer_changes(s), _offload_changes(s),
                _task_changes(s), _sharding_changes(s), _gpu_changes(s), _seq_changes(s))
    return [replace(c, step=i) for family in families for i, c in enumerate(family, 1)]


def _dominated(x: "Suggestion", others: list["Suggestion"]) -> bool:
    """Another fitting suggestion takes the same kinds of change, each no further, one less far."""
    steps = {c.kind: c.step for c in x.changes}
    for o in others:
        if o is x:
            continue
        o_steps = {c.kind: c.step for c in o.changes}
        if set(o_steps) <= set(steps) and all(o_steps[k] <= steps[k] for k in o_steps) and o_steps != steps:
            return True
    return False


def _apply(s: TrainSetup, changes: tuple[Change, ...]) -> TrainSetup:
    merged: dict[str, Any] = {}
    for c in changes:
        merged.update(c.fields)
    return replace(s, **merged)


def flags_of(changes: tuple[Change, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for c in changes:
        out.update(c.flags)
    return out


def gpu_seconds_per_token(arch: Any, gpu: Any, s: TrainSetup, trainable: int) -> float:
    """GPU-seconds per trained token for this setup, from the planner's step model."""
    from gpuprov.sizing.throughput import (Shape, flops_per_token, inter_node_gbytes, intra_node_gbytes,
                                           step_estimate, utilisation)
    from gpuprov.sizing.operators import op_model

    gpn = min(s.gpus_per_node, s.gpus)
    nodes = max(1, s.gpus // gpn)
    sharding = s.sharding if s.sharding != "none" or s.gpus == 1 else "ddp"
    group = s.shard_group if (s.sharding == "hsdp" and s.shard_group) else (gpn if s.sharding == "hsdp" else s.gpus)
    shape = Shape(nodes=nodes, gpus_per_node=gpn, sharding=sharding, shard_group=group,
                  micro_batch=s.micro_batch, grad_accum=s.grad_accumulation_steps, seq_len=s.seq_len)
    util, _ = utilisation(gpu, compiled=s.compile)
    intra, _ = intra_node_gbytes(gpu)
    step = step_estimate(
        shape=shape, flops=flops_per_token(arch, s.seq_len, s.task, trainable, s.activation_checkpointing),
        peak_tflops=gpu.bf16_tflops, util=util, hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=intra,
        inter_gbytes=inter_node_gbytes("infiniband", 400.0), params=arch.params, trainable=trainable,
        num_layers=arch.num_layers, task=s.task, optimizer=s.optimizer, precision=s.precision,
        offload=s.offload, pcie_gen=gpu.pcie_gen,
        ops=op_model(arch, gpu, ac=s.activation_checkpointing, compiled=s.compile, task=s.task, trainable=trainable,
                     document_mask=bool(getattr(s, "document_mask", False))),
    )
    tokens = s.micro_batch * s.seq_len * s.grad_accumulation_steps * s.gpus
    return step.step_time_s * s.gpus / tokens


def offload_notes(arch: Any, s: TrainSetup, trainable: int, base_breakdown: dict[str, int], gpu: Any) -> tuple[str, ...]:
    """Host RAM a node needs for what is offloaded, and the PCIe traffic per step per GPU."""
    if s.offload == "none":
        return ()
    from gpuprov.sizing.throughput import assumptions

    moved = base_breakdown.get("optimizer_states", 0) + base_breakdown.get("fp32_master", 0)
    if s.offload == "full":
        moved += base_breakdown.get("parameters", 0) + base_breakdown.get("gradients", 0)
    per_node = moved * min(s.gpus_per_node, s.gpus)
    a = assumptions()
    off = a.raw["offload"]
    shard = s.gpus if s.sharding in ("fsdp", "zero1", "zero2") else (s.shard_group or min(s.gpus_per_node, s.gpus)) \
        if s.sharding == "hsdp" else 1
    # the optimizer's shard: grads down, params up once per step; full offload also brings the parameter
    # shard up for forward and backward and the grads down on every micro-batch
    traffic = trainable / shard * float(off["host_link_bytes_per_param_per_step"])
    if s.offload == "full":
        traffic += arch.params / shard * float(off["full_offload_bytes_per_param_per_micro_batch"]) * s.grad_accumulation_steps
    link = a.pcie_gbytes.get(int(gpu.pcie_gen), 16.0) * a.link_eff["pcie"]
    return (f"needs {per_node / 2**30:.0f} GiB of pinned host RAM per node for the offloaded states",
            f"moves about {traffic / 2**30:.1f} GiB per GPU per step over PCIe Gen{gpu.pcie_gen} "
            f"(~{traffic / (link * 1e9):.1f} s at {link:.0f} GB/s)")


def suggest(arch: Any, gpu: Any, setup: TrainSetup, estimator: Callable, memory_bytes: int,
            limit: int = 3, rebuild: Callable[[dict[str, str]], TrainSetup] | None = None) -> list[Suggestion]:
    """The `limit` cheapest single changes or pairs of changes that fit (on the user's GPU count first),
    cheapest first.

    `rebuild(flags)` gives the setup the command with those flags changed would size (the CLI passes
    its own flag resolution, so a framework preset's task- or sharding-dependent settings follow the
    change); without it the change's fields are applied to `setup` as they are."""
    base = estimator(arch, setup, memory_bytes)
    changes = candidate_changes(setup)
    combos: list[tuple[Change, ...]] = [(c,) for c in changes]
    combos += [pair for pair in combinations(changes, 2) if pair[0].kind != pair[1].kind]
    found: list[Suggestion] = []
    for combo in combos:
        try:
            s = rebuild(flags_of(combo)) if rebuild else _apply(setup, combo)
            est = estimator(arch, s, memory_bytes)
        except Exception:  # a change the model cannot size here (e.g. a rank the shard group refuses)
            continue
        if est.per_gpu_bytes > memory_bytes:
            continue
        cost = gpu_seconds_per_token(arch, gpu, s, est.trainable_params)
        if any(c.kind == "seq_len" for c in combo):
            cost *= DATA_CHANGE_PENALTY
        notes = offload_notes(arch, s, est.trainable_params, dict(base.breakdown), gpu)
        found.append(Suggestion(combo, s, est.per_gpu_bytes, cost, notes))
    # keep the smallest changes: drop what a fitting subset, or a shorter step of the same kinds, already does
    found = [x for x in found if not _dominated(x, found)]
    # what fits the GPUs the user has is kept first (more GPUs is hardware they may not own); the ones
    # kept are then shown cheapest first, as the list's heading says
    found.sort(key=lambda x: (any(c.kind == "gpus" for c in x.changes), x.gpu_seconds_per_token, len(x.changes)))
    return sorted(found[:limit], key=lambda x: (x.gpu_seconds_per_token, len(x.changes)))
