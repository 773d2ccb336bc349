"""Precise mode's training step: the model built from its config under the current tensor mode,
wrapped as the run wraps it (LoRA, NF4, activation checkpointing, FSDP2), with its optimizer.

torch, transformers and peft are imported inside functions: `gpuprov plan` never pays for them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from gpuprov.errors import GpuprovError
from gpuprov.sizing.precise_kernels import (
    _ATTN_IMPL, _adamw8bit_class, _constants, _cross_entropy_loss, _offload_saved_activations,
    _quantize_frozen_linears, _register_attention,
)
from gpuprov.sizing.types import TrainSetup

Progress = Callable[[str, float], None]

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
