"""Precise mode: simulate one real training step on fake tensors and read its peak memory.

The model is built from its Hugging Face config under `FakeTensorMode` (shapes, dtypes and
storages but no data), wrapped the way the run would be (LoRA via peft, QLoRA NF4 storage, AC,
FSDP2 `fully_shard` on a fake process group of the shard-group size), and one forward, backward
and optimizer step runs under PyTorch's `MemTracker` / `FSDPMemTracker`. Their peak snapshot is
the tensor memory of one GPU; the non-tensor terms (CUDA context, allocator, NCCL) come from the
same constants catalog the analytic model reads.

Where the CPU build differs from a CUDA run, and what is done about it:
- no fake CUDA device: tensors are fake *CPU* tensors; MemTracker rounds only CUDA tensors to the
  caching allocator's 512 B blocks, so that rounding is applied here explicitly;
- attention: HF's SDPA on CPU may fall back to the math path (s^2 scores) or eager attention, and
  the CPU flash kernel writes its output (b, h, s, d) so HF copies it; a registered attention
  function forces the CPU flash kernel and re-lays its output out as CUDA FlashAttention-2 does
  (see `_register_attention`), so activations are linear in sequence length as on the GPU;
- autocast: CPU autocast's op lists differ slightly from CUDA's (both run matmuls and SDPA in bf16,
  norms and the loss in fp32), which matters only without FSDP (FSDP2 casts by policy);
- kernels' scratch (cuBLAS workspaces, FA2 split buffers) and NCCL/CUDA context are not tensors:
  the non-tensor terms come from memory_constants.yaml like the analytic model's.
Not simulated (said in the assumptions): torch.compile fusion, chunked cross-entropy, activation
offloading, MoE routing (data-dependent shapes); ZeRO-1/2 are run unsharded and their partitioning
applied to the optimizer states (and gradients) afterwards.

The simulation is checked against a real CPU run of the same step (tests/test_precise.py): the
profiler's allocator events agree with the simulated peak to within 0.1% on tiny models.

torch, transformers and peft are imported inside functions: `gpuprov plan` never pays for them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from gpuprov.errors import GpuprovError
from gpuprov.sizing.precise_kernels import _constants, nf4_bytes  # noqa: F401 - nf4_bytes: precise mode's interface
from gpuprov.sizing.precise_step import _global_bytes, _local_bytes, _progress_hooks, build_step
from gpuprov.sizing.types import MemoryEstimate, TrainSetup
from gpuprov.units import gib

Progress = Callable[[str, float], None]

INSTALL_HINT = ("precise mode needs PyTorch, transformers and peft: pip install torch transformers peft "
                "(the [precise] extra of a gpuprov checkout)")

# MemTracker / FSDPMemTracker reference types -> the analytic model's breakdown terms
# (gpuprov.sizing.memory.TERMS). "Temp" is what backward allocates beyond saved activations
# (activation gradients, recomputed tensors), the analytic model's activation_transient.
_TERM_OF_REFTYPE = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Optstate": "optimizer_states",
    "OptState": "optimizer_states",
    "Unsharded Param": "gathered_params",
    "All Gather": "gathered_params",
    "Unsharded Grad": "reduce_scatter_buffers",
    "Reduce Scatter": "reduce_scatter_buffers",
    "Activation": "activations",
    "Inputs": "activations",
    "Other": "activations",
    "Temp": "activation_transient",
    "logits": "logits",
    "cross_entropy": "cross_entropy",
    "autocast_weight_cache": "autocast_weight_cache",
}

# Wall time of a simulation: fake tensors cost per op, not per byte, so time ~ decoder layers.
# Measured on a shared 2-core machine (benchmarks/precise_grid.py prints each run's seconds):
# Llama-2-7B FSDP 8 GPUs seq 4096 took 23 s (full AC) to 59 s (selective AC, incl. imports),
# Llama-3.2-1B 5-17 s; first use in a process also pays ~10 s to import transformers and peft.
_SECONDS_BASE = 5.0
_SECONDS_IMPORT = 10.0
_SECONDS_PER_LAYER = 0.6
_SECONDS_FACTORS = {"selective": 1.5, "lora": 1.8, "qlora": 1.8, "sharded": 1.2}


# torchao, when installed, is imported by transformers' and peft's availability checks: on a CPU
# machine it logs a warning per CUDA extension it cannot load, and torch's pytree logs a deprecation
# for torchao's enums. Import-time noise on the user's terminal, nothing about the estimate.
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def _require_torch(setup: TrainSetup) -> None:
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        if setup.task in ("lora", "qlora"):
            import peft  # noqa: F401
    except ImportError as exc:
        raise GpuprovError(INSTALL_HINT) from exc
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError as exc:
        raise GpuprovError(
            f"precise mode needs transformers >= 4.56 (found {transformers.__version__}): "
            "pip install -U torch transformers peft (the [precise] extra)"
        ) from exc


def estimate_seconds(arch: Any, setup: TrainSetup) -> float:
    """Up-front guess of estimate_precise's wall time in seconds (about +-50% on a busy CPU)."""
    import sys

    layers = int(getattr(arch, "num_layers", 0) or arch.hf_config.get("num_hidden_layers", 32))
    per_layer = _SECONDS_PER_LAYER
    if setup.activation_checkpointing == "selective":
        per_layer *= _SECONDS_FACTORS["selective"]  # the SAC policy runs in Python per op
    if setup.task in ("lora", "qlora"):
        per_layer *= _SECONDS_FACTORS[setup.task]  # peft adds three modules per projection
    if _shard_world(setup) > 1:
        per_layer *= _SECONDS_FACTORS["sharded"]  # FSDP2 hooks and DTensor bookkeeping
    imports = 0.0 if "transformers" in sys.modules and "peft" in sys.modules else _SECONDS_IMPORT
    return _SECONDS_BASE + imports + per_layer * layers


def _shard_world(setup: TrainSetup) -> int:
    if setup.sharding == "fsdp":
        return setup.gpus
    if setup.sharding == "hsdp":
        return setup.shard_group or min(setup.gpus, setup.gpus_per_node)
    return 1


def _validate(arch: Any, setup: TrainSetup) -> None:
    for name in ("seq_len", "micro_batch", "gpus", "lora_rank"):
        if getattr(setup, name) <= 0:
            raise GpuprovError(f"{name.replace('_', '-')} must be positive, got {getattr(setup, name)}")
    if setup.sharding == "hsdp" and setup.gpus % _shard_world(setup):
        raise GpuprovError(
            f"hsdp shard group {_shard_world(setup)} does not divide {setup.gpus} GPUs"
        )
    cfg = getattr(arch, "hf_config", None)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise GpuprovError("precise mode needs the model's Hugging Face config (hf_config with model_type)")
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 1
    if experts > 1:
        # MoE routing uses nonzero()/data-dependent shapes, which fake tensors cannot run.
        raise GpuprovError(
            "precise mode cannot simulate MoE routing (data-dependent shapes); use the analytic estimate"
        )


def _head_aware_class() -> type:
    """A tracker mixin that splits the loss end of the model out of "Activation"/"Temp"."""
    import torch

    _TO_COPY = torch.ops.aten._to_copy.default

    class HeadAware:
        """Split the loss end of the model out of "Activation"/"Temp": tensors made inside the
        output head are "logits", those made by the loss outside any decoder module (fp32
        upcast, log-softmax, their gradients) are "cross_entropy" - the analytic model's terms."""

        head = None  # the output-embedding module
        _param_cast = False
        body = None  # the decoder stack module (embeddings, layers, final norm)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            snap = self._curr_mem_snap.setdefault(winfo.device, dict.fromkeys(self._ref_class, 0))
            snap.setdefault("Total", 0)
            for key in (winfo.reftype, old_reftype):
                if key is not None:
                    snap.setdefault(key, 0)
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # torch.autocast's low-precision copy of a weight (cached for the forward, saved by
            # autograd until the weight's backward): the analytic autocast_weight_cache term.
            self._param_cast = (
                func is _TO_COPY and bool(args) and isinstance(args[0], torch.nn.Parameter)
            )
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _track(self, reftype, t):
            if self._param_cast and getattr(reftype, "value", None) == "Activation":
                reftype = "autocast_weight_cache"
            elif getattr(reftype, "value", None) in ("Activation", "Temp") and self.head is not None:
                known = self._mod_tracker._known_modules
                parents = self._mod_tracker.parents
                if known.get(self.head) in parents:
                    reftype = "logits"
                elif known.get(self.body) not in parents and not self._in_ac:
                    reftype = "cross_entropy"
            super()._track(reftype, t)

    return HeadAware


def _tracker_classes():
    """(MemTracker, FSDPMemTracker) subclasses tuned for this use.

    - Only the global peak is kept: upstream also updates every tracked module's local peak on
      every op, O(ops x modules), which dominates the run time with peft's many small modules.
    - MemTracker skips gradient hooks on frozen parameters (upstream hooks every parameter,
      which raises for LoRA's requires_grad=False base weights).
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    def update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)

    HeadAware = _head_aware_class()

    class FastMemTracker(HeadAware, MemTracker):
        _update_peak_stats = update_peak_stats

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if not param.requires_grad or param in self._param_to_grad_hook_handles:
                        continue

                    def grad_hook(grad):
                        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

                    self._param_to_grad_hook_handles[param] = (
                        param.register_hook(grad_hook),
                        param.register_post_accumulate_grad_hook(lambda p: grad_hook(p.grad)),
                    )
            return sizes

    class FastFSDPMemTracker(HeadAware, FSDPMemTracker):
        _update_peak_stats = update_peak_stats

    return FastMemTracker, FastFSDPMemTracker


@contextlib.contextmanager
def _cuda_allocator_rounding():
    """MemTracker rounds to the CUDA caching allocator's 512 B blocks only for CUDA tensors; the
    fake tensors here are CPU, so apply the same rounding while tracking."""
    from torch.distributed._tools import mem_tracker

    orig = mem_tracker._WeakRefInfo._calculate_mem_consumed

    def rounded(self) -> int:
        return math.ceil(self.size * self.element_size / 512) * 512

    mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    try:
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = orig


def _unsimulated(setup: TrainSetup, use_fsdp: bool) -> list[str]:
    """Stack knobs the fake-tensor step does not reproduce (it runs FSDP2 and an eager model)."""
    checks = (
        ("FSDP1 flat parameters (simulated as FSDP2)", use_fsdp and setup.fsdp_version == 1),
        ("FSDP1 frozen flat-parameter gradients", use_fsdp and setup.fsdp1_frozen_grads),
        ("gradient accumulation without gradient sync", use_fsdp and setup.defer_grad_sync and setup.grad_accumulation_steps > 1),
        ("torch.compile of the model (only a compiled loss is modelled)", setup.compile),
        ("fp32 model logits", setup.fp32_logits),
        ("fp32 logits of transformers < 4.45", setup.loss_impl == "hf-legacy"),
    )
    return [name for name, on in checks if on]


def _assumptions(setup: TrainSetup, world: int, use_fsdp: bool, torch_version: str) -> list[str]:
    """What the simulation runs, and what it leaves to the analytic model."""
    out: list[str] = [
        "precise: one forward+backward+AdamW step simulated on fake tensors (torch "
        f"{torch_version}, FakeTensorMode + {'FSDPMemTracker' if use_fsdp else 'MemTracker'}"
        f"{f', FSDP2 on a fake process group of {world}' if use_fsdp else ''}); optimizer states "
        "created by a warm-up step first, so the measured step is steady state",
        "attention: FlashAttention-2 memory (saves q,k,v,out and fp32 logsumexp; no s^2 scores, "
        "GQA without repeated k/v): the CPU build's flash kernel is forced (the SDPA math path "
        "and eager attention would materialise s^2 scores) and its (b,h,s,d) output is laid out "
        "as CUDA FA2 writes it (saves one (b,s,h*d) copy per layer); masks, softcap and sliding "
        "windows are applied inside the kernel",
        "eager PyTorch (no torch.compile), HF transformers modelling code, loss via HF "
        f"ForCausalLMLoss ({'fp32 upcast of logits' if setup.loss_upcast else 'no fp32 upcast'}; the output "
        f"{'freed before backward' if setup.loss_impl == 'native' else 'held through the step'}), "
        f"AdamW {getattr(setup, 'optimizer_impl', 'fused')}"
        + ("; torch.autocast over fp32 parameters (no FSDP MixedPrecisionPolicy)"
           if setup.precision == "bf16-mixed" and setup.autocast_fp32_params else "")
        + ("; embeddings and head sharded as FSDP units of their own" if setup.shard_embeddings and use_fsdp else ""),
        "tensor sizes rounded to the CUDA caching allocator's 512 B blocks; fragmentation and "
        "non-tensor terms from memory_constants.yaml",
    ]
    unsimulated = _unsimulated(setup, use_fsdp)
    if unsimulated:
        out.append("not simulated (the analytic estimate models them): " + ", ".join(unsimulated))
    if setup.compile:
        out.append(
            "torch.compile: only the loss is modelled as compiled (fused cross-entropy keeping "
            "bf16 logits + fp32 log-sum-exp); the blocks run eager (overestimate of fused "
            "intermediates)"
        )
    if int(getattr(setup, "grad_accumulation_steps", 1) or 1) > 1:
        out.append("gradient accumulation: gradients stay allocated through the forward")
    if getattr(setup, "activation_offloading", False):
        out.append(
            "activation offloading (torchtune-style saved-tensor hooks): saved activations leave "
            "the GPU after use and return for backward; prefetch buffers in flight not counted"
        )
    if setup.chunked_cross_entropy:
        out.append(
            "chunked cross-entropy as torchtune's CEWithChunkedOutputLoss: bf16 logits of the whole "
            "sequence, fp32 upcast per chunk (chunks from memory_constants.yaml)"
        )
    return out


@dataclass
class _Measured:
    """What one simulated step measured (bytes; `untracked`: parameters outside FSDP's view)."""

    peak: dict
    state_local: int
    state_global: int
    param_global: int
    grad_global: int
    grad_local: int
    trainable: int
    untracked: int
    elapsed: float


def _tracker_for(step: Any, use_fsdp: bool) -> Any:
    plain_tracker, fsdp_tracker = _tracker_classes()
    if use_fsdp:
        tracker = fsdp_tracker(step.model, step.opt)
        tracker.track_inputs((step.ids, step.labels))
    else:
        tracker = plain_tracker()
        tracker.track_external(step.model, step.opt, step.ids, step.labels)
    tracker.head = step.model.get_output_embeddings()
    tracker.body = step.model.get_decoder()
    return tracker


def _measure(step: Any, setup: TrainSetup, use_fsdp: bool, report: Progress, t_start: float) -> _Measured:
    """Warm the optimizer up, then run one tracked step and read its peak and the states' sizes."""
    import torch

    grad_accum = int(getattr(setup, "grad_accumulation_steps", 1) or 1)
    step.warm_up_optimizer(keep_grads=grad_accum > 1)
    tracker = _tracker_for(step, use_fsdp)
    hooks = _progress_hooks(step.layers, report)
    report("forward", 0.15)
    with tracker:
        step.run(report)
    for h in hooks:
        h.remove()
    states = [v for st in step.opt.state.values() for v in st.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    # Parameters left out of FSDP (a replicated NF4 base) are not FSDP state, so the
    # FSDP tracker does not see them; they are live the whole step, so add them whole.
    untracked = sum(
        _local_bytes(m.weight) for m in step.model.modules()
        if use_fsdp and type(m).__name__ == "NF4Linear" and getattr(setup, "qlora_base_replicated", False)
    )
    return _Measured(
        peak=tracker.get_tracker_snapshot("peak"),
        state_local=sum(_local_bytes(v) for v in states), state_global=sum(_global_bytes(v) for v in states),
        param_global=sum(_global_bytes(p) for p in step.model.parameters()),
        grad_global=sum(_global_bytes(p) for p in step.params),  # grads take the param dtype
        grad_local=sum(_local_bytes(p) for p in step.params), trainable=step.trainable, untracked=untracked,
        elapsed=time.monotonic() - t_start)


def _simulate(arch: Any, setup: TrainSetup, assumptions: list[str], report: Progress, world: int,
              use_fsdp: bool) -> _Measured:
    """Build and run the step on fake tensors, on a fake process group when FSDP shards it."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created_pg = False
    if use_fsdp:
        if dist.is_initialized():
            raise GpuprovError(
                "precise mode needs its own fake process group: run it outside a distributed job"
            )
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
        created_pg = True
    try:
        mesh = init_device_mesh("cpu", (world,)) if use_fsdp else None  # outside fake mode
        t_start = time.monotonic()
        report("building model", 0.02)
        with FakeTensorMode(), _cuda_allocator_rounding(), warnings.catch_warnings():
            # transformers deprecation chatter from checkpoint wrappers is not the user's concern
            warnings.simplefilter("ignore", FutureWarning)
            step = build_step(arch, setup, assumptions, mesh=mesh)
            report("optimizer warm-up", 0.1)
            return _measure(step, setup, use_fsdp, report, t_start)
    finally:
        if created_pg:
            dist.destroy_process_group()


def _estimate(m: _Measured, setup: TrainSetup, world: int, use_fsdp: bool, assumptions: list[str],
              gpu_memory_bytes: int | None) -> MemoryEstimate:
    """The measured peak as the analytic model's terms, with the non-tensor terms added."""
    breakdown = _breakdown_from_peak(m.peak, m.state_local)
    if m.untracked:
        breakdown["parameters"] = breakdown.get("parameters", 0) + m.untracked
        assumptions.append(f"qlora: NF4 base replicated on every GPU (left out of FSDP), {gib(m.untracked, 2)}")
    breakdown = _apply_sharding_outside_fsdp(breakdown, setup, m.grad_local, assumptions)
    breakdown = _apply_offload(breakdown, setup, assumptions)
    breakdown.update(_overhead_terms(setup, sum(breakdown.values()), assumptions))
    if use_fsdp and setup.offload == "none":
        # FSDP2 allocates the sharded gradients (reduce-scatter outputs) on its reduce-scatter
        # stream; zero_grad frees them into that stream's cache, which the compute stream's
        # activations cannot reuse, so the blocks stay reserved through the next forward.
        held = max(0, m.grad_local - breakdown.get("gradients", 0))
        if held:
            breakdown["allocator_fragmentation"] = breakdown.get("allocator_fragmentation", 0) + held
            assumptions.append(
                f"allocator: {gib(held, 2)} of freed sharded gradients stay cached on "
                "FSDP's reduce-scatter stream (reserved, not reusable by activations)"
            )
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    replicas = max(1, setup.gpus // world)
    if setup.sharding == "zero1":
        states_all = (m.param_global + m.grad_global) * setup.gpus + m.state_global
    elif setup.sharding == "zero2":
        states_all = m.param_global * setup.gpus + m.grad_global + m.state_global
    else:
        states_all = (m.param_global + m.grad_global + m.state_global) * replicas
    assumptions.append(f"simulated in {m.elapsed:.1f} s on CPU")
    per_gpu = sum(breakdown.values())
    if gpu_memory_bytes is not None:
        verdict = "fits" if per_gpu <= gpu_memory_bytes else "does not fit"
        assumptions.append(f"{verdict}: {gib(per_gpu, 2)} of {gib(gpu_memory_bytes, 2)}")
    return MemoryEstimate(per_gpu_bytes=per_gpu, breakdown=breakdown, model_states_bytes=int(states_all),
                          trainable_params=int(m.trainable), assumptions=tuple(assumptions))


def estimate_precise(
    arch: Any,
    setup: TrainSetup,
    gpu_memory_bytes: int | None = None,
    progress: Progress | None = None,
) -> MemoryEstimate:
    """Peak memory of one GPU from a simulated training step (see the module docstring)."""
    _validate(arch, setup)
    _require_torch(setup)
    report: Progress = progress or (lambda stage, fraction: None)
    report("loading torch", 0.0)

    import torch

    world = _shard_world(setup)
    use_fsdp = setup.sharding in ("fsdp", "hsdp")
    assumptions = _assumptions(setup, world, use_fsdp, torch.__version__)
    measured = _simulate(arch, setup, assumptions, report, world, use_fsdp)
    estimate = _estimate(measured, setup, world, use_fsdp, assumptions, gpu_memory_bytes)
    report("done", 1.0)
    return estimate


def _breakdown_from_peak(peak: dict, state_local: int) -> dict[str, int]:
    """Map the tracker's peak snapshot (one device) to breakdown terms."""
    out: dict[str, int] = {}
    for dev_snap in peak.values():
        for reftype, nbytes in dev_snap.items():
            key = getattr(reftype, "value", reftype)
            if key == "Total" or not nbytes:
                continue
            term = _TERM_OF_REFTYPE.get(key, "activations")
            out[term] = out.get(term, 0) + nbytes
    # The tracker lumps the foreach step's temporaries with the states; split them.
    opt = out.get("optimizer_states", 0)
    if opt > state_local:
        out["optimizer_states"] = state_local
        out["optimizer_step_transient"] = opt - state_local
    return out


def _apply_sharding_outside_fsdp(
    bd: dict[str, int], setup: TrainSetup, grad_bytes: int, notes: list[str]
) -> dict[str, int]:
    """ddp / zero1 / zero2 run unsharded in the simulation; apply their partitioning here."""
    n = setup.gpus
    bd = dict(bd)
    if setup.sharding == "ddp" and n > 1:
        # DDP's reducer allocates flat buckets holding a copy of every gradient at construction
        # (gradient_as_bucket_view=False, the default); they live for the whole run.
        bd["comm_buckets"] = grad_bytes
        notes.append("ddp: gradient buckets = one more copy of the gradients (PyTorch default)")
    elif setup.sharding in ("zero1", "zero2") and n > 1:
        for term in ("optimizer_states", "optimizer_step_transient") + (
            ("gradients",) if setup.sharding == "zero2" else ()
        ):
            if term in bd:
                bd[term] = math.ceil(bd[term] / n)
        notes.append(
            f"{setup.sharding}: simulated unsharded, then optimizer states"
            f"{' and gradients' if setup.sharding == 'zero2' else ''} divided by {n} GPUs"
        )
    return bd


def _apply_offload(bd: dict[str, int], setup: TrainSetup, notes: list[str]) -> dict[str, int]:
    bd = dict(bd)
    if setup.offload == "optimizer":
        bd.pop("optimizer_states", None)
        bd.pop("optimizer_step_transient", None)
        notes.append("offload optimizer: states and the step run on the host (not in GPU memory)")
    elif setup.offload == "full":
        for term in ("optimizer_states", "optimizer_step_transient", "parameters", "gradients"):
            bd.pop(term, None)
        notes.append(
            "offload full: sharded parameters, gradients and optimizer states live on the host; "
            "the GPU holds unsharded layers and activations"
        )
    return bd


def _overhead_terms(setup: TrainSetup, tensor_bytes: int, notes: list[str]) -> dict[str, int]:
    """Non-tensor terms, computed from memory_constants.yaml exactly as the analytic model does."""
    c = _constants()
    alloc = c["allocator"]
    frac = alloc["fragmentation_compiled"] if setup.compile else alloc["fragmentation_eager"]
    terms = {
        "allocator_fragmentation": int(tensor_bytes * frac),
        "cuda_context": int(c["cuda_context"]["bytes"]),
    }
    if setup.gpus > 1:
        nc = c["nccl"]
        terms["nccl_buffers"] = int(
            nc["buffsize_bytes"] * nc["channels"] * nc["connections_per_channel"] * nc["protocol_factor"]
        )
    notes.append(
        f"non-tensor terms from memory_constants.yaml: allocator fragmentation +{frac:.0%} of live "
        "tensors, CUDA context" + (", NCCL buffers" if setup.gpus > 1 else "")
    )
    return terms
