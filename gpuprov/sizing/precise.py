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
import math
import time
import warnings
from typing import Any, Callable

from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import MemoryEstimate, TrainSetup

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

# bitsandbytes 8-bit optimizers keep fp32 states for tensors under min_8bit_size elements
# (bnb.optim.Optimizer8bit default). NF4 and 8-bit block sizes come from memory_constants.yaml.
_BNB8_MIN_SIZE = 4096

_ATTN_IMPL = "gpuprov_fa2"  # no "flash" in the name: HF would look for a hub kernel

# Wall time of a simulation: fake tensors cost per op, not per byte, so time ~ decoder layers.
# Measured on a shared 2-core machine (benchmarks/precise_grid.py prints each run's seconds):
# Llama-2-7B FSDP 8 GPUs seq 4096 took 23 s (full AC) to 59 s (selective AC, incl. imports),
# Llama-3.2-1B 5-17 s; first use in a process also pays ~10 s to import transformers and peft.
_SECONDS_BASE = 5.0
_SECONDS_IMPORT = 10.0
_SECONDS_PER_LAYER = 0.6
_SECONDS_FACTORS = {"selective": 1.5, "lora": 1.8, "qlora": 1.8, "sharded": 1.2}


def _require_torch(setup: TrainSetup) -> None:
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


# --------------------------------------------------------------------------------------------
# Attention: FlashAttention-2 memory behaviour on the CPU build
# --------------------------------------------------------------------------------------------

def _register_attention() -> None:
    """Register an HF attention implementation that behaves like FlashAttention-2 in memory.

    The CPU build has no CUDA kernels. HF's `sdpa` path on CPU happens to pick PyTorch's CPU flash
    kernel (O(s) memory: saves q, k, v, out and a (b, h, s) fp32 logsumexp, GQA without repeating
    k/v), but (1) any attention mask (padding, sliding window) or a softcap sends it to the math
    path or eager attention, which materialise (b, h, s, s) scores, and (2) the CPU kernel returns
    out in (b, h, s, d) layout, so HF's transpose().contiguous() copies it and the copy is saved
    for o_proj: a (b, s, h*d) tensor per layer that CUDA FA2 (which writes (b, s, h, d)) never has.
    This function forces the flash kernel with is_causal=True (no mask tensor) and hands back the
    output in the CUDA layout, so neither the s^2 scores nor the extra copy appear.
    """
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    if _ATTN_IMPL in AttentionInterface._global_mapping:
        return

    aten = torch.ops.aten

    class _FlashCPU(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale):  # q: (b, h, s, d); k, v: (b, kvh, s, d)
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, True, scale=scale
            )
            # CUDA FA2 layout: (b, s, h, d) memory; the (b, h, s, d) CPU buffer dies here.
            out_bshd = out.transpose(1, 2).contiguous()
            del out
            ctx.scale = scale
            ctx.save_for_backward(q, k, v, out_bshd, lse)
            return out_bshd

        @staticmethod
        def backward(ctx, grad_bshd):
            q, k, v, out_bshd, lse = ctx.saved_tensors
            dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_bshd.transpose(1, 2), q, k, v, out_bshd.transpose(1, 2), lse,
                0.0, True, scale=ctx.scale,
            )
            return dq, dk, dv, None

    def flash_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        # Masks (padding, sliding window) and softcap are ignored: FA2 applies them inside the
        # kernel without extra memory; only the memory behaviour matters here.
        # Autocast runs SDPA in the low-precision dtype (CUDA and CPU lists); a custom Function
        # is not autocast, so cast as it would.
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else value.dtype
        query, key, value = (t.to(dtype) for t in (query, key, value))
        return _FlashCPU.apply(query, key, value, scaling), None

    AttentionInterface.register(_ATTN_IMPL, flash_forward)
    AttentionMaskInterface.register(_ATTN_IMPL, flash_attention_mask)


# --------------------------------------------------------------------------------------------
# QLoRA: NF4 storage of frozen base weights
# --------------------------------------------------------------------------------------------

def nf4_bytes(numel: int) -> int:
    """Bytes bitsandbytes NF4 with double quantisation stores for `numel` weights: 4-bit codes,
    an 8-bit absmax per block, an fp32 scale per double-quant block of absmax values."""
    q = _constants()["nf4"]
    blocks = math.ceil(numel / q["blocksize"])
    return (
        math.ceil(numel * q["weight_bits"] / 8)
        + blocks * q["double_quant_absmax_bytes"]
        + q["double_quant_scale_bytes"] * math.ceil(blocks / q["double_quant_blocksize"])
    )


def _nf4_linear_class():
    import torch
    from torch import nn

    class _Dequant4bit(torch.autograd.Function):
        """bnb MatMul4Bit: dequantise to the compute dtype for the matmul, keep only the packed
        weight for backward, dequantise again there (no weight gradient: the base is frozen)."""

        @staticmethod
        def forward(ctx, x, packed, shape):
            w = torch.empty(shape, dtype=x.dtype, device=x.device)  # transient dequantised weight
            y = x @ w.t()
            ctx.shape = shape
            ctx.save_for_backward(packed)
            return y

        @staticmethod
        def backward(ctx, grad_y):
            w = torch.empty(ctx.shape, dtype=grad_y.dtype, device=grad_y.device)
            return grad_y @ w, None, None

    class NF4Linear(nn.Module):
        """A frozen Linear whose weight is stored as NF4 + double-quant scales.

        The packed storage is kept in the frozen dtype (bnb_4bit_quant_storage, as FSDP QLoRA
        recipes set it) so FSDP2 shards it like any parameter; its byte count is `nf4_bytes`.
        """

        def __init__(self, linear: nn.Linear, storage_dtype):
            super().__init__()
            self.in_features = linear.in_features
            self.out_features = linear.out_features
            numel = self.in_features * self.out_features
            esize = torch.empty((), dtype=storage_dtype).element_size()
            packed = torch.empty(math.ceil(nf4_bytes(numel) / esize), dtype=storage_dtype,
                                 device=linear.weight.device)
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.bias = linear.bias

        def forward(self, x):
            y = _Dequant4bit.apply(x, self.weight, (self.out_features, self.in_features))
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y

    return NF4Linear


def _quantize_frozen_linears(model, storage_dtype) -> int:
    """Replace every frozen nn.Linear inside the decoder layers by NF4Linear (lm_head stays)."""
    from torch import nn

    nf4 = _nf4_linear_class()
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (
                type(child) is nn.Linear
                and ".layers." in f".{full}"
                and not child.weight.requires_grad
            ):
                setattr(module, child_name, nf4(child, storage_dtype))
                replaced += 1
    return replaced


# --------------------------------------------------------------------------------------------
# 8-bit AdamW (bitsandbytes) state sizes
# --------------------------------------------------------------------------------------------

def _adamw8bit_class():
    import torch

    class AdamW8bitSim(torch.optim.Optimizer):
        """Memory model of bnb.optim.AdamW8bit: two uint8 states + fp32 absmax per block
        (fp32 states under 4096 elements); the fused kernel updates in place (no transient).
        The update arithmetic is plain SGD-like: only the bytes are simulated."""

        def __init__(self, params, lr=1e-4):
            super().__init__(params, {"lr": lr})

        @torch.no_grad()
        def step(self, closure=None):
            block = _constants()["adamw_8bit"]["blocksize"]
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = self.state[p]
                    if not state:
                        if p.numel() < _BNB8_MIN_SIZE:
                            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
                            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
                        else:
                            blocks = math.ceil(p.numel() / block)
                            state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                            state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                            state["absmax1"] = p.new_zeros(blocks, dtype=torch.float32)
                            state["absmax2"] = p.new_zeros(blocks, dtype=torch.float32)
                    p.add_(p.grad, alpha=-group["lr"])

    return AdamW8bitSim


# --------------------------------------------------------------------------------------------
# The simulation
# --------------------------------------------------------------------------------------------

def _build_config(arch: Any, setup: TrainSetup):
    import copy

    from transformers import AutoConfig

    # Deep copy: transformers rewrites nested dicts such as rope_scaling in place, and the
    # caller's arch (a preset or a config.json) goes on to be rendered into plans and bundles.
    cfg = copy.deepcopy(dict(arch.hf_config))
    model_type = cfg.pop("model_type")
    for key in ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path",
                "auto_map", "quantization_config"):
        cfg.pop(key, None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except (ValueError, TypeError, KeyError) as exc:
        raise GpuprovError(f"cannot build a {model_type!r} model from its config: {exc}") from None
    config.use_cache = False
    config._attn_implementation = _ATTN_IMPL
    return config


def _decoder_layers(model):
    """The ModuleList of decoder layers (HF CausalLM.model.layers, also under a peft wrapper)."""
    from torch import nn

    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module) > 0:
            return module
    raise GpuprovError("precise mode: found no decoder layers in the model")


def _selective_policy(meta: dict):
    """torchtitan's op-level SAC: keep matmul (every other one) and attention outputs, recompute
    the rest (norms, activations, rotary, elementwise)."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        key = f"{mode}_mm_count"
        if func == aten.mm.default:
            meta[key] = meta.get(key, 0) + 1
        keep = func in save and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _apply_ac(layers, mode: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for i, layer in enumerate(layers):
        if mode == "full":
            layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
        elif mode == "selective":
            def ctx_fn():  # fresh mm counter per layer call, shared by forward and recompute
                return create_selective_checkpoint_contexts(_selective_policy({}))

            layers[i] = checkpoint_wrapper(layer, context_fn=ctx_fn, preserve_rng_state=False)


def _progress_hooks(layers, report: Progress):
    """Per-layer progress through forward (0.15..0.5) and backward (0.5..0.9)."""
    n = len(layers)
    handles = []
    done_fwd = set()

    def make(i):
        def pre_hook(module, args):
            if i not in done_fwd:
                done_fwd.add(i)
                report("forward", 0.15 + 0.35 * (i + 1) / n)

        def post_hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if getattr(out, "requires_grad", False):
                out.register_hook(lambda g: report("backward", 0.5 + 0.4 * (n - i) / n))

        return pre_hook, post_hook

    for i, layer in enumerate(layers):
        pre, post = make(i)
        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles


def _add_lora(model, setup: TrainSetup, dtype_frozen, dtype_store, notes: list[str]):
    """peft LoRA on the meta model; QLoRA also swaps frozen decoder Linears for NF4 storage."""
    from peft import LoraConfig, get_peft_model

    model.requires_grad_(False)
    model.to(dtype_frozen)
    lcfg = LoraConfig(
        r=setup.lora_rank, lora_alpha=2 * setup.lora_rank, lora_dropout=0.0,
        target_modules=list(setup.lora_targets), bias="none",
    )
    model = get_peft_model(model, lcfg, autocast_adapter_dtype=False)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(dtype_store)
    name = lambda d: str(d).split(".")[-1]  # noqa: E731
    notes.append(
        f"LoRA via peft: rank {setup.lora_rank}, targets {','.join(setup.lora_targets)}, "
        f"dropout 0; frozen base weights in {name(dtype_frozen)}, adapters in {name(dtype_store)}"
    )
    if setup.task == "qlora":
        n = _quantize_frozen_linears(model, dtype_frozen)
        notes.append(
            f"QLoRA: {n} frozen decoder Linear weights stored as NF4 + double-quant scales "
            "(~0.516 B/param; bnb quant_storage in the frozen dtype so FSDP2 shards it), "
            "dequantised per matmul (transient), embeddings and lm_head unquantised"
        )
    return model


def _materialize(model) -> None:
    """Replace meta parameters/buffers by CPU tensors: fake inside FakeTensorMode, real (and
    uninitialised: memory is what matters) outside. Tied parameters stay tied."""
    import torch
    from torch import nn

    memo: dict[int, Any] = {}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                memo[id(p)] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="cpu"), requires_grad=p.requires_grad
                )
            module._parameters[key] = memo[id(p)]
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _global_bytes(t) -> int:
    return t.numel() * t.element_size()


class Step:
    """A training step ready to run: model, optimizer, batch (fake or real tensors)."""

    def __init__(self, model, layers, opt, params, ids, labels, autocast, trainable: int,
                 offload_activations: bool = False, keep_outputs: bool = False):
        self.model, self.layers, self.opt, self.params = model, layers, opt, params
        self.ids, self.labels, self.autocast, self.trainable = ids, labels, autocast, trainable
        self.offload_activations = offload_activations
        self.keep_outputs = keep_outputs  # the loop holds the model output (logits) through the step

    def warm_up_optimizer(self, keep_grads: bool = False) -> None:
        """Create optimizer states (and DTensor sharding caches) with one step on zero grads.
        keep_grads: leave the gradients allocated, as in gradient accumulation, where the
        measured micro-batch runs with the previous micro-batches' gradients alive."""
        import torch

        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt.step()
        if not keep_grads:
            self.opt.zero_grad(set_to_none=True)

    def run(self, report: Progress | None = None) -> None:
        """forward, backward, optimizer step, zero_grad(set_to_none): one steady-state step."""
        report = report or (lambda stage, fraction: None)
        offload = _offload_saved_activations() if self.offload_activations else contextlib.nullcontext()
        with self.autocast, offload:
            out = self.model(input_ids=self.ids, labels=self.labels)
        loss = out.loss
        if not self.keep_outputs:
            del out  # torchtitan / torchtune / HF Trainer: only the loss survives the forward
        report("backward", 0.5)
        loss.backward()
        del loss
        report("optimizer step", 0.92)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _fused_cross_entropy_class():
    import torch

    class FusedChunkCE(torch.autograd.Function):
        """What a compiled (fused) cross-entropy keeps: the low-precision logits and one fp32
        log-sum-exp per token; the fp32 softmax is rebuilt in backward one chunk at a time."""

        @staticmethod
        def forward(ctx, logits, labels):  # logits (b, c, V), labels (b, c)
            lse = torch.logsumexp(logits.float(), dim=-1)  # the fp32 chunk lives only here
            picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
            ctx.save_for_backward(logits, labels, lse)
            return (lse - picked).sum()

        @staticmethod
        def backward(ctx, grad_out):
            logits, labels, lse = ctx.saved_tensors
            # one fp32 chunk-sized buffer, updated in place as a fused kernel would
            grad = logits.float()
            grad.sub_(lse.unsqueeze(-1)).exp_()
            grad.scatter_add_(-1, labels.unsqueeze(-1), -torch.ones_like(lse).unsqueeze(-1))
            grad.mul_(grad_out)
            return grad.to(logits.dtype), None

    return FusedChunkCE


def _cross_entropy_loss(chunks: int, fused: bool, upcast: bool = True):
    """An HF loss_function: eager chunked CE (torchtune CEWithChunkedOutputLoss: fp32 upcast per
    chunk, every chunk's log-softmax saved) or, for torch.compile, a fused CE per chunk."""

    def loss_function(logits, labels, vocab_size=None, num_items_in_batch=None,
                      ignore_index: int = -100, **kwargs):
        import torch.nn.functional as F

        # next-token targets as HF shifts them; the padded last position is clamped to a valid
        # id (memory is the same, and the fused path indexes with it)
        labels = F.pad(labels, (0, 1), value=0)[..., 1:]
        total = None
        fused_ce = _fused_cross_entropy_class() if fused else None
        for lc, yc in zip(logits.chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
            if fused_ce is not None:
                part = fused_ce.apply(lc, yc)
            else:
                part = F.cross_entropy((lc.float() if upcast else lc).flatten(0, 1), yc.flatten(), reduction="sum")
            total = part if total is None else total + part
        return total / labels.numel()

    return loss_function


def _offload_saved_activations():
    """torchtune-style activation offloading: saved activations leave the GPU after the forward
    uses them and come back for their backward. Simulated by keeping only the shape: the tensor
    is freed at pack time and re-allocated at unpack (the host-to-device copy's destination)."""
    import torch

    def pack(t):
        if isinstance(t, torch.nn.Parameter) or t.numel() < 2**12:
            return t  # weights and small tensors stay (torchtune skips them too)
        return (t.shape, t.dtype, t.device)

    def unpack(packed):
        if isinstance(packed, tuple):
            shape, dtype, device = packed
            return torch.empty(shape, dtype=dtype, device=device)
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def build_step(arch: Any, setup: TrainSetup, notes: list[str], mesh=None) -> Step:
    """Build the configured model and optimizer in the current tensor mode.

    Inside FakeTensorMode the tensors are fake; outside they are real CPU tensors (the tests
    run the same step for real to check the simulation against measured allocations).
    `mesh` (a DeviceMesh) turns on FSDP2 fully_shard per decoder layer and at the root.
    """
    import torch
    from transformers import AutoModelForCausalLM

    _register_attention()
    config = _build_config(arch, setup)
    lowp = torch.bfloat16
    dtype_store = torch.float32 if setup.precision in ("bf16-mixed", "fp32") else lowp
    # Frozen weights of LoRA/QLoRA need no fp32 master: stored in bf16 unless the run is fp32.
    fp32_autocast = setup.precision == "bf16-mixed" and setup.autocast_fp32_params
    dtype_frozen = torch.float32 if (setup.precision == "fp32" or fp32_autocast) else lowp
    # Build (and adapt) on the meta device outside any fake mode, then materialise: peft and
    # Module.to() cannot move fake parameters (swap_tensors refuses their weak references).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype_store)
        if setup.task in ("lora", "qlora"):
            model = _add_lora(model, setup, dtype_frozen, dtype_store, notes)
    _materialize(model)
    if setup.chunked_cross_entropy or setup.compile or not setup.loss_upcast:
        chunks = int(_constants()["cross_entropy"]["chunks"]) if setup.chunked_cross_entropy else 1
        getattr(model, "get_base_model", lambda: model)().loss_function = _cross_entropy_loss(
            chunks, fused=setup.compile, upcast=setup.loss_upcast
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = _decoder_layers(model)
    _apply_ac(layers, setup.activation_checkpointing)
    if mesh is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {"mesh": mesh}
        if setup.precision == "bf16-mixed" and not fp32_autocast:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=lowp, reduce_dtype=torch.float32)
        if setup.task == "qlora" and getattr(setup, "qlora_base_replicated", False):
            # gpuprov's trainer leaves the NF4 base out of FSDP (it cannot shard bitsandbytes
            # weights): every GPU holds all of it, so simulate the same.
            kwargs["ignored_params"] = {m.weight for m in model.modules() if type(m).__name__ == "NF4Linear"}
        for layer in layers:
            fully_shard(layer, **kwargs)
        if setup.shard_embeddings and not getattr(config, "tie_word_embeddings", False):
            # torchtitan / torchtune: embeddings and output head are FSDP units of their own
            fully_shard(model.get_input_embeddings(), **kwargs)
            fully_shard(model.get_output_embeddings(), **kwargs)
        fully_shard(model, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    if setup.optimizer == "adamw":
        # fused (the analytic model's default) updates in place; foreach, PyTorch's default for
        # CUDA tensors, holds one extra state-sized buffer (sqrt of exp_avg_sq) at the step.
        impl = getattr(setup, "optimizer_impl", "fused")
        if impl not in ("fused", "foreach"):
            raise GpuprovError(f"optimizer implementation {impl!r} is not one of fused, foreach")
        opt = torch.optim.AdamW(params, lr=1e-4, fused=impl == "fused", foreach=impl == "foreach")
    else:
        opt = _adamw8bit_class()(params, lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (setup.micro_batch, setup.seq_len))
    labels = ids.clone()
    # Without FSDP, bf16-mixed is PyTorch AMP (fp32 weights, autocast casts; the cast weights
    # are cached and saved for backward). With FSDP2 the MixedPrecisionPolicy does the casts.
    amp = (
        torch.autocast("cpu", dtype=lowp)
        if setup.precision == "bf16-mixed" and (mesh is None or fp32_autocast)
        else contextlib.nullcontext()
    )
    return Step(model, layers, opt, params, ids, labels, amp, trainable,
                offload_activations=bool(setup.activation_offloading), keep_outputs=setup.loss_impl != "native")


def _tracker_classes():
    """(MemTracker, FSDPMemTracker) subclasses tuned for this use.

    - Only the global peak is kept: upstream also updates every tracked module's local peak on
      every op, O(ops x modules), which dominates the run time with peft's many small modules.
    - MemTracker skips gradient hooks on frozen parameters (upstream hooks every parameter,
      which raises for LoRA's requires_grad=False base weights).
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    import torch

    _TO_COPY = torch.ops.aten._to_copy.default

    def update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)

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
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = _shard_world(setup)
    use_fsdp = setup.sharding in ("fsdp", "hsdp")
    assumptions: list[str] = [
        "precise: one forward+backward+AdamW step simulated on fake tensors (torch "
        f"{torch.__version__}, FakeTensorMode + {'FSDPMemTracker' if use_fsdp else 'MemTracker'}"
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
        assumptions.append("not simulated (the analytic estimate models them): " + ", ".join(unsimulated))
    if setup.compile:
        assumptions.append(
            "torch.compile: only the loss is modelled as compiled (fused cross-entropy keeping "
            "bf16 logits + fp32 log-sum-exp); the blocks run eager (overestimate of fused "
            "intermediates)"
        )
    if int(getattr(setup, "grad_accumulation_steps", 1) or 1) > 1:
        assumptions.append("gradient accumulation: gradients stay allocated through the forward")
    if getattr(setup, "activation_offloading", False):
        assumptions.append(
            "activation offloading (torchtune-style saved-tensor hooks): saved activations leave "
            "the GPU after use and return for backward; prefetch buffers in flight not counted"
        )
    if setup.chunked_cross_entropy:
        assumptions.append(
            "chunked cross-entropy as torchtune's CEWithChunkedOutputLoss: bf16 logits of the whole "
            "sequence, fp32 upcast per chunk (chunks from memory_constants.yaml)"
        )

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
            grad_accum = int(getattr(setup, "grad_accumulation_steps", 1) or 1)
            step.warm_up_optimizer(keep_grads=grad_accum > 1)
            plain_tracker, fsdp_tracker = _tracker_classes()
            if use_fsdp:
                tracker = fsdp_tracker(step.model, step.opt)
                tracker.track_inputs((step.ids, step.labels))
            else:
                tracker = plain_tracker()
                tracker.track_external(step.model, step.opt, step.ids, step.labels)
            tracker.head = step.model.get_output_embeddings()
            tracker.body = step.model.get_decoder()
            hooks = _progress_hooks(step.layers, report)
            report("forward", 0.15)
            with tracker:
                step.run(report)
            for h in hooks:
                h.remove()
            peak = tracker.get_tracker_snapshot("peak")
            states = [
                v for st in step.opt.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ]
            state_local = sum(_local_bytes(v) for v in states)
            state_global = sum(_global_bytes(v) for v in states)
            param_global = sum(_global_bytes(p) for p in step.model.parameters())
            grad_global = sum(_global_bytes(p) for p in step.params)  # grads take the param dtype
            grad_local = sum(_local_bytes(p) for p in step.params)
            trainable = step.trainable
            # Parameters left out of FSDP (a replicated NF4 base) are not FSDP state, so the
            # FSDP tracker does not see them; they are live the whole step, so add them whole.
            untracked = sum(
                _local_bytes(m.weight) for m in step.model.modules()
                if use_fsdp and type(m).__name__ == "NF4Linear" and getattr(setup, "qlora_base_replicated", False)
            )
        elapsed = time.monotonic() - t_start
    finally:
        if created_pg:
            dist.destroy_process_group()

    breakdown = _breakdown_from_peak(peak, state_local)
    if untracked:
        breakdown["parameters"] = breakdown.get("parameters", 0) + untracked
        assumptions.append(f"qlora: NF4 base replicated on every GPU (left out of FSDP), {untracked / 2**30:.2f} GiB")
    breakdown = _apply_sharding_outside_fsdp(breakdown, setup, grad_local, assumptions)
    breakdown = _apply_offload(breakdown, setup, assumptions)
    breakdown.update(_overhead_terms(setup, sum(breakdown.values()), assumptions))
    if use_fsdp and setup.offload == "none":
        # FSDP2 allocates the sharded gradients (reduce-scatter outputs) on its reduce-scatter
        # stream; zero_grad frees them into that stream's cache, which the compute stream's
        # activations cannot reuse, so the blocks stay reserved through the next forward.
        held = max(0, grad_local - breakdown.get("gradients", 0))
        if held:
            breakdown["allocator_fragmentation"] = breakdown.get("allocator_fragmentation", 0) + held
            assumptions.append(
                f"allocator: {held / 2**30:.2f} GiB of freed sharded gradients stay cached on "
                "FSDP's reduce-scatter stream (reserved, not reusable by activations)"
            )
    breakdown = {k: int(v) for k, v in breakdown.items() if v}
    replicas = max(1, setup.gpus // world)
    if setup.sharding == "zero1":
        states_all = (param_global + grad_global) * setup.gpus + state_global
    elif setup.sharding == "zero2":
        states_all = param_global * setup.gpus + grad_global + state_global
    else:
        states_all = (param_global + grad_global + state_global) * replicas
    assumptions.append(f"simulated in {elapsed:.1f} s on CPU")
    per_gpu = sum(breakdown.values())
    if gpu_memory_bytes is not None:
        verdict = "fits" if per_gpu <= gpu_memory_bytes else "does not fit"
        assumptions.append(
            f"{verdict}: {per_gpu / 2**30:.2f} GiB of {gpu_memory_bytes / 2**30:.2f} GiB"
        )
    report("done", 1.0)
    return MemoryEstimate(
        per_gpu_bytes=per_gpu,
        breakdown=breakdown,
        model_states_bytes=int(states_all),
        trainable_params=int(trainable),
        assumptions=tuple(assumptions),
    )


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


def _constants() -> dict:
    from gpuprov.catalog import load_data

    return load_data("memory_constants.yaml")


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
