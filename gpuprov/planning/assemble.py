"""Plan assembly: the search's choice, sized and described as a complete Plan."""

from __future__ import annotations

from typing import Any, Iterable

from gpuprov.sizing.time_error import time_range
from gpuprov import __version__, bringup_plan
from gpuprov.candidates import candidate_rows, pick_warnings
from gpuprov.catalog.fabrics import fabric_allreduce_threshold, get_fabric, get_software
from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.instances import list_instances, nvme_device_glob
from gpuprov.catalog.models import get_model, weights_source
from gpuprov.errors import GpuprovError
from gpuprov.host import host_needs, make_host, rules, size_onprem, unknown_host_notes
from gpuprov.onprem import with_declared_hosts
from gpuprov.plan import (
    Alternative, Cluster, GpuInfo, Health, InstanceInfo, Memory, ModelInfo, Plan, RunBreakdown, Storage, Throughput,
    Training,
)
from gpuprov.planning.families import check_family
from gpuprov.planning.messages import (
    _notes, loss_reason, nothing_fits_message, pipeline_note, rule_of_thumb_bytes_per_param,
)
from gpuprov.planning.onprem import _prefer_every_host, hosts_note
from gpuprov.planning.search import search
from gpuprov.planning.space import (
    Candidate, Estimator, SearchResult, _lora_targets, objective_key, setup_for, stack_for,
)
from gpuprov.recipes import notes as recipe_notes
from gpuprov.recipes import schedule
from gpuprov.sizing.memory import estimate_memory
from gpuprov.spot import notes as spot_notes
from gpuprov.stack import attention_notes
from gpuprov.storage_cost import checkpoint_every
from gpuprov.storage_cost import describe as storage_describe
from gpuprov.sizing.step_parts import step_breakdown
from gpuprov.sizing.throughput import flops_per_token, float8_step_kw
from gpuprov.targets import get_target
from gpuprov.targets.decide import decided
from gpuprov.units import GiB

OPS_SOURCE = ("per-operation step model, catalog/data/operators.yaml: GEMMs by shape at the GPU's measured GEMM "
              "ceiling, FlashAttention-2's published throughput by sequence length, memory-bound ops at HBM "
              "bandwidth, kernel launches")


def _run(spec: Any, best: Candidate) -> RunBreakdown:
    """The parts time_hours and cost_usd add up from, as the search computed them."""
    from gpuprov.sizing.throughput import assumptions

    train_h = best.steps * best.step.step_time_s / 3600.0
    startup = float(assumptions().raw["run"]["overhead_hours"])
    compute = None if best.cost_usd is None else best.cost_usd - best.storage_usd
    unpriced = list(best.storage.unpriced) if best.storage is not None else []
    if best.checkpoint_hours is None:
        unpriced.append("checkpoint write time (no sourced write bandwidth where checkpoints land)")
    return RunBreakdown(train_hours=train_h, startup_hours=startup, checkpoint_hours=best.checkpoint_hours,
                        preemption_hours=best.preemption_hours, compute_usd=compute,
                        storage_usd=None if best.cost_usd is None else best.storage_usd,
                        not_in_cost=unpriced)


def _training_defaults(spec: Any, arch: Any, steps: int, step_time_s: float) -> dict[str, Any]:
    """LR schedule: the fine-tuning recipe of the task, or pre-training's from scratch (gpuprov/recipes.py)."""
    ckpt = checkpoint_every(steps, step_time_s, spec.checkpoint_every_steps)
    return dict(**schedule(spec, arch.params, steps), grad_clip=1.0,
                checkpoint_every_steps=ckpt, log_every_steps=max(1, min(10, steps)))


def _canonical(value: Any) -> Any:
    """Keys sorted at every level: plan.json stores the config sorted, and `check` rebuilds from it."""
    if isinstance(value, dict):
        return {k: _canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def offload_retry(spec: Any, arch: Any, est_fn: Estimator, pool: list[Any]) -> tuple[Any, SearchResult] | None:
    """When nothing fits and the user did not choose --offload: the least offload that fits, if any."""
    if "offload" in getattr(spec, "model_fields_set", {"offload"}) or spec.offload != "none":
        return None
    for level in ("optimizer", "full"):
        trial = spec.model_copy(update={"offload": level})
        result = search(trial, arch, estimator=est_fn, instances=pool, gpu_lookup=get_gpu)
        if result.best is not None:
            return trial, result
    return None


OFFLOAD_NOTE = ("Nothing fits on these GPUs without CPU offload: planned with --offload {} (the optimizer states, "
                "and with full also the parameters, live in host RAM; steps are slower)")


def make_plan(spec: Any, *, estimator: Estimator | None = None, instances: Iterable[Any] | None = None) -> Any:
    """The cheapest (or fastest / fewest-GPU) configuration that fits, as a complete Plan."""
    arch = get_model(spec.model)
    check_family(spec, arch)
    est_fn = estimator or estimate_memory
    pool = list(instances) if instances is not None else list(list_instances())
    pool = with_declared_hosts(spec, pool, get_gpu)
    if spec.gpus:
        for g in spec.gpus:
            get_gpu(g)  # unknown slug -> GpuprovError with suggestions
    # each type priced at the purchase option it would be bought with; unbuyable types drop out
    pool, unbuyable = bringup_plan.priced_pool(pool, spec)
    result = search(spec, arch, estimator=est_fn, instances=pool, gpu_lookup=get_gpu)
    offloaded = None
    if result.best is None:
        offloaded = offload_retry(spec, arch, est_fn, pool)
        if offloaded is None:
            raise GpuprovError(nothing_fits_message(spec, arch, result, pool, get_gpu, est_fn)
                               + bringup_plan.unbuyable_hint(spec, unbuyable))
        spec, result = offloaded
    best = _prefer_every_host(spec, arch, result, est_fn, get_gpu)
    plan = _assemble(spec, arch, est_fn, pool, result, best)
    plan = plan.model_copy(update={"notes": [*plan.notes, *attention_notes(plan)]})
    # said from the spec alone, so a plan regenerated from its lock (offload recorded) says it again
    if offloaded or (spec.offload != "none" and search(spec.model_copy(update={"offload": "none"}), arch,
                                                       estimator=est_fn, instances=pool,
                                                       gpu_lookup=get_gpu).best is None):
        plan = plan.model_copy(update={"notes": [*plan.notes, OFFLOAD_NOTE.format(spec.offload)]})
    return _with_table(decided(plan), spec, arch, result, best, est_fn)


def _assemble(spec: Any, arch: Any, est_fn: Estimator, pool: list[Any], result: SearchResult,
              best: Candidate) -> Plan:
    """The Plan for the chosen candidate: memory re-sized for it, host, fabric, software, bring-up."""
    inst, gpu = best.instance, best.gpu
    mem = est_fn(arch, setup_for(spec, arch, best))
    needs = host_needs(gpu_memory_bytes=gpu.memory_bytes, gpus_per_node=inst.gpus, nodes=best.nodes,
                       params=arch.params, trainable=mem.trainable_params, tokens=spec.tokens, task=spec.task,
                       offload=spec.offload)
    bom = None
    if inst.onprem and inst.ram_bytes is None and not inst.unknown:  # a template: sized as a purchase
        inst, bom = size_onprem(inst, needs)
    fabric = get_fabric(inst.fabric if best.nodes > 1 else "none", inst.cloud, inst.name)
    if best.nodes > 1:
        # the instance catalog knows this machine's own share of the fabric
        fabric = fabric.model_copy(update={"gbps_per_gpu": inst.fabric_gbps_per_gpu})
    fabric = get_target(inst.cloud).plan_fabric(fabric, tuple(getattr(inst, "unknown", ())), best.nodes)
    glob, _glob_src = nvme_device_glob(inst.cloud)
    bringup = bringup_plan.bringup_fields(spec, best.instance, best.nodes, needs)
    return Plan(
        gpuprov_version=__version__, spec=spec, task=spec.task,
        model=ModelInfo(name=spec.model, display_name=arch.display_name, hf_model_type=arch.model_type,
                        params=arch.params, trainable_params=mem.trainable_params, hf_config=_canonical(arch.hf_config),
                        source=arch.source),
        gpu=GpuInfo(slug=gpu.slug, name=gpu.name, architecture=gpu.architecture, memory_bytes=gpu.memory_bytes,
                    bf16_tflops=gpu.bf16_tflops, fp8_tflops=gpu.fp8_tflops,
                    nvlink_gbytes_per_s=gpu.nvlink_gbytes_per_s, pcie_gen=gpu.pcie_gen, source=gpu.source),
        instance=_instance_info(spec, inst), fabric=fabric, cluster=_cluster(spec, inst, best),
        training=_training(spec, arch, best), memory=_memory(spec, arch, gpu, mem),
        throughput=_throughput(spec, arch, best, mem.trainable_params),
        time_hours=best.time_hours, cost_usd=best.cost_usd, run=_run(spec, best),
        time_hours_range=list(time_range(best.time_hours, best.steps * best.step.step_time_s / 3600.0)),
        host=make_host(inst, needs, bom),
        software=get_software(gpu.architecture, fabric.name, inst.nvswitch, gpu=gpu.slug, cloud=inst.cloud,
                              instance=inst.name),
        storage=Storage(mount_point="/scratch", raid_name="scratch", device_glob=glob, devices=inst.nvme_count,
                        expected_bytes=inst.nvme_bytes_total),
        health=_health(inst, fabric, best.nodes),
        hosts=list(spec.hosts[: best.nodes]) if inst.onprem and spec.hosts else None,
        alternatives=_alternatives(spec, result, best) + bringup_plan.purchase_alternatives(spec, best),
        notes=recipe_notes(spec, best.steps, best.batch_tokens, best.dp) + _notes(spec, arch, best, mem, pool, get_gpu)
        + spot_notes(inst, spec.region or inst.region, best.nodes, best.steps * best.step.step_time_s / 3600.0)
        + unknown_host_notes(inst, best.nodes)
        + [n for n in (storage_describe(best.storage, best.time_hours) if best.storage else "",) if n]
        + [n for n in (calibration_note(spec, best),) if n]
        + [n for n in (hosts_note(spec, arch, best, est_fn, get_gpu), result.every_host_note,
                       pipeline_note(spec, arch, best)) if n]
        + bringup_plan.purchase_notes(spec, bringup["purchase"], best.instance, best.time_hours, best.nodes,
                                      bringup["shared_storage"])
        + bringup_plan.access_notes(bringup["access"], best.time_hours),
        **bringup,
        stack=stack_for(spec, arch, best.tp, best.float8, best.cp),
    )


def calibration_note(spec: Any, best: Candidate) -> str | None:
    from gpuprov.calibration import layout_of, plan_note

    probe = type("_Probe", (), {"cluster": _cluster(spec, best.instance, best)})()
    return plan_note(spec, best.instance.gpu, spec.model, layout_of(probe), best.gpu.tdp_w)


def _instance_info(spec: Any, inst: Any) -> InstanceInfo:
    return InstanceInfo(
        cloud=inst.cloud, name=inst.name, region=spec.region or inst.region, gpus=inst.gpus,
        vcpus=inst.vcpus or 0, ram_bytes=inst.ram_bytes or 0, local_nvme_count=inst.nvme_count,
        local_nvme_bytes_each=inst.nvme_bytes_each, network_cards=inst.network_cards,
        efa_interfaces=inst.efa_interfaces, nvswitch=inst.nvswitch, pcie_gen=inst.pcie_gen,
        price_per_hour_usd=inst.price_per_hour_usd, price_date=inst.price_date, unknown=list(inst.unknown),
        source=inst.source + (f"; price: {inst.price_source}" if inst.price_source else ""))


def _cluster(spec: Any, inst: Any, best: Candidate) -> Cluster:
    return Cluster(
        cloud=inst.cloud, region=spec.region or inst.region, instance_type=inst.name, gpu=best.gpu.slug,
        gpus_per_node=inst.gpus, nodes=best.nodes, total_gpus=best.total_gpus, sharding=best.sharding,
        # train.yaml's mesh is pp x replicate x shard: one stage's share of the replica's GPUs
        shard_group=best.shard_group // best.pp, replicate=best.total_gpus // best.shard_group,
        activation_checkpointing=best.activation_checkpointing, micro_batch=best.micro_batch,
        grad_accum=best.grad_accum, seq_len=spec.seq_len, global_batch_tokens=best.batch_tokens,
        precision=spec.precision, optimizer=spec.optimizer, offload=spec.offload, tp=best.tp, cp=best.cp, pp=best.pp,
        pp_schedule=best.pp_schedule)


def _training(spec: Any, arch: Any, best: Candidate) -> Training:
    targets = list(_lora_targets(spec, arch)) if spec.task != "full" else []
    return Training(task=spec.task, init=spec.init,
                    base_weights=weights_source(spec.model) if spec.init == "pretrained" else None,
                    lora_rank=None if spec.task == "full" else spec.lora_rank,
                    lora_alpha=None if spec.task == "full" else 2 * spec.lora_rank,
                    lora_targets=targets, tokens=spec.tokens, steps=best.steps,
                    export_merged=spec.export_merged and spec.task != "full",
                    **_training_defaults(spec, arch, best.steps, best.step.step_time_s))


def _memory(spec: Any, arch: Any, gpu: Any, mem: Any) -> Memory:
    usable = int(gpu.memory_bytes * (1.0 - spec.safety_margin))
    return Memory(per_gpu_bytes=mem.per_gpu_bytes, breakdown=dict(mem.breakdown),
                  model_states_bytes=mem.model_states_bytes,
                  rule_of_thumb_bytes=rule_of_thumb_bytes_per_param() * arch.params,
                  gpu_memory_bytes=gpu.memory_bytes, safety_margin=spec.safety_margin, fits=True,
                  headroom_bytes=usable - mem.per_gpu_bytes, assumptions=list(mem.assumptions))


def _throughput(spec: Any, arch: Any, best: Candidate, trainable: int) -> Throughput:
    step, gpu = best.step, best.gpu
    fl = flops_per_token(arch, spec.seq_len, spec.task, trainable, best.activation_checkpointing)
    return Throughput(tokens_per_s=step.tokens_per_s, mfu=step.mfu, mfu_assumed=step.utilisation, mfu_source=OPS_SOURCE,
                      flops_per_token=fl.model, attention_flops_per_token=fl.attention,
                      step_time_s=step.step_time_s, compute_time_s=step.compute_time_s,
                      comm_time_s=step.exposed_comm_s, bound=step.bound,
                      float8_gain=float8_step_kw(gpu, arch)["float8_gain"] if best.float8 else 1.0,
                      gpu_power_w=gpu.tdp_w, step_terms_s={k: round(v, 6) for k, v in step_breakdown(step).items()})


def _alternatives(spec: Any, result: SearchResult, best: Candidate) -> list[Alternative]:
    """The best of every other GPU type, those the deadline or budget ruled out, and those too small."""
    def row(cand: Candidate, slug: str, reason: str) -> Alternative:
        return Alternative(
            cloud=cand.instance.cloud, instance_type=cand.instance.name, gpu=slug, nodes=cand.nodes,
            total_gpus=cand.total_gpus, sharding=cand.sharding, time_hours=round(cand.time_hours, 3),
            cost_usd=None if cand.cost_usd is None else round(cand.cost_usd, 2), reason=reason,
            purchase=cand.instance.purchase)

    out = [row(cand, slug, loss_reason(cand, best, spec.objective))
           for slug, cand in sorted(result.best_by_gpu.items(), key=lambda kv: objective_key(spec.objective, kv[1]))
           if cand is not best]
    for slug, cand in sorted(result.constrained_by_gpu.items()):
        limits = []
        if spec.deadline_hours is not None and cand.time_hours > spec.deadline_hours:
            limits.append(f"over deadline: fastest fit takes {cand.time_hours:,.1f} h > {spec.deadline_hours:g} h")
        if spec.budget_usd is not None and cand.cost_usd is not None and cand.cost_usd > spec.budget_usd:
            limits.append(f"over budget: ${cand.cost_usd:,.0f} > ${spec.budget_usd:,.0f}")
        out.append(row(cand, slug, "; ".join(limits)))
    for slug, miss in sorted(result.unfit_gpus.items()):
        out.append(Alternative(
            cloud=miss.instance.cloud, instance_type=miss.instance.name, gpu=slug, nodes=miss.nodes,
            total_gpus=miss.nodes * miss.instance.gpus, sharding=miss.sharding, time_hours=None, cost_usd=None,
            reason=f"too small: needs {miss.per_gpu_bytes / GiB:,.1f} GiB per GPU, {miss.usable_bytes / GiB:,.1f} GiB "
                   f"usable at best (x{miss.nodes} nodes, {miss.sharding})"))
    return out


def _with_table(plan: Any, spec: Any, arch: Any, result: SearchResult, best: Candidate, est_fn: Estimator) -> Any:
    """The plan with its candidates table and the warnings on a pathological pick."""
    rows = candidate_rows(spec, arch, result, best, est_fn)
    min_gbps = float(rules()["network"]["min_gbps_per_gpu_multinode"])
    return plan.model_copy(update={"candidates": rows, "warnings": pick_warnings(spec, best, rows, min_gbps)})


def _health(inst: Any, fabric: Any, nodes: int) -> Health:
    fabric_min, fabric_source = fabric_allreduce_threshold(fabric, inst.gpus, nodes)
    return Health(nccl_allreduce_busbw_gbytes_per_s=inst.nccl_busbw_gbytes_per_s,
                  source=inst.busbw_source or "no published threshold",
                  fabric_allreduce_busbw_gbytes_per_s=fabric_min, fabric_source=fabric_source)
