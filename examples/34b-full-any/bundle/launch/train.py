#!/usr/bin/env python3
"""gpuprov's FSDP2 trainer for Hugging Face causal LMs, configured by train.yaml.

Standalone on purpose: the cluster runs it without gpuprov installed. Needs torch >= 2.7
(runtime.min_torch), transformers, numpy, safetensors and PyYAML; peft for LoRA; bitsandbytes
(CUDA) for QLoRA; torchao for float8.

    torchrun --nnodes N --nproc-per-node G ... train.py --config train.yaml [--set batch.seq_len=2048 ...]
    torchrun ... train.py --export-from step-N    # or "latest": write an HF model / PEFT adapter

What it does, in order (the layout follows torchtitan's train.py):
  1. process group + DeviceMesh: 1-D ("shard",) for FULL_SHARD / ZeRO-2, 2-D ("replicate", "shard")
     for HSDP (parameters sharded inside a shard group, replicated across groups)
  2. model from the plan's config on the meta device (or a local pretrained path), LoRA adapters
  3. activation checkpointing, torch.compile and float8 per block, then fully_shard per block, the
     embeddings, the final norm + head, and the root
  4. materialise the shards on the device and initialise, or read pretrained safetensors file by
     file onto the shards (skipped for a full-training resume: the checkpoint has every weight)
  5. AdamW (fused on CUDA), linear warmup + cosine decay, gradient clipping, micro-batches x gradient accumulation
  6. data: memory-mapped shards from prepare_data.py (tokens + loss mask, train/ and val/), raw
     token files, or (data.synthetic: true) a synthetic stream
  7. torch.distributed.checkpoint (async) every N steps and resume (model, optimizer, step, data position)
  8. a log line every N steps: loss, tokens/s, MFU (the planner's formula), peak GPU memory; a
     validation loss every data.validation.every_steps
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import gc
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

GiB = 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ConfigError(SystemExit):
    """A wrong value in train.yaml: one clear line, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"train.py: {message}")


# --------------------------------------------------------------------------------------------
# config


def load_config(path: str, overrides: list[str]) -> dict:
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"--set {key}: no section {part!r} in {path}")
            node = node[part]
        if leaf not in node and parents[:2] != ["model", "hf_config"]:  # a config.json takes any key
            raise ConfigError(f"--set {key}: unknown key {leaf!r} (known: {', '.join(node)})")
        node[leaf] = yaml.safe_load(raw)
    return cfg


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# distributed setup


def check_torch(minimum: str) -> None:
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    want = tuple(int(x) for x in str(minimum).split(".")[:2])
    if have < want:
        raise ConfigError(f"torch {torch.__version__} is older than runtime.min_torch {minimum} "
                          f"(FSDP2 fully_shard(ignored_params=...) first shipped there)")


def configure_backends(cfg: dict) -> None:
    """TF32 tensor cores for fp32 matmuls when the plan sized them (about 7x fp32's rate on H100)."""
    if cfg["precision"].get("tf32"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")


def flight_recorder(rt_cfg: dict) -> None:
    """NCCL flight recorder: the last N collectives per rank, dumped when a collective times out."""
    entries = int(rt_cfg.get("flight_recorder_entries") or 0)
    if entries > 0:
        # renamed TORCH_FR_BUFFER_SIZE in torch 2.8 (the old name still works, with a warning)
        new = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE" if new else "TORCH_NCCL_TRACE_BUFFER_SIZE", str(entries))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if rt_cfg.get("flight_recorder_dir"):
            Path(rt_cfg["flight_recorder_dir"]).mkdir(parents=True, exist_ok=True)
            dump = Path(rt_cfg["flight_recorder_dir"], "nccl_trace_rank_")
            os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(dump))


class GarbageCollection:
    """Python's GC off between steps, one generation-1 pass every N steps, as torchtitan does:
    automatic collections at random points stall one rank and so every rank."""

    def __init__(self, every: int):
        self.every = int(every or 0)
        if self.every > 0:
            gc.disable()
            gc.collect(1)

    def step(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect(1)


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh | None  # None for DDP / single process
    dp_rank: int  # every rank is data-parallel here (no tensor/pipeline parallelism)
    dp_size: int
    shard_rank: int  # coordinate in the shard dimension: replicas of one shard share it

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def model_parallel(cfg: dict):
    """parallel.py beside this file (TP/CP on a 4-D mesh) when train.yaml asks for tp or cp > 1."""
    par = cfg["parallel"]
    if int(par.get("tp", 1)) * int(par.get("cp", 1)) == 1:
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpuprov_parallel", Path(__file__).with_name("parallel.py"))
    module = sys.modules.setdefault("gpuprov_parallel", importlib.util.module_from_spec(spec))
    if not hasattr(module, "runtime"):
        spec.loader.exec_module(module)
    return module


def init_runtime(cfg: dict) -> Runtime:
    want = cfg["runtime"]["device"]
    use_cuda = want == "cuda" or (want == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("runtime.device is cuda but no CUDA device is visible")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if "RANK" in os.environ:
        flight_recorder(cfg["runtime"])
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None,
                                timeout=datetime.timedelta(seconds=float(cfg["runtime"]["pg_timeout_s"])))
    if model_parallel(cfg) is not None:  # TP/CP: launch/parallel.py builds the 4-D mesh
        return model_parallel(cfg).runtime(cfg, Runtime, rank, world, local_rank, device)

    par = cfg["parallel"]
    sharding = par["sharding"]
    replicate, shard = int(par["replicate"]), int(par["shard"])
    mesh, shard_rank = None, 0
    if sharding in ("fsdp", "hsdp", "zero1", "zero2"):
        if replicate * shard != world:
            raise ConfigError(
                f"parallel.replicate {replicate} x parallel.shard {shard} = {replicate * shard} GPUs, "
                f"but torchrun started {world} processes: fix train.yaml or the launch")
        if sharding == "hsdp":
            # Row-major: consecutive ranks (one node's GPUs) form a shard group; replicas span nodes.
            mesh = init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
            shard_rank = mesh.get_local_rank("shard")
        else:
            if replicate != 1:
                raise ConfigError(f"parallel.sharding {sharding} needs parallel.replicate 1, got {replicate}")
            mesh = init_device_mesh(device.type, (shard,), mesh_dim_names=("shard",))
            shard_rank = mesh.get_local_rank("shard")
    elif sharding not in ("ddp", "none"):
        raise ConfigError(f"unknown parallel.sharding {sharding!r}")
    elif sharding == "none" and world != 1:
        raise ConfigError(f"parallel.sharding none runs one process, torchrun started {world}")
    return Runtime(rank, world, local_rank, device, mesh, rank, world, shard_rank)


# --------------------------------------------------------------------------------------------
# model


def build_model(cfg: dict, rt: Runtime) -> tuple[torch.nn.Module, bool]:
    """The HF causal LM, on the meta device unless it must hold real weights now.

    Returns (model, on_meta). Meta construction costs no memory: each rank later materialises only
    its shards, so a 70B model never exists whole on one host.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    mcfg, task = cfg["model"], cfg["task"]["kind"]
    master = DTYPES[cfg["precision"]["master_dtype"]]
    check_attention(mcfg["attn_implementation"])
    if task == "qlora":
        return build_qlora_model(cfg, rt), False
    path = pretrained_path(cfg)
    if path:
        config = AutoConfig.from_pretrained(path)
    else:
        hf = dict(mcfg["hf_config"])
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    config.use_cache = False  # no KV cache in training
    with torch.device("meta"):
        # The plan sizes attention that never stores the s x s scores: ask for it, never eager.
        model = AutoModelForCausalLM.from_config(config, attn_implementation=mcfg["attn_implementation"])
    return model.to(master), True


def pretrained_path(cfg: dict) -> str | None:
    """model.init says where the weights come from; a silent random base is never the default."""
    mcfg, task = cfg["model"], cfg["task"]["kind"]
    init, path = mcfg.get("init", "pretrained"), mcfg.get("pretrained_path")
    if init == "pretrained":
        if not path:
            raise ConfigError("model.init is pretrained but model.pretrained_path is null: set it to a local "
                              "directory with config.json + *.safetensors (or model.init=random to train from scratch)")
        if not Path(path, "config.json").is_file():
            raise ConfigError(f"model.pretrained_path {path!r} has no config.json (a local directory is needed)")
        return path
    if init != "random":
        raise ConfigError(f"model.init must be pretrained or random, got {init!r}")
    if path:
        raise ConfigError(f"model.init is random but model.pretrained_path is {path!r}: set model.init=pretrained")
    if task == "qlora":
        raise ConfigError("task qlora quantises pretrained weights: "
                          "set model.init=pretrained and model.pretrained_path")
    return None


def check_attention(impl: str) -> None:
    if impl == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError as exc:
            raise ConfigError("model.attn_implementation flash_attention_2 needs flash-attn >= 2.6 "
                              "(pip install flash-attn --no-build-isolation)") from exc
    elif impl not in ("sdpa", "eager"):
        raise ConfigError(f"unknown model.attn_implementation {impl!r} (sdpa | flash_attention_2 | eager)")


def cast_frozen(model: torch.nn.Module, cfg: dict) -> None:
    """LoRA: the frozen base in task.frozen_dtype (bf16, as the plan sizes it), adapters in master_dtype."""
    frozen = cfg["task"].get("frozen_dtype")
    if cfg["task"]["kind"] != "lora" or not frozen:
        return
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(DTYPES[frozen])


def dtype_kwarg(dtype: torch.dtype) -> dict:
    """from_pretrained's dtype argument: `dtype` in transformers 5, `torch_dtype` before."""
    import transformers

    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}


def build_qlora_model(cfg: dict, rt: Runtime) -> torch.nn.Module:
    """QLoRA: the base in 4-bit NF4 (double quantisation) from local weights; bitsandbytes is CUDA-only."""
    if not rt.is_cuda:
        raise ConfigError("task qlora needs CUDA: bitsandbytes 4-bit kernels do not run on CPU "
                          "(use task.kind lora to test the adapter path on CPU)")
    path = pretrained_path(cfg)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = DTYPES[cfg["precision"]["param_dtype"]]
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=compute)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, device_map={"": rt.local_rank},
                                                 attn_implementation=cfg["model"]["attn_implementation"],
                                                 **dtype_kwarg(compute))
    model.config.use_cache = False
    return model


def apply_lora(model: torch.nn.Module, cfg: dict) -> torch.nn.Module:
    from peft import get_peft_model

    return get_peft_model(model, lora_config(cfg))


def lora_config(cfg: dict):
    from peft import LoraConfig

    lora = cfg["task"]["lora"]
    targets = lora["targets"]
    return LoraConfig(r=int(lora["rank"]), lora_alpha=int(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                      target_modules="all-linear" if targets == "all-linear" else list(targets),
                      task_type="CAUSAL_LM", base_model_name_or_path=cfg["model"].get("pretrained_path"))


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder-layer list (model.model.layers in Llama-style models, also under a peft wrapper)."""
    lists = [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
             and name.split(".")[-1] in ("layers", "h", "blocks")]
    if not lists:
        raise ConfigError(f"cannot find the transformer blocks of {type(model).__name__}")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def selective_ac_context():
    """Op-level selective checkpointing, torchtitan's policy (and what gpuprov's estimate assumes).

    Inside each block: keep the block input, the attention kernel's output and every other
    matmul output; recompute the rest (norms, RoPE, activations, the other matmuls) in backward.
    Called once per block forward, so the matmul count restarts for each block.
    """
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = ["mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    mm = aten.mm.default
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[key] += 1
        keep = func in save and not (func == mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(blocks: torch.nn.ModuleList, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    if mode == "full":
        wrap = partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False)
    elif mode == "selective":
        wrap = partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False,
                       context_fn=selective_ac_context)
    else:
        raise ConfigError(f"unknown parallel.activation_checkpointing {mode!r}")
    for i, block in enumerate(blocks):
        blocks[i] = wrap(block)


def shard_model(model: torch.nn.Module, blocks: torch.nn.ModuleList, cfg: dict, rt: Runtime) -> torch.nn.Module:
    """FSDP2: fully_shard each transformer block, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    prec, par = cfg["precision"], cfg["parallel"]
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[prec["param_dtype"]], reduce_dtype=DTYPES[prec["reduce_dtype"]])
    offload: OffloadPolicy = OffloadPolicy()
    if par["offload"] != "none":
        if not rt.is_cuda:
            raise ConfigError("parallel.offload needs CUDA (it moves shards between GPU and host memory)")
        # FSDP2 offloads parameters, gradients and the optimizer step together; there is no
        # optimizer-only variant, so "optimizer" uses less GPU memory than planned, never more.
        offload = CPUOffloadPolicy(pin_memory=True)
    # fsdp/hsdp free the gathered weights after forward (ZeRO-3); zero1/zero2 keep them until
    # backward (FSDP2 has no optimizer-only sharding: zero1 runs as zero2).
    reshard = par["sharding"] in ("fsdp", "hsdp")
    # QLoRA: the NF4 base stays whole on every GPU (the plan sizes it so); FSDP2 would turn
    # bitsandbytes' Params4bit into plain DTensors and lose their quant_state. Adapters are sharded.
    ignored = {p for p in model.parameters() if type(p).__name__ == "Params4bit"} or None
    kw = dict(mesh=rt.mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if not tied:
        # torchtitan's units: embeddings alone, then each block, then final norm + head together
        # (needed first by backward: kept gathered); a tied head stays with the root.
        fully_shard(embed, reshard_after_forward=reshard, **kw)
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kw)
    norm = final_norm(model)
    if not tied and head is not None:
        fully_shard([norm, head] if norm is not None else head, reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    return getattr(inner, "norm", None) if inner is not None else None


def apply_compile(blocks: torch.nn.ModuleList, cfg: dict, rt: Runtime) -> None:
    """torch.compile each block (torchtitan's unit): fused norms and activations, fewer kernels."""
    if not cfg["efficiency"]["compile"] or not rt.is_cuda:
        return  # CPU runs (tests, smoke runs) stay eager: compile there only costs time
    for i, block in enumerate(blocks):
        blocks[i] = torch.compile(block)


def apply_float8(model: torch.nn.Module, cfg: dict, rt: Runtime) -> bool:
    """torchao float8 linears (dynamic scaling) with FSDP2 float8 all-gather, Hopper and later."""
    if not cfg["efficiency"]["float8"]:
        return False
    if not rt.is_cuda or torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError("efficiency.float8 needs an sm_89+ GPU (Ada, Hopper, Blackwell)")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError("efficiency.float8 needs torchao (pip install torchao)") from exc
    head = model.get_output_embeddings()
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=lambda m, fqn: m is not head)  # the head stays bf16
    return True


def materialise(model: torch.nn.Module, on_meta: bool, cfg: dict, rt: Runtime, from_checkpoint: bool) -> None:
    """Allocate this rank's shards and fill them: fresh init, or pretrained weights file by file.

    `from_checkpoint`: a full-training resume, whose checkpoint holds every weight, so neither the
    pretrained files are read nor an init is spent (LoRA still needs its frozen base from them).
    """
    if not on_meta:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model.to_empty(device=rt.device)
    path = pretrained_path(cfg)
    skip = from_checkpoint and cfg["task"]["kind"] == "full"
    # DTensor random ops are exact on CUDA (offset-based RNG); on CPU each rank draws its local
    # shard from its own generator: seed by shard coordinate so HSDP replicas agree (LoRA's A too).
    torch.manual_seed(int(cfg["training"]["seed"]) + (0 if rt.is_cuda else rt.shard_rank))
    with torch.no_grad():
        if skip:
            log("resuming: every weight comes from the checkpoint (pretrained files not read)")
        elif path:
            load_pretrained(model, path, rt)
        else:
            if hasattr(base, "initialize_weights"):
                base.initialize_weights()
            else:
                base.apply(base._init_weights)
        reset_lora(model)
        reset_rotary_buffers(model, rt.device)
    if skip:
        return
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local).all():
            raise RuntimeError(f"parameter {name} is not finite after initialisation")


def hf_name(name: str) -> str:
    """A trainer parameter's name in the HF checkpoint: no wrapper prefixes (activation
    checkpointing, compile), and peft's base_model.model.<fqn> / <layer>.base_layer undone."""
    name = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def load_pretrained(model: torch.nn.Module, path: str, rt: Runtime) -> None:
    """HF safetensors, one file at a time: every rank reads the file (memory-mapped) and copies
    only its own shard of each tensor into place, so no rank ever holds the whole model."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.pretrained_path {path!r} has no *.safetensors files (save_pretrained writes them)")
    params = {hf_name(n): p for n, p in model.named_parameters() if "lora_" not in n}
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                p = params.get(key)
                if p is None:
                    continue
                full = sf.get_tensor(key).to(p.dtype)
                if isinstance(p, DTensor):
                    # src_data_rank=None: slice locally, no communication (every rank has the file)
                    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    p.to_local().copy_(local)
                else:
                    p.copy_(full)
                loaded.add(key)
                del full
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in params if k not in loaded and not (tied and k == "lm_head.weight")]
    if missing:
        raise ConfigError(f"model.pretrained_path {path!r} lacks {len(missing)} weights, e.g. {missing[0]}")
    log(f"pretrained: {len(loaded)} tensors from {len(files)} safetensors file(s) in {path}")


def reset_lora(model: torch.nn.Module) -> None:
    """LoRA's own init (A random, B zero: the adapted model starts equal to the base)."""
    for m in model.modules():
        if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A"):
            for adapter in m.lora_A:
                m.reset_lora_parameters(adapter, True)


def reset_rotary_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Rotary inv_freq buffers are not in any state dict: recompute them from the config."""
    for m in model.modules():
        if "Rotary" in type(m).__name__ and hasattr(m, "config") and hasattr(m, "inv_freq"):
            with torch.device("cpu"):
                fresh = type(m)(m.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(m, name).copy_(buf.to(device))


def count_params(model: torch.nn.Module) -> tuple[int, int, list[str]]:
    total = trainable = 0
    names = []
    for name, p in model.named_parameters():
        n = p.numel()  # the global (unsharded) size for DTensor parameters
        total += n
        if p.requires_grad:
            trainable += n
            names.append(name)
    return total, trainable, names


def verify_replicas(model: torch.nn.Module, rt: Runtime) -> None:
    """HSDP: every replica of a shard must hold the same numbers; catch a broken init at once."""
    if rt.mesh is None or rt.mesh.ndim != 2:
        return
    with torch.no_grad():
        s = torch.stack([p.to_local().float().sum() for p in model.parameters()]).to(rt.device)
    lo, hi = s.clone(), s.clone()
    group = rt.mesh.get_group("replicate")
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        names = [n for (n, _), a, b in zip(model.named_parameters(), lo, hi) if a != b]
        raise RuntimeError(f"HSDP replicas differ after initialisation: {', '.join(names[:3])}")


# --------------------------------------------------------------------------------------------
# data


class TokenWindows:
    """Samples of seq_len + 1 tokens (inputs and shifted labels) and their loss mask, by global index.

    From files: raw little-endian uint16/uint32 token streams (`*.bin`, the nanoGPT/Megatron
    layout), memory-mapped, cut into non-overlapping windows that never cross a file; read in
    order (prepare_data.py shuffles documents before packing). A `<name>.mask` file beside a
    `.bin` (uint8, one per token) marks which tokens are trained on as labels (0: an instruction
    prompt). A directory from prepare_data.py holds `train/` and `val/` (`split` picks one).
    Synthetic (data.synthetic: true): each sample is an arithmetic sequence mod the vocabulary
    with a per-sample start and stride, so the loss can fall without real data;
    `data.synthetic_samples` bounds the stream (one global batch = a fixed batch).
    """

    def __init__(self, cfg: dict, seq_len: int, vocab: int, seed: int, split: str = "train"):
        d = cfg["data"]
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.path, self.masks = d.get("path"), None
        if self.path:
            files = self._files(Path(self.path), split)
            meta = Path(self.path, "meta.json")
            dtype = json.loads(meta.read_text())["dtype"] if meta.is_file() else d.get("dtype", "uint16")
            dtype = np.dtype(dtype).newbyteorder("<")
            self.shards = [np.memmap(f, dtype=dtype, mode="r") for f in files]
            if all(f.with_suffix(".mask").is_file() for f in files):
                self.masks = [np.memmap(f.with_suffix(".mask"), dtype=np.uint8, mode="r") for f in files]
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
            self.starts = list(np.cumsum([0] + counts))
            self.size = int(self.starts[-1])
            if self.size == 0:
                raise ConfigError(f"data.path {self.path!r} holds fewer than seq_len + 1 = {seq_len + 1} tokens")
        elif not d.get("synthetic"):
            raise ConfigError("data.path is null: point it at prepare_data.py's output (or token .bin files), "
                              "or set data.synthetic=true for a smoke test that learns nothing")
        else:
            n = d.get("synthetic_samples")
            self.size = int(n) if n else 2**62

    @staticmethod
    def _files(p: Path, split: str) -> list[Path]:
        if (p / "meta.json").is_file():
            p = p / split
        elif split != "train":
            return []
        files = sorted(p.glob("*.bin")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError(f"data.path {str(p)!r}: no .bin token files there")
        return files

    @classmethod
    def validation(cls, cfg: dict, seq_len: int, vocab: int, seed: int) -> TokenWindows | None:
        path = cfg["data"].get("path")
        if not path or not (Path(path) / "meta.json").is_file() or not (Path(path) / "val").is_dir():
            return None
        return cls(cfg, seq_len, vocab, seed, split="val")

    def __len__(self) -> int:
        return self.size

    def _where(self, index: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, (index - self.starts[shard]) * self.seq_len

    def sample(self, index: int) -> np.ndarray:
        index %= self.size  # wrap: another epoch
        if self.path:
            shard, off = self._where(index)
            return np.asarray(self.shards[shard][off: off + self.seq_len + 1], dtype=np.int64)
        rng = np.random.default_rng([self.seed, index])
        start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
        return (start + stride * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab

    def mask(self, index: int) -> np.ndarray | None:
        if self.masks is None:
            return None
        shard, off = self._where(index % self.size)
        return np.asarray(self.masks[shard][off: off + self.seq_len + 1], dtype=bool)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [count, seq_len + 1], labels [count, seq_len]: next tokens, -100 where masked)."""
        tokens = torch.from_numpy(np.stack([self.sample(first + i) for i in range(count)]))
        top = int(tokens.max())
        if top >= self.vocab:
            raise ConfigError(f"token id {top} in data.path {self.path!r} is outside the model's vocabulary "
                              f"of {self.vocab}: tokenized with another tokenizer?")
        labels = tokens[:, 1:].clone()
        if self.masks is not None:
            keep = torch.from_numpy(np.stack([self.mask(first + i) for i in range(count)]))[:, 1:]
            labels[~keep] = -100  # F.cross_entropy's ignore_index: no loss on prompt tokens
        return tokens, labels


# --------------------------------------------------------------------------------------------
# optimizer and schedule


def build_optimizer(model: torch.nn.Module, cfg: dict, rt: Runtime) -> torch.optim.Optimizer:
    opt = cfg["optimizer"]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)  # no weight decay on norms and biases
    groups = [{"params": decay, "weight_decay": float(opt["weight_decay"])},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=float(opt["lr"]), betas=tuple(opt["betas"]), eps=float(opt["eps"]))
    if opt["name"] == "adamw":
        # Fused on CUDA: one kernel updates in place, where PyTorch's foreach default holds a
        # state-sized temporary at the step (the plan's memory estimate assumes fused). Works on
        # DTensor shards. With CPU offload the step runs on host tensors: PyTorch's default there.
        fused = rt.is_cuda and cfg["parallel"]["offload"] == "none"
        return torch.optim.AdamW(groups, **kw, **({"fused": True} if fused else {}))
    if opt["name"] == "adamw-8bit":
        if not rt.is_cuda:
            raise ConfigError("optimizer adamw-8bit needs CUDA (torchao's 8-bit AdamW)")
        try:
            from torchao.optim import AdamW8bit
        except ImportError as exc:
            raise ConfigError("optimizer adamw-8bit needs torchao (pip install torchao)") from exc
        return AdamW8bit(groups, **kw)
    raise ConfigError(f"unknown optimizer.name {opt['name']!r}")


def lr_at(step: int, cfg: dict) -> float:
    """Linear warmup to optimizer.lr, then cosine decay to lr * min_lr_ratio at the last step."""
    lr, s = float(cfg["optimizer"]["lr"]), cfg["schedule"]
    warmup, total, floor = int(s["warmup_steps"]), int(s["steps"]), float(s["min_lr_ratio"])
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


# --------------------------------------------------------------------------------------------
# checkpoints


class TrainState(Stateful):
    """What a resume needs: model, optimizer, step and data position (samples consumed)."""

    def __init__(self, model, optimizer, frozen_ok: bool):
        self.model, self.optimizer = model, optimizer
        self.step = 0
        self.samples_seen = 0
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # LoRA: the frozen base is not saved each time (it never changes); so loading must not
        # demand it (strict off), and load_state_dict checks that every trainable weight came back.
        self.frozen_ok = frozen_ok
        self.options = StateDictOptions(ignore_frozen_params=frozen_ok)
        self.load_options = StateDictOptions(ignore_frozen_params=frozen_ok, strict=not frozen_ok)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd,
                "train": {"step": self.step, "samples_seen": self.samples_seen}}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        result = set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                                optim_state_dict=sd["optim"], options=self.load_options)
        lost = sorted(set(getattr(result, "missing_keys", []) or []) & trainable)
        if lost:
            raise RuntimeError(f"checkpoint lacks {len(lost)} trainable weights, e.g. {lost[0]}")
        self.step, self.samples_seen = int(sd["train"]["step"]), int(sd["train"]["samples_seen"])


def checkpoint_dirs(root: Path) -> list[Path]:
    done = [p for p in root.glob("step-*") if (p / ".metadata").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def check_shared_dir(root: Path, rt: Runtime) -> None:
    """Several nodes: refuse a checkpoint directory they do not all see (each rank writes its own
    shard files, only rank 0 writes .metadata and prunes; a resume needs every shard in one place)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world))
    if rt.world <= local_world:
        return
    token = [f".gpuprov-shared-{os.getpid()}-{time.time_ns()}" if rt.rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = root / token[0]
    if rt.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe\n")
    dist.barrier()
    seen = torch.tensor([int(probe.is_file())], device=rt.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    dist.barrier()
    if rt.rank == 0:
        probe.unlink(missing_ok=True)
    if not int(seen):
        raise ConfigError(f"checkpoint.dir {str(root)!r} is not shared by all {rt.world // local_world} nodes "
                          f"(a node cannot see rank 0's files there): point it at shared storage, "
                          f"e.g. /shared/checkpoints")


class Checkpointer:
    """DCP saves every N steps, asynchronous where asked (the step loop goes on while the shards
    are written; the next save, or the end, waits for the previous one), pruned to `keep`."""

    def __init__(self, cfg: dict, rt: Runtime):
        ck = cfg["checkpoint"]
        self.root, self.keep, self.rt = Path(ck["dir"]), int(ck["keep"]), rt
        self.use_async = bool(ck.get("async")) and rt.world > 1
        self.pending = None
        # the background save runs its own collectives: on a group of its own, never the one the
        # training step is using at the same time
        self.group = dist.new_group(backend="gloo") if self.use_async else None

    def save(self, state: TrainState) -> Path:
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = self.root / f"step-{state.step:08d}"
        if self.use_async:
            self.pending = dcp.async_save({"app": state}, checkpoint_id=str(path), process_group=self.group)
        else:
            dcp.save({"app": state}, checkpoint_id=str(path))
            self.prune()
        return path

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            if self.rt.world > 1:
                dist.barrier()
            self.prune()

    def prune(self) -> None:
        if self.rt.rank == 0 and self.keep > 0:
            for old in checkpoint_dirs(self.root)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path, rt: Runtime) -> Path | None:
    """Rank 0 picks the newest complete checkpoint and tells the others, so all load the same one."""
    found = [str(checkpoint_dirs(root)[-1]) if root.is_dir() and checkpoint_dirs(root) else None]
    if rt.world > 1:
        dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else None


def resolve_checkpoint(name: str, root: Path, rt: Runtime) -> Path:
    """--export-from: 'latest', a step-N directory name under checkpoint.dir, or a path."""
    if name == "latest":
        path = latest_checkpoint(root, rt)
        if path is None:
            raise ConfigError(f"no complete checkpoint under {root}")
        return path
    path = Path(name) if Path(name).is_dir() else root / name
    if not path.is_dir() and name.startswith("step-") and name[5:].isdigit():
        path = root / f"step-{int(name[5:]):08d}"
    if not (path / ".metadata").is_file():
        raise ConfigError(f"--export-from {name}: no complete checkpoint at {path}")
    return path


def load_checkpoint(state: TrainState, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": state}, checkpoint_id=str(path))


# --------------------------------------------------------------------------------------------
# export


def export_model(model: torch.nn.Module, cfg: dict, rt: Runtime, out: Path, merged: bool = False) -> Path:
    """Hugging Face format from the sharded model: safetensors + config.json for full training,
    a PEFT adapter (adapter_config.json + adapter_model.safetensors) for LoRA, plus a merged
    copy when asked. Rank 0 gathers the full state on CPU (the collective needs every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lora = cfg["task"]["kind"] != "full"
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    sd = get_model_state_dict(model, options=opts)
    if rt.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if lora:
            write_adapter(sd, cfg, out)
            if merged:
                write_merged(cfg, out)
        else:
            write_hf_model(sd, model, cfg, out)
        log(f"exported {'adapter' if lora else 'model'} to {out}")
    if rt.world > 1:
        dist.barrier()
    return out


def write_hf_model(sd: dict, model: torch.nn.Module, cfg: dict, out: Path) -> None:
    from safetensors.torch import save_file

    dtype = DTYPES[cfg["export"]["dtype"]]
    tensors = {hf_name(k.removeprefix("module.")): v.to(dtype).contiguous() for k, v in sd.items()}
    model = unwrap(model)
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # save_pretrained drops the tied copy too
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    import transformers

    setattr(config, "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype",
            cfg["export"]["dtype"])
    config.use_cache = True
    config.save_pretrained(str(out))


def write_adapter(sd: dict, cfg: dict, out: Path) -> None:
    from safetensors.torch import save_file

    # PEFT's file keys: the module path without the adapter name ("default")
    tensors = {k.replace(".default.", "."): v.contiguous() for k, v in sd.items() if "lora_" in k}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    lora_config(cfg).save_pretrained(str(out))


def write_merged(cfg: dict, out: Path) -> None:
    """The base with the adapter folded in (rank 0, on CPU): a plain HF model for serving."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[cfg["export"]["dtype"]]
    base = AutoModelForCausalLM.from_pretrained(cfg["model"]["pretrained_path"], **dtype_kwarg(dtype))
    PeftModel.from_pretrained(base, str(out)).merge_and_unload().save_pretrained(str(out / "merged"))


# --------------------------------------------------------------------------------------------
# metrics


class Metrics:
    """Loss, tokens/s, MFU and peak memory every N steps; JSON lines for tools, text for people."""

    def __init__(self, cfg: dict, rt: Runtime, tokens_per_step: int, seq_len: int):
        self.rt, self.tokens_per_step = rt, tokens_per_step
        self.flops_per_token = flops_per_token(cfg["mfu"], seq_len)
        self.peak_flops = float(cfg["mfu"]["peak_tflops_per_gpu"]) * 1e12
        self.plan = cfg.get("plan_estimate") or {}
        path = cfg["logging"].get("metrics_file")
        self.file = None
        if path and rt.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")
        self.tb = None
        if cfg["logging"].get("tensorboard_dir") and rt.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg["logging"]["tensorboard_dir"])
        self.t0, self.steps = time.perf_counter(), 0

    @contextlib.contextmanager
    def paused(self):
        """Time spent here (checkpoints, validation) is not training: tokens/s leaves it out."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.t0 += time.perf_counter() - t

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.tb and "step" in record:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def peak_memory(self) -> tuple[int | None, int | None]:
        if not self.rt.is_cuda:
            return None, None
        t = torch.tensor([torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()],
                         device=self.rt.device)
        if self.rt.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the busiest GPU, as the planner sizes it
        return int(t[0]), int(t[1])

    def step_done(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, every: int) -> None:
        self.steps += 1
        if step % every:
            return
        grad_norm = float(grad_norm)
        loss_v = mean_over_ranks(loss, self.rt)  # the sync point: all queued work is done
        if self.rt.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.t0
        tps = self.tokens_per_step * self.steps / elapsed
        # The planner's MFU: model FLOPs per token (no recompute) over the cluster's dense peak.
        mfu = tps * self.flops_per_token / (self.rt.world * self.peak_flops)
        reserved, allocated = self.peak_memory()
        rec = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
               "mfu": mfu, "peak_memory_reserved_bytes": reserved, "peak_memory_allocated_bytes": allocated}
        self.write(rec)
        mem = "n/a (cpu)" if reserved is None else f"{reserved / GiB:.2f} GiB reserved"
        log(f"step {step:6d} | loss {loss_v:.4f} | lr {lr:.3e} | grad norm {grad_norm:.3f} | "
            f"{tps:,.0f} tokens/s | MFU {100 * mfu:.1f}% | peak memory {mem}")
        self.t0, self.steps = time.perf_counter(), 0

    def summary(self) -> None:
        reserved, allocated = self.peak_memory()
        plan_mem = self.plan.get("memory_per_gpu_bytes")
        rec = {"event": "end", "peak_memory_reserved_bytes": reserved, "peak_memory_allocated_bytes": allocated,
               "plan_memory_per_gpu_bytes": plan_mem}
        self.write(rec)
        if reserved is not None and plan_mem:
            log(f"peak GPU memory {reserved / GiB:.2f} GiB reserved ({allocated / GiB:.2f} GiB allocated) "
                f"vs planned {plan_mem / GiB:.2f} GiB per GPU")


def flops_per_token(mfu: dict, seq_len: int) -> float:
    """The plan's model FLOPs per token at the seq_len actually run (attention grows with it)."""
    total, attn = float(mfu["flops_per_token"]), float(mfu.get("attention_flops_per_token") or 0.0)
    plan_seq = int(mfu.get("plan_seq_len") or seq_len)
    return total - attn + attn * seq_len / plan_seq


def mean_over_ranks(value: torch.Tensor, rt: Runtime) -> float:
    value = value.detach().clone()
    if rt.world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)  # gloo has no AVG
        value = value / rt.world
    return float(value)


# --------------------------------------------------------------------------------------------
# training


def prepare_model(cfg: dict, rt: Runtime, from_checkpoint: bool) -> tuple[torch.nn.Module, bool]:
    """The model as it trains: built, adapted, checkpointed, compiled, parallelised, materialised.

    Returns (model, float8). Tensor/context parallelism (launch/parallel.py) hooks in here.
    """
    model, on_meta = build_model(cfg, rt)
    if cfg["task"]["kind"] in ("lora", "qlora"):
        model = apply_lora(model, cfg)
        cast_frozen(model, cfg)
    install_chunked_loss(model, cfg)
    mp = model_parallel(cfg)
    if mp is not None:
        model = mp.parallelize(model)  # TP before float8, AC, compile and FSDP, as torchtitan orders them
    fp8 = apply_float8(model, cfg, rt)
    blocks = transformer_blocks(model)
    apply_activation_checkpointing(blocks, cfg["parallel"]["activation_checkpointing"])
    apply_compile(blocks, cfg, rt)
    if rt.mesh is not None:
        model = shard_model(model, blocks, cfg, rt)
        materialise(model, on_meta, cfg, rt, from_checkpoint)
    else:
        materialise(model, on_meta, cfg, rt, from_checkpoint)
        if rt.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.is_cuda else None)
    return model, fp8


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under DDP's wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


# = catalog memory_constants.yaml cross_entropy.chunks: the plan sizes this many (torchtune's count)
LOSS_CHUNKS = 8


class ChunkedLossHead(torch.nn.Linear):
    """The LM head, computing the loss a sequence chunk at a time while `labels` is set.

    Each chunk's logits are upcast to fp32 and turned into a summed cross-entropy on their own, so
    the whole sequence's logits never exist at once: what stays for backward is each chunk's fp32
    log-softmax (the plan's chunked_cross_entropy, as torchtune's CEWithChunkedOutputLoss). It runs
    inside the head's own forward, so FSDP2 gathers the weight once per step. With `labels` unset
    it is the plain head (generation, export). Its class is swapped in; weights and names stay.
    """

    labels: torch.Tensor | None = None
    softcap: float | None = None  # Gemma-2's final_logit_softcapping, applied per chunk here

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return super().forward(hidden)
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.tensor_split(LOSS_CHUNKS, dim=1), self.labels.tensor_split(LOSS_CHUNKS, dim=1)):
            logits = super().forward(h)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            total = total + F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                                            reduction="sum")
        return total


def install_chunked_loss(model: torch.nn.Module, cfg: dict) -> None:
    """efficiency.chunked_cross_entropy: the head becomes a ChunkedLossHead (before TP/FSDP wrap it).
    Under tensor parallelism the loss already runs on vocab-sharded logits (loss_parallel), and the
    plan sizes it unchunked there too."""
    if not cfg["efficiency"].get("chunked_cross_entropy") or int(cfg["parallel"].get("tp", 1) or 1) > 1:
        return
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ConfigError(f"efficiency.chunked_cross_entropy: the output head is a {type(head).__name__}, "
                          "not a plain Linear; set it false and re-plan")
    head.__class__ = ChunkedLossHead
    head.softcap = getattr(model.config, "final_logit_softcapping", None)


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled tokens (`inputs` are the tokens before each label).
    The logits are dropped before backward: only the loss's own fp32 log-softmax stays alive (the
    plan's loss_impl "native", as torchtitan). Under TP the logits and the loss are DTensors."""
    hf = unwrap(model)
    head = getattr(hf, "get_output_embeddings", lambda: None)()
    if isinstance(head, ChunkedLossHead):
        cap = getattr(hf.config, "final_logit_softcapping", None)
        head.labels = labels
        try:
            if cap is not None:
                hf.config.final_logit_softcapping = None  # the head caps each chunk itself
            loss = model(input_ids=inputs).logits  # the head returned the summed loss
        finally:
            head.labels = None
            if cap is not None:
                hf.config.final_logit_softcapping = cap
    else:
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        del logits
    # a micro-batch of prompt tokens only (all masked) adds 0, not the NaN a plain mean gives
    return loss / labels.ne(-100).sum().clamp(min=1)


@torch.no_grad()
def validation_loss(model, data: TokenWindows, cfg: dict, rt: Runtime, micro: int) -> float:
    model.eval()
    total = torch.zeros((), device=rt.device)
    batches = int(cfg["data"]["validation"]["batches"])
    for b in range(batches):
        tokens, labels = data.batch((b * rt.dp_size + rt.dp_rank) * micro, micro)
        mp = model_parallel(cfg)
        inputs, labels = tokens[:, :-1].to(rt.device).contiguous(), labels.to(rt.device).contiguous()
        with (mp.step_context(inputs, labels) if mp else contextlib.nullcontext()):
            loss = next_token_loss(model, inputs, labels)
        total += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).float()
    model.train()
    return mean_over_ranks(total / batches, rt)


def train(cfg: dict) -> None:
    check_torch(cfg["runtime"]["min_torch"])
    configure_backends(cfg)
    rt = init_runtime(cfg)
    if not rt.is_cuda:
        # DTensor warns that CPU random ops are not offset-tracked; materialise() handles the seeding.
        warnings.filterwarnings("ignore", message="DTensor random")
    task, par, batch = cfg["task"]["kind"], cfg["parallel"], cfg["batch"]
    seq_len, micro, accum = int(batch["seq_len"]), int(batch["micro_batch"]), int(batch["grad_accum"])
    steps = int(cfg["schedule"]["steps"])
    ck = cfg["checkpoint"]
    ck_root = Path(ck["dir"])
    check_shared_dir(ck_root, rt)
    # Find the run's own checkpoint first: a full-training resume then never reads the pretrained files.
    latest = latest_checkpoint(ck_root, rt) if ck.get("resume", True) else None

    model, fp8 = prepare_model(cfg, rt, from_checkpoint=latest is not None)
    vocab = unwrap(model).config.vocab_size
    mp = model_parallel(cfg)
    total, trainable, trainable_names = count_params(model)
    optimizer = build_optimizer(model, cfg, rt)
    state = TrainState(model, optimizer, frozen_ok=task != "full")
    if latest is not None:
        load_checkpoint(state, latest)
        log(f"resumed from {latest} at step {state.step} (samples seen {state.samples_seen})")
    verify_replicas(model, rt)

    data = TokenWindows(cfg, seq_len, vocab, int(cfg["training"]["seed"]))
    val = TokenWindows.validation(cfg, seq_len, vocab, int(cfg["training"]["seed"]))
    samples_per_step = micro * accum * rt.dp_size
    metrics = Metrics(cfg, rt, samples_per_step * seq_len, seq_len)
    metrics.write({"event": "start", "step": state.step, "world": rt.world, "device": rt.device.type,
                   "sharding": par["sharding"], "mesh": None if rt.mesh is None else list(rt.mesh.shape),
                   "total_params": total, "trainable_params": trainable, "trainable": trainable_names,
                   "data": data.path or "synthetic", "dtypes": param_dtypes(model)})
    log(f"{cfg['model']['name']}: {total:,} params ({trainable:,} trainable), task {task}, "
        f"{par['sharding']} on {rt.world} x {rt.device.type} mesh {None if rt.mesh is None else tuple(rt.mesh.shape)}, "
        f"AC {par['activation_checkpointing']}, micro-batch {micro} x accum {accum} x seq {seq_len}, "
        f"data {data.path or 'synthetic'}")

    # Mixed precision outside FSDP2 (DDP) comes from autocast; FSDP2 casts via its policy.
    amp = (torch.autocast(rt.device.type, dtype=DTYPES[cfg["precision"]["param_dtype"]])
           if rt.mesh is None and cfg["precision"]["param_dtype"] != cfg["precision"]["master_dtype"]
           else contextlib.nullcontext())
    params = [p for p in model.parameters() if p.requires_grad]
    clip = float(cfg["optimizer"]["grad_clip"])
    every_log, every_ck = int(cfg["logging"]["every_steps"]), int(ck["every_steps"])
    every_val = int(cfg["data"]["validation"]["every_steps"] or 0) if val is not None else 0
    checkpointer = Checkpointer(cfg, rt)
    collector = GarbageCollection(cfg["runtime"].get("gc_every_steps"))
    model.train()
    while state.step < steps:
        lr = lr_at(state.step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss = torch.zeros((), device=rt.device)
        for m in range(accum):
            last = m == accum - 1
            # HSDP: reduce-scatter inside the shard group every micro-batch (gradients stay sharded),
            # all-reduce across replicas (the inter-node hop) only once per step.
            if rt.mesh is not None and rt.mesh.ndim == 2:
                model.set_requires_all_reduce(last)
            sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last \
                else contextlib.nullcontext()
            first = state.samples_seen + (m * rt.dp_size + rt.dp_rank) * micro
            tokens, labels = data.batch(first, micro)
            inputs = tokens[:, :-1].to(rt.device, non_blocking=True).contiguous()
            labels = labels.to(rt.device, non_blocking=True).contiguous()
            with sync, (mp.step_context(inputs, labels) if mp else contextlib.nullcontext()):
                with amp:
                    loss = next_token_loss(model, inputs, labels) / accum
                loss.backward()
            step_loss += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()  # TP: a DTensor
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        if fp8:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples_seen += samples_per_step
        collector.step(state.step)
        metrics.step_done(state.step, step_loss, grad_norm, lr, every_log)  # syncs only on log steps
        if every_val and (state.step % every_val == 0 or state.step == steps):
            with metrics.paused(), amp:
                v = validation_loss(model, val, cfg, rt, micro)
            metrics.write({"step": state.step, "val_loss": v})
            log(f"step {state.step:6d} | validation loss {v:.4f}")
        if every_ck > 0 and (state.step % every_ck == 0 or state.step == steps):
            with metrics.paused():
                path = checkpointer.save(state)
            log(f"checkpoint {path}")
    checkpointer.wait()
    if cfg["export"].get("at_end"):
        export_model(model, cfg, rt, export_dir(cfg, f"step-{state.step:08d}"), merged=cfg["export"].get("merged"))
    metrics.summary()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def param_dtypes(model: torch.nn.Module) -> dict[str, list[str]]:
    """Trainable and frozen parameter dtypes (what the plan sized: e.g. LoRA's bf16 base)."""
    out: dict[str, set] = {"trainable": set(), "frozen": set()}
    for p in model.parameters():
        out["trainable" if p.requires_grad else "frozen"].add(str(p.dtype).removeprefix("torch."))
    return {k: sorted(v) for k, v in out.items()}


def export_dir(cfg: dict, name: str) -> Path:
    return Path(cfg["export"].get("dir") or Path(cfg["checkpoint"]["dir"]) / "export") / name


def export(cfg: dict, name: str, merged: bool) -> None:
    """--export-from: load one DCP checkpoint onto the sharded model and write it in HF format."""
    check_torch(cfg["runtime"]["min_torch"])
    rt = init_runtime(cfg)
    root = Path(cfg["checkpoint"]["dir"])
    path = resolve_checkpoint(name, root, rt)
    model, _ = prepare_model(cfg, rt, from_checkpoint=True)
    state = TrainState(model, build_optimizer(model, cfg, rt), frozen_ok=cfg["task"]["kind"] != "full")
    load_checkpoint(state, path)
    export_model(model, cfg, rt, export_dir(cfg, path.name), merged=merged)
    if dist.is_initialized():
        dist.destroy_process_group()


def _record(fn):
    """torchelastic's @record: a failing rank's traceback goes to the error file torchrun reports."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:
        return fn
    return record(fn)


@_record
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).with_name("train.yaml")))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one train.yaml value (YAML syntax), repeatable")
    ap.add_argument("--export-from", metavar="CHECKPOINT",
                    help="export a checkpoint (step-N, 'latest' or a path) to HF format and exit")
    ap.add_argument("--merged", action="store_true", help="with --export-from on LoRA: also a merged model")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.set)
    if args.export_from:
        export(cfg, args.export_from, args.merged)
    else:
        train(cfg)


if __name__ == "__main__":
    sys.exit(main())
