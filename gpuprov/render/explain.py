"""`gpuprov explain`: a plan's arithmetic, term by term, beside the 18 B/param rule of thumb.

One section per function; each reads the plan and the step estimate the planner's throughput model
gives for its layout (the same call the planner made), and decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuprov.planning.retime import plan_step
from gpuprov.render.step_terms import STEP_TERM_WORDS
from gpuprov.sizing.operators import constants as op_constants, cp_gather_passes
from gpuprov.sizing.step_parts import step_breakdown
from gpuprov.sizing.throughput import assumptions
from gpuprov.units import GiB, TB


@dataclass(frozen=True)
class _Inputs:
    """What every section reads: the plan, its model and GPU, the FLOPs and the step estimate."""

    plan: Any
    arch: Any
    gpu: Any
    a: Any  # the throughput model's assumptions
    fl: Any  # FLOPs per token
    st: Any  # the step estimate
    intra: float
    link: str
    inter: float
    ops: Any = None  # the operation model the step was timed with


def _inputs(spec: Any, plan: Any) -> _Inputs:
    r = plan_step(plan)
    return _Inputs(plan, r.arch, r.gpu, assumptions(), r.fl, r.st, r.intra, r.link, r.inter, r.ops)


def _memory(x: _Inputs) -> list[str]:
    plan, gpu, fl = x.plan, x.gpu, x.fl
    c, m = plan.cluster, plan.memory
    out = ["1. Parameters (exact, from the config)",
           f"   N = {plan.model.params:,}   trainable = {plan.model.trainable_params:,}   "
           f"matmul params (no input embedding) = {fl.matmul_params:,}",
           "",
           "2. Memory per GPU (estimator terms)                         GiB"]
    out += [f"   {term:<55}{b / GiB:10,.2f}" for term, b in m.breakdown.items() if b]
    out.append(f"   {'= per-GPU peak':<55}{m.per_gpu_bytes / GiB:10,.2f}")
    usable = m.gpu_memory_bytes * (1 - m.safety_margin)
    out.append(f"   usable = {m.gpu_memory_bytes / GiB:,.2f} GiB x (1 - {m.safety_margin:g}) = {usable / GiB:,.2f} GiB "
               f"-> headroom {m.headroom_bytes / GiB:,.2f} GiB")
    one = m.model_states_bytes // c.replicate  # HSDP/DDP replicas hold copies, not more states
    who = "all GPUs" if c.replicate == 1 else f"one replica ({c.replica_gpus} GPUs; {c.replicate} replicas hold copies)"
    out.append(f"   model states, {who} (weights + grads + optimizer) = {one / GiB:,.1f} GiB"
               f"   | rule of thumb: 18 B x N = {m.rule_of_thumb_bytes / GiB:,.1f} GiB "
               f"({(one - m.rule_of_thumb_bytes) / m.rule_of_thumb_bytes:+.1%})")
    node_mem = gpu.memory_bytes * c.gpus_per_node
    out.append(f"   one node holds {c.gpus_per_node} x {gpu.memory_bytes / GiB:,.1f} GiB = {node_mem / GiB:,.1f} GiB "
               f"of GPU memory; the rule of thumb {'fits' if m.rule_of_thumb_bytes <= node_mem else 'does NOT fit'}"
               " in it")
    return out


def _flops(x: _Inputs) -> list[str]:
    plan, fl, arch = x.plan, x.fl, x.arch
    c, trainable = plan.cluster, plan.model.trainable_params
    d = arch.num_attention_heads * arch.head_dim
    out = ["3. FLOPs per token (PaLM appendix B)"]
    if plan.task == "full":
        out.append(f"   6 x N_matmul            = 6 x {fl.matmul_params:,} = {6 * fl.matmul_params:.4g}")
    else:
        out.append(f"   4 x N_matmul + 6 x N_lora = 4 x {fl.matmul_params:,} + 6 x {trainable:,} = "
                   f"{4 * fl.matmul_params + 6 * trainable:.4g}")
    out += [f"   attention 12 x L x s x d = 12 x {arch.num_layers} x {c.seq_len} x {d} = {fl.attention:.4g}",
            f"   model FLOPs (MFU counts) = {fl.model:.4g}   | rule of thumb 6N = {6 * plan.model.params:.4g}",
            f"   recompute ({c.activation_checkpointing}) = {fl.recompute:.4g}  -> executed = {fl.executed:.4g}"]
    return out


def _compute(x: _Inputs) -> list[str]:
    plan, a, st = x.plan, x.a, x.st
    c, t, peak, terms = plan.cluster, plan.throughput, x.gpu.bf16_tflops, st.terms
    ops, oc = x.ops, op_constants()
    what, samples = "per micro-batch", c.micro_batch
    if c.pp > 1:  # the schedule's pass over a data-parallel rank's local batch, each stage 1/pp of the work
        what, samples = "per step (local batch)", c.micro_batch * c.grad_accum
    tokens = samples * c.seq_len // c.cp
    out = [f"4. Compute, operation by operation (catalog/data/operators.yaml), {what}: {samples} x {c.seq_len} tokens"
           + (f" / cp {c.cp}" if c.cp > 1 else "") + (f", TP {c.tp} splits each linear" if c.tp > 1 else "")
           + (f", stage of {-(-x.arch.num_layers // c.pp)} layers" if c.pp > 1 else "")]
    g = oc["gemm"]
    power = ""
    if t.gpu_power_w is not None and t.gpu_power_w != x.gpu.tdp_w:
        power = (f" at the {t.gpu_power_w} W power limit (TDP {x.gpu.tdp_w} W), clock x (limit / TDP)^"
                 f"{float(a.raw['power']['clock_exponent']):.3g} (catalog/data/throughput.yaml power)")
    out.append(f"   GEMMs: every linear's forward, input- and weight-gradient matmul at (M={tokens:,} tokens, N, K); "
               f"{peak:g} TFLOPS x isolated-GEMM ceiling x {float(g['in_training']):g} in training{power} = "
               f"{ops.gpu.gemm_flops / 1e12:,.0f} TFLOP/s, less wave quantisation on {ops.gpu.sms} SMs, or HBM-bound when "
               f"skinny = {terms['gemm_per_micro_batch_s']:,.3f} s")
    if plan.task == "qlora":
        out.append(f"   x QLoRA dequantisation factor {a.qlora_factor:g} ({a.qlora_source})")
    out.append(f"   attention: FlashAttention-2 forward + backward, causal (half the square), at its published "
               f"throughput for {c.seq_len // c.cp:,}-token sequences = {terms['attention_per_micro_batch_s']:,.3f} s")
    mode = "compiled" if x.ops.compiled else "eager"
    out.append(f"   memory-bound ({mode}): norms, RoPE, SwiGLU, residual adds, the loss"
               + (", FSDP's copy-in/out" if c.sharding in ("fsdp", "hsdp") else "")
               + f" at {x.gpu.hbm_gbytes_per_s:,.0f} GB/s HBM = {terms['memory_bound_per_micro_batch_s']:,.3f} s")
    lc = oc["launch"]
    out.append(f"   kernel launches ({mode}): {lc['kernels_per_layer'][mode]} kernels per layer x "
               f"{float(lc['seconds_per_kernel']) * 1e6:g} us, and the GPU waiting for the host where issuing "
               f"them ({float(lc['host_seconds_per_kernel']) * 1e6:g} us each) takes longer than running them "
               f"= {terms['launch_per_micro_batch_s']:,.3f} s")
    out.append(f"   = {terms['compute_per_micro_batch_s']:,.3f} s: the executed FLOPs ({x.fl.executed:.4g} per token) run at "
               f"{st.utilisation:.1%} of the {peak:g} TFLOPS peak on average")
    return out


def _sharding_comm(x: _Inputs) -> list[str]:
    """What the data-parallel sharding moves per micro-batch and per step."""
    plan, a, terms = x.plan, x.a, x.st.terms
    c = plan.cluster
    if c.sharding in ("fsdp", "hsdp"):
        g = c.shard_group // c.tp  # FSDP runs over dp x cp; each rank gathers its TP shard (1/tp)
        if plan.task == "full":
            gathers = f"{a.param_gather_bytes:g} B"
            if plan.throughput.float8_gain != 1.0:  # the blocks' linears travel as float8
                gathers = f"{a.f8_gather_bytes:g} B (block linears, float8) or {a.param_gather_bytes:g} B"
            what = f"(2 all-gathers x {gathers} + reduce-scatter {a.grad_reduce_bytes:g} B) per parameter"
        else:
            base = a.qlora_gather_bytes if plan.task == "qlora" else a.param_gather_bytes
            what = (f"(2 all-gathers of the frozen base x {base:g} B/param + reduce-scatter of the adapter "
                    f"grads x {a.grad_reduce_bytes:g} B/param)")
        out = [f"   per micro-batch over the shard group of {g}: (g-1)/g x {what} = "
               f"{terms['comm_per_micro_batch_s']:,.3f} s"]
        if c.sharding == "hsdp":
            out.append(f"   per step across {c.replicate} replicas: all-reduce of the grad shard = "
                       f"{terms['sync_per_step_s']:,.3f} s")
        return out
    if c.sharding == "zero2":
        return [f"   per micro-batch reduce-scatter of grads = {terms['comm_per_micro_batch_s']:,.3f} s; after the "
                f"step all-gather of params = {terms['tail_s']:,.3f} s (not hidden)"]
    if c.sharding == "ddp":
        return [f"   once per step all-reduce of {a.grad_reduce_bytes:g} B/param grads = "
                f"{terms['sync_per_step_s']:,.3f} s"]
    return ["   single GPU: none"]


def _comm(x: _Inputs) -> list[str]:
    plan, st = x.plan, x.st
    c, terms = plan.cluster, st.terms
    out = ["5. Communication per GPU"]
    out.append(f"   inside a node: {x.link} at {x.intra:,.0f} GB/s achievable; across nodes: {plan.fabric.name} "
               f"{plan.fabric.gbps_per_gpu:g} Gb/s per GPU -> {x.inter:,.1f} GB/s achievable" if c.nodes > 1 else
               f"   inside a node: {x.link} at {x.intra:,.0f} GB/s achievable (single node: no fabric)")
    out += _sharding_comm(x)
    if c.tp > 1:
        out.append(f"   tensor parallel {c.tp} (Megatron-LM sec. 3: 2 all-reduces forward + 2 backward per layer, + "
                   f"recompute; SP splits each into reduce-scatter + all-gather) on {x.link}: "
                   f"{terms['tp_comm_per_micro_batch_s']:,.3f} s per micro-batch, not hidden (the next matmul waits "
                   "for it)")
    if c.cp > 1 and x.ops is not None and x.ops.gathers(c.cp):
        out.append(f"   context parallel {c.cp} on packed documents (the trainer's cp_attention: per layer "
                   f"{cp_gather_passes(c.activation_checkpointing)} all-gathers of K/V, forward and recomputes, + a "
                   f"reduce-scatter of dK/dV; nothing runs beside them): "
                   f"{terms['cp_ring_per_micro_batch_s']:,.3f} s per micro-batch, all exposed")
    elif c.cp > 1:
        out.append(f"   context parallel {c.cp} ring (K/V forward, K/V + fp32 dK/dV backward, cp-1 hops per layer): "
                   f"{terms['cp_ring_per_micro_batch_s']:,.3f} s per micro-batch, exposed "
                   f"{terms['cp_exposed_per_micro_batch_s']:,.3f} s")
    if c.sharding in ("fsdp", "hsdp") and c.offload != "full":
        out.append("   FSDP2 prefetches layer i+1's all-gather under layer i's forward, and in backward layer i-1's "
                   "all-gather and layer i+1's reduce-scatter under layer i's backward; the first all-gather and the "
                   f"last reduce-scatter wait: {terms['exposed_per_micro_batch_s']:,.3f} s per micro-batch exposed; "
                   f"the per-step sync hides under {x.a.overlap:.0%} of the last backward: "
                   f"{terms['exposed_sync_s']:,.3f} s exposed")
    else:
        out.append(f"   compute hides {x.a.overlap:.0%} of the per-micro-batch communication (it runs while the GPUs "
                   f"compute); what is left waits: {terms['exposed_per_micro_batch_s']:,.3f} s per micro-batch, "
                   f"{terms['exposed_sync_s']:,.3f} s for the per-step sync")
    out.append(f"   total per GPU per step: {st.comm_bytes_per_gpu / 1e9:,.2f} GB")
    return out


def _calibrated_text(plan: Any, step_s: float) -> str:
    """The step's sum, and with a calibration for this GPU the measured speed ratio it is divided by."""
    cal = next((c for c in plan.spec.calibration or [] if c.gpu == plan.gpu.slug), None)
    if cal is None or cal.speed_ratio == 1.0:
        return f"{step_s:,.3f} s"
    if cal.gemm_efficiency_ratio:
        return (f"{step_s:,.3f} s, its GEMMs at x{cal.gemm_efficiency_ratio:.4g} the modelled throughput: what a run "
                f"on {cal.gpu} measured at {cal.speed_ratio:g}x the predicted tokens/s implies "
                f"({cal.source or 'calibration'})")
    return (f"{step_s * cal.speed_ratio:,.3f} s, / {cal.speed_ratio:g} measured/predicted tokens/s of a run on "
            f"{cal.gpu} ({cal.source or 'calibration'}) = {step_s:,.3f} s")


def _step(x: _Inputs) -> list[str]:
    plan, terms = x.plan, x.st.terms
    c, t, peak = plan.cluster, plan.throughput, x.gpu.bf16_tflops
    pp = f" x pp {c.pp}" if c.pp > 1 else ""
    ranks = (f"{c.total_gpus // (c.tp * c.cp * c.pp)} data-parallel ranks (GPUs / (tp {c.tp} x cp {c.cp}{pp}))"
             if c.tp * c.cp * c.pp > 1 else f"{c.total_gpus}")
    # PP: one pass over the local batch (the schedule's micro-batches), idle for the pipeline's bubble
    times, bubble = (1, f" + pipeline bubble {terms['pipeline_bubble_s']:,.3f}") if c.pp > 1 else (c.grad_accum, "")
    overhead = float(x.a.raw["run"]["overhead_hours"])
    run = plan.run
    ideal = 6 * plan.model.params * plan.training.tokens / (c.total_gpus * peak * 1e12 * t.mfu_assumed) / 3600
    parts = step_breakdown(x.st)
    out = ["6. Step, time and cost",
           f"   step = {times} x ({terms['compute_per_micro_batch_s']:,.3f} + "
           f"{terms['exposed_per_micro_batch_s']:,.3f}) + {terms['exposed_sync_s']:,.3f} + {terms['tail_s']:,.3f} + "
           f"optimizer {terms['optimizer_s']:,.3f}{bubble} = {_calibrated_text(plan, t.step_time_s)}",
           "   by operation: " + " + ".join(f"{STEP_TERM_WORDS[k]} {v:,.3f}" for k, v in parts.items() if v > 0)
           + f" = {sum(parts.values()):,.3f} s",
           f"   tokens per step = {c.micro_batch} x {c.seq_len} x {ranks} x {c.grad_accum} = "
           f"{c.global_batch_tokens:,}; steps = ceil({plan.training.tokens:,} / {c.global_batch_tokens:,}) = "
           f"{plan.training.steps:,}",
           f"   time = {plan.training.steps:,} x {t.step_time_s:,.3f} s / 3600 + {overhead:g} h start-up"
           + (f" + {run.checkpoint_hours:,.3f} h checkpoint writes" if run and run.checkpoint_hours else "")
           + (f" + {run.preemption_hours if run else 0.0:,.3f} h expected preemption (spot)"
              if plan.purchase.option == "spot" else "")
           + f" = {plan.time_hours:,.2f} h",
           f"   | rule of thumb 6 N D / (GPUs x peak x MFU) = {ideal:,.2f} h"]
    if plan.instance.price_per_hour_usd is not None:
        storage = f" + storage ${run.storage_usd:,.2f}" if run and run.storage_usd else ""
        out.append(f"   cost = {plan.time_hours:,.2f} h x {c.nodes} nodes x ${plan.instance.price_per_hour_usd:,.3f}/h"
                   f"{storage} = ${plan.cost_usd:,.2f}")
    out.append(f"   tokens/s = {t.tokens_per_s:,.0f}; MFU = tokens/s x model FLOPs / (GPUs x peak) = {t.mfu:.1%}")
    return out


def _host(plan: Any) -> list[str]:
    out = ["7. Host rules"]
    out += [f"   [{'ok' if chk.ok else 'SHORT'}] {chk.rule}: need {chk.required}; have {chk.actual}"
            for chk in plan.host.checks]
    out.append(f"   checkpoint = {plan.host.checkpoint_bytes / TB:,.2f} TB (16 B x trainable params) x "
               f"{plan.host.checkpoints_kept} kept")
    if plan.notes:
        out += ["", "Notes:"] + [f"   - {n}" for n in plan.notes]
    return out


def render_explain(spec: Any, plan: Any) -> str:
    """The plan's arithmetic, term by term; the 18 B/param rule of thumb beside the model states."""
    x = _inputs(spec, plan)
    c = plan.cluster
    out = [f"== {plan.model.display_name}: {c.nodes} x {c.instance_type}, {c.total_gpus} x {x.gpu.slug}, "
           f"{c.sharding}, AC {c.activation_checkpointing}, micro-batch {c.micro_batch}", ""]
    for section in (_memory(x), _flops(x), _compute(x), _comm(x), _step(x)):
        out += section + [""]
    out += _host(plan)
    return "\n".join(out)


def explain_data(spec: Any, plan: Any) -> dict:
    """`explain --json`: the numbers the sections print, by name (README: JSON output)."""
    x = _inputs(spec, plan)
    c, m, t, fl = plan.cluster, plan.memory, plan.throughput, x.fl
    overhead = float(x.a.raw["run"]["overhead_hours"])
    ideal = 6 * plan.model.params * plan.training.tokens / (c.total_gpus * x.gpu.bf16_tflops * 1e12 * t.mfu_assumed) / 3600
    return {
        "model": plan.model.display_name, "params": plan.model.params, "trainable_params": plan.model.trainable_params,
        "memory": {"terms_bytes": {k: v for k, v in m.breakdown.items() if v}, "per_gpu_bytes": m.per_gpu_bytes,
                   "usable_bytes": int(m.gpu_memory_bytes * (1 - m.safety_margin)), "headroom_bytes": m.headroom_bytes,
                   "model_states_one_replica_bytes": m.model_states_bytes // c.replicate,
                   "rule_of_thumb_bytes": m.rule_of_thumb_bytes},
        "flops_per_token": {"matmul_params": fl.matmul_params, "model": fl.model, "attention": fl.attention,
                            "recompute": fl.recompute, "executed": fl.executed,
                            "rule_of_thumb_6n": 6 * plan.model.params},
        "step": {"terms_s": dict(x.st.terms), "by_operation_s": step_breakdown(x.st),
                 "step_time_s": t.step_time_s, "utilisation": x.st.utilisation,
                 "comm_bytes_per_gpu": x.st.comm_bytes_per_gpu, "tokens_per_step": c.global_batch_tokens,
                 "steps": plan.training.steps},
        "links": {"intra_node": x.link, "intra_gbytes_per_s": x.intra, "inter_gbytes_per_s": x.inter},
        "time_hours": plan.time_hours, "startup_hours": overhead,
        "checkpoint_hours": plan.run.checkpoint_hours if plan.run else 0.0,
        "preemption_hours": plan.run.preemption_hours if plan.run else 0.0,
        "rule_of_thumb_hours": ideal, "cost_usd": plan.cost_usd, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu,
        "host_checks": [{"rule": chk.rule, "ok": chk.ok, "required": chk.required, "actual": chk.actual}
                        for chk in plan.host.checks],
        "notes": list(plan.notes),
    }
