#!/usr/bin/env python3
"""The GPU day's torchtitan side: pinned torchtitan's own training components on gpuprov's shape.

    python gpu_day_titan.py CONFIG_JSON    # one process; gpu_day.py runs it (CONFIG_JSON: train.yaml as JSON)

What of torchtitan runs (torchtitan 0.3.0, carried as wheels; imports from its package):
  the llama3 model (Llama3Model.Config: its "1B" / "8B" flavour where gpuprov's hf_config is that
  shape, else built with torchtitan's llama3 layer builder from the shape, as its debugmodel is),
  its LoRAConverter / Float8LinearConverter on that config, parallelize_llama (activation
  checkpointing FullAC / SelectiveAC, per-block torch.compile, FSDP2 with its MixedPrecisionPolicy),
  init_weights, its CrossEntropyLoss / ChunkedLossWrapper, its AdamW OptimizersContainer and
  LRSchedulersContainer, and its clip_grad_norm_.
Differences that remain by design: torchtitan keeps LoRA's frozen base in its training dtype (fp32,
cast to bf16 per block by FSDP2) where gpuprov stores it in bf16; torchtitan's llama3 fuses q/k/v into
one wqkv linear (LoRA on q/k/v adapts wqkv); its attention is FlexAttention with block-causal masks
(one document per row: causal), gpuprov's is SDPA.
What this file supplies: the synthetic token batches (one document per row, as gpuprov's side),
and the step loop, which repeats the lines of torchtitan's Trainer.train_step for one micro-batch
(global valid-token count, forward, loss, backward, clip, optimizer and scheduler step). The Trainer
class itself is not used: its module imports tensorboard (through torch.utils.tensorboard), the HF
tokenizer and datasets stack, which a lent machine cannot carry.
On CPU (the dry run) three things differ, all because torchtitan assumes an accelerator: the
process group is gloo and torchtitan's device type is pointed at "cpu"; attention is torchtitan's
ScaledDotProductAttention module (causal), because FlexAttention has no CPU backward; and, where
triton is not installed, the import of torchtitan's expert-parallel triton kernels (a module the dense
llama3 path never calls) is answered by a placeholder whose functions raise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

# the pinned release and the only packages its training path imports beyond torch and numpy
PINS = ("torchtitan==0.3.0", "spmd_types==0.2.3", "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1")
# Hugging Face projection names -> torchtitan's llama3 linears (q/k/v are one fused wqkv there)
LORA_NAMES = {"q_proj": "wqkv", "k_proj": "wqkv", "v_proj": "wqkv", "o_proj": "wo",
              "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
EP_KERNELS = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
              "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
              "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def without_triton() -> None:
    """torchtitan's MoE token dispatcher imports triton kernels at import time; dense llama3 never calls them."""
    if importlib.util.find_spec("triton") is not None:
        return
    mod = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")

    def absent(*_a, **_k):
        raise RuntimeError("torchtitan's expert-parallel kernels need triton")

    for name in EP_KERNELS:
        setattr(mod, name, absent)
    sys.modules[mod.__name__] = mod


def on_cpu() -> None:
    """torchtitan picks "cuda" when no accelerator is found; the dry run's mesh is a gloo one on cpu."""
    import torch
    import torchtitan.distributed.parallel_dims as pdims
    import torchtitan.distributed.utils as dutils
    import torchtitan.tools.utils as tutils

    for m in (tutils, pdims, dutils):
        m.device_type = "cpu"
    tutils.device_module = dutils.device_module = torch.cpu


def flavour_or_shape(hf: dict, cpu: bool):
    """torchtitan's llama3 config for gpuprov's hf_config: its own flavour when the shape is one."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dim, heads, vocab = hf["hidden_size"], hf["num_attention_heads"], hf["vocab_size"]
    tie = bool(hf.get("tie_word_embeddings", False))
    want = (dim, hf["num_hidden_layers"], heads, hf.get("num_key_value_heads", heads), hf["intermediate_size"], vocab, tie)
    cfg, name = None, "shape"
    for flavour, build in llama3.llama3_configs.items():
        c = build(attn_backend="flex")
        att = c.layers[0].attention
        have = (c.dim, len(c.layers), att.n_heads, att.n_kv_heads or att.n_heads,
                c.layers[0].feed_forward.w1.out_features, c.vocab_size, c.enable_weight_tying)
        if have == want:
            cfg, name = c, flavour
    if cfg is None:  # the llama3 debugmodel's recipe at gpuprov's shape (the dry run's tiny model)
        cfg = llama3.Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=tie,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=llama3._EMBEDDING_SKIP_INIT if tie else llama3._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
            layers=llama3._build_llama3_layers(
                n_layers=hf["num_hidden_layers"], dim=dim, n_heads=heads, n_kv_heads=hf.get("num_key_value_heads"),
                hidden_dim=hf["intermediate_size"], attn_backend="flex",
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000, scaling="llama")))
    if cpu:
        for layer in cfg.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg, name


def converted(model_cfg, cfg: dict, compiled: bool):
    """LoRA (gpuprov's rank, alpha and targets) and float8 as gpuprov's config asks, via torchtitan's converters."""
    if cfg["task"]["kind"] == "lora":
        from torchtitan.components.lora import LoRAConverter

        lora = cfg["task"]["lora"]
        targets = sorted({LORA_NAMES.get(t, t) for t in lora["targets"]})
        model_cfg = LoRAConverter.Config(rank=lora["rank"], alpha=lora["alpha"], target_modules=targets).build().convert(model_cfg)
    if cfg["efficiency"]["float8"]:
        from torchtitan.components.quantization import Float8LinearConverter

        model_cfg = Float8LinearConverter.Config(model_compile_enabled=compiled).build().convert(model_cfg)
    return model_cfg


def build(cfg: dict, device):
    """Model, loss, optimizers and schedulers through torchtitan's own builders."""
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.llama3 import parallelize_llama

    cpu = device.type == "cpu"
    compiled = bool(cfg["efficiency"]["compile"]) and not cpu  # gpuprov compiles on CUDA only
    model_cfg, flavour = flavour_or_shape(cfg["model"]["hf_config"], cpu)
    model_cfg = converted(model_cfg, cfg, compiled)
    b, opt = cfg["batch"], cfg["optimizer"]
    mixed = "bfloat16" if cfg["precision"]["param_dtype"] == "bfloat16" else "float32"
    training = TrainingConfig(local_batch_size=b["micro_batch"], seq_len=b["seq_len"], steps=cfg["schedule"]["steps"],
                              max_norm=opt["grad_clip"], dtype="float32", mixed_precision_param=mixed)
    parallelism = ParallelismConfig()
    compile_config = CompileConfig(enable=compiled, components=["model", "loss"])
    ac = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[cfg["parallel"]["activation_checkpointing"]]
    dump = str(Path(cfg["checkpoint"]["dir"]).parent)
    world = dist_utils.init_distributed(CommConfig(trace_buf_size=0), base_folder=dump)
    parallel_dims = ParallelDims.from_config(parallelism, world)
    with torch.device("meta"):
        model = model_cfg.build()
    inner = CrossEntropyLoss.Config(global_vocab_size=model_cfg.vocab_size)
    loss_cfg = ChunkedLossWrapper.Config(loss_fn=inner) if cfg["efficiency"]["chunked_cross_entropy"] else inner
    loss_fn = loss_cfg.build(compile_config=compile_config)
    model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=compile_config, ac_config=ac, dump_folder=dump)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    if isinstance(loss_fn, ChunkedLossWrapper):  # as torchtitan's Trainer wires it
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = default_adamw(lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                               weight_decay=opt["weight_decay"]).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=cfg["schedule"]["warmup_steps"]).build(
        optimizers=optimizers, training_steps=cfg["schedule"]["steps"])
    return model, loss_fn, optimizers, schedulers, flavour


def step_inputs(model, inputs) -> dict:
    """What torchtitan's Trainer.post_dataloading_process adds: the per-document positions its
    dataloaders emit (one document per row here) and, for FlexAttention / varlen, the block-causal masks."""
    import torch
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs).contiguous()
    extra = {"positions": positions}
    inner = getattr(model.config.first_attention, "inner_attention", None)
    if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
        extra["attention_masks"] = model.get_attention_masks(positions=positions)
    return extra


def measure(cfg: dict) -> dict:
    """Steps of torchtitan's Trainer.train_step on synthetic tokens; tokens/s and peak memory."""
    import torch
    import torch.distributed as dist

    without_triton()
    cuda = torch.cuda.is_available() and cfg["runtime"]["device"] != "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        on_cpu()
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    from torchtitan.distributed import utils as dist_utils

    model, loss_fn, optimizers, schedulers, flavour = build(cfg, device)
    b = cfg["batch"]
    vocab = cfg["model"]["hf_config"]["vocab_size"]
    tokens = torch.randint(0, vocab, (b["micro_batch"], b["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    extra = step_inputs(model, inputs)
    params = [p for p in model.parameters()]
    times, losses = [], []
    for _ in range(cfg["schedule"]["steps"]):
        t = time.perf_counter()
        optimizers.zero_grad()
        global_valid_tokens = (labels != -100).sum()
        pred = model(inputs, **extra)
        loss, _ = loss_fn(pred, labels, global_valid_tokens, positions=extra["positions"])
        del pred
        if loss.requires_grad:
            loss.backward()
        dist_utils.clip_grad_norm_(params, cfg["optimizer"]["grad_clip"], foreach=True, pp_mesh=None, ep_enabled=False)
        optimizers.step()
        schedulers.step()
        losses.append(float(loss.detach()))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    rates = [b["micro_batch"] * b["seq_len"] / t for t in times]
    dist.destroy_process_group()
    return {"tokens_per_s": statistics.median(rates[2:] or rates), "flavour": flavour, "loss": losses[-1],
            "reserved": torch.cuda.max_memory_reserved() if cuda else None,
            "allocated": torch.cuda.max_memory_allocated() if cuda else None}


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help") or not Path(sys.argv[1]).is_file():
        print("usage: python gpu_day_titan.py CONFIG_JSON  (train.yaml as JSON; gpu_day.py runs it)", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(measure(json.loads(Path(sys.argv[1]).read_text()))))
