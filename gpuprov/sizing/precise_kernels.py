"""Precise mode's stand-ins for GPU kernels on the CPU build: FlashAttention-2's memory layout,
bitsandbytes NF4 storage and 8-bit AdamW states, a fused cross-entropy and activation offloading.

torch, transformers and peft are imported inside functions: `gpuprov plan` never pays for them.
"""

from __future__ import annotations

import math

from gpuprov.catalog import load_data

# bitsandbytes 8-bit optimizers keep fp32 states for tensors under min_8bit_size elements
# (bnb.optim.Optimizer8bit default). NF4 and 8-bit block sizes come from memory_constants.yaml.
_BNB8_MIN_SIZE = 4096

_ATTN_IMPL = "gpuprov_fa2"  # no "flash" in the name: HF would look for a hub kernel


def _constants() -> dict:
    return load_data("memory_constants.yaml")

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
