"""The search: walk instance types x nodes x layouts x recompute x micro-batch, keep what fits and
meets the constraints, rank by the objective (gpuprov/planner.py says what it prunes and why)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gpuprov.catalog import load_data
from gpuprov.errors import GpuprovError
from gpuprov.recipes import global_batch_tokens
from gpuprov.storage_cost import (
    StorageTerms, boot_disk_gib, checkpoint_bytes_of, checkpoint_every, checkpoint_hours, dataset_bytes_of,
    storage_terms, storage_usd_per_hour,
)
from gpuprov.planning import search_memo
from gpuprov.planning.space import (
    AC_MODES, MICRO_BATCHES, Candidate, Estimator, Miss, SearchResult, _group, _Layout, _layouts,
    _mp_degrees, _pool, fixed_grad_accumulation, objective_key, pipeline_degrees, pipeline_micro_batches,
    settings_set_batch, stack_for, task_trainable,
)
from gpuprov.sizing.operators import OpModel, op_model
from gpuprov.stack import cp_gathers, document_mask
from gpuprov.sizing.setup import make_setup
from gpuprov.sizing.step_parts import calibrated
from gpuprov.sizing.throughput import (
    LayerShape, Shape, StepEstimate, assumptions, attention_executed, float8_refusal, float8_step_kw, flops_per_token, inter_node_gbytes,
    intra_node_gbytes, layout_step_estimate, pipelined, plan_power_limit, power_capped, tp_gpu_seconds_per_token,
    utilisation,
)
from gpuprov.sizing.types import MemoryEstimate
from gpuprov.targets import get_target

CHECKPOINT_INTERVAL_H = 1.0  # the plan checkpoints about every hour (planning/assemble.py CHECKPOINT_INTERVAL_S)


def spot_overhead_hours(train_hours: float, nodes: int, interval_hours: float | None = None) -> float:
    """What preemption adds on spot nodes, given the plan's checkpoint interval (gpuprov/spot.py;
    None: the default, about an hour)."""
    from gpuprov.spot import overhead_hours

    return overhead_hours(train_hours, nodes, CHECKPOINT_INTERVAL_H if interval_hours is None else interval_hours)

@dataclass
class _Slot:
    """One instance type at one node count: the figures every layout on it shares (the walk reads the derived
    ones for every layout, AC mode and shape: computed once here)."""

    inst: Any
    gpu: Any
    nodes: int
    usable: int
    util: float
    intra: float
    inter: float
    gpn: int = field(init=False)  # GPUs per node
    total: int = field(init=False)
    group: tuple[str, str] = field(init=False)  # the candidates table's row (_group)
    fits: tuple = field(init=False)  # what memory depends on besides the layout and shape (fitting_shapes)

    def __post_init__(self) -> None:
        self.gpn = self.inst.gpus
        self.total = self.nodes * self.gpn
        self.group = _group(self.inst)
        self.fits = (self.inst.gpu, self.usable, self.gpn, self.total)


class _Search:
    """One walk of the space for one spec. Methods are the steps; the fields are what they share."""

    tp_cache: dict[tuple, float]  # -> _tp_seconds
    f8_on: dict[tuple[str, int], bool]  # (GPU slug, tp) -> float8_on

    def __init__(self, spec: Any, arch: Any, estimator: Estimator, gpus: dict[str, Any], exhaustive: bool):
        self.spec, self.arch, self.estimator, self.gpus, self.exhaustive = spec, arch, estimator, gpus, exhaustive
        self.task = spec.task
        self.targets, self.trainable = task_trainable(arch, self.task, spec.lora_rank, spec.lora_targets)
        self.seq, self.tokens = spec.seq_len, spec.tokens
        # --pp fixes the degree; unset, the search also tries pipeline stages where the trainer runs them
        self.pps, self.pp_schedule = pipeline_degrees(spec, arch)
        self.auto_pp = getattr(spec, "pp", None) is None
        # the batch a fine-tuning recipe publishes depends on the data-parallel ranks (gpuprov/recipes.py);
        # it never shrinks as ranks grow, so the widest batch bounds every walk
        self.gbt_cache: dict[int, int] = {}
        self.gbt = self.gbt_at(1 << 20)
        if self.seq > self.gbt_at(1):
            raise GpuprovError(f"--seq-len {self.seq} is longer than the global batch of {self.gbt_at(1)} tokens")
        self.objective = spec.objective
        # what the user fixed the planner keeps; it chooses the rest
        fixed_ac = getattr(spec, "activation_checkpointing", None)
        self.ac_modes = (fixed_ac,) if fixed_ac else AC_MODES
        self.micro_batches = (spec.micro_batch,) if getattr(spec, "micro_batch", None) else MICRO_BATCHES
        # a fixed --pp refuses an accumulation its schedule cannot run; pipeline stages the search tries
        # itself skip it (batch_shapes)
        self.fixed_ga = fixed_grad_accumulation(spec, self.pps[0], self.pp_schedule) if not self.auto_pp \
            else getattr(spec, "grad_accumulation", None)
        # the GPUs the user has (--gpus) with their micro-batch or accumulation fixed and no batch stated:
        # the global batch follows those settings instead of the recipe's default (settings_set_batch)
        self.batch_follows = settings_set_batch(spec)
        # measured runs: GPU slug -> measured / predicted tokens/s (gpuprov/calibration.py RULE)
        # a calibration that carries the achieved-GEMM ratio scales the GEMMs (what the operation model
        # takes from a measurement); an older file's whole-step ratio scales the step
        cals = getattr(spec, "calibration", None) or []
        self.gemm_scale = {c.gpu: float(c.gemm_efficiency_ratio) for c in cals
                           if getattr(c, "gemm_efficiency_ratio", None)}
        self.speed = {c.gpu: float(c.speed_ratio) for c in cals if c.gpu not in self.gemm_scale}
        self.op_cache: dict[tuple[str, str], OpModel] = {}
        self.flops_by_ac = {ac: flops_per_token(arch, self.seq, self.task, self.trainable, ac) for ac in AC_MODES}
        self.stack = stack_for(spec, arch)
        self.stack_f8 = stack_for(spec, arch, float8=True)
        # GPU slug -> step_estimate's float8 arguments ({}: float8 not allowed or not measured there)
        self.f8_kw: dict[str, dict[str, float]] = {}
        self.f8_allowed = getattr(spec, "float8", False) and float8_refusal(
            task=self.task, precision=spec.precision, compiled=self.stack.compile, moe=arch.is_moe, tp=1) is None
        a = assumptions()
        self.overhead_h = float(a.raw["run"]["overhead_hours"])
        self.tol = float(a.raw["run"]["batch_tolerance"])
        self.qfac = a.qlora_factor if self.task == "qlora" else 1.0
        self.ckpt_bytes, self.ckpt_kept = checkpoint_bytes_of(self.trainable)
        self.dataset_bytes = dataset_bytes_of(self.tokens)
        self.storage_cache: dict[tuple[str, int], StorageTerms] = {}
        self.mem_cache: dict[tuple, MemoryEstimate] = {}
        self.mem_calls = 0
        # Per-GPU memory never grows when the same model state is spread over more GPUs, and
        # replicas (ddp, hsdp with a fixed shard group) do not change it at all: a fit (or, for
        # replicas, a miss) seen at one cluster size settles others without asking the estimator
        # again. Gradient accumulation enters as the estimator models it: whether gradients stay
        # alive between micro-batches (steps > 1), not how many; the family key separates the two.
        # The brute force asks every time; tests and benchmark hold the two to the same answer.
        self.seen: dict[tuple, list[tuple[int, int]]] = {}
        self.shape_cache: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}
        self.layout_cache: dict[tuple[str, int, int], list[_Layout]] = {}  # (GPU, GPUs per node, nodes) ->
        self.compute_cache: dict[tuple[str, str], float] = {}
        self.degrees_cache: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.fit_cache: dict[tuple, list[tuple[int, int, int]]] = {}
        self.walk_top: dict[str, int] = {}  # instance -> the most nodes an ascending walk reaches
        self.probe_cache: dict[tuple, int] = {}  # -> the farthest node count that misses (0: none)
        self.step_cache: dict[tuple, StepEstimate] = {}
        self.tp_cache, self.f8_on = {}, {}
        # what the TP and CP collectives move per layer (SDPA sees GQA's K/V repeated to the query heads)
        self.layer = LayerShape(arch.num_layers, arch.hidden_size,
                                arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim, arch.kv_dim)
        self.best: Candidate | None = None
        self.best_by_gpu: dict[str, Candidate] = {}
        self.best_by_group: dict[tuple[str, str], Candidate] = {}
        self.fastest: Candidate | None = None
        self.cheapest: Candidate | None = None
        self.nearest: Miss | None = None
        self.unfit: dict[str, Miss] = {}
        self.constrained: dict[str, Candidate] = {}
        self.evaluated = self.fitting = self.constrained_out = 0

    # ---------------------------------------------------------------- memory
    @staticmethod
    def _accum(lay: _Layout, ga: int) -> int | bool:
        """What the estimate sees of accumulation: without PP only whether gradients live between
        micro-batches (ga > 1); with PP the count, the pipeline micro-batches in flight and kept."""
        return ga if lay.pp > 1 else ga > 1

    @classmethod
    def _family(cls, gpn: int, lay: _Layout, ac: str, mb: int, ga: int) -> tuple:
        sg = lay.sg if lay.sharding in ("hsdp", "ddp") else 0
        return (gpn, lay.sharding, sg, ac, mb, cls._accum(lay, ga), lay.tp, lay.cp, lay.f8, lay.pp)

    def memory(self, total: int, gpn: int, lay: _Layout, ac: str, mb: int, ga: int) -> MemoryEstimate:
        key = (total, gpn, lay, ac, mb, self._accum(lay, ga))
        est = None if self.exhaustive else self.mem_cache.get(key)
        if est is None:
            spec = self.spec
            setup = make_setup(
                task=self.task, seq_len=self.seq, micro_batch=mb, gpus=total, gpus_per_node=gpn,
                sharding=lay.sharding, shard_group=lay.sg if lay.sharding == "hsdp" else None,
                activation_checkpointing=ac, precision=spec.precision, optimizer=spec.optimizer,
                offload=spec.offload, lora_rank=spec.lora_rank, lora_targets=self.targets, grad_accum=ga,
                tp=lay.tp, cp=lay.cp, pp=lay.pp, pp_schedule=self.pp_schedule,
                framework=getattr(spec, "framework", "gpuprov"), stack=self.stack_f8 if lay.f8 else self.stack,
            )
            est = self.estimator(self.arch, setup)
            self.mem_calls += 1
            self.mem_cache[key] = est
            self.seen.setdefault(self._family(gpn, lay, ac, mb, ga), []).append((total, est.per_gpu_bytes))
        return est

    def known_fit(self, total: int, gpn: int, lay: _Layout, ac: str, mb: int, ga: int, usable: int) -> bool | None:
        replicas = lay.sharding in ("ddp", "hsdp")
        for t, b in self.seen.get(self._family(gpn, lay, ac, mb, ga), ()):
            if b <= usable and t <= total:
                return True
            if replicas and b > usable:
                return False
        return self.fsdp_missed(total, gpn, lay, ac, mb, ga, usable) if lay.sharding == "hsdp" else None

    def fsdp_missed(self, total: int, gpn: int, lay: _Layout, ac: str, mb: int, ga: int, usable: int) -> bool | None:
        """False when FSDP over all the GPUs (same TP x CP, same shape) already misses: HSDP holds at least as much."""
        flat = self.mem_cache.get((total, gpn, lay._replace(sharding="fsdp", sg=total), ac, mb, self._accum(lay, ga)))
        return False if flat is not None and flat.per_gpu_bytes > usable else None

    # ---------------------------------------------------------------- bounds
    def ops(self, gpu: Any, ac: str) -> OpModel:
        """The operation model of this model on this GPU (at its power limit, with its calibration) and AC."""
        key = (gpu.slug, ac)
        out = self.op_cache.get(key)
        if out is None:
            out = self.op_cache[key] = op_model(self.arch, gpu, ac=ac, compiled=self.stack.compile, task=self.task,
                                                trainable=self.trainable, gemm_scale=self.gemm_scale.get(gpu.slug, 1.0),
                                                document_mask=document_mask(self.stack), cp_gather=cp_gathers(self.stack))
        return out

    def _compute_seconds(self, inst: Any, ac: str) -> float:
        """GPU-seconds no layout can beat: the executed matmul FLOPs at the GPU's best GEMM rate (no wave or
        bandwidth loss, no attention, memory-bound work, launches or communication)."""
        key = (inst.gpu, ac)
        out = self.compute_cache.get(key)
        if out is None:
            gpu = self.gpus[inst.gpu]
            fl = self.flops_by_ac[ac]
            gain = self.gain(gpu) or 1.0  # a bound: float8 (where allowed) is the fastest the GPU runs
            speed = self.speed.get(inst.gpu, 1.0)  # an older calibration scales every term: the bound too
            rate = self.ops(gpu, ac).gpu.gemm_flops
            # 0.99: the norms' few parameters count in N but run no matmul
            out = self.compute_cache[key] = \
                0.99 * self.tokens * (fl.executed - attention_executed(fl)) / (rate * self.qfac * gain * speed)
        return out

    def _tp_seconds(self, slot: _Slot, tp: int, ac: str) -> float:
        """GPU-seconds per token of the TP collectives a TP layout cannot hide (0 without TP); asked for every
        layout and AC mode, it depends on the GPU, its NVLink bandwidth, the TP degree and the AC mode alone."""
        if tp == 1:
            return 0.0
        key = (slot.inst.gpu, slot.gpu.slug, slot.intra, tp, ac)
        out = None if self.exhaustive else self.tp_cache.get(key)
        if out is None:
            # a bound: float8 linears (where allowed on this GPU) gather in float8, the least TP traffic
            out = self.tp_cache[key] = tp_gpu_seconds_per_token(
                layer=self.layer, tp=tp, ac=ac, gbytes=slot.intra,
                float8=self.gain(slot.gpu) is not None) / self.speed.get(slot.inst.gpu, 1.0)
        return out

    def lower_bound_cost(self, inst: Any, nodes: int = 1, ac: str = "none", tp_s: float = 0.0) -> float:
        """No candidate on `inst` with >= `nodes` nodes and this AC can cost less (compute only, plus
        `tp_s` GPU-seconds per token of TP collectives)."""
        price = inst.price_per_hour_usd
        if price is None:
            return 0.0
        gpu_seconds = self._compute_seconds(inst, ac) + self.tokens * tp_s
        return (gpu_seconds / 3600.0 / inst.gpus + self.overhead_h * nodes) * price

    def lower_bound_hours(self, inst: Any, nodes: int, ac: str = "none", tp_s: float = 0.0) -> float:
        gpu_seconds = self._compute_seconds(inst, ac) + self.tokens * tp_s
        return gpu_seconds / (nodes * inst.gpus) / 3600.0 + self.overhead_h

    def beaten(self, inst: Any, nodes: int, ac: str, tp_s: float = 0.0) -> bool:
        """True when no candidate from here on can beat the best of this instance's table row."""
        if self.exhaustive:
            return False
        inc = self.best_by_group.get(_group(inst))
        return inc is not None and self.beats_bound(inc, inst, nodes, ac, tp_s)

    def beats_bound(self, inc: Candidate, inst: Any, nodes: int, ac: str, tp_s: float) -> bool:
        """True when `inc` beats every candidate on `inst` from `nodes` nodes on (the bounds above)."""
        if self.objective == "cost":
            return inc.cost_usd is not None and inst.price_per_hour_usd is not None and \
                self.lower_bound_cost(inst, nodes, ac, tp_s) > inc.cost_usd
        if self.objective == "time":
            return self.lower_bound_hours(inst, nodes, ac, tp_s) > inc.time_hours
        return nodes * inst.gpus > inc.total_gpus

    # ---------------------------------------------------------------- shapes
    def gbt_at(self, dp: int) -> int:
        out = self.gbt_cache.get(dp)
        if out is None:
            out = self.gbt_cache[dp] = global_batch_tokens(self.spec, dp)
        return out

    def batch_shapes(self, dp: int, pp: int = 1) -> tuple[tuple[int, int, int], ...]:
        """(micro-batch, grad accum, batch tokens) that form the global batch within tolerance.

        `dp` counts data-parallel ranks: the GPUs over tp x cp x pp (one sample spans a TP x CP x PP group).
        With PP the accumulation steps are the pipeline's micro-batches: only counts the schedule runs and
        that fill the pipeline (pipeline_micro_batches)."""
        cached = self.shape_cache.get((dp, pp))
        if cached is None:
            out: list[tuple[int, int, int]] = []
            gbt = self.gbt_at(dp)
            for mb in self.micro_batches:
                per_step_tokens = mb * self.seq * dp
                if self.fixed_ga is None:
                    ga = pipeline_micro_batches(pp, self.pp_schedule, round(gbt / per_step_tokens))
                elif pipeline_micro_batches(pp, self.pp_schedule, self.fixed_ga) == self.fixed_ga:
                    ga = self.fixed_ga
                else:
                    continue  # the user's accumulation is no count this pipeline runs
                batch = ga * per_step_tokens
                if abs(batch - gbt) <= self.tol * gbt or (self.batch_follows and batch > gbt):
                    out.append((mb, ga, batch))
                elif per_step_tokens > gbt:
                    break
            cached = self.shape_cache[(dp, pp)] = tuple(out)
        return cached

    def record_miss(self, slot: _Slot, sharding: str, est: MemoryEstimate) -> None:
        ratio = est.per_gpu_bytes / slot.usable
        slug = slot.inst.gpu
        miss = Miss(ratio, slot.inst, slot.gpu, slot.nodes, sharding, est.per_gpu_bytes, slot.usable,
                    est.model_states_bytes)
        if self.nearest is None or ratio < self.nearest.ratio:
            self.nearest = miss
        if slug not in self.best_by_gpu and slug not in self.constrained and (
                slug not in self.unfit or ratio < self.unfit[slug].ratio):
            self.unfit[slug] = miss

    def fitting_shapes(self, slot: _Slot, lay: _Layout, ac: str,
                       shapes: tuple[tuple[int, int, int], ...]) -> list[tuple[int, int, int]]:
        """The shapes whose memory fits the slot's GPUs."""
        if self.exhaustive:
            out = []
            for x in shapes:
                est = self.memory(slot.total, slot.gpn, lay, ac, x[0], x[1])
                if est.per_gpu_bytes <= slot.usable:
                    out.append(x)
                else:
                    self.record_miss(slot, lay.sharding, est)
            return out
        # The same GPU type on another cloud (or instance) answers the same: memory does not depend
        # on the instance, and its misses were recorded the first time (a repeat ratio changes no miss).
        key = (slot.fits, lay, ac, shapes)
        cached = self.fit_cache.get(key)
        if cached is None:
            cached = self.fit_cache[key] = self.scan_shapes(slot, lay, ac, shapes)
        return cached

    def scan_shapes(self, slot: _Slot, lay: _Layout, ac: str,
                    shapes: tuple[tuple[int, int, int], ...]) -> list[tuple[int, int, int]]:
        """fitting_shapes without the brute force: settled by what is known, else the estimator."""
        total, gpn, usable = slot.total, slot.gpn, slot.usable
        out = []
        # memory grows with the micro-batch: stop at the first that does not fit (estimates are
        # cached across instances, so smaller GPUs reuse them). A larger micro-batch can end
        # accumulation (1 step) and free the gradients held between micro-batches, so the scan
        # stops per accumulating/not.
        stopped: set[bool] = set()
        for x in shapes:
            accumulating = x[1] > 1
            if accumulating in stopped:
                continue
            known = self.known_fit(total, gpn, lay, ac, x[0], x[1], usable)
            if known is False:
                stopped.add(accumulating)
                continue
            if known is None and self.misses_everywhere(slot, lay, ac, x[0], x[1]):
                stopped.add(accumulating)
                continue
            if known is None:
                est = self.memory(total, gpn, lay, ac, x[0], x[1])
                if est.per_gpu_bytes > usable:
                    self.record_miss(slot, lay.sharding, est)
                    stopped.add(accumulating)
                    continue
            out.append(x)
        return out

    def misses_everywhere(self, slot: _Slot, lay: _Layout, ac: str, mb: int, ga: int) -> bool:
        """True when this sharded shape misses on the largest cluster the walk will reach: memory never
        grows as the same state is sharded over more GPUs, so it misses on this smaller one too. One
        estimate there settles the node counts below it. The walk records that miss when it gets there
        (the smallest ratio, the one an unpruned walk keeps), so the misses reported stay the same."""
        top = self.walk_top.get(slot.inst.name)
        if top is None or lay.sharding not in ("fsdp", "zero2") or slot.nodes >= top:
            return False  # the widest slot itself is estimated (and its miss recorded) as before
        key = (slot.inst.gpu, slot.usable, slot.gpn, top, lay.sharding, lay.tp, lay.cp, lay.pp, lay.f8, ac, mb, ga > 1)
        far = self.probe_cache.get(key)
        if far is None:
            far = self.probe_cache[key] = self._farthest_miss(slot, lay, ac, mb, ga > 1, top)
        return slot.nodes < far

    def _farthest_miss(self, slot: _Slot, lay: _Layout, ac: str, mb: int, accumulating: bool, top: int) -> int:
        """The largest node count (<= top) with this shape, when the shape misses there; else 0."""
        for nodes in range(top, 0, -1):
            total = nodes * slot.gpn
            if total % lay.mp:
                continue
            shape = next((x for x in self.batch_shapes(total // lay.mp, lay.pp)
                          if x[0] == mb and (x[1] > 1) == accumulating),
                         None)
            if shape is None:
                continue
            est = self.memory(total, slot.gpn, lay._replace(sg=total), ac, mb, shape[1])
            return nodes if est.per_gpu_bytes > slot.usable else 0
        return 0

    # ---------------------------------------------------------------- timing and ranking
    def step(self, slot: _Slot, lay: _Layout, ac: str, mb: int, ga: int) -> StepEstimate:
        """One step's time; the same GPU at the same fabric bandwidth on another cloud reuses it."""
        key = (slot.inst.gpu, slot.gpn, slot.nodes, slot.inter, lay, ac, mb, ga)
        out = None if self.exhaustive else self.step_cache.get(key)
        if out is None:
            spec, arch, gpu = self.spec, self.arch, slot.gpu
            shape, pipeline = pipelined(Shape(nodes=slot.nodes, gpus_per_node=slot.gpn, sharding=lay.sharding,
                                              shard_group=lay.sg, micro_batch=mb, grad_accum=ga, seq_len=self.seq),
                                        lay.pp, self.pp_schedule)
            out = self.step_cache[key] = layout_step_estimate(
                shape=shape, tp=lay.tp, cp=lay.cp, layer=self.layer, ac=ac,
                flops=self.flops_by_ac[ac], peak_tflops=gpu.bf16_tflops, util=slot.util,
                hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=slot.intra, inter_gbytes=slot.inter,
                params=arch.params, trainable=self.trainable, num_layers=arch.num_layers, task=self.task,
                optimizer=spec.optimizer, precision=spec.precision, offload=spec.offload, pcie_gen=gpu.pcie_gen,
                pipeline=pipeline, async_tp=False,  # the trainer runs no async TP
                ops=self.ops(gpu, ac), **(self.float8_kw(gpu) if lay.f8 else {}),
            )
            out = self.step_cache[key] = calibrated(out, self.speed.get(slot.inst.gpu, 1.0))
        return out

    # ---------------------------------------------------------------- float8
    def float8_kw(self, gpu: Any) -> dict[str, float]:
        """step_estimate's float8 arguments on this GPU when the spec allows float8 and a measurement
        covers the setup (catalog/data/throughput.yaml float8); else {}."""
        if gpu.slug not in self.f8_kw:
            self.f8_kw[gpu.slug] = float8_step_kw(gpu, self.arch) if self.f8_allowed else {}
        return self.f8_kw[gpu.slug]

    def gain(self, gpu: Any) -> float | None:
        return self.float8_kw(gpu).get("float8_gain")

    def float8_on(self, gpu: Any, tp: int) -> bool:
        key = (gpu.slug, tp)  # asked for every layout; the rest of what it reads is the spec's
        out = self.f8_on.get(key)
        if out is None:
            out = self.f8_on[key] = self.gain(gpu) is not None and float8_refusal(
                task=self.task, precision=self.spec.precision, compiled=self.stack.compile, moe=self.arch.is_moe,
                tp=tp) is None
        return out

    def timed(self, slot: _Slot, lay: _Layout, ac: str, mb: int, ga: int, batch: int) -> Candidate:
        gpu = slot.gpu
        steps = -(-self.tokens // batch)
        step = self.step(slot, lay, ac, mb, ga)
        self.evaluated += 1
        train_h = steps * step.step_time_s / 3600.0
        terms = self.storage(slot.inst.cloud, slot.nodes)
        given = self.spec.checkpoint_every_steps
        every = checkpoint_every(steps, step.step_time_s, given)
        ckpt_h = checkpoint_hours(terms, self.ckpt_bytes, steps, every, step.step_time_s, slot.total)
        lost = 0.0
        if getattr(slot.inst, "purchase", None) == "spot":  # expected preemption losses (gpuprov/spot.py)
            lost = spot_overhead_hours(train_h, slot.nodes, None if given is None else every * step.step_time_s / 3600)
        hours = train_h + self.overhead_h + (ckpt_h or 0.0) + lost
        price = slot.inst.price_per_hour_usd
        storage = hours * storage_usd_per_hour(terms)
        cost = None if price is None else hours * slot.nodes * price + storage
        return Candidate(slot.inst, gpu, slot.nodes, lay.sharding, lay.sg, ac, mb, ga, batch, steps, None, step,
                         hours, cost, lay.tp, lay.cp, lay.pp, self.pp_schedule, lay.f8, checkpoint_hours=ckpt_h,
                         storage_usd=storage if price is not None else 0.0, preemption_hours=lost, storage=terms)

    def storage(self, cloud: str, nodes: int) -> StorageTerms:
        key = (cloud, nodes)
        out = self.storage_cache.get(key)
        if out is None:
            out = self.storage_cache[key] = storage_terms(cloud, nodes, boot_disk_gib(cloud), self.ckpt_bytes,
                                                          self.ckpt_kept, self.dataset_bytes)
        return out

    def over_limits(self, cand: Candidate) -> bool:
        deadline, budget = self.spec.deadline_hours, self.spec.budget_usd
        return (deadline is not None and cand.time_hours > deadline) or (
            budget is not None and cand.cost_usd is not None and cand.cost_usd > budget)

    def consider(self, cand: Candidate) -> None:
        """Rank one timed candidate against the best so far (overall, per GPU, per table row)."""
        slug = cand.instance.gpu
        if self.fastest is None or cand.time_hours < self.fastest.time_hours:
            self.fastest = cand
        if cand.cost_usd is not None and (self.cheapest is None or cand.cost_usd < (self.cheapest.cost_usd or math.inf)):
            self.cheapest = cand
        self.unfit.pop(slug, None)
        if self.over_limits(cand):
            self.constrained_out += 1
            prev = self.constrained.get(slug)
            if prev is None or cand.time_hours < prev.time_hours:
                self.constrained[slug] = cand
            return
        k = objective_key(self.objective, cand)
        group = _group(cand.instance)
        row = self.best_by_group.get(group)
        if row is None or k < objective_key(self.objective, row):
            self.best_by_group[group] = cand
        cur = self.best_by_gpu.get(slug)
        if cur is None or k < objective_key(self.objective, cur):
            self.best_by_gpu[slug] = cand
            if self.best is None or k < objective_key(self.objective, self.best):
                self.best = cand

    # ---------------------------------------------------------------- the walk
    def node_order(self, inst: Any, top: int, only_nodes: int | None) -> Iterable[int]:
        if self.spec.gpu_count is not None:  # exactly N GPUs: the one node count that makes N, if any
            n, rest = divmod(self.spec.gpu_count, inst.gpus)
            only_nodes = n if not rest and only_nodes in (None, n) else 0
        if only_nodes is not None:
            order: Iterable[int] = [only_nodes] if 1 <= only_nodes <= top else []
        elif self.objective == "time" and not self.exhaustive:
            order = range(top, 0, -1)
        else:
            order = range(1, top + 1)
        if self.spec.offload == "none":
            return order
        return [n for n in order if self.offload_fits(inst, n)]

    def offload_fits(self, inst: Any, nodes: int) -> bool:
        """CPU offload keeps each node's share of the optimizer states in its RAM (host_rules.yaml
        offload_extra_bytes_per_param, as gpuprov/host.py sizes the hosts): a node count whose share
        exceeds the instance's RAM cannot run."""
        per_param = load_data("host_rules.yaml")["ram"]["offload_extra_bytes_per_param"]
        return inst.ram_bytes is None or math.ceil(self.trainable * per_param / nodes) <= inst.ram_bytes

    def slot(self, inst: Any, nodes: int) -> _Slot:
        gpu = self.gpus[inst.gpu]
        return _Slot(inst=inst, gpu=gpu, nodes=nodes, usable=int(gpu.memory_bytes * (1.0 - self.spec.safety_margin)),
                     util=utilisation(gpu, compiled=self.stack.compile)[0], intra=intra_node_gbytes(gpu)[0],
                     inter=inter_node_gbytes(inst.fabric, inst.fabric_gbps_per_gpu))

    def degrees(self, inst: Any) -> list[tuple[int, int]]:
        """The (tp, cp) pairs this instance can host (_mp_degrees), once per GPU type and count."""
        key = (inst.gpu, inst.gpus)
        out = self.degrees_cache.get(key)
        if out is None:
            out = self.degrees_cache[key] = _mp_degrees(self.spec, self.arch, self.gpus[inst.gpu], inst.gpus)
        return out

    def walk_instance(self, inst: Any, top: int, only_nodes: int | None) -> None:
        degrees = self.degrees(inst)
        if not degrees:
            return  # a fixed --tp this machine cannot host (no NVLink, or not a divisor of its GPUs)
        # no pp factor: a step runs at least pp pipeline micro-batches, so PP leaves the smallest batch as it was
        max_mp = max(t * c for t, c in degrees)
        descending = self.objective == "time" and not self.exhaustive
        order = self.node_order(inst, top, only_nodes)
        if isinstance(order, range) and order.step == 1 and not self.exhaustive:
            widest = int(self.gbt * (1 + self.tol) * max_mp // (self.seq * inst.gpus))
            self.walk_top[inst.name] = min(order.stop - 1, widest)
        for nodes in order:
            if self.seq * nodes * inst.gpus > self.gbt * (1 + self.tol) * max_mp and not self.batch_follows:
                if descending:
                    continue
                break  # even micro-batch 1 on the widest TP x CP group overshoots; more nodes only worse
            if self.beaten(inst, nodes, "none"):
                # cost and GPU-count bounds grow with nodes (per-node overhead; GPU count); the time
                # bound grows as nodes fall, and time walks the node counts downwards
                break
            self.walk_slot(self.slot(inst, nodes), degrees)

    def walk_slot(self, slot: _Slot, degrees: list[tuple[int, int]]) -> None:
        """Every layout on one slot; HSDP is skipped where FSDP over every GPU (same TP x CP) fits nothing."""
        missed: set[tuple[int, int, int]] = set()  # (tp, cp, pp) whose FSDP fits nothing on this slot
        for lay in self.slot_layouts(slot, degrees):
            if lay.sharding == "hsdp" and (lay.tp, lay.cp, lay.pp) in missed and not self.exhaustive:
                continue  # HSDP holds at least what FSDP over every GPU holds: nothing fits either
            if self.walk_layout(slot, lay) and lay.sharding == "fsdp":
                missed.add((lay.tp, lay.cp, lay.pp))

    def slot_layouts(self, slot: _Slot, degrees: list[tuple[int, int]]) -> list[_Layout]:
        """layouts() with float8 set where it runs; the same for every instance with this GPU, GPU count and node
        count (degrees() and float8_on() read nothing else of the slot)."""
        key = (slot.inst.gpu, slot.gpn, slot.nodes)
        out = self.layout_cache.get(key)
        if out is None:
            out = []
            for lay in self.layouts(slot, degrees):
                f8 = self.float8_on(slot.gpu, lay.tp)
                out.append(lay._replace(f8=f8) if f8 != lay.f8 else lay)  # _layouts leave it False
            self.layout_cache[key] = out
        return out

    def layouts(self, slot: _Slot, degrees: list[tuple[int, int]]) -> list[_Layout]:
        """The slot's layouts for each PP degree the search walks. A proposed pipeline's stages span whole
        nodes (pp divides the node count: activations cross the inter-node fabric between stages), shard
        each stage with FSDP (torchtitan's PP x FSDP x TP; HSDP per stage is left to --pp, to keep plan
        fast) and run no CP (the trainer's stages have no ring attention)."""
        out: list[_Layout] = []
        for pp in self.pps:
            if pp > 1 and self.auto_pp and slot.nodes % pp:
                continue
            out += [lay for lay in _layouts(slot.total, slot.gpn, slot.nodes, degrees, pp)
                    if lay.pp == 1 or not self.auto_pp or (lay.cp == 1 and lay.sharding == "fsdp")]
        return out

    def walk_layout(self, slot: _Slot, lay: _Layout) -> bool:
        """Every AC mode and micro-batch of one layout on one slot. True when every AC mode was
        tried (no bound cut the scan) and nothing fits."""
        fitted: set[int] = set()  # micro-batches a cheaper AC mode already fits
        all_shapes = self.batch_shapes(slot.total // lay.mp, lay.pp)
        for ac in self.ac_modes:
            if not self.exhaustive and fitted and fitted.issuperset(x[0] for x in all_shapes):
                return False  # every micro-batch fits with less recompute: more recompute only costs
            inc = None if self.exhaustive else self.best_by_group.get(slot.group)  # beaten(), its row known
            if inc is not None and self.beats_bound(inc, slot.inst, slot.nodes, ac, self._tp_seconds(slot, lay.tp, ac)):
                return False
            shapes = all_shapes
            if fitted and not self.exhaustive:
                # same shape with less recompute fits already: dominated
                shapes = tuple(x for x in shapes if x[0] not in fitted)
            for mb, ga, batch in self.fitting_shapes(slot, lay, ac, shapes):
                fitted.add(mb)
                self.fitting += 1
                self.consider(self.timed(slot, lay, ac, mb, ga, batch))
        return not fitted

    def result(self, searched: list[Any], unpriced: list[str], excluded: list[Any]) -> SearchResult:
        return SearchResult(
            best=self.best, best_by_gpu=self.best_by_gpu, fastest_unconstrained=self.fastest,
            cheapest_unconstrained=self.cheapest, nearest_miss=self.nearest,
            unfit_gpus={k: v for k, v in self.unfit.items() if k not in self.best_by_gpu},
            evaluated=self.evaluated, memory_calls=self.mem_calls, fitting=self.fitting,
            constrained_out=self.constrained_out, unpriced=unpriced,
            constrained_by_gpu={k: v for k, v in self.constrained.items() if k not in self.best_by_gpu},
            searched=searched, excluded_unpriced=excluded, best_by_group=dict(self.best_by_group),
        )


def search(
    spec: Any,
    arch: Any,
    *,
    estimator: Estimator,
    instances: Iterable[Any],
    gpu_lookup: Callable[[str], Any],
    exhaustive: bool = False,
    only_nodes: int | None = None,
) -> SearchResult:
    """Enumerate the space, keep what fits and meets the constraints, rank by spec.objective.

    `only_nodes` searches that one node count (make_plan asks what all the on-prem hosts would do)."""
    offered = list(instances)
    insts, searched, unpriced, excluded = _pool(spec, offered, exhaustive)
    limit = plan_power_limit(spec)  # GPUs under a power limit are timed at the clocks it holds
    gpus = {i.gpu: power_capped(gpu_lookup(i.gpu), limit) for i in insts}
    # the same question asked again (a later run): the walk's answer from the user's cache (search_memo.py)
    memo = search_memo.entry(spec, arch, estimator, offered, gpus, exhaustive, only_nodes)
    found = memo.load() if memo is not None else None
    if found is not None:
        return found
    s = _Search(spec, arch, estimator, gpus, exhaustive)
    if not exhaustive and spec.objective == "cost":
        insts.sort(key=s.lower_bound_cost)
    hosts = len(spec.hosts) if spec.hosts else None
    for inst in insts:
        # the target's limit (Azure's scale set, on-prem's host count; also under cloud 'any')
        s.walk_instance(inst, get_target(inst.cloud).node_cap(spec.max_nodes, hosts), only_nodes)
    result = s.result(searched, unpriced, excluded)
    if memo is not None:
        memo.save(result)
    return result
