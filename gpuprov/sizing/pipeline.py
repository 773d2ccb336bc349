"""What one pipeline rank holds at each backward of a step, as torchtitan and torch.distributed.pipelining run it.

Pure integer bookkeeping (no bytes): parallel.py turns each moment into memory terms.

* Stages: torchtitan splits the blocks into pp x v stages, v = 1 stage per rank for single-stage schedules
  (1F1B) and 2 for multi-stage ones (Interleaved1F1B); the first stage gets num_layers // stages blocks, the
  middle stages one more while the remainder lasts, the last stage the rest
  (pytorch/torchtitan@9dec370ad26b5f8e9a7333a0e36165018262644b torchtitan/parallelisms/pipelining_utils.py
  generate_split_points). Rank r runs stages r, r + pp, ... ("loop" style, stage_ids_this_rank), and the
  step has pp micro-batches unless set (build_pipeline_schedule: n_microbatches defaults to the PP degree).
* Order of one rank's forwards (F) and backwards (B) (pytorch/pytorch@1963fc83a1c32e162162e2414f78b043f0674bae
  torch/distributed/pipelining/schedules.py): Schedule1F1B runs min(n, pp - stage) warm-up forwards, then one
  backward and one forward in turn, then the remaining backwards. ScheduleInterleaved1F1B
  (_calculate_single_rank_operations, _get_1f1b_rank_ops) runs min((v - 1) x mb_per_round + 2 x (pp - 1 - r),
  n x v) warm-up forwards (mb_per_round = n // max(1, n // pp)), local stage (k // mb_per_round) % v for its
  k-th forward, then a forward and a backward in turn, then the remaining backwards, the k-th backward on
  local stage v - 1 - (k // mb_per_round) % v.
* FSDP under PP (torchtitan apply_fsdp: reshard_after_forward=False with PP; torch pipelining stage.py
  backward_maybe_with_nosync): a stage's blocks stay gathered from its first forward and its fp32 gradients
  unsharded from its first backward until its last backward, where it reduce-scatters and reshards the
  whole stage at once (run_post_backward): with two stages per rank whose backwards do not interleave, only
  one stage's gradients are ever whole.
* Kept outputs (stage.py at that commit): forward_one_chunk appends every micro-batch's output to
  `output_chunks` on every stage (pytorch/pytorch#153383, May 2025, later kept them on the last stage only)
  until the next step clears them, and the last stage merges them (torch.cat) when the step returns;
  _prepare_forward_infra / _prepare_backward_infra allocate a receive buffer per micro-batch for the input
  (all but the first stage) and for the output gradient (all but the last stage), kept across steps; the
  input buffers are autograd leaves, so each micro-batch's backward leaves its input gradient in the
  buffer's .grad until clear_runtime_states sets it to None at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TYPE_CHECKING

from gpuprov.sizing.types import PP_SCHEDULES

if TYPE_CHECKING:  # the step model's Shape (throughput.py imports this module)
    from gpuprov.sizing.throughput import Shape

SCHEDULES = PP_SCHEDULES


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "Interleaved1F1B" else 1


@lru_cache(maxsize=256)
def split_layers(num_layers: int, total_stages: int) -> tuple[int, ...]:
    """Blocks per stage, as torchtitan's generate_split_points places the split points."""
    base, extra = divmod(num_layers, total_stages)
    out = []
    for i in range(total_stages - 1):
        n = base
        if i > 0 and extra > 0:
            n, extra = base + 1, extra - 1
        out.append(n)
    out.append(num_layers - sum(out))
    return tuple(out)


@lru_cache(maxsize=256)
def rank_ops(pp: int, n: int, v: int, rank: int) -> tuple[tuple[str, int], ...]:
    """("F" or "B", local stage index) in the order the rank runs them."""
    if v == 1:
        warm = min(n, pp - rank)
        ops = [("F", 0)] * warm
        fwd = warm
        for _ in range(n):
            ops.append(("B", 0))
            if fwd < n:
                ops.append(("F", 0))
                fwd += 1
        return tuple(ops)
    per_round = n // max(1, n // pp)
    warm = min((v - 1) * per_round + 2 * (pp - 1 - rank), n * v)
    total = n * v
    ops = []
    for op in range(total):
        ops.append(("F", (op // per_round) % v))
        if op >= warm:
            ops.append(("B", v - 1 - ((op - warm) // per_round) % v))
    for op in range(total, total + warm):
        ops.append(("B", v - 1 - ((op - warm) // per_round) % v))
    return tuple(ops)


Part = tuple[int, bool, bool]  # (blocks, embedding, output head + final norm)


@dataclass(frozen=True)
class Moment:
    """What one rank holds when a backward starts (or, end=True, once its step's backwards are done)."""

    rank: int
    stage: int  # global stage index of this backward
    micro_batch: int
    held: Part  # every stage of the rank: sharded states
    gathered: Part  # stages FSDP holds gathered (first forward .. last backward)
    grads: Part  # stages whose unsharded gradients are alive
    reduced: Part  # stages already reduce-scattered this step
    act_layers: int  # blocks x micro-batches of saved activations
    in_flight: int  # micro-batches whose activations the rank holds
    outputs: int  # hidden-sized tensors kept: output_chunks of non-last stages + receive buffers
    logit_chunks: int  # the last stage's kept outputs (logits)
    loss: bool  # this backward starts at the loss
    end: bool = False


def _part(stages: list[int], layers: tuple[int, ...]) -> Part:
    return (sum(layers[s] for s in stages), 0 in stages, len(layers) - 1 in stages)


def _dominated(a: Moment, b: Moment) -> bool:
    """b holds at least what a holds in every respect."""
    def ge(x: Part, y: Part) -> bool:
        return y[0] >= x[0] and y[1] >= x[1] and y[2] >= x[2]
    return (b.loss >= a.loss and ge(a.gathered, b.gathered) and ge(a.grads, b.grads) and ge(a.reduced, b.reduced)
            and b.act_layers >= a.act_layers and b.outputs >= a.outputs and b.logit_chunks >= a.logit_chunks)


def _score(m: Moment) -> int:
    """A sum that never falls from a moment to one that dominates it (so dominators are seen first)."""
    return (m.loss + sum(sum(p) for p in (m.gathered, m.grads, m.reduced)) + m.act_layers + m.outputs
            + m.logit_chunks)


def _front(cands: list[Moment]) -> list[Moment]:
    """The moments no other one dominates (of equal ones, the earliest), in their order: each is checked
    only against those already kept, taken in decreasing score, as a rank has up to n x v of them."""
    kept: list[int] = []
    for i in sorted(range(len(cands)), key=lambda i: (-_score(cands[i]), i)):
        if not any(_dominated(cands[i], cands[j]) for j in kept):
            kept.append(i)
    return [cands[i] for i in sorted(kept)]


def _pick(stages: list[int], layers: tuple[int, ...], keep: list[bool]) -> Part:
    """The part of a rank's stages selected by `keep` (one flag per local stage)."""
    return _part([g for g, k in zip(stages, keep, strict=True) if k], layers)


@lru_cache(maxsize=256)
def moments(num_layers: int, pp: int, n: int, schedule: str, fsdp: bool) -> tuple[Moment, ...]:
    """Every rank's candidate peaks: each backward that holds more than the others of its rank, and the end."""
    v = stages_per_rank(schedule)
    layers = split_layers(num_layers, pp * v)
    last = pp * v - 1
    out: list[Moment] = []
    for r in range(pp):
        mine = [r + s * pp for s in range(v)]
        held = _part(mine, layers)
        fwd, bwd = [0] * v, [0] * v
        # receive buffers, one per micro-batch: the input (not on stage 0), its gradient (not on the last stage)
        buffers = sum(n * ((g != 0) + (g != last)) for g in mine)
        cands: list[Moment] = []
        for kind, s in rank_ops(pp, n, v, r):
            if kind == "F":
                fwd[s] += 1
                continue
            if fsdp:
                gathered = _pick(mine, layers, [fwd[i] > 0 and bwd[i] < n for i in range(v)])
                grads = _pick(mine, layers, [i == s or 0 < bwd[i] < n for i in range(v)])
                reduced = _pick(mine, layers, [bwd[i] == n for i in range(v)])
            else:
                gathered, grads, reduced = held, held, (0, False, False)
            cands.append(Moment(
                rank=r, stage=mine[s], micro_batch=bwd[s], held=held, gathered=gathered, grads=grads, reduced=reduced,
                act_layers=sum((fwd[i] - bwd[i]) * layers[g] for i, g in enumerate(mine)),
                in_flight=sum(fwd[i] - bwd[i] for i in range(v)),
                outputs=buffers + sum(fwd[i] for i, g in enumerate(mine) if g != last)
                + sum(bwd[i] + (i == s) for i, g in enumerate(mine) if g != 0),
                logit_chunks=sum(fwd[i] for i, g in enumerate(mine) if g == last),
                loss=mine[s] == last,
            ))
            bwd[s] += 1
        out.extend(_front(cands))
        done = (0, False, False)
        out.append(Moment(
            rank=r, stage=mine[-1], micro_batch=n, held=held, gathered=done if fsdp else held, grads=done if fsdp else held,
            reduced=held if fsdp else done, act_layers=0, in_flight=0,
            outputs=buffers + n * sum((g != last) + (g != 0) for g in mine), logit_chunks=n * (last in mine), loss=False,
            end=True,
        ))
    return tuple(out)


@dataclass(frozen=True)
class Pipeline:
    """Pipeline parallelism of one layout: stages (the PP degree), micro-batches per step and model chunks
    per rank (1 for 1F1B/GPipe, 2 for torchtitan's looped schedules such as Interleaved1F1B)."""

    stages: int = 1
    micro_batches: int = 1
    stages_per_rank: int = 1

    def bubble(self) -> float:
        """Idle time over busy time: (p - 1)/m for 1F1B, (p - 1)/(v m) interleaved (Narayanan et al. 2021,
        "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2)."""
        if self.stages <= 1:
            return 0.0
        return (self.stages - 1) / (max(1, self.stages_per_rank) * max(1, self.micro_batches))


def pipelined(shape: Shape, pp: int, schedule: str) -> tuple[Shape, Pipeline | None]:
    """The shape and Pipeline layout_step_estimate times a plan's PP layout with. The plan's micro_batch x
    grad_accum samples are one data-parallel rank's local batch, which the schedule splits into grad_accum
    pipeline micro-batches in one step (torchtitan train step: pp_schedule.step over the whole batch), so FSDP's
    collectives run once per step: the shape carries the local batch and no accumulation."""
    if pp <= 1:
        return shape, None
    local = replace(shape, micro_batch=shape.micro_batch * shape.grad_accum, grad_accum=1)
    return local, Pipeline(stages=pp, micro_batches=shape.grad_accum, stages_per_rank=stages_per_rank(schedule))
