"""The planner: choose instance type, node count and parallelism for a TrainingSpec.

Search space (the same for the planner and the exhaustive brute force that checks it):
instance type x nodes (1..max_nodes; on-prem: at most one node per host listed) x sharding (single GPU: none; else ddp, zero2, fsdp, and
hsdp with shard group = k nodes for every k that divides the node count, k < nodes) x
activation checkpointing (none, selective, full) x micro-batch (1, 2, 4, ... 32).
A candidate is kept when the memory estimator's per-GPU peak fits under
gpu memory x (1 - safety margin) and the global batch can be formed
(micro_batch x seq_len x GPUs <= global batch tokens). It is then timed (sizing/throughput.py),
costed, filtered by deadline and budget, and ranked by the objective.

The planner prunes what cannot win, without changing the answer:
- instances dominated by a cheaper one with the same GPU, count, links and fabric;
- memory estimates are cached per setup (they do not depend on the instance) and the
  micro-batch scan stops at the first size that does not fit (memory grows with micro-batch);
- a lower bound per instance (pure compute at the assumed utilisation, no recompute, no
  communication) skips instances that cannot beat the best found for their GPU type.
`search(..., exhaustive=True)` turns every pruning off: the brute force.

On-prem hosts (`--hosts FILE`): the objective picks the node count among 1..len(hosts) as it does
in the cloud (cost ranks on-prem runs by GPU-hours); the plan runs on the first hosts in file order
and never leaves a host out silently: a note names the others with the reason and what all the
hosts would do, and `gpuprov plan`, the bundle README and the inventory list them (hosts_note).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from gpuprov.errors import GpuprovError
from gpuprov.sizing.throughput import Flops, Shape, StepEstimate, flops_per_token, inter_node_gbytes, \
    intra_node_gbytes, step_estimate, utilisation
from gpuprov.sizing.types import LORA_TARGET_PRESETS, MemoryEstimate, TrainSetup

GiB = 2**30
TB = 10**12
MICRO_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
RULE_OF_THUMB_BYTES_PER_PARAM = 18  # the seed's table: 18 bytes/param for full fine-tuning
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

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.instance.gpus

    def key(self) -> tuple:
        return (self.instance.cloud, self.instance.name, self.nodes, self.sharding, self.shard_group,
                self.activation_checkpointing, self.micro_batch)


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


def make_setup(*, grad_accum: int, **fields: Any) -> TrainSetup:
    """The estimator's setup for one candidate, as the bundle's trainer will run it.

    `grad_accum` (global batch / (micro-batch x seq-len x data-parallel ranks)) decides whether
    gradients stay alive through the next forward. QLoRA: the trainer leaves the NF4 base out of
    FSDP2 (it cannot shard bitsandbytes weights), so every GPU holds all of it.
    """
    from gpuprov.sizing.memory import ExtendedSetup

    return ExtendedSetup(
        **fields,
        grad_accumulation_steps=max(1, int(grad_accum)),
        qlora_base_replicated=fields.get("task") == "qlora",
    )


def _lora_targets(spec: Any) -> tuple[str, ...]:
    from gpuprov.sizing.arch import resolve_lora_targets

    return resolve_lora_targets(spec.lora_targets)


def _objective_key(objective: str, c: Candidate) -> tuple:
    cost = c.cost_usd if c.cost_usd is not None else math.inf
    if objective == "time":
        return (c.time_hours, cost, c.total_gpus)
    if objective == "gpus":
        return (c.total_gpus, cost, c.time_hours)
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
    task = spec.task
    targets = _lora_targets(spec) if task != "full" else LORA_TARGET_PRESETS["all-linear"]
    trainable = arch.trainable_params(task, spec.lora_rank, targets) if task != "full" else arch.params
    seq = spec.seq_len
    gbt = spec.global_batch_tokens
    tokens = spec.tokens
    if seq > gbt:
        raise GpuprovError(f"--seq-len {seq} is longer than the global batch of {gbt} tokens")
    margin = spec.safety_margin
    objective = spec.objective
    flops_by_ac = {ac: flops_per_token(arch, seq, task, trainable, ac) for ac in AC_MODES}
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
    max_nodes = spec.max_nodes
    # on-prem machines are the user's hosts: no more nodes than hosts listed (also under cloud 'any')
    onprem_max = min(max_nodes, len(spec.hosts)) if spec.hosts else max_nodes
    unpriced = sorted({i.name for i in insts if not i.onprem and i.price_per_hour_usd is None})
    excluded_unpriced: list[Any] = []
    if objective == "cost":
        # a machine without a public price cannot be ranked by cost
        excluded_unpriced = [i for i in insts if not i.onprem and i.price_per_hour_usd is None]
        insts = [i for i in insts if i.onprem or i.price_per_hour_usd is not None]
    searched = list(insts)
    if not exhaustive:
        dom = _dominated(insts)
        insts = [i for i in insts if i.name not in dom]

    gpus = {i.gpu: gpu_lookup(i.gpu) for i in insts}
    mem_cache: dict[tuple, MemoryEstimate] = {}
    mem_calls = 0

    def memory(total: int, gpn: int, sharding: str, sg: int, ac: str, mb: int, ga: int) -> MemoryEstimate:
        nonlocal mem_calls
        key = (total, gpn, sharding, sg, ac, mb, ga)
        est = None if exhaustive else mem_cache.get(key)
        if est is None:
            setup = make_setup(
                task=task, seq_len=seq, micro_batch=mb, gpus=total, gpus_per_node=gpn, sharding=sharding,
                shard_group=sg if sharding == "hsdp" else None, activation_checkpointing=ac,
                precision=spec.precision, optimizer=spec.optimizer, offload=spec.offload,
                lora_rank=spec.lora_rank, lora_targets=targets, grad_accum=ga,
            )
            est = estimator(arch, setup)
            mem_calls += 1
            mem_cache[key] = est
            seen.setdefault(_family(gpn, sharding, sg, ac, mb, ga), []).append((total, est.per_gpu_bytes))
        return est

    # Per-GPU memory never grows when the same model state is spread over more GPUs, and replicas
    # (ddp, hsdp with a fixed shard group) do not change it at all: a fit (or, for replicas, a
    # miss) seen at one cluster size settles others without asking the estimator again. Gradient
    # accumulation enters as the estimator models it: whether gradients stay alive between
    # micro-batches (steps > 1), not how many steps; the family key separates the two. The
    # brute force asks every time, and the tests and benchmark hold the two to the same answer.
    seen: dict[tuple, list[tuple[int, int]]] = {}

    def _family(gpn: int, sharding: str, sg: int, ac: str, mb: int, ga: int) -> tuple:
        return (gpn, sharding, sg if sharding in ("hsdp", "ddp") else 0, ac, mb, ga > 1)

    def known_fit(total: int, gpn: int, sharding: str, sg: int, ac: str, mb: int, ga: int,
                  usable: int) -> bool | None:
        replicas = sharding in ("ddp", "hsdp")
        for t, b in seen.get(_family(gpn, sharding, sg, ac, mb, ga), ()):
            if b <= usable and t <= total:
                return True
            if replicas and b > usable:
                return False
        return None

    from gpuprov.sizing.throughput import assumptions

    a = assumptions()
    overhead_h = float(a.raw["run"]["overhead_hours"])
    tol = float(a.raw["run"]["batch_tolerance"])
    qfac = a.qlora_factor if task == "qlora" else 1.0

    def lower_bound_cost(inst: Any, nodes: int = 1, ac: str = "none") -> float:
        """No candidate on `inst` with >= `nodes` nodes and this AC can cost less (compute only)."""
        gpu = gpus[inst.gpu]
        util, _ = utilisation(gpu)
        gpu_seconds = tokens * flops_by_ac[ac].executed / (gpu.bf16_tflops * 1e12 * util * qfac)
        price = inst.price_per_hour_usd
        if price is None:
            return 0.0
        return (gpu_seconds / 3600.0 / inst.gpus + overhead_h * nodes) * price

    def lower_bound_hours(inst: Any, nodes: int, ac: str = "none") -> float:
        gpu = gpus[inst.gpu]
        util, _ = utilisation(gpu)
        return tokens * flops_by_ac[ac].executed / (gpu.bf16_tflops * 1e12 * util * qfac) / (
            nodes * inst.gpus) / 3600.0 + overhead_h

    def beaten(inst: Any, nodes: int, ac: str) -> bool:
        """True when no candidate from here on can beat the best for this GPU type."""
        if exhaustive:
            return False
        inc = best_by_gpu.get(inst.gpu)
        if inc is None:
            return False
        if objective == "cost":
            return inc.cost_usd is not None and inst.price_per_hour_usd is not None and \
                lower_bound_cost(inst, nodes, ac) > inc.cost_usd
        if objective == "time":
            return lower_bound_hours(inst, nodes, ac) > inc.time_hours
        return nodes * inst.gpus > inc.total_gpus

    if not exhaustive and objective == "cost":
        insts.sort(key=lower_bound_cost)

    best: Candidate | None = None
    best_by_gpu: dict[str, Candidate] = {}
    fastest: Candidate | None = None
    cheapest: Candidate | None = None
    nearest: Miss | None = None
    unfit: dict[str, Miss] = {}
    evaluated = fitting = constrained_out = 0
    constrained: dict[str, Candidate] = {}
    deadline, budget = spec.deadline_hours, spec.budget_usd

    shape_cache: dict[int, list[tuple[int, int, int]]] = {}

    def batch_shapes(total: int) -> list[tuple[int, int, int]]:
        """(micro-batch, grad accum, batch tokens) that form the global batch within tolerance."""
        out = shape_cache.get(total)
        if out is None:
            out = []
            for mb in MICRO_BATCHES:
                per_step_tokens = mb * seq * total
                ga = max(1, round(gbt / per_step_tokens))
                batch = ga * per_step_tokens
                if abs(batch - gbt) <= tol * gbt:
                    out.append((mb, ga, batch))
                elif per_step_tokens > gbt:
                    break
            shape_cache[total] = out
        return out

    descending = objective == "time" and not exhaustive
    for inst in insts:
        top = onprem_max if inst.onprem else max_nodes
        if only_nodes is not None:
            node_order: Iterable[int] = [only_nodes] if 1 <= only_nodes <= top else []
        else:
            node_order = range(top, 0, -1) if descending else range(1, top + 1)
        gpu = gpus[inst.gpu]
        usable = int(gpu.memory_bytes * (1.0 - margin))
        util, _ = utilisation(gpu)
        intra, _ = intra_node_gbytes(gpu)
        inter = inter_node_gbytes(inst.fabric, inst.fabric_gbps_per_gpu)
        gpn = inst.gpus
        price = inst.price_per_hour_usd
        for nodes in node_order:
            total = nodes * gpn
            if seq * total > gbt * (1 + tol):
                if descending:
                    continue
                break  # even micro-batch 1 overshoots the global batch; more nodes only worse
            if beaten(inst, nodes, "none"):
                # cost and GPU-count bounds grow with nodes (per-node overhead; GPU count); the time
                # bound grows as nodes fall, and time walks the node counts downwards
                break
            for sharding, sg in _shardings(total, gpn, nodes):
                fitted: set[int] = set()  # micro-batches a cheaper AC mode already fits
                for ac in AC_MODES:
                    if not exhaustive and fitted and fitted.issuperset(x[0] for x in batch_shapes(total)):
                        break  # every micro-batch fits with less recompute: more recompute only costs
                    if beaten(inst, nodes, ac):
                        break
                    fl: Flops = flops_by_ac[ac]
                    shapes = batch_shapes(total)
                    if not exhaustive:
                        # same shape with less recompute fits already: dominated
                        shapes = [x for x in shapes if x[0] not in fitted]

                    def record_miss(est: MemoryEstimate) -> None:
                        nonlocal nearest
                        ratio = est.per_gpu_bytes / usable
                        miss = Miss(ratio, inst, gpu, nodes, sharding, est.per_gpu_bytes, usable,
                                    est.model_states_bytes)
                        if nearest is None or ratio < nearest.ratio:
                            nearest = miss
                        if inst.gpu not in best_by_gpu and inst.gpu not in constrained and (
                                inst.gpu not in unfit or ratio < unfit[inst.gpu].ratio):
                            unfit[inst.gpu] = miss

                    if exhaustive:
                        fitting_shapes = []
                        for x in shapes:
                            est = memory(total, gpn, sharding, sg, ac, x[0], x[1])
                            if est.per_gpu_bytes <= usable:
                                fitting_shapes.append(x)
                            else:
                                record_miss(est)
                    else:
                        # memory grows with the micro-batch: stop at the first that does not fit
                        # (estimates are cached across instances, so smaller GPUs reuse them). A
                        # larger micro-batch can end accumulation (1 step) and free the gradients
                        # held between micro-batches, so the scan stops per accumulating/not.
                        fitting_shapes = []
                        stopped: set[bool] = set()
                        for x in shapes:
                            accumulating = x[1] > 1
                            if accumulating in stopped:
                                continue
                            known = known_fit(total, gpn, sharding, sg, ac, x[0], x[1], usable)
                            if known is False:
                                stopped.add(accumulating)
                                continue
                            if known is None:
                                est = memory(total, gpn, sharding, sg, ac, x[0], x[1])
                                if est.per_gpu_bytes > usable:
                                    record_miss(est)
                                    stopped.add(accumulating)
                                    continue
                            fitting_shapes.append(x)
                    for mb, ga, batch in fitting_shapes:
                        fitted.add(mb)
                        fitting += 1
                        steps = -(-tokens // batch)
                        shape = Shape(nodes=nodes, gpus_per_node=gpn, sharding=sharding, shard_group=sg,
                                      micro_batch=mb, grad_accum=ga, seq_len=seq)
                        step = step_estimate(
                            shape=shape, flops=fl, peak_tflops=gpu.bf16_tflops, util=util,
                            hbm_gbytes_per_s=gpu.hbm_gbytes_per_s, intra_gbytes=intra, inter_gbytes=inter,
                            params=arch.params, trainable=trainable, num_layers=arch.num_layers, task=task,
                            optimizer=spec.optimizer, precision=spec.precision, offload=spec.offload,
                            pcie_gen=gpu.pcie_gen,
                        )
                        evaluated += 1
                        hours = steps * step.step_time_s / 3600.0 + overhead_h
                        cost = None if price is None else hours * nodes * price
                        cand = Candidate(inst, gpu, nodes, sharding, sg, ac, mb, ga, batch, steps, None, step,
                                         hours, cost)
                        if fastest is None or hours < fastest.time_hours:
                            fastest = cand
                        if cost is not None and (cheapest is None or cost < (cheapest.cost_usd or math.inf)):
                            cheapest = cand
                        if (deadline is not None and hours > deadline) or (
                                budget is not None and cost is not None and cost > budget):
                            constrained_out += 1
                            prev = constrained.get(inst.gpu)
                            if prev is None or hours < prev.time_hours:
                                constrained[inst.gpu] = cand
                            unfit.pop(inst.gpu, None)
                            continue
                        k = _objective_key(objective, cand)
                        cur = best_by_gpu.get(inst.gpu)
                        if cur is None or k < _objective_key(objective, cur):
                            best_by_gpu[inst.gpu] = cand
                            if best is None or k < _objective_key(objective, best):
                                best = cand
                        unfit.pop(inst.gpu, None)
    return SearchResult(
        best=best, best_by_gpu=best_by_gpu, fastest_unconstrained=fastest, cheapest_unconstrained=cheapest,
        nearest_miss=nearest, unfit_gpus={k: v for k, v in unfit.items() if k not in best_by_gpu},
        evaluated=evaluated, memory_calls=mem_calls, fitting=fitting, constrained_out=constrained_out,
        unpriced=unpriced, constrained_by_gpu={k: v for k, v in constrained.items() if k not in best_by_gpu},
        searched=searched, excluded_unpriced=excluded_unpriced,
    )


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


def nothing_fits_message(spec: Any, arch: Any, result: SearchResult, instances: list[Any],
                         gpu_lookup: Callable[[str], Any]) -> str:
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
        return f"no instance in the catalog matches {scope} (see `gpuprov instances`)"
    node_bytes, node = largest_node_bytes(result.searched or instances, gpu_lookup)
    # model states of one replica: the nearest miss's total over its shard group(s)
    states = miss.model_states_bytes
    hint = []
    if node_bytes and states > node_bytes * (1 - spec.safety_margin):
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
        grad_accum=c.grad_accum,
    )


def _notes(spec: Any, arch: Any, best: Candidate, mem: MemoryEstimate, instances: list[Any],
           gpu_lookup: Callable) -> list[str]:
    """Where the seed's 18 bytes/param rule of thumb and its table are wrong for this spec."""
    notes: list[str] = []
    rot = RULE_OF_THUMB_BYTES_PER_PARAM * arch.params
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
        notes.append(f"Rule of thumb 18 B/param ({_tbs(rot)}) is for full training; {spec.task} trains "
                     f"{mem.trainable_params:,} adapter parameters and keeps the base frozen: model states "
                     f"{_tbs(states)}")
    # the seed's table: '70B ~1.26 TB, 8x141GB H200 or multi-node' -- check each 8-GPU node type
    # against its own rule: does 18 B/param fit in the node's GPU memory?
    seen: set[str] = set()
    for inst in instances:
        if inst.gpus != 8 or inst.gpu in seen or spec.task != "full":
            continue
        seen.add(inst.gpu)
        gpu = gpu_lookup(inst.gpu)
        node_gb = 8 * _nominal_gb(gpu)
        if rot > node_gb * 1e9 and rot < node_gb * 1e9 * 1.25:
            notes.append(
                f"The seed's table suggests one 8 x {_nominal_gb(gpu):.0f} GB {gpu.name.split(' ')[1]} node for "
                f"{arch.display_name}, but 8 x {_nominal_gb(gpu):.0f} GB = {node_gb / 1000:.2f} TB < "
                f"{_tbs(rot)} by its own 18 B/param rule: the model states cannot fit one node "
                f"(and activations need room on top); plan multi-node sharding or LoRA")
    if best.batch_tokens != spec.global_batch_tokens:
        notes.append(f"Global batch is {best.batch_tokens:,} tokens ({best.micro_batch} x {spec.seq_len} x "
                     f"{best.total_gpus} GPUs x {best.grad_accum} accumulation), "
                     f"{(best.batch_tokens - spec.global_batch_tokens) / spec.global_batch_tokens:+.1%} from the "
                     f"requested {spec.global_batch_tokens:,}")
    if best.instance.onprem and not spec.gpus:
        notes.append("On-prem: this server template was chosen among all templates by GPU-hours; pass --gpu "
                     "with your hosts' GPU type so the plan matches the machines you have")
    if spec.region and best.instance.region and spec.region != best.instance.region:
        notes.append(f"Price is the {best.instance.region} list price ({best.instance.price_date}); "
                     f"{spec.region} may differ and the instance type may not be offered there")
    if best.instance.name.startswith("p5e."):
        notes.append("p5e.48xlarge is sold through EC2 Capacity Blocks only (its price here is the block rate): "
                     "reserve a block and pass --capacity-reservation-id")
    for name in sorted({i.name for i in instances if not i.onprem and i.price_per_hour_usd is None}):
        if spec.objective == "cost":
            notes.append(f"{name} has no public on-demand price (quote only); not ranked by cost")
    return notes


def _nominal_gb(gpu: Any) -> float:
    """The marketing size (141 GB, 80 GB) the seed's table speaks in, from the slug."""
    import re

    m = re.search(r"(\d+)gb", gpu.slug)
    return float(m.group(1)) if m else gpu.memory_bytes / 1e9


def make_plan(spec: Any, *, estimator: Estimator | None = None, instances: Iterable[Any] | None = None) -> Any:
    """The cheapest (or fastest / fewest-GPU) configuration that fits, as a complete Plan."""
    from gpuprov import __version__
    from gpuprov.catalog.fabrics import get_fabric, get_software
    from gpuprov.catalog.gpus import get_gpu
    from gpuprov.catalog.instances import list_instances, nvme_device_glob
    from gpuprov.catalog.models import get_model
    from gpuprov.host import host_needs, make_host, size_onprem
    from gpuprov.plan import (
        Alternative, Cluster, GpuInfo, InstanceInfo, Memory, ModelInfo, Plan, Storage, Throughput,
        Training,
    )
    from gpuprov.sizing.throughput import utilisation as util_of

    arch = get_model(spec.model)
    est_fn = estimator or _default_estimator()
    pool = list(instances) if instances is not None else list(list_instances())
    if spec.gpus:
        for g in spec.gpus:
            get_gpu(g)  # unknown slug -> GpuprovError with suggestions
    result = search(spec, arch, estimator=est_fn, instances=pool, gpu_lookup=get_gpu)
    best = result.best
    if best is None:
        raise GpuprovError(nothing_fits_message(spec, arch, result, pool, get_gpu))

    inst, gpu = best.instance, best.gpu
    mem = est_fn(arch, setup_for(spec, arch, best))
    trainable = mem.trainable_params
    needs = host_needs(gpu_memory_bytes=gpu.memory_bytes, gpus_per_node=inst.gpus, nodes=best.nodes,
                       params=arch.params, trainable=trainable, tokens=spec.tokens, task=spec.task,
                       offload=spec.offload)
    bom = None
    if inst.onprem:
        inst, bom = size_onprem(inst, needs)
    host = make_host(inst, needs, bom)

    fabric_name = inst.fabric if best.nodes > 1 else "none"
    fabric = get_fabric(fabric_name, inst.cloud, inst.name)
    if best.nodes > 1:
        # the instance catalog knows this machine's own share of the fabric
        fabric = fabric.model_copy(update={"gbps_per_gpu": inst.fabric_gbps_per_gpu})
    software = get_software(gpu.architecture, fabric.name, inst.nvswitch, gpu=gpu.slug, cloud=inst.cloud)
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
            reason=loss_reason(cand, best, spec.objective)))
    for slug, cand in sorted(result.constrained_by_gpu.items()):
        limits = []
        if spec.deadline_hours is not None and cand.time_hours > spec.deadline_hours:
            limits.append(f"over deadline: fastest fit takes {cand.time_hours:,.1f} h > {spec.deadline_hours:g} h")
        if spec.budget_usd is not None and cand.cost_usd is not None and cand.cost_usd > spec.budget_usd:
            limits.append(f"over budget: ${cand.cost_usd:,.0f} > ${spec.budget_usd:,.0f}")
        alternatives.append(Alternative(
            cloud=cand.instance.cloud, instance_type=cand.instance.name, gpu=slug, nodes=cand.nodes,
            total_gpus=cand.total_gpus, sharding=cand.sharding, time_hours=round(cand.time_hours, 3),
            cost_usd=None if cand.cost_usd is None else round(cand.cost_usd, 2), reason="; ".join(limits)))
    for slug, miss in sorted(result.unfit_gpus.items()):
        alternatives.append(Alternative(
            cloud=miss.instance.cloud, instance_type=miss.instance.name, gpu=slug, nodes=miss.nodes,
            total_gpus=miss.nodes * miss.instance.gpus, sharding=miss.sharding, time_hours=None, cost_usd=None,
            reason=f"too small: needs {miss.per_gpu_bytes / GiB:,.1f} GiB per GPU, {miss.usable_bytes / GiB:,.1f} GiB "
                   f"usable at best (x{miss.nodes} nodes, {miss.sharding})"))

    rot = RULE_OF_THUMB_BYTES_PER_PARAM * arch.params
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
            precision=spec.precision, optimizer=spec.optimizer, offload=spec.offload),
        training=Training(task=spec.task, lora_rank=None if spec.task == "full" else spec.lora_rank,
                          lora_alpha=None if spec.task == "full" else 2 * spec.lora_rank,
                          lora_targets=targets, tokens=spec.tokens, steps=best.steps, **defaults),
        memory=Memory(per_gpu_bytes=mem.per_gpu_bytes, breakdown=dict(mem.breakdown),
                      model_states_bytes=mem.model_states_bytes, rule_of_thumb_bytes=rot,
                      gpu_memory_bytes=gpu.memory_bytes, safety_margin=spec.safety_margin, fits=True,
                      headroom_bytes=usable - mem.per_gpu_bytes, assumptions=list(mem.assumptions)),
        throughput=Throughput(tokens_per_s=step.tokens_per_s, mfu=step.mfu, mfu_assumed=util, mfu_source=util_src,
                              flops_per_token=fl.model, step_time_s=step.step_time_s,
                              compute_time_s=step.compute_time_s, comm_time_s=step.exposed_comm_s,
                              bound=step.bound),
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
        + [n for n in (hosts_note(spec, arch, best, est_fn, get_gpu),) if n],
    )
    return plan


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
        why = f"ranked by {ranked}: chosen {_describe(best)}; {label}: {_describe(other)}"
    hint = "; --objective time ranks by wall time" if spec.objective != "time" else ""
    return f"{head}. Why: {why}{hint}; reorder the hosts file to choose which hosts run"


def _health(inst: Any, fabric: Any, nodes: int) -> Any:
    from gpuprov.catalog.fabrics import fabric_allreduce_threshold
    from gpuprov.plan import Health

    fabric_min, fabric_source = fabric_allreduce_threshold(fabric, inst.gpus, nodes)
    return Health(nccl_allreduce_busbw_gbytes_per_s=inst.nccl_busbw_gbytes_per_s,
                  source=inst.busbw_source or "no published threshold",
                  fabric_allreduce_busbw_gbytes_per_s=fabric_min, fabric_source=fabric_source)
