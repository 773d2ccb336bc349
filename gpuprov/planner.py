"""The planner: choose instance type, node count and parallelism for a TrainingSpec.

Search space (the same for the planner and the exhaustive brute force that checks it):
instance type x nodes (1..max_nodes; on-prem: at most one node per host listed) x sharding (single GPU: none; else ddp, zero2, fsdp, and
hsdp with shard group = k nodes for every k that divides the node count, k < nodes) x
activation checkpointing (none, selective, full) x micro-batch (1, 2, 4, ... 32); for full training,
also a model-parallel layout: tensor parallelism inside a node's NVLink domain and context
parallelism for long sequences, with FSDP/HSDP over what they leave (torchtitan's mesh).
A candidate is kept when the memory estimator's per-GPU peak fits under
gpu memory x (1 - safety margin) and the global batch can be formed
(micro_batch x seq_len x GPUs <= global batch tokens). It is then timed (sizing/throughput.py),
costed, filtered by deadline and budget, and ranked by the objective.

The planner prunes what cannot win, without changing the answer:
- instances dominated by a cheaper one with the same GPU, count, links and fabric;
- memory estimates are cached per setup (they do not depend on the instance) and the
  micro-batch scan stops at the first size that does not fit (memory grows with micro-batch);
- a lower bound per instance (pure compute at the assumed utilisation, no recompute, no
  communication; TP layouts add their unhidden TP collectives) skips instances that cannot beat
  the best found for their GPU type;
- HSDP holds at least what FSDP over every GPU holds in the same TP x CP layout: an FSDP miss
  settles the HSDP shapes (and, when FSDP fits nothing, the HSDP layouts) without the estimator.
`search(..., exhaustive=True)` turns every pruning off: the brute force.

On-prem hosts (`--hosts FILE`): the objective picks the node count among 1..len(hosts) as it does
in the cloud (cost ranks on-prem runs by GPU-hours); the plan runs on the first hosts in file order
and never leaves a host out silently: a note names the others with the reason and what all the
hosts would do, and `gpuprov plan`, the bundle README and the inventory list them (hosts_note).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

from gpuprov.errors import GpuprovError
from gpuprov.sizing.throughput import LayerShape, Shape, StepEstimate, float8_refusal, float8_step_kw, \
    flops_per_token, inter_node_gbytes, intra_node_gbytes, layout_step_estimate, tp_gpu_seconds_per_token, \
    utilisation
from gpuprov.sizing.types import LORA_TARGET_PRESETS, MemoryEstimate, TrainSetup

GiB = 2**30
TB = 10**12
MICRO_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
Estimator = Callable[..., MemoryEstimate]


@dataclass(frozen=True)
class Candidate:
    instance: Any  # InstanceType
    gpu: Any  # GpuSpec
    nodes: int
    sharding: str
    shard_group: int
    activation_checkpointing: str
    micro_batch: int
    grad_accum: int
    batch_tokens: int  # effective global batch
    steps: int
    memory: MemoryEstimate | None  # filled for the chosen one (make_plan)
    step: StepEstimate
    time_hours: float
    cost_usd: float | None
    tp: int = 1  # tensor-parallel degree (inside one node)
    cp: int = 1  # context-parallel degree
    float8: bool = False  # torchao float8 linears (the spec allowed it and a measurement covers the GPU)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.instance.gpus

    def key(self) -> tuple:
        return (self.instance.cloud, self.instance.name, self.nodes, self.sharding, self.shard_group,
                self.activation_checkpointing, self.micro_batch, self.tp, self.cp)


@dataclass
class Miss:
    """The candidate closest to fitting (smallest per-GPU bytes / usable bytes)."""

    ratio: float
    instance: Any
    gpu: Any
    nodes: int
    sharding: str
    per_gpu_bytes: int
    usable_bytes: int
    model_states_bytes: int


@dataclass
class SearchResult:
    best: Candidate | None
    best_by_gpu: dict[str, Candidate]  # best per GPU slug (objective), among feasible
    fastest_unconstrained: Candidate | None  # fits memory, ignoring deadline/budget
    cheapest_unconstrained: Candidate | None
    nearest_miss: Miss | None
    unfit_gpus: dict[str, Miss]  # GPU slugs where nothing fits: their nearest miss
    evaluated: int  # candidates timed
    memory_calls: int
    fitting: int  # candidates that fit memory (any constraint)
    constrained_out: int  # fit but excluded by deadline/budget
    unpriced: list[str] = field(default_factory=list)
    constrained_by_gpu: dict[str, Candidate] = field(default_factory=dict)  # fastest that fit, over limits
    searched: list[Any] = field(default_factory=list)  # the instances the space was built from
    excluded_unpriced: list[Any] = field(default_factory=list)  # dropped: no price under the cost objective
    best_by_group: dict[tuple[str, str], Candidate] = field(default_factory=dict)  # (cloud, GPU) -> best
    every_host_note: str | None = None  # on-prem: why the plan uses every host though fewer ranked first


def make_setup(*, grad_accum: int, framework: str = "gpuprov", stack: Any = None, **fields: Any) -> TrainSetup:
    """The estimator's setup for one candidate, as the bundle's trainer will run it.

    `grad_accum` (global batch / (micro-batch x seq-len x data-parallel ranks)) decides whether
    gradients stay alive through the next forward. QLoRA: the trainer leaves the NF4 base out of
    FSDP2 (it cannot shard bitsandbytes weights), so every GPU holds all of it. `stack` (the
    Plan's Stack) carries the rest of what the trainer runs: loss, compile, optimizer step.
    """
    from gpuprov.sizing.types import TrainSetup

    if framework == "gpuprov":  # the bundle's own trainer: the Plan's Stack says what it runs
        from gpuprov.stack import choose_stack, setup_fields

        if stack is None:  # the stack any model of this task and precision gets (attention aside)
            stack = choose_stack(fields.get("task", "full"), fields.get("precision", "bf16-mixed"), "")
        extra = setup_fields(stack, tp=int(fields.get("tp", 1)))
    else:  # another framework's stack (catalog/data/frameworks.yaml); the candidate's own fields win
        from gpuprov.sizing.frameworks import preset_stack

        preset = preset_stack(framework, fields.get("task", "full"), fields.get("sharding", "fsdp"), int(fields.get("tp", 1)))
        extra = {k: v for k, v in preset.items() if k not in fields}
    return TrainSetup(**fields, **extra, grad_accumulation_steps=max(1, int(grad_accum)))


def stack_for(spec: Any, arch: Any, tp: int = 1, float8: bool = False) -> Any:
    """The Stack the bundle's trainer runs for this spec and model (gpuprov/stack.py)."""
    from gpuprov.stack import choose_stack

    return choose_stack(spec.task, spec.precision, arch.model_type, tp, float8)


def rule_of_thumb_bytes_per_param() -> int:
    """The widely quoted 18 B/param of mixed-precision Adam (host_rules.yaml names the papers)."""
    from gpuprov.host import rules

    return int(rules()["memory"]["rule_of_thumb_bytes_per_param"])


def _lora_targets(spec: Any) -> tuple[str, ...]:
    from gpuprov.sizing.arch import resolve_lora_targets

    return resolve_lora_targets(spec.lora_targets)


def _objective_key(objective: str, c: Candidate) -> tuple:
    cost = c.cost_usd if c.cost_usd is not None else math.inf
    if objective == "time":
        return (c.time_hours, cost, c.total_gpus)
    if objective == "gpus":
        # equal GPU counts: the faster run first (its GPUs are held for less time), then the cheaper
        return (c.total_gpus, c.time_hours, cost)
    # cost: on-prem has no price; GPU-hours order it (the owner pays in machine time)
    return (cost, c.time_hours * c.total_gpus, c.time_hours)


def _shardings(total: int, gpus_per_node: int, nodes: int) -> list[tuple[str, int]]:
    if total == 1:
        return [("none", 1)]
    out = [("ddp", 1), ("zero2", total), ("fsdp", total)]
    for k in range(1, nodes):
        if nodes % k == 0:
            out.append(("hsdp", k * gpus_per_node))
    return out


def _mp_degrees(spec: Any, arch: Any, gpu: Any, gpus_per_node: int) -> list[tuple[int, int]]:
    """(tp, cp) pairs worth trying: TP inside the NVLink domain of one node, CP for long sequences.

    A fixed --tp / --cp keeps only that degree. LoRA/QLoRA stay data-parallel (the trainer's TP
    plan is for full training)."""
    from gpuprov.sizing.throughput import assumptions

    fixed_tp, fixed_cp = getattr(spec, "tp", None), getattr(spec, "cp", None)
    if (getattr(spec, "pp", None) or 1) > 1:
        raise GpuprovError("--pp is sized by `gpuprov estimate --pp`; plans and the trainer do not run pipeline stages yet")
    if spec.task != "full":
        if (fixed_tp or 1) * (fixed_cp or 1) > 1:
            raise GpuprovError("--tp/--cp apply to --task full (LoRA/QLoRA adapters train data-parallel)")
        return [(1, 1)]
    mp = assumptions().raw["model_parallel"]
    seq = spec.seq_len
    tps = [fixed_tp] if fixed_tp else mp["tp_degrees"]
    cps = [fixed_cp] if fixed_cp else [c for c in mp["cp_degrees"] if c == 1 or seq >= mp["cp_min_seq_len"]]
    ok_tp = [t for t in tps if t == 1 or (
        bool(gpu.nvlink_gbytes_per_s) and gpus_per_node % t == 0 and arch.num_attention_heads % t == 0
        and arch.num_kv_heads % t == 0 and arch.intermediate_size % t == 0 and seq % t == 0
        and not arch.tie_word_embeddings)]
    ok_cp = [c for c in cps if c == 1 or seq % (2 * c) == 0]
    return [(t, c) for t in ok_tp for c in ok_cp]


class _Layout(NamedTuple):
    """How one slot's GPUs split the work: data-parallel sharding (shard group) x TP x CP."""

    sharding: str
    sg: int
    tp: int = 1
    cp: int = 1
    f8: bool = False  # torchao float8 on this slot's GPU (_Search.float8_on)

    @property
    def mp(self) -> int:
        """GPUs one sample spans (a TP x CP group acts as one data-parallel rank)."""
        return self.tp * self.cp


def _layouts(total: int, gpus_per_node: int, nodes: int, degrees: list[tuple[int, int]]) -> list[_Layout]:
    """The data-parallel choices of _shardings, plus FSDP/HSDP over what TP and CP leave
    (torchtitan: FSDP over dp_shard x cp, TP innermost). Each (tp, cp)'s FSDP comes before its HSDPs."""
    out = [_Layout(s, sg) for s, sg in _shardings(total, gpus_per_node, nodes)] if (1, 1) in degrees else []
    for tp, cp in degrees:
        mp = tp * cp
        if mp == 1 or total % mp:
            continue
        out.append(_Layout("fsdp", total, tp, cp))
        out += [_Layout("hsdp", k * gpus_per_node, tp, cp) for k in range(1, nodes)
                if nodes % k == 0 and (k * gpus_per_node) % mp == 0]
    return out


def _dominated(instances: list[Any]) -> set[str]:
    """Instance names another instance beats or ties on every input the planner uses."""
    out: set[str] = set()
    for a in instances:
        for b in instances:
            if a is b or a.cloud != b.cloud or a.gpu != b.gpu or a.gpus != b.gpus:
                continue
            if a.price_per_hour_usd is None or b.price_per_hour_usd is None:
                continue
            same_links = (b.fabric == a.fabric and b.fabric_gbps_per_gpu >= a.fabric_gbps_per_gpu
                          and b.nvswitch == a.nvswitch and b.pcie_gen == a.pcie_gen)
            if not same_links:
                continue
            cheaper = b.price_per_hour_usd < a.price_per_hour_usd
            tie = b.price_per_hour_usd == a.price_per_hour_usd and b.fabric_gbps_per_gpu == a.fabric_gbps_per_gpu \
                and b.name < a.name
            if cheaper or tie:
                out.add(a.name)
                break
    return out


def _group(inst: Any) -> tuple[str, str]:
    """The candidates table's row key: the best per GPU type on each cloud (bounds prune per group)."""
    return (inst.cloud, inst.gpu)


def _pool(spec: Any, instances: Iterable[Any], exhaustive: bool) -> tuple[list[Any], list[Any], list[str], list[Any]]:
    """The instances the spec allows: (to walk, searched, unpriced names, excluded for no price)."""
    insts = list(instances)
    if spec.gpus:
        wanted = {g.lower() for g in spec.gpus}
        insts = [i for i in insts if i.gpu.lower() in wanted]
    if spec.cloud != "any":
        insts = [i for i in insts if i.cloud == spec.cloud]
    else:
        # 'any' compares clouds; on-prem needs the user's hosts, so it joins only when asked
        insts = [i for i in insts if i.cloud != "onprem" or spec.hosts]
    if spec.region and spec.cloud == "any":
        raise GpuprovError(f"--region {spec.region} names one cloud's region: give --cloud as well")
    if spec.region:
        from gpuprov.catalog.regions import check_region

        check_region(spec.cloud, spec.region, insts)
    unpriced = sorted({i.name for i in insts if not i.onprem and i.price_per_hour_usd is None})
    excluded: list[Any] = []
    if spec.objective == "cost":
        # a machine without a public price cannot be ranked by cost
        excluded = [i for i in insts if not i.onprem and i.price_per_hour_usd is None]
        insts = [i for i in insts if i.onprem or i.price_per_hour_usd is not None]
    searched = list(insts)
    if not exhaustive:
        dom = _dominated(insts)
        insts = [i for i in insts if i.name not in dom]
    return insts, searched, unpriced, excluded


@dataclass
class _Slot:
    """One instance type at one node count: the figures every layout on it shares."""

    inst: Any
    gpu: Any
    nodes: int
    usable: int
    util: float
    intra: float
    inter: float

    @property
    def gpn(self) -> int:
        return self.inst.gpus

    @property
    def total(self) -> int:
        return self.nodes * self.inst.gpus


class _Search:
    """One walk of the space for one spec. Methods are the steps; the fields are what they share."""

    def __init__(self, spec: Any, arch: Any, estimator: Estimator, gpus: dict[str, Any], exhaustive: bool):
        from gpuprov.sizing.throughput import assumptions

        self.spec, self.arch, self.estimator, self.gpus, self.exhaustive = spec, arch, estimator, gpus, exhaustive
        self.task = spec.task
        self.targets = _lora_targets(spec) if self.task != "full" else LORA_TARGET_PRESETS["all-linear"]
        self.trainable = arch.trainable_params(self.task, spec.lora_rank, self.targets) \
            if self.task != "full" else arch.params
        self.seq, self.gbt, self.tokens = spec.seq_len, spec.global_batch_tokens, spec.tokens
        if self.seq > self.gbt:
            raise GpuprovError(f"--seq-len {self.seq} is longer than the global batch of {self.gbt} tokens")
        self.objective = spec.objective
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
        self.mem_cache: dict[tuple, MemoryEstimate] = {}
        self.mem_calls = 0
        # Per-GPU memory never grows when the same model state is spread over more GPUs, and
        # replicas (ddp, hsdp with a fixed shard group) do not change it at all: a fit (or, for
        # replicas, a miss) seen at one cluster size settles others without asking the estimator
        # again. Gradient accumulation enters as the estimator models it: whether gradients stay
        # alive between micro-batches (steps > 1), not how many; the family key separates the two.
        # The brute force asks every time; tests and benchmark hold the two to the same answer.
        self.seen: dict[tuple, list[tuple[int, int]]] = {}
        self.shape_cache: dict[int, list[tuple[int, int, int]]] = {}
        self.compute_cache: dict[tuple[str, str], float] = {}
        self.degrees_cache: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self.fit_cache: dict[tuple, list[tuple[int, int, int]]] = {}
        self.walk_top: dict[str, int] = {}  # instance -> the most nodes an ascending walk reaches
        self.probe_cache: dict[tuple, bool] = {}
        self.step_cache: dict[tuple, StepEstimate] = {}
        # what the TP and CP collectives move per layer (SDPA sees GQA's K/V repeated to the query heads)
        self.layer = LayerShape(arch.num_layers, arch.hidden_size,
                                arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim)
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
    def _family(gpn: int, lay: _Layout, ac: str, mb: int, ga: int) -> tuple:
        sg = lay.sg if lay.sharding in ("hsdp", "ddp") else 0
        return (gpn, lay.sharding, sg, ac, mb, ga > 1, lay.tp, lay.cp, lay.f8)

    def memory(self, total: int, gpn: int, lay: _Layout, ac: str, mb: int, ga: int) -> MemoryEstimate:
        # the estimate sees accumulation only as "gradients live between micro-batches" (ga > 1):
        # the planner lays out no pipeline stages, whose in-flight micro-batches would count ga
        key = (total, gpn, lay, ac, mb, ga > 1)
        est = None if self.exhaustive else self.mem_cache.get(key)
        if est is None:
            spec = self.spec
            setup = make_setup(
                task=self.task, seq_len=self.seq, micro_batch=mb, gpus=total, gpus_per_node=gpn,
                sharding=lay.sharding, shard_group=lay.sg if lay.sharding == "hsdp" else None,
                activation_checkpointing=ac, precision=spec.precision, optimizer=spec.optimizer,
                offload=spec.offload, lora_rank=spec.lora_rank, lora_targets=self.targets, grad_accum=ga,
                tp=lay.tp, cp=lay.cp,
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
        flat = self.mem_cache.get((total, gpn, lay._replace(sharding="fsdp", sg=total), ac, mb, ga > 1))
        return False if flat is not None and flat.per_gpu_bytes > usable else None

    # ---------------------------------------------------------------- bounds
    def _compute_seconds(self, inst: Any, ac: str) -> float:
        """GPU-seconds of pure compute at the assumed utilisation (no recompute, no communication)."""
        key = (inst.gpu, ac)
        out = self.compute_cache.get(key)
        if out is None:
            gpu = self.gpus[inst.gpu]
            util, _ = utilisation(gpu)
            gain = self.gain(gpu) or 1.0  # a bound: float8 (where allowed) is the fastest the GPU runs
            out = self.compute_cache[key] = \
                self.tokens * self.flops_by_ac[ac].executed / (gpu.bf16_tflops * 1e12 * util * self.qfac * gain)
        return out

    def _tp_seconds(self, slot: _Slot, tp: int, ac: str) -> float:
        """GPU-seconds per token of the TP collectives a TP layout cannot hide (0 without TP)."""
        return tp_gpu_seconds_per_token(layer=self.layer, tp=tp, ac=ac, gbytes=slot.intra) if tp > 1 else 0.0

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
        if inc is None:
            return False
        if self.objective == "cost":
            return inc.cost_usd is not None and inst.price_per_hour_usd is not None and \
                self.lower_bound_cost(inst, nodes, ac, tp_s) > inc.cost_usd
        if self.objective == "time":
            return self.lower_bound_hours(inst, nodes, ac, tp_s) > inc.time_hours
        return nodes * inst.gpus > inc.total_gpus

    # ---------------------------------------------------------------- shapes
    def batch_shapes(self, dp: int) -> list[tuple[int, int, int]]:
        """(micro-batch, grad accum, batch tokens) that form the global batch within tolerance.

        `dp` counts data-parallel ranks: the GPUs over tp x cp (one sample spans a TP x CP group)."""
        out = self.shape_cache.get(dp)
        if out is None:
            out = []
            for mb in MICRO_BATCHES:
                per_step_tokens = mb * self.seq * dp
                ga = max(1, round(self.gbt / per_step_tokens))
                batch = ga * per_step_tokens
                if abs(batch - self.gbt) <= self.tol * self.gbt:
                    out.append((mb, ga, batch))
                elif per_step_tokens > self.gbt:
                    break
            self.shape_cache[dp] = out
        return out

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
                       shapes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
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
        key = (slot.inst.gpu, slot.usable, slot.gpn, slot.total, lay, ac, tuple(shapes))
        out = self.fit_cache.get(key)
        if out is None:
            out = self.fit_cache[key] = self.scan_shapes(slot, lay, ac, shapes)
        return out

    def scan_shapes(self, slot: _Slot, lay: _Layout, ac: str,
                    shapes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
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
        key = (slot.inst.gpu, slot.usable, slot.gpn, top, lay.sharding, lay.tp, lay.cp, lay.f8, ac, mb, ga > 1)
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
            shape = next((x for x in self.batch_shapes(total // lay.mp) if x[0] == mb and (x[1] > 1) == accumulating),
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
            shape = Shape(nodes=slot.nodes, gpus_per_node=slot.gpn, sharding=lay.sharding, shard_group=lay.sg,
                          micro_batch=mb, grad_accum=ga, seq_len=self.seq)
            out = self.step_cache[key] = layout_step_estimate(
                shape=shape, tp=lay.tp, cp=lay.cp, layer=self.layer, ac=ac,
                flops=self.flops_by_ac[ac], peak_tflops=gpu.bf16_tflops, util=slot.util,
                hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=slot.intra, inter_gbytes=slot.inter,
                params=arch.params, trainable=self.trainable, num_layers=arch.num_layers, task=self.task,
                optimizer=spec.optimizer, precision=spec.precision, offload=spec.offload, pcie_gen=gpu.pcie_gen,
                **(self.float8_kw(gpu) if lay.f8 else {}),
            )
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
        return self.gain(gpu) is not None and float8_refusal(
            task=self.task, precision=self.spec.precision, compiled=self.stack.compile, moe=self.arch.is_moe, tp=tp) is None

    def timed(self, slot: _Slot, lay: _Layout, ac: str, mb: int, ga: int, batch: int) -> Candidate:
        gpu = slot.gpu
        steps = -(-self.tokens // batch)
        step = self.step(slot, lay, ac, mb, ga)
        self.evaluated += 1
        hours = steps * step.step_time_s / 3600.0 + self.overhead_h
        price = slot.inst.price_per_hour_usd
        cost = None if price is None else hours * slot.nodes * price
        return Candidate(slot.inst, gpu, slot.nodes, lay.sharding, lay.sg, ac, mb, ga, batch, steps, None, step,
                         hours, cost, lay.tp, lay.cp, lay.f8)

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
        k = _objective_key(self.objective, cand)
        group = _group(cand.instance)
        row = self.best_by_group.get(group)
        if row is None or k < _objective_key(self.objective, row):
            self.best_by_group[group] = cand
        cur = self.best_by_gpu.get(slug)
        if cur is None or k < _objective_key(self.objective, cur):
            self.best_by_gpu[slug] = cand
            if self.best is None or k < _objective_key(self.objective, self.best):
                self.best = cand

    # ---------------------------------------------------------------- the walk
    def node_order(self, inst: Any, top: int, only_nodes: int | None) -> Iterable[int]:
        if self.spec.gpu_count is not None:  # exactly N GPUs: the one node count that makes N, if any
            n, rest = divmod(self.spec.gpu_count, inst.gpus)
            only_nodes = n if not rest and only_nodes in (None, n) else 0
        if only_nodes is not None:
            return [only_nodes] if 1 <= only_nodes <= top else []
        if self.objective == "time" and not self.exhaustive:
            return range(top, 0, -1)
        return range(1, top + 1)

    def slot(self, inst: Any, nodes: int) -> _Slot:
        gpu = self.gpus[inst.gpu]
        return _Slot(inst=inst, gpu=gpu, nodes=nodes, usable=int(gpu.memory_bytes * (1.0 - self.spec.safety_margin)),
                     util=utilisation(gpu)[0], intra=intra_node_gbytes(gpu)[0],
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
        max_mp = max(t * c for t, c in degrees)
        descending = self.objective == "time" and not self.exhaustive
        order = self.node_order(inst, top, only_nodes)
        if isinstance(order, range) and order.step == 1 and not self.exhaustive:
            widest = int(self.gbt * (1 + self.tol) * max_mp // (self.seq * inst.gpus))
            self.walk_top[inst.name] = min(order.stop - 1, widest)
        for nodes in order:
            if self.seq * nodes * inst.gpus > self.gbt * (1 + self.tol) * max_mp:
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
        missed: set[tuple[int, int]] = set()  # (tp, cp) whose FSDP fits nothing on this slot
        for lay in _layouts(slot.total, slot.gpn, slot.nodes, degrees):
            lay = lay._replace(f8=self.float8_on(slot.gpu, lay.tp))
            if lay.sharding == "hsdp" and (lay.tp, lay.cp) in missed and not self.exhaustive:
                continue  # HSDP holds at least what FSDP over every GPU holds: nothing fits either
            if self.walk_layout(slot, lay) and lay.sharding == "fsdp":
                missed.add((lay.tp, lay.cp))

    def walk_layout(self, slot: _Slot, lay: _Layout) -> bool:
        """Every AC mode and micro-batch of one layout on one slot. True when every AC mode was
        tried (no bound cut the scan) and nothing fits."""
        fitted: set[int] = set()  # micro-batches a cheaper AC mode already fits
        all_shapes = self.batch_shapes(slot.total // lay.mp)
        for ac in AC_MODES:
            if not self.exhaustive and fitted and fitted.issuperset(x[0] for x in all_shapes):
                return False  # every micro-batch fits with less recompute: more recompute only costs
            if self.beaten(slot.inst, slot.nodes, ac, self._tp_seconds(slot, lay.tp, ac)):
                return False
            shapes = all_shapes
            if not self.exhaustive:
                # same shape with less recompute fits already: dominated
                shapes = [x for x in shapes if x[0] not in fitted]
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
    insts, searched, unpriced, excluded = _pool(spec, instances, exhaustive)
    s = _Search(spec, arch, estimator, {i.gpu: gpu_lookup(i.gpu) for i in insts}, exhaustive)
    # on-prem machines are the user's hosts: no more nodes than hosts listed (also under cloud 'any')
    onprem_max = min(spec.max_nodes, len(spec.hosts)) if spec.hosts else spec.max_nodes
    if not exhaustive and spec.objective == "cost":
        insts.sort(key=s.lower_bound_cost)
    for inst in insts:
        s.walk_instance(inst, onprem_max if inst.onprem else spec.max_nodes, only_nodes)
    return s.result(searched, unpriced, excluded)


# --------------------------------------------------------------------------- explanations
def _tbs(b: float) -> str:
    return f"{b / TB:.2f} TB"


def largest_node_bytes(instances: Iterable[Any], gpu_lookup: Callable[[str], Any]) -> tuple[int, Any]:
    best, which = 0, None
    for inst in instances:
        total = gpu_lookup(inst.gpu).memory_bytes * inst.gpus
        if total > best:
            best, which = total, inst
    return best, which


def _floor_with_many_gpus(spec: Any, arch: Any, miss: Miss, estimator: Estimator | None) -> int | None:
    """Per-GPU peak of the miss's GPU with 64 of them (FSDP, full recompute, micro-batch 1)."""
    if estimator is None:
        return None
    setup = make_setup(task=spec.task, seq_len=spec.seq_len, micro_batch=1, gpus=64, gpus_per_node=8,
                       sharding="fsdp", shard_group=None, activation_checkpointing="full",
                       precision=spec.precision, optimizer=spec.optimizer, offload=spec.offload,
                       lora_rank=spec.lora_rank, lora_targets=_lora_targets(spec) if spec.task != "full"
                       else LORA_TARGET_PRESETS["all-linear"], grad_accum=2,
                       framework=getattr(spec, "framework", "gpuprov"), stack=stack_for(spec, arch))
    return estimator(arch, setup).per_gpu_bytes


def nothing_fits_message(spec: Any, arch: Any, result: SearchResult, instances: list[Any],
                         gpu_lookup: Callable[[str], Any], estimator: Estimator | None = None) -> str:
    """One line: what the spec needs, the nearest miss, and what to relax."""
    if result.fitting and result.constrained_out:
        parts = []
        f, c = result.fastest_unconstrained, result.cheapest_unconstrained
        if spec.deadline_hours is not None and f is not None:
            parts.append(f"the fastest fitting run ({f.instance.name} x{f.nodes}) takes {f.time_hours:,.1f} h "
                         f"> deadline {spec.deadline_hours:g} h")
        if spec.budget_usd is not None and c is not None and c.cost_usd is not None:
            parts.append(f"the cheapest ({c.instance.name} x{c.nodes}) costs ${c.cost_usd:,.0f} > budget "
                         f"${spec.budget_usd:,.0f}")
        return ("configurations fit in memory but none meets the constraints: "
                + "; ".join(parts) + "; relax --deadline/--budget, allow more nodes (--max-nodes) or train fewer tokens")
    miss = result.nearest_miss
    if miss is None:
        scope = f"cloud {spec.cloud}" + (f", GPUs {','.join(spec.gpus)}" if spec.gpus else "")
        if spec.gpu_count:
            sizes = sorted({i.gpus for i in result.searched})
            return (f"no instance type of {scope} makes exactly {spec.gpu_count} GPUs within --max-nodes "
                    f"{spec.max_nodes} (GPUs per node on offer: {', '.join(map(str, sizes)) or 'none'}; "
                    f"see `gpuprov instances`)")
        return f"no instance in the catalog matches {scope} (see `gpuprov instances`)"
    node_bytes, node = largest_node_bytes(result.searched or instances, gpu_lookup)
    # model states of one replica: the nearest miss's total over its shard group(s)
    states = miss.model_states_bytes
    hint = []
    bigger_gpus = _gpus_that_fit(miss, spec.safety_margin)
    if bigger_gpus:
        hint.append(f"GPUs that hold {miss.per_gpu_bytes / GiB:,.1f} GiB in this layout ({miss.nodes * miss.instance.gpus} "
                    f"GPUs, {miss.sharding}): {', '.join(bigger_gpus)}")
    floor = _floor_with_many_gpus(spec, arch, miss, estimator)
    if floor is not None and floor > miss.usable_bytes:
        hint.append(f"more {miss.instance.gpu} GPUs do not help: even 64 of them need {floor / GiB:,.1f} GiB each "
                    f"(what every GPU keeps whole{', the NF4 base included' if spec.task == 'qlora' else ''})")
    elif spec.hosts and miss.instance.onprem:
        hint.append(f"add hosts to the hosts file (it lists {len(spec.hosts)})")
    elif node_bytes and states > node_bytes * (1 - spec.safety_margin):
        hint.append("allow 2+ nodes" if spec.max_nodes == 1 else "allow more nodes (--max-nodes)")
    elif spec.max_nodes < 32:
        hint.append("allow more nodes (--max-nodes)")
    if spec.task == "full":
        hint.append("use LoRA (--task lora) or QLoRA (--task qlora)")
    elif spec.task == "lora":
        hint.append("use QLoRA (--task qlora)")
    if miss.per_gpu_bytes <= miss.usable_bytes / (1 - spec.safety_margin) * 0.98 and spec.safety_margin > 0.02:
        hint.append("lower --safety-margin")
    hint.append("or shorten --seq-len")
    bigger = [i for i in result.excluded_unpriced if gpu_lookup(i.gpu).memory_bytes * i.gpus > node_bytes]
    if bigger:
        hint.append(f"{bigger[0].name} (larger, no public price) is searched with --objective time")
    if node is not None:
        nominal = _nominal_gb(gpu_lookup(node.gpu))
        node_txt = (f"{node.gpus * nominal / 1000:.2f} TB ({node.gpus} x {nominal:.0f} GB, {node.name}; "
                    f"{node_bytes / 2**40:.2f} TiB visible, {node_bytes * (1 - spec.safety_margin) / 2**40:.2f} TiB "
                    f"usable at {spec.safety_margin:.0%} margin)")
    else:
        node_txt = "n/a"
    return (f"nothing fits: {arch.display_name} {spec.task} needs {_tbs(states)} of model states plus "
            f"activations; the largest "
            f"single node holds {node_txt}; nearest miss {miss.instance.name} x{miss.nodes} {miss.sharding}: "
            f"{miss.per_gpu_bytes / GiB:,.1f} GiB per GPU vs {miss.usable_bytes / GiB:,.1f} GiB usable; "
            + "; ".join(hint))


def _gpus_that_fit(miss: Miss, margin: float) -> list[str]:
    """GPU slugs of the catalog whose usable memory holds the nearest miss's per-GPU peak."""
    from gpuprov.catalog.gpus import list_gpus

    fit = [g for g in list_gpus() if g.memory_bytes * (1 - margin) >= miss.per_gpu_bytes]
    return [g.slug for g in sorted(fit, key=lambda g: g.memory_bytes)][:4]


def loss_reason(alt: Candidate, best: Candidate, objective: str) -> str:
    bits = []
    if best.cost_usd is not None and alt.cost_usd is not None and alt.cost_usd > best.cost_usd:
        bits.append(f"dearer: ${alt.cost_usd:,.0f} vs ${best.cost_usd:,.0f} (x{alt.cost_usd / best.cost_usd:.2f})")
    if alt.time_hours > best.time_hours * 1.0001:
        bits.append(f"slower: {alt.time_hours:,.1f} h vs {best.time_hours:,.1f} h")
    elif alt.time_hours < best.time_hours * 0.9999:
        bits.append(f"faster ({alt.time_hours:,.1f} h) but not better on {objective}")
    if alt.total_gpus > best.total_gpus:
        bits.append(f"more GPUs: {alt.total_gpus} vs {best.total_gpus}")
    if alt.step.bound == "communication":
        bits.append("communication-bound")
    return "; ".join(bits) or f"ties on {objective}; ranked after the chosen one"


# --------------------------------------------------------------------------- the Plan
def _default_estimator() -> Estimator:
    from gpuprov.sizing.memory import estimate_memory

    return estimate_memory


def _training_defaults(arch: Any, task: str, steps: int, step_time_s: float) -> dict[str, Any]:
    """LR schedule defaults: Llama 2 (Touvron et al. 2023, Table 1) for full training, QLoRA paper
    (Dettmers et al. 2023, Appendix B) for adapters; warmup 2000 steps capped at 5% of the run."""
    if task == "full":
        lr = 1.5e-4 if arch.params >= 30e9 else 3e-4
        wd = 0.1
    else:
        lr = 1e-4 if arch.params >= 30e9 else 2e-4
        wd = 0.0
    warmup = max(1, min(2000, steps // 20))
    # checkpoint about every hour of training (a node failure loses at most an hour)
    ckpt = max(1, min(steps, round(3600.0 / max(step_time_s, 1e-6))))
    return dict(learning_rate=lr, warmup_steps=warmup, weight_decay=wd, grad_clip=1.0,
                checkpoint_every_steps=ckpt, log_every_steps=max(1, min(10, steps)))


def setup_for(spec: Any, arch: Any, c: Candidate) -> TrainSetup:
    """The estimator's setup for one candidate (what `gpuprov estimate` would be asked)."""
    return make_setup(
        task=spec.task, seq_len=spec.seq_len, micro_batch=c.micro_batch, gpus=c.total_gpus,
        gpus_per_node=c.instance.gpus, sharding=c.sharding,
        shard_group=c.shard_group if c.sharding == "hsdp" else None,
        activation_checkpointing=c.activation_checkpointing, precision=spec.precision, optimizer=spec.optimizer,
        offload=spec.offload, lora_rank=spec.lora_rank,
        lora_targets=_lora_targets(spec) if spec.task != "full" else LORA_TARGET_PRESETS["all-linear"],
        grad_accum=c.grad_accum, tp=c.tp, cp=c.cp, framework=getattr(spec, "framework", "gpuprov"),
        stack=stack_for(spec, arch, c.tp, c.float8),
    )


def _notes(spec: Any, arch: Any, best: Candidate, mem: MemoryEstimate, instances: list[Any],
           gpu_lookup: Callable) -> list[str]:
    """Where the widely quoted 18 bytes/param rule of thumb (mixed-precision Adam) is wrong for this spec."""
    notes: list[str] = []
    framework = getattr(spec, "framework", "gpuprov")
    if framework != "gpuprov":
        notes.append(f"Memory is sized for the {framework} stack (`gpuprov estimate --framework {framework}`); the "
                     "bundle's launch files run gpuprov's own trainer, so launch your framework yourself")
    rot = rule_of_thumb_bytes_per_param() * arch.params
    states = mem.model_states_bytes
    if spec.task == "full":
        per_param = states / arch.params
        diff = (states - rot) / rot
        if abs(diff) > 0.05:
            notes.append(
                f"Rule of thumb 18 B/param x {arch.params / 1e9:.1f}B = {_tbs(rot)}; the estimator's model states "
                f"(weights + grads + optimizer, {spec.precision}, {spec.optimizer}) are {per_param:.1f} B/param = "
                f"{_tbs(states)} ({diff:+.0%})")
    else:
        if spec.task == "qlora" and getattr(spec, "framework", "gpuprov") == "gpuprov":
            notes.append("QLoRA base: the trainer leaves the NF4 base out of FSDP2 (it cannot shard bitsandbytes "
                         "weights), so every GPU holds all of it and the memory estimate sizes it so "
                         "(`gpuprov estimate --framework gpuprov` or `--qlora-base replicated` gives the same figure)")
        notes.append(f"Rule of thumb 18 B/param ({_tbs(rot)}) is for full training; {spec.task} trains "
                     f"{mem.trainable_params:,} adapter parameters and keeps the base frozen: model states "
                     f"{_tbs(states)}")
    # sizing tables built on the rule put a 70B (~1.26 TB) on one 8 x 141 GB node: check each
    # 8-GPU node type against the rule itself -- do 18 B/param fit in the node's GPU memory?
    seen: set[str] = set()
    for inst in instances:
        if inst.gpus != 8 or inst.gpu in seen or spec.task != "full":
            continue
        seen.add(inst.gpu)
        gpu = gpu_lookup(inst.gpu)
        node_gb = 8 * _nominal_gb(gpu)
        if rot > node_gb * 1e9 and rot < node_gb * 1e9 * 1.25:
            notes.append(
                f"One 8 x {_nominal_gb(gpu):.0f} GB {gpu.name.split(' ')[1]} node looks enough for "
                f"{arch.display_name}, but 8 x {_nominal_gb(gpu):.0f} GB = {node_gb / 1000:.2f} TB < "
                f"{_tbs(rot)} by its own 18 B/param rule: the model states cannot fit one node "
                f"(and activations need room on top); plan multi-node sharding or LoRA")
    if getattr(spec, "float8", False):
        notes.append(_float8_note(spec, arch, best))
    if best.batch_tokens != spec.global_batch_tokens:
        notes.append(f"Global batch is {best.batch_tokens:,} tokens ({best.micro_batch} x {spec.seq_len} x "
                     f"{best.total_gpus} GPUs x {best.grad_accum} accumulation), "
                     f"{(best.batch_tokens - spec.global_batch_tokens) / spec.global_batch_tokens:+.1%} from the "
                     f"requested {spec.global_batch_tokens:,}")
    if best.instance.onprem and not spec.gpus and not any(h.gpu for h in spec.hosts or []):
        notes.append("On-prem: this server template was chosen among all templates by GPU-hours; give each host "
                     "gpu: and gpus: in the hosts file (`gpuprov hosts probe` fills them) or pass --gpu, so the "
                     "plan matches the machines you have")
    if spec.region and best.instance.region and spec.region != best.instance.region:
        notes.append(f"Price is the {best.instance.region} list price ({best.instance.price_date}); "
                     f"{spec.region} may differ and the instance type may not be offered there")
    for name in sorted({i.name for i in instances if not i.onprem and i.price_per_hour_usd is None
                        and spec.cloud in ("any", i.cloud)}):
        if spec.objective == "cost":
            notes.append(f"{name} has no public on-demand price (quote only); not ranked by cost")
    return notes


def _float8_note(spec: Any, arch: Any, best: Candidate) -> str:
    """What --float8 did to this plan, and why not where it did nothing."""
    if best.float8:
        gain = float8_step_kw(best.gpu, arch)["float8_gain"]
        return (f"float8 on (torchao tensorwise float8 linears, float8 FSDP all-gather): compute timed x{gain:.2f} "
                f"faster, the measured float8/bf16 tokens/s ratio for a {arch.params / 1e9:.0f}B model on "
                f"{best.gpu.architecture.capitalize()}; blocks gathered at 1 byte per linear weight; MFU is counted "
                "against the BF16 peak")
    why = float8_refusal(task=spec.task, precision=spec.precision, compiled=stack_for(spec, arch).compile,
                         moe=arch.is_moe, tp=best.tp)
    return "float8 allowed but off in this plan: " + (why or f"no published float8 speed-up covers {best.gpu.slug}")


def _nominal_gb(gpu: Any) -> float:
    """The marketing size (141 GB, 80 GB) sizing tables speak in, from the slug."""
    import re

    m = re.search(r"(\d+)gb", gpu.slug)
    return float(m.group(1)) if m else gpu.memory_bytes / 1e9


def make_plan(spec: Any, *, estimator: Estimator | None = None, instances: Iterable[Any] | None = None) -> Any:
    """The cheapest (or fastest / fewest-GPU) configuration that fits, as a complete Plan."""
    from gpuprov import __version__, bringup_plan
    from gpuprov.catalog.fabrics import get_fabric, get_software
    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.instances import list_instances, nvme_device_glob
    from gpuprov.catalog.models import get_model
    from gpuprov.host import host_needs, make_host, size_onprem
    from gpuprov.onprem import with_declared_hosts
    from gpuprov.plan import (
        Alternative, Cluster, GpuInfo, InstanceInfo, Memory, ModelInfo, Plan, Storage, Throughput,
        Training,
    )
    from gpuprov.sizing.throughput import utilisation as util_of

    arch = get_model(spec.model)
    est_fn = estimator or _default_estimator()
    pool = list(instances) if instances is not None else list(list_instances())
    pool = with_declared_hosts(spec, pool, get_gpu)
    if spec.gpus:
        for g in spec.gpus:
            get_gpu(g)  # unknown slug -> GpuprovError with suggestions
    # each type priced at the purchase option it would be bought with; unbuyable types drop out
    pool, unbuyable = bringup_plan.priced_pool(pool, spec)
    result = search(spec, arch, estimator=est_fn, instances=pool, gpu_lookup=get_gpu)
    if result.best is None:
        raise GpuprovError(nothing_fits_message(spec, arch, result, pool, get_gpu, est_fn)
                           + bringup_plan.unbuyable_hint(spec, unbuyable))
    best = _prefer_every_host(spec, arch, result, est_fn, get_gpu)

    inst, gpu = best.instance, best.gpu
    mem = est_fn(arch, setup_for(spec, arch, best))
    trainable = mem.trainable_params
    needs = host_needs(gpu_memory_bytes=gpu.memory_bytes, gpus_per_node=inst.gpus, nodes=best.nodes,
                       params=arch.params, trainable=trainable, tokens=spec.tokens, task=spec.task,
                       offload=spec.offload)
    bom = None
    if inst.onprem and inst.ram_bytes is None:  # a template, or hosts that declare only their GPUs
        inst, bom = size_onprem(inst, needs)
    host = make_host(inst, needs, bom)

    fabric_name = inst.fabric if best.nodes > 1 else "none"
    fabric = get_fabric(fabric_name, inst.cloud, inst.name)
    if best.nodes > 1:
        # the instance catalog knows this machine's own share of the fabric
        fabric = fabric.model_copy(update={"gbps_per_gpu": inst.fabric_gbps_per_gpu})
    software = get_software(gpu.architecture, fabric.name, inst.nvswitch, gpu=gpu.slug, cloud=inst.cloud,
                            instance=inst.name)
    glob, _glob_src = nvme_device_glob(inst.cloud)
    util, util_src = util_of(gpu)
    step = best.step
    fl = flops_per_token(arch, spec.seq_len, spec.task, trainable, best.activation_checkpointing)
    usable = int(gpu.memory_bytes * (1.0 - spec.safety_margin))
    targets = list(_lora_targets(spec)) if spec.task != "full" else []
    defaults = _training_defaults(arch, spec.task, best.steps, step.step_time_s)

    alternatives: list[Alternative] = []
    for slug, cand in sorted(result.best_by_gpu.items(), key=lambda kv: _objective_key(spec.objective, kv[1])):
        if cand is best:
            continue
        alternatives.append(Alternative(
            cloud=cand.instance.cloud, instance_type=cand.instance.name, gpu=slug, nodes=cand.nodes,
            total_gpus=cand.total_gpus, sharding=cand.sharding, time_hours=round(cand.time_hours, 3),
            cost_usd=None if cand.cost_usd is None else round(cand.cost_usd, 2),
            reason=loss_reason(cand, best, spec.objective), purchase=cand.instance.purchase))
    for slug, cand in sorted(result.constrained_by_gpu.items()):
        limits = []
        if spec.deadline_hours is not None and cand.time_hours > spec.deadline_hours:
            limits.append(f"over deadline: fastest fit takes {cand.time_hours:,.1f} h > {spec.deadline_hours:g} h")
        if spec.budget_usd is not None and cand.cost_usd is not None and cand.cost_usd > spec.budget_usd:
            limits.append(f"over budget: ${cand.cost_usd:,.0f} > ${spec.budget_usd:,.0f}")
        alternatives.append(Alternative(
            cloud=cand.instance.cloud, instance_type=cand.instance.name, gpu=slug, nodes=cand.nodes,
            total_gpus=cand.total_gpus, sharding=cand.sharding, time_hours=round(cand.time_hours, 3),
            cost_usd=None if cand.cost_usd is None else round(cand.cost_usd, 2), reason="; ".join(limits),
            purchase=cand.instance.purchase))
    for slug, miss in sorted(result.unfit_gpus.items()):
        alternatives.append(Alternative(
            cloud=miss.instance.cloud, instance_type=miss.instance.name, gpu=slug, nodes=miss.nodes,
            total_gpus=miss.nodes * miss.instance.gpus, sharding=miss.sharding, time_hours=None, cost_usd=None,
            reason=f"too small: needs {miss.per_gpu_bytes / GiB:,.1f} GiB per GPU, {miss.usable_bytes / GiB:,.1f} GiB "
                   f"usable at best (x{miss.nodes} nodes, {miss.sharding})"))

    alternatives += bringup_plan.purchase_alternatives(spec, best)
    bringup = bringup_plan.bringup_fields(spec, best.instance, best.nodes, needs)

    rot = rule_of_thumb_bytes_per_param() * arch.params
    plan = Plan(
        gpuprov_version=__version__,
        spec=spec,
        model=ModelInfo(name=spec.model, display_name=arch.display_name, hf_model_type=arch.model_type,
                        params=arch.params, trainable_params=trainable, hf_config=dict(arch.hf_config),
                        source=arch.source),
        task=spec.task,
        gpu=GpuInfo(slug=gpu.slug, name=gpu.name, architecture=gpu.architecture, memory_bytes=gpu.memory_bytes,
                    bf16_tflops=gpu.bf16_tflops, fp8_tflops=gpu.fp8_tflops,
                    nvlink_gbytes_per_s=gpu.nvlink_gbytes_per_s, pcie_gen=gpu.pcie_gen, source=gpu.source),
        instance=InstanceInfo(
            cloud=inst.cloud, name=inst.name, region=spec.region or inst.region, gpus=inst.gpus,
            vcpus=inst.vcpus or 0, ram_bytes=inst.ram_bytes or 0, local_nvme_count=inst.nvme_count,
            local_nvme_bytes_each=inst.nvme_bytes_each, network_cards=inst.network_cards,
            efa_interfaces=inst.efa_interfaces, nvswitch=inst.nvswitch, pcie_gen=inst.pcie_gen,
            price_per_hour_usd=inst.price_per_hour_usd, price_date=inst.price_date,
            source=inst.source + (f"; price: {inst.price_source}" if inst.price_source else "")),
        fabric=fabric,
        cluster=Cluster(
            cloud=inst.cloud, region=spec.region or inst.region, instance_type=inst.name, gpu=gpu.slug,
            gpus_per_node=inst.gpus, nodes=best.nodes, total_gpus=best.total_gpus, sharding=best.sharding,
            shard_group=best.shard_group, replicate=best.total_gpus // best.shard_group,
            activation_checkpointing=best.activation_checkpointing, micro_batch=best.micro_batch,
            grad_accum=best.grad_accum, seq_len=spec.seq_len, global_batch_tokens=best.batch_tokens,
            precision=spec.precision, optimizer=spec.optimizer, offload=spec.offload, tp=best.tp, cp=best.cp),
        training=Training(task=spec.task, lora_rank=None if spec.task == "full" else spec.lora_rank,
                          lora_alpha=None if spec.task == "full" else 2 * spec.lora_rank,
                          lora_targets=targets, tokens=spec.tokens, steps=best.steps, **defaults),
        memory=Memory(per_gpu_bytes=mem.per_gpu_bytes, breakdown=dict(mem.breakdown),
                      model_states_bytes=mem.model_states_bytes, rule_of_thumb_bytes=rot,
                      gpu_memory_bytes=gpu.memory_bytes, safety_margin=spec.safety_margin, fits=True,
                      headroom_bytes=usable - mem.per_gpu_bytes, assumptions=list(mem.assumptions)),
        throughput=Throughput(tokens_per_s=step.tokens_per_s, mfu=step.mfu, mfu_assumed=util, mfu_source=util_src,
                              flops_per_token=fl.model, attention_flops_per_token=fl.attention, step_time_s=step.step_time_s,
                              compute_time_s=step.compute_time_s, comm_time_s=step.exposed_comm_s,
                              bound=step.bound,
                              float8_gain=float8_step_kw(gpu, arch)["float8_gain"] if best.float8 else 1.0),
        time_hours=best.time_hours,
        cost_usd=best.cost_usd,
        host=host,
        software=software,
        storage=Storage(mount_point="/scratch", raid_name="scratch", device_glob=glob, devices=inst.nvme_count,
                        expected_bytes=inst.nvme_bytes_total),
        health=_health(inst, fabric, best.nodes),
        hosts=list(spec.hosts[: best.nodes]) if inst.onprem and spec.hosts else None,
        alternatives=alternatives,
        notes=_notes(spec, arch, best, mem, pool, get_gpu)
        + [n for n in (hosts_note(spec, arch, best, est_fn, get_gpu), result.every_host_note) if n]
        + bringup_plan.purchase_notes(spec, bringup["purchase"], best.instance, best.time_hours, best.nodes,
                                      bringup["shared_storage"]),
        **bringup,
        stack=stack_for(spec, arch, best.tp, best.float8),
    )
    return _with_table(plan, spec, arch, result, best, est_fn)


def _with_table(plan: Any, spec: Any, arch: Any, result: SearchResult, best: Candidate, est_fn: Estimator) -> Any:
    """The plan with its candidates table and the warnings on a pathological pick."""
    from gpuprov.candidates import candidate_rows, pick_warnings
    from gpuprov.host import rules

    rows = candidate_rows(spec, arch, result, best, est_fn)
    min_gbps = float(rules()["network"]["min_gbps_per_gpu_multinode"])
    return plan.model_copy(update={"candidates": rows, "warnings": pick_warnings(spec, best, rows, min_gbps)})


# Leaving an on-prem host idle must save at least this share of the objective's measure (GPU-hours
# under cost, wall time under time): the owner's machines are there to be used, and a plan that
# leaves one out for a sliver of GPU-hours runs longer for nothing.
ONPREM_LEAVE_OUT_SAVING = 0.10


def _onprem_measure(objective: str, c: Candidate) -> float:
    return c.time_hours if objective == "time" else _gpu_hours(c)


def _prefer_every_host(spec: Any, arch: Any, result: SearchResult, estimator: Estimator,
                       gpu_lookup: Callable[[str], Any]) -> Candidate:
    """On-prem: the run on every host unless leaving hosts out saves ONPREM_LEAVE_OUT_SAVING."""
    best = result.best
    every = min(len(spec.hosts or []), spec.max_nodes)
    if not best.instance.onprem or best.nodes >= every or spec.objective == "gpus" or spec.gpu_count:
        return best
    other = search(spec, arch, estimator=estimator, instances=[best.instance], gpu_lookup=gpu_lookup,
                   only_nodes=every).best
    if other is None:
        return best
    saving = 1 - _onprem_measure(spec.objective, best) / _onprem_measure(spec.objective, other)
    if saving >= ONPREM_LEAVE_OUT_SAVING:
        return best
    measure = "wall time" if spec.objective == "time" else "GPU-hours"
    result.every_host_note = (
        f"On-prem: the plan uses all {every} hosts. Leaving {every - best.nodes} out would save only {saving:.1%} "
        f"of {measure} ({_describe(best)}; all {every}: {_describe(other)}), under the "
        f"{ONPREM_LEAVE_OUT_SAVING:.0%} that justifies idle machines; every host also finishes sooner")
    result.best_by_group[_group(other.instance)] = other
    result.best_by_gpu[other.instance.gpu] = other
    result.best = other
    return other


def _gpu_hours(c: Candidate) -> float:
    return c.time_hours * c.total_gpus


def _describe(c: Candidate) -> str:
    cost = "" if c.cost_usd is None else f", ${c.cost_usd:,.0f}"
    return (f"{c.nodes} node{'s' if c.nodes > 1 else ''}: {c.time_hours:,.1f} h x {c.total_gpus} GPUs = {_gpu_hours(c):,.0f} GPU-hours{cost}, "
            f"{c.sharding}")


def hosts_note(spec: Any, arch: Any, best: Candidate, estimator: Estimator,
               gpu_lookup: Callable[[str], Any]) -> str | None:
    """Say which of the user's on-prem hosts the plan leaves out, why, and what all of them would do.

    The objective decides the node count among 1..len(hosts), as it does in the cloud: under `cost`
    on-prem runs rank by GPU-hours (the owner pays in machine time; a host left out stays free for
    other work), under `time` by wall time, under `gpus` by GPU count. The plan uses the first hosts
    in the order listed; the rest are named here, in `gpuprov plan`, the README and the inventory."""
    hosts = list(spec.hosts or [])
    if not hosts:
        return None
    if not best.instance.onprem:
        return (f"The plan runs on {best.instance.cloud} ({best.instance.name}); none of the {len(hosts)} on-prem "
                f"hosts listed is used (pass --cloud onprem to plan on them)")
    if best.nodes >= len(hosts):
        return None
    used, left = hosts[: best.nodes], hosts[best.nodes:]
    head = (f"On-prem: the plan uses {len(used)} of the {len(hosts)} hosts listed "
            f"({', '.join(h.name for h in used)}: the first {len(used)} in file order); left out: "
            f"{', '.join(f'{h.name} ({h.address})' for h in left)}")
    if spec.max_nodes < len(hosts) and best.nodes == spec.max_nodes:
        return f"{head}; --max-nodes {spec.max_nodes} caps the node count"
    every = min(len(hosts), spec.max_nodes)
    other = search(spec, arch, estimator=estimator, instances=[best.instance], gpu_lookup=gpu_lookup,
                   only_nodes=every).best
    ranked = {"cost": "GPU-hours (the owner pays in machine time)", "time": "wall time",
              "gpus": "GPU count"}[spec.objective]
    if other is None:
        total = every * best.instance.gpus
        why = (f"on {every} hosts ({total} GPUs) the global batch of {spec.global_batch_tokens:,} tokens "
               f"cannot be formed at seq-len {spec.seq_len} (one sequence per GPU is already more)"
               if spec.seq_len * total > spec.global_batch_tokens else
               f"no configuration on {every} hosts fits memory and the deadline/budget")
    else:
        label = f"all {every} hosts" if every == len(hosts) else f"{every} hosts (--max-nodes {spec.max_nodes})"
        measure = _onprem_measure(spec.objective, best) / _onprem_measure(spec.objective, other)
        saved = (f"; leaving hosts out saves {1 - measure:.0%} of {'wall time' if spec.objective == 'time' else 'GPU-hours'}"
                 f" (hosts are left out only when that saves {ONPREM_LEAVE_OUT_SAVING:.0%} or more)"
                 if spec.objective != "gpus" else "")
        why = f"ranked by {ranked}: chosen {_describe(best)}; {label}: {_describe(other)}{saved}"
    hint = "; --objective time ranks by wall time" if spec.objective != "time" else ""
    return f"{head}. Why: {why}{hint}; reorder the hosts file to choose which hosts run"


def _health(inst: Any, fabric: Any, nodes: int) -> Any:
    from gpuprov.catalog.fabrics import fabric_allreduce_threshold
    from gpuprov.plan import Health

    fabric_min, fabric_source = fabric_allreduce_threshold(fabric, inst.gpus, nodes)
    return Health(nccl_allreduce_busbw_gbytes_per_s=inst.nccl_busbw_gbytes_per_s,
                  source=inst.busbw_source or "no published threshold",
                  fabric_allreduce_busbw_gbytes_per_s=fabric_min, fabric_source=fabric_source)
