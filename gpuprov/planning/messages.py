"""What the planner tells the user in words: why nothing fits, why an alternative lost, where the
18 B/param rule of thumb is wrong for this spec."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from gpuprov.catalog.gpus import list_gpus
from gpuprov.host import rules
from gpuprov.recipes import global_batch_tokens
from gpuprov.planning.space import (
    Candidate, Estimator, Miss, SearchResult, _lora_targets, fixed_settings_words, stack_for,
)
from gpuprov.sizing.pipeline import split_layers, stages_per_rank
from gpuprov.sizing.setup import make_setup
from gpuprov.units import GiB, tb
from gpuprov.sizing.throughput import assumptions, float8_refusal, float8_step_kw
from gpuprov.sizing.types import LORA_TARGET_PRESETS, MemoryEstimate

def rule_of_thumb_bytes_per_param() -> int:
    """The widely quoted 18 B/param of mixed-precision Adam (host_rules.yaml names the papers)."""
    return int(rules()["memory"]["rule_of_thumb_bytes_per_param"])


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
                       lora_rank=spec.lora_rank, lora_targets=_lora_targets(spec, arch) if spec.task != "full"
                       else LORA_TARGET_PRESETS["all-linear"], grad_accum=2,
                       framework=getattr(spec, "framework", "gpuprov"), stack=stack_for(spec, arch))
    return estimator(arch, setup).per_gpu_bytes


def _constrained_hint(spec: Any, fastest: Any) -> str:
    """What to relax when runs fit but miss the deadline or budget. A sample is never split across
    data-parallel ranks, so once the fastest run gives every sequence of the global batch its own rank
    (TP/CP at the node's width), more nodes cannot make it faster: the batch is what to raise."""
    if spec.deadline_hours is not None and fastest is not None:
        sequences = fastest.batch_tokens // max(1, spec.seq_len)
        if fastest.dp >= sequences:
            return (f"more nodes cannot help: the fastest run already gives each of the global batch's {sequences:,} "
                    f"sequences ({spec.seq_len:,} tokens) its own data-parallel rank; raise --global-batch, relax "
                    f"--deadline/--budget or train fewer tokens")
    return "relax --deadline/--budget, allow more nodes (--max-nodes) or train fewer tokens"


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
                + "; ".join(parts) + "; " + _constrained_hint(spec, f))
    miss = result.nearest_miss
    if miss is None and (getattr(spec, "pp", None) or 1) > 1 and result.searched and not result.memory_calls:
        return _unfilled_pipeline(spec)
    if miss is None and result.searched and not result.memory_calls and fixed_settings_words(spec):
        return _unformed_batch(spec)
    if miss is None:
        scope = f"cloud {spec.cloud}" + (f", GPUs {','.join(spec.gpus)}" if spec.gpus else "")
        if spec.gpu_count:
            sizes = sorted({i.gpus for i in result.searched})
            return (f"no instance type of {scope} makes exactly {spec.gpu_count} GPUs within --max-nodes "
                    f"{spec.max_nodes} (GPUs per node on offer: {', '.join(map(str, sizes)) or 'none'}; "
                    f"see `gpuprov instances`)")
        unpriced = _unpriced_in_scope(spec, result.excluded_unpriced)
        if unpriced:
            return unpriced_message(spec, unpriced)
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
    fixed = [f"--activation-checkpointing {spec.activation_checkpointing}"
             if getattr(spec, "activation_checkpointing", None) not in (None, "full") else "",
             f"--micro-batch {spec.micro_batch}" if (getattr(spec, "micro_batch", None) or 1) > 1 else ""]
    if any(fixed):
        hint.append(f"leave {' '.join(f for f in fixed if f)} to the planner (fixed, they hold more activations)")
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
    return (f"nothing fits: {arch.display_name} {spec.task} needs {tb(states)} of model states plus "
            f"activations; the largest "
            f"single node holds {node_txt}; nearest miss {miss.instance.name} x{miss.nodes} {miss.sharding}: "
            f"{miss.per_gpu_bytes / GiB:,.1f} GiB per GPU vs {miss.usable_bytes / GiB:,.1f} GiB usable; "
            + "; ".join(hint))


def _unformed_batch(spec: Any) -> str:
    """Every layout was left out before sizing: the fixed micro-batch / accumulation form the global batch
    on no cluster searched."""
    batch = (f"{spec.global_batch_tokens:,} tokens" if spec.global_batch_tokens is not None
             else "the recipe's batch")
    return (f"{fixed_settings_words(spec)} with --seq-len {spec.seq_len} forms no global batch within "
            f"{assumptions().raw['run']['batch_tolerance']:.0%} of {batch} on any cluster searched: give "
            "--global-batch-tokens, or --gpus N to plan your GPUs with the batch these settings make")


def _unfilled_pipeline(spec: Any) -> str:
    """Every layout was left out before sizing: with --pp no batch shape forms the global batch."""
    multiple = " (a multiple of --pp for Interleaved1F1B)" if spec.pp_schedule == "Interleaved1F1B" else ""
    return (f"--pp {spec.pp} leaves no batch shape: a step runs at least {spec.pp} pipeline micro-batches{multiple} "
            "of one sequence or more on every data-parallel rank (GPUs / (tp x cp x pp)), past the global batch on "
            "every cluster searched; raise --global-batch, or use fewer GPUs (--gpus, --max-nodes) or a larger --tp")


def pipeline_note(spec: Any, arch: Any, best: Candidate) -> str | None:
    """How the plan lays out --pp: stages, micro-batches per step and why that count."""
    if best.pp == 1:
        return None
    v = stages_per_rank(best.pp_schedule)
    split = split_layers(arch.num_layers, best.pp * v)
    rule = ("that are multiples of pp (ScheduleInterleaved1F1B refuses others)" if v > 1
            else "of at least pp (fewer leave stages idle)")
    bubble = best.step.terms.get("pipeline_bubble_s", 0.0)
    chosen = "" if getattr(spec, "pp", None) else " (proposed by the planner: the best run it found; --pp 1 rules PP out)"
    return (f"Pipeline{chosen}: PP {best.pp} {best.pp_schedule}, {v} stage(s) per rank, blocks per stage {list(split)} "
            f"(torchtitan's split); each optimizer step runs grad accumulation = {best.grad_accum} pipeline "
            f"micro-batches of {best.micro_batch} sample(s) per data-parallel rank (train.yaml batch.grad_accum); the "
            f"planner keeps only counts {rule}; the schedule's bubble "
            f"((p-1)/(v m) of the compute) is {bubble:,.3f} s of each step; mesh pp {best.pp} x replicate "
            f"{best.total_gpus // best.shard_group} x shard {best.shard_group // best.pp}, FSDP2 per stage without "
            "reshard after forward")


def _gpus_that_fit(miss: Miss, margin: float) -> list[str]:
    """GPU slugs of the catalog whose usable memory holds the nearest miss's per-GPU peak."""

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


def _notes(spec: Any, arch: Any, best: Candidate, mem: MemoryEstimate, instances: list[Any],
           gpu_lookup: Callable) -> list[str]:
    """Where the widely quoted 18 bytes/param rule of thumb (mixed-precision Adam) is wrong for this spec."""
    notes: list[str] = []
    framework = getattr(spec, "framework", "gpuprov")
    if framework != "gpuprov":
        notes.append(f"Memory is sized for the {framework} stack (`gpuprov estimate --framework {framework}`); the "
                     "bundle's launch files run gpuprov's own trainer, so launch your framework yourself")
    rot = rule_of_thumb_bytes_per_param() * arch.params
    # model states of one model replica: HSDP/DDP replicas hold copies, not more states
    states = mem.model_states_bytes // max(1, best.total_gpus // best.shard_group)
    if spec.task == "full":
        per_param = states / arch.params
        diff = (states - rot) / rot
        if abs(diff) > 0.05:
            notes.append(
                f"Rule of thumb 18 B/param x {arch.params / 1e9:.1f}B = {tb(rot)}; the estimator's model states "
                f"(weights + grads + optimizer, {spec.precision}, {spec.optimizer}) are {per_param:.1f} B/param = "
                f"{tb(states)} ({diff:+.0%})")
    else:
        if spec.task == "qlora" and getattr(spec, "framework", "gpuprov") == "gpuprov":
            notes.append("QLoRA base: the trainer leaves the NF4 base out of FSDP2 (it cannot shard bitsandbytes "
                         "weights), so every GPU holds all of it and the memory estimate sizes it so "
                         "(`gpuprov estimate --framework gpuprov` or `--qlora-base replicated` gives the same figure)")
        notes.append(f"Rule of thumb 18 B/param ({tb(rot)}) is for full training; {spec.task} trains "
                     f"{mem.trainable_params:,} adapter parameters and keeps the base frozen: model states "
                     f"{tb(states)}")
    # a node whose GPU memory is within a quarter of the model states looks enough at a glance:
    # check each 8-GPU node type against gpuprov's own count of the states (not the rule of thumb)
    seen: set[str] = set()
    for inst in instances:
        if inst.gpus != 8 or inst.gpu in seen or spec.task != "full":
            continue
        seen.add(inst.gpu)
        gpu = gpu_lookup(inst.gpu)
        node_gb = 8 * _nominal_gb(gpu)
        if node_gb * 1e9 < states < node_gb * 1e9 * 1.25:
            notes.append(
                f"One 8 x {_nominal_gb(gpu):.0f} GB {gpu.name.split(' ')[1]} node looks enough for "
                f"{arch.display_name}, but 8 x {_nominal_gb(gpu):.0f} GB = {node_gb:,.0f} GB < {states / 1e9:,.0f} GB "
                f"of model states as gpuprov counts them ({states / arch.params:.1f} B/param: weights, gradients "
                f"and optimizer as the trainer keeps them): they cannot fit one node (and activations need room "
                f"on top); plan multi-node sharding or LoRA")
    from gpuprov.sizing.why import notes as why_notes

    notes.extend(why_notes(spec.task, best.activation_checkpointing, dict(mem.breakdown)))
    if getattr(spec, "float8", False):
        notes.append(_float8_note(spec, arch, best))
    wanted = global_batch_tokens(spec, best.dp)
    if best.batch_tokens != wanted:
        notes.append(f"Global batch is {best.batch_tokens:,} tokens ({best.micro_batch} x {spec.seq_len} x "
                     f"{best.dp} data-parallel ranks x {best.grad_accum} accumulation), "
                     f"{(best.batch_tokens - wanted) / wanted:+.1%} from the "
                     f"requested {wanted:,}")
    if best.instance.onprem and not spec.gpus and not any(h.gpu for h in spec.hosts or []):
        notes.append("On-prem: this server template was chosen among all templates by GPU-hours; give each host "
                     "gpu: and gpus: in the hosts file (`gpuprov hosts probe` fills them) or pass --gpu, so the "
                     "plan matches the machines you have")
    if spec.region and best.instance.region and spec.region != best.instance.region:
        notes.append(f"Price is the {best.instance.region} list price ({best.instance.price_date}); "
                     f"{spec.region} may differ and the instance type may not be offered there")
    unpriced = [i for i in instances if not i.onprem and i.price_per_hour_usd is None and spec.cloud in ("any", i.cloud)]
    if unpriced and spec.objective == "cost":
        notes.append(unpriced_note(spec, unpriced))
    return notes


def _price_kind(inst: Any) -> str:
    """The price an unpriced type lacks: its purchase option's (spot, capacity-block) or the list price."""
    option = getattr(inst, "purchase", None) or "on-demand"
    return "recorded spot price" if option == "spot" else f"public {option} price (quote only)"


def _unpriced_in_scope(spec: Any, insts: list[Any]) -> list[Any]:
    wanted = {g.lower() for g in spec.gpus} if spec.gpus else None
    return [i for i in insts if spec.cloud in ("any", i.cloud) and (wanted is None or i.gpu.lower() in wanted)]


def _names_by_kind(spec: Any, insts: list[Any]) -> str:
    """`a, b (no recorded spot price in us-central1); c (no public on-demand price (quote only))`."""
    groups: dict[str, list[str]] = {}
    for i in sorted(insts, key=lambda i: i.name):
        where = spec.region if spec.region and spec.cloud == i.cloud else i.region
        kind = _price_kind(i) + (f" in {where}" if getattr(i, "purchase", None) == "spot" and where else "")
        groups.setdefault(kind, []).append(i.name)
    return "; ".join(f"{', '.join(names)} (no {kind})" for kind, names in groups.items())


def unpriced_message(spec: Any, insts: list[Any]) -> str:
    """Why nothing was ranked when every matching type lacks a price under --objective cost."""
    return (f"every instance type that matches has no price to rank by cost: {_names_by_kind(spec, insts)}; "
            "--objective time plans them without a cost, or allow a priced option with --purchase")


def unpriced_note(spec: Any, insts: list[Any]) -> str:
    """One Notes line for the types --objective cost left out for want of a price."""
    return (f"Not ranked by cost, no price: {_names_by_kind(spec, insts)}; --objective time ranks them by "
            "time without a cost")


def _float8_note(spec: Any, arch: Any, best: Candidate) -> str:
    """What --float8 did to this plan, and why not where it did nothing."""
    if best.float8:
        gain = float8_step_kw(best.gpu, arch)["float8_gain"]
        tp = f", torchao float8 TP styles at TP {best.tp}" if best.tp > 1 else ""
        return (f"float8 on (torchao tensorwise float8 linears, float8 FSDP all-gather{tp}): compute timed x{gain:.2f} "
                f"faster, the measured float8/bf16 tokens/s ratio for a {arch.params / 1e9:.0f}B model on "
                f"{best.gpu.architecture.capitalize()}; blocks gathered at 1 byte per linear weight; MFU is counted "
                "against the BF16 peak")
    why = float8_refusal(task=spec.task, precision=spec.precision, compiled=stack_for(spec, arch).compile,
                         moe=arch.is_moe, tp=best.tp)
    return "float8 allowed but off in this plan: " + (why or f"no published float8 speed-up covers {best.gpu.slug}")


def _nominal_gb(gpu: Any) -> float:
    """The marketing size (141 GB, 80 GB) sizing tables speak in, from the slug."""

    m = re.search(r"(\d+)gb", gpu.slug)
    return float(m.group(1)) if m else gpu.memory_bytes / 1e9
