"""The planner's search space: candidates, layouts, the instance pool and the objective's order.

Shared by the search (planning/search.py), the messages and the assembly; imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

from gpuprov.catalog import load_data
from gpuprov.catalog.regions import check_region
from gpuprov.errors import GpuprovError
from gpuprov.planning.families import pipeline_ok, tensor_parallel_ok
from gpuprov.sizing.arch import resolve_lora_targets
from gpuprov.sizing.pipeline import stages_per_rank
from gpuprov.sizing.setup import make_setup
from gpuprov.sizing.throughput import StepEstimate, assumptions
from gpuprov.sizing.types import LORA_TARGET_PRESETS, MemoryEstimate, TrainSetup
from gpuprov.stack import choose_stack

MICRO_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
AC_MODES: tuple[str, ...] = ("none", "selective", "full")
Estimator = Callable[..., MemoryEstimate]


@dataclass(frozen=True)
class Candidate:
    """One point of the search: instance, node count, parallel layout and batch shape, timed and priced."""
    instance: Any  # InstanceType
    gpu: Any  # GpuSpec
    nodes: int
    sharding: str
    shard_group: int  # GPUs of one model replica, every pipeline stage of it (the estimator's shard group)
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
    pp: int = 1  # pipeline stages (fixed by --pp); grad_accum is then the pipeline micro-batches per step
    pp_schedule: str = "1F1B"  # torch.distributed.pipelining schedule (with pp > 1)
    float8: bool = False  # torchao float8 linears (the spec allowed it and a measurement covers the GPU)
    checkpoint_hours: float | None = 0.0  # checkpoint writes training waits for (None: not modelled)
    storage_usd: float = 0.0  # shared filesystem + boot disks over the run (in cost_usd)
    preemption_hours: float = 0.0  # spot: expected losses (in time_hours)
    storage: Any = None  # storage_cost.StorageTerms of this (cloud, nodes)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.instance.gpus

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the GPUs over one TP x CP x PP group (one sample spans the group)."""
        return self.total_gpus // (self.tp * self.cp * self.pp)

    def key(self) -> tuple:
        return (self.instance.cloud, self.instance.name, self.nodes, self.sharding, self.shard_group,
                self.activation_checkpointing, self.micro_batch, self.tp, self.cp, self.pp)


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
    """What the search found: the best candidate, the best per GPU type, and why the others missed."""
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


def stack_for(spec: Any, arch: Any, tp: int = 1, float8: bool = False, cp: int = 1) -> Any:
    """The Stack the bundle's trainer runs for this spec and model (gpuprov/stack.py)."""

    return choose_stack(spec.task, spec.precision, arch.model_type, tp, float8, getattr(spec, "compile", None), cp)


def _lora_targets(spec: Any, arch: Any) -> tuple[str, ...]:
    """The spec's LoRA targets as the model family's module names (phi3's fused, DeepSeek's MLA projections)."""
    return resolve_lora_targets(spec.lora_targets, arch.model_type)


def task_trainable(arch: Any, task: str, lora_rank: int, lora_targets: Any) -> tuple[tuple[str, ...], int]:
    """(LoRA target modules, trainable parameters) of a task: every parameter under full training, the adapters'
    on the resolved targets under LoRA/QLoRA (what the search times and benchmarks/throughput.py predicts)."""
    if task == "full":
        return LORA_TARGET_PRESETS["all-linear"], arch.params
    targets = resolve_lora_targets(lora_targets, arch.model_type)
    return targets, arch.trainable_params(task, lora_rank, targets)


def objective_key(objective: str, c: Candidate) -> tuple:
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


def pipeline_degree(spec: Any, arch: Any) -> tuple[int, str]:
    """(pp, schedule) --pp fixes (1 when unset; pipeline_degrees adds what the search tries); one-line errors
    for what the trainer's pipeline cannot run (catalog/data/trainer.yaml `pipeline`)."""
    pp = getattr(spec, "pp", None) or 1
    if pp == 1:
        return 1, "1F1B"
    facts, schedule = load_data("trainer.yaml")["pipeline"], spec.pp_schedule
    if spec.task not in facts["tasks"]:
        raise GpuprovError(f"--pp applies to --task {'/'.join(facts['tasks'])} (the trainer pipelines full "
                           f"training only; {spec.task} adapters train data-parallel)")
    if schedule not in facts["schedules"]:
        raise GpuprovError(f"--pp-schedule {schedule} is not one the trainer runs ({', '.join(facts['schedules'])})")
    if (getattr(spec, "cp", None) or 1) > 1 and not facts["with_cp"]:
        raise GpuprovError("--pp does not combine with --cp in the bundle's trainer (its stages run no ring "
                           "attention): use one of them")
    if arch.tie_word_embeddings and not facts["tied_embeddings"]:
        raise GpuprovError(f"--pp puts the embedding and the output head on different stages; {arch.display_name} "
                           "ties them, and the bundle's trainer pipelines untied models only")
    stages = pp * stages_per_rank(schedule)
    if stages > arch.num_layers:
        what = f"{schedule} runs {stages_per_rank(schedule)} stages per rank: {stages} stages" \
            if stages != pp else f"--pp {pp} stages"
        raise GpuprovError(f"{what}, more than the {arch.num_layers} layers of {arch.display_name}: use a smaller --pp"
                           + (" or --pp-schedule 1F1B" if stages != pp and pp <= arch.num_layers else ""))
    return pp, schedule


AUTO_PP = (2, 4, 8)  # the degrees the search tries when --pp is not given (torchtitan's 405B recipe: PP 8)


def pipeline_degrees(spec: Any, arch: Any) -> tuple[tuple[int, ...], str]:
    """(PP degrees the search walks, schedule). --pp N fixes one (--pp 1: no PP); unset, the search tries no
    PP and each AUTO_PP degree the trainer's pipeline runs for this spec (trainer.yaml `pipeline`: its tasks,
    untied embeddings, no CP with it, no more stages than blocks); dense models only (its stages split
    Llama-family decoder blocks; an MoE block's experts are not placed per stage)."""
    pp, schedule = pipeline_degree(spec, arch)
    if getattr(spec, "pp", None) is not None:
        return (pp,), schedule
    facts = load_data("trainer.yaml")["pipeline"]
    if (spec.task not in facts["tasks"] or arch.is_moe or not pipeline_ok(arch)
            or (arch.tie_word_embeddings and not facts["tied_embeddings"])
            or ((getattr(spec, "cp", None) or 1) > 1 and not facts["with_cp"])):
        return (1,), schedule
    return (1, *(p for p in AUTO_PP if p * stages_per_rank(schedule) <= arch.num_layers)), schedule


def pipeline_micro_batches(pp: int, schedule: str, wanted: int) -> int:
    """The accumulation steps nearest `wanted` that the schedule runs and that fill the pipeline: at least pp
    micro-batches (fewer leave stages idle; torchtitan's default is pp), a multiple of pp for Interleaved1F1B
    (torch's ScheduleInterleaved1F1B refuses others)."""
    if pp == 1:
        return max(1, wanted)
    if schedule == "Interleaved1F1B":
        return pp * max(1, round(wanted / pp))
    return max(pp, wanted)


def fixed_grad_accumulation(spec: Any, pp: int, schedule: str) -> int | None:
    """The grad accumulation the user fixed (None: the planner chooses); with PP it must be a count the
    schedule runs (pipeline_micro_batches)."""
    ga = getattr(spec, "grad_accumulation", None)
    if ga is None:
        return None
    if pipeline_micro_batches(pp, schedule, ga) != ga:
        need = f"a multiple of --pp {pp}" if schedule == "Interleaved1F1B" else f"at least --pp {pp}"
        raise GpuprovError(f"--grad-accumulation {ga}: with --pp {pp} --pp-schedule {schedule} each step runs "
                           f"{need} pipeline micro-batches")
    return int(ga)


def settings_set_batch(spec: Any) -> bool:
    """True when the global batch follows the user's own settings: a fixed GPU count (--gpus) with a fixed
    micro-batch or accumulation and no batch stated. The recipe's batch is a default; a run the user
    describes whole (their GPUs, their micro-batch) is planned as described, its batch micro-batch x
    seq_len x data-parallel ranks x accumulation (accumulation 1 unless fixed or needed to reach the
    recipe's batch)."""
    fixed = getattr(spec, "micro_batch", None) or getattr(spec, "grad_accumulation", None)
    return bool(fixed) and spec.gpu_count is not None and spec.global_batch_tokens is None


def fixed_settings_words(spec: Any) -> str:
    """The batch settings the user fixed, as flags (for messages)."""
    words = [f"--micro-batch {spec.micro_batch}" if getattr(spec, "micro_batch", None) else "",
             f"--grad-accumulation {spec.grad_accumulation}" if getattr(spec, "grad_accumulation", None) else ""]
    return " ".join(w for w in words if w)


def _mp_degrees(spec: Any, arch: Any, gpu: Any, gpus_per_node: int) -> list[tuple[int, int]]:
    """(tp, cp) pairs worth trying: TP inside the NVLink domain of one node, CP for long sequences.

    A fixed --tp / --cp keeps only that degree. LoRA/QLoRA stay data-parallel (the trainer's TP
    plan is for full training)."""

    fixed_tp, fixed_cp = getattr(spec, "tp", None), getattr(spec, "cp", None)
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
        and not arch.tie_word_embeddings and tensor_parallel_ok(arch))]
    if (getattr(spec, "pp", None) or 1) > 1 and not load_data("trainer.yaml")["pipeline"]["with_cp"]:
        cps = [1]  # the trainer's pipeline stages run no ring attention (pipeline_degree refuses a fixed --cp)
    ok_cp = [c for c in cps if c == 1 or seq % (2 * c) == 0]
    return [(t, c) for t in ok_tp for c in ok_cp]


class _Layout(NamedTuple):
    """How one slot's GPUs split the work: data-parallel sharding (shard group) x TP x CP x PP."""

    sharding: str
    sg: int  # GPUs of one model replica, all its pipeline stages
    tp: int = 1
    cp: int = 1
    f8: bool = False  # torchao float8 on this slot's GPU (_Search.float8_on)
    pp: int = 1

    @property
    def mp(self) -> int:
        """GPUs one sample spans (a TP x CP x PP group acts as one data-parallel rank)."""
        return self.tp * self.cp * self.pp


def _layouts(total: int, gpus_per_node: int, nodes: int, degrees: list[tuple[int, int]], pp: int = 1) -> list[_Layout]:
    """The data-parallel choices of _shardings, plus FSDP/HSDP over what TP, CP and PP leave
    (torchtitan: FSDP over dp_shard x cp, TP innermost). Each (tp, cp)'s FSDP comes before its HSDPs.
    Pipeline stages run FSDP or HSDP only (the trainer's FSDP2 per stage; sizing/parallel.py validate)."""
    out = [_Layout(s, sg) for s, sg in _shardings(total, gpus_per_node, nodes)] \
        if (1, 1) in degrees and pp == 1 else []
    for tp, cp in degrees:
        mp = tp * cp * pp
        if mp == 1 or total % mp:
            continue
        out.append(_Layout("fsdp", total, tp, cp, pp=pp))
        out += [_Layout("hsdp", k * gpus_per_node, tp, cp, pp=pp) for k in range(1, nodes)
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


def setup_for(spec: Any, arch: Any, c: Candidate) -> TrainSetup:
    """The estimator's setup for one candidate (what `gpuprov estimate` would be asked)."""
    return make_setup(
        task=spec.task, seq_len=spec.seq_len, micro_batch=c.micro_batch, gpus=c.total_gpus,
        gpus_per_node=c.instance.gpus, sharding=c.sharding,
        shard_group=c.shard_group if c.sharding == "hsdp" else None,
        activation_checkpointing=c.activation_checkpointing, precision=spec.precision, optimizer=spec.optimizer,
        offload=spec.offload, lora_rank=spec.lora_rank,
        lora_targets=_lora_targets(spec, arch) if spec.task != "full" else LORA_TARGET_PRESETS["all-linear"],
        grad_accum=c.grad_accum, tp=c.tp, cp=c.cp, pp=c.pp, pp_schedule=c.pp_schedule,
        framework=getattr(spec, "framework", "gpuprov"),
        stack=stack_for(spec, arch, c.tp, c.float8),
    )
