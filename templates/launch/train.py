#!/usr/bin/env python3
"""gpuprov's FSDP2 trainer for Hugging Face causal LMs, configured by train.yaml.

Standalone on purpose: the cluster runs it without gpuprov installed. Needs torch >= 2.6,
transformers, numpy and PyYAML; peft for LoRA; bitsandbytes (CUDA) for QLoRA.

    torchrun --nnodes N --nproc-per-node G ... train.py --config train.yaml [--set batch.seq_len=2048 ...]

What it does, in order (the layout follows torchtitan's train.py):
  1. process group + DeviceMesh: 1-D ("shard",) for FULL_SHARD / ZeRO-2, 2-D ("replicate", "shard")
     for HSDP (parameters sharded inside a shard group, replicated across groups)
  2. model from the plan's config on the meta device (or a local pretrained path), LoRA adapters
  3. activation checkpointing per block, then fully_shard per block and at the root
  4. materialise the shards on the device and initialise (or broadcast pretrained weights from rank 0)
  5. AdamW (fused on CUDA), linear warmup + cosine decay, gradient clipping, micro-batches x gradient accumulation
  6. data: memory-mapped pre-tokenized shards (raw uint16/uint32 tokens) or a synthetic stream
  7. torch.distributed.checkpoint save every N steps and resume (model, optimizer, step, data position)
  8. a log line every N steps: loss, tokens/s, MFU (the planner's formula), peak GPU memory
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
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
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None)
    if model_parallel(cfg) is not None:
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
    path = mcfg.get("pretrained_path")
    master = DTYPES[cfg["precision"]["master_dtype"]]
    if task == "qlora":
        return build_qlora_model(cfg, rt), False
    if path:
        if not Path(path, "config.json").is_file():
            raise ConfigError(f"model.pretrained_path {path!r} has no config.json (a local directory is needed)")
        config = AutoConfig.from_pretrained(path)
    else:
        hf = dict(mcfg["hf_config"])
        config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    config.use_cache = False  # no KV cache in training
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(master), True


def dtype_kwarg(dtype: torch.dtype) -> dict:
    """from_pretrained's dtype argument: `dtype` in transformers 5, `torch_dtype` before."""
    import transformers

    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}


def build_qlora_model(cfg: dict, rt: Runtime) -> torch.nn.Module:
    """QLoRA: the base in 4-bit NF4 (double quantisation) from local weights; bitsandbytes is CUDA-only."""
    if not rt.is_cuda:
        raise ConfigError("task qlora needs CUDA: bitsandbytes 4-bit kernels do not run on CPU "
                          "(use task.kind lora to test the adapter path on CPU)")
    path = cfg["model"].get("pretrained_path")
    if not path:
        raise ConfigError("task qlora quantises pretrained weights: set model.pretrained_path to a local directory")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    compute = DTYPES[cfg["precision"]["param_dtype"]]
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=compute)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, device_map={"": rt.local_rank},
                                                 **dtype_kwarg(compute))
    model.config.use_cache = False
    return model


def apply_lora(model: torch.nn.Module, cfg: dict) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = cfg["task"]["lora"]
    targets = lora["targets"]
    config = LoraConfig(r=int(lora["rank"]), lora_alpha=int(lora["alpha"]), lora_dropout=float(lora["dropout"]),
                        target_modules="all-linear" if targets == "all-linear" else list(targets),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


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
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model


def materialise(model: torch.nn.Module, on_meta: bool, cfg: dict, rt: Runtime) -> None:
    """Allocate this rank's shards and fill them: fresh init, or pretrained weights from rank 0."""
    if not on_meta:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model.to_empty(device=rt.device)
    path = cfg["model"].get("pretrained_path")
    with torch.no_grad():
        if path:
            load_pretrained(model, path, cfg, rt)
        else:
            # DTensor random ops are exact on CUDA (offset-based RNG); on CPU each rank draws its
            # local shard from its own generator: seed by shard coordinate so HSDP replicas agree.
            torch.manual_seed(int(cfg["training"]["seed"]) + (0 if rt.is_cuda else rt.shard_rank))
            if hasattr(base, "initialize_weights"):
                base.initialize_weights()
            else:
                base.apply(base._init_weights)
        reset_lora(model)
        reset_rotary_buffers(model, rt.device)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local).all():
            raise RuntimeError(f"parameter {name} is not finite after initialisation")


def load_pretrained(model: torch.nn.Module, path: str, cfg: dict, rt: Runtime) -> None:
    """Rank 0 reads the checkpoint once; set_model_state_dict scatters each tensor to its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full: dict = {}
    if rt.rank == 0:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, **dtype_kwarg(DTYPES[cfg["precision"]["master_dtype"]]))
        hf_sd = hf.state_dict()
        for name in model.state_dict():
            # peft renames wrapped layers: base_model.model.<fqn> and <layer>.base_layer.weight
            hf_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            if hf_name in hf_sd:
                full[name] = hf_sd[hf_name]
        log(f"pretrained: {len(full)} tensors from {path}")
        del hf
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                strict=False))


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
        raise RuntimeError("HSDP replicas differ after initialisation")


# --------------------------------------------------------------------------------------------
# data


class TokenWindows:
    """Samples of seq_len + 1 tokens (inputs and shifted labels), addressed by a global index.

    From files: raw little-endian uint16/uint32 token streams (`*.bin`, the nanoGPT/Megatron
    layout), memory-mapped, cut into non-overlapping windows that never cross a file; read in
    order (shuffle when tokenizing). Synthetic: each sample is an arithmetic sequence mod the
    vocabulary with a per-sample start and stride, so the loss can fall without real data;
    `data.synthetic_samples` bounds the stream (one global batch = a fixed batch).
    """

    def __init__(self, cfg: dict, seq_len: int, vocab: int, seed: int):
        d = cfg["data"]
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.path = d.get("path")
        if self.path:
            p = Path(self.path)
            files = sorted(p.glob("*.bin")) if p.is_dir() else [p]
            if not files or not all(f.is_file() for f in files):
                raise ConfigError(f"data.path {self.path!r}: no .bin token files there")
            dtype = np.dtype(d["dtype"]).newbyteorder("<")
            self.shards = [np.memmap(f, dtype=dtype, mode="r") for f in files]
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
            self.starts = list(np.cumsum([0] + counts))
            self.size = int(self.starts[-1])
            if self.size == 0:
                raise ConfigError(f"data.path {self.path!r} holds fewer than seq_len + 1 = {seq_len + 1} tokens")
        else:
            n = d.get("synthetic_samples")
            self.size = int(n) if n else 2**62

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> np.ndarray:
        index %= self.size  # wrap: another epoch
        if self.path:
            shard = bisect.bisect_right(self.starts, index) - 1
            off = (index - self.starts[shard]) * self.seq_len
            return np.asarray(self.shards[shard][off: off + self.seq_len + 1], dtype=np.int64)
        rng = np.random.default_rng([self.seed, index])
        start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
        return (start + stride * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab

    def batch(self, first: int, count: int) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.sample(first + i) for i in range(count)]))


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

        # LoRA: the frozen base is not saved each time (it never changes).
        self.options = StateDictOptions(ignore_frozen_params=frozen_ok)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd,
                "train": {"step": self.step, "samples_seen": self.samples_seen}}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],
                       options=self.options)
        self.step, self.samples_seen = int(sd["train"]["step"]), int(sd["train"]["samples_seen"])


def checkpoint_dirs(root: Path) -> list[Path]:
    done = [p for p in root.glob("step-*") if (p / ".metadata").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def save_checkpoint(state: TrainState, root: Path, keep: int, rt: Runtime) -> Path:
    import torch.distributed.checkpoint as dcp

    path = root / f"step-{state.step:08d}"
    dcp.save({"app": state}, checkpoint_id=str(path))
    if rt.world > 1:
        dist.barrier()
        # Every rank wrote its own shard files; only rank 0 wrote .metadata. A resume needs all
        # of them in one place: say so at once if nodes do not share this directory.
        seen = torch.tensor([int((path / ".metadata").is_file())], device=rt.device)
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
        if not int(seen):
            log(f"warning: {root} is not shared by all nodes; to resume, copy every node's {path.name} "
                f"into one directory all nodes can read, or set checkpoint.dir to shared storage")
    if rt.rank == 0 and keep > 0:
        for old in checkpoint_dirs(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def latest_checkpoint(root: Path, rt: Runtime) -> Path | None:
    """Rank 0 picks the newest complete checkpoint and tells the others, so all load the same one."""
    found = [str(checkpoint_dirs(root)[-1]) if root.is_dir() and checkpoint_dirs(root) else None]
    if rt.world > 1:
        dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else None


def load_checkpoint(state: TrainState, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": state}, checkpoint_id=str(path))


# --------------------------------------------------------------------------------------------
# metrics


class Metrics:
    """Loss, tokens/s, MFU and peak memory every N steps; JSON lines for tools, text for people."""

    def __init__(self, cfg: dict, rt: Runtime, tokens_per_step: int):
        self.rt, self.tokens_per_step = rt, tokens_per_step
        m = cfg["mfu"]
        self.flops_per_token = float(m["flops_per_token"])
        self.peak_flops = float(m["peak_tflops_per_gpu"]) * 1e12
        self.plan = cfg.get("plan_estimate") or {}
        path = cfg["logging"].get("metrics_file")
        self.file = None
        if path and rt.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")
        self.t0, self.steps = time.perf_counter(), 0

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

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
        if self.rt.world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # gloo has no AVG
            loss = loss / self.rt.world
        loss_v = float(loss)  # the sync point: all queued work is done
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


# --------------------------------------------------------------------------------------------
# training


def train(cfg: dict) -> None:
    rt = init_runtime(cfg)
    if not rt.is_cuda:
        # DTensor warns that CPU random ops are not offset-tracked; materialise() handles the seeding.
        warnings.filterwarnings("ignore", message="DTensor random")
    task, par, batch = cfg["task"]["kind"], cfg["parallel"], cfg["batch"]
    seq_len, micro, accum = int(batch["seq_len"]), int(batch["micro_batch"]), int(batch["grad_accum"])
    steps = int(cfg["schedule"]["steps"])

    model, on_meta = build_model(cfg, rt)
    vocab = model.config.vocab_size
    if task in ("lora", "qlora"):
        model = apply_lora(model, cfg)
    mp = model_parallel(cfg)
    if mp is not None:
        model = mp.parallelize(model)  # TP before AC and FSDP, as torchtitan orders them
    blocks = transformer_blocks(model)
    apply_activation_checkpointing(blocks, par["activation_checkpointing"])
    if rt.mesh is not None:
        model = shard_model(model, blocks, cfg, rt)
        materialise(model, on_meta, cfg, rt)
    else:
        materialise(model, on_meta, cfg, rt)
        if rt.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.is_cuda else None)
    verify_replicas(model, rt)
    total, trainable, trainable_names = count_params(model)

    optimizer = build_optimizer(model, cfg, rt)
    state = TrainState(model, optimizer, frozen_ok=task != "full")
    ck = cfg["checkpoint"]
    ck_root = Path(ck["dir"])
    latest = latest_checkpoint(ck_root, rt) if ck.get("resume", True) else None
    if latest is not None:
        load_checkpoint(state, latest)
        log(f"resumed from {latest} at step {state.step} (samples seen {state.samples_seen})")

    data = TokenWindows(cfg, seq_len, vocab, int(cfg["training"]["seed"]))
    samples_per_step = micro * accum * rt.dp_size
    metrics = Metrics(cfg, rt, samples_per_step * seq_len)
    metrics.write({"event": "start", "step": state.step, "world": rt.world, "device": rt.device.type,
                   "sharding": par["sharding"], "mesh": None if rt.mesh is None else list(rt.mesh.shape),
                   "total_params": total, "trainable_params": trainable, "trainable": trainable_names,
                   "data": data.path or "synthetic"})
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
            tokens = data.batch(first, micro).to(rt.device, non_blocking=True)
            inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            with sync, (mp.step_context(inputs, labels) if mp else contextlib.nullcontext()):
                with amp:
                    logits = model(input_ids=inputs).logits
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) / accum
                loss.backward()
            step_loss += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()  # TP: a DTensor
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.samples_seen += samples_per_step
        metrics.step_done(state.step, step_loss, grad_norm, lr, every_log)  # syncs only on log steps
        if every_ck > 0 and (state.step % every_ck == 0 or state.step == steps):
            path = save_checkpoint(state, ck_root, int(ck["keep"]), rt)
            log(f"checkpoint {path}")
    metrics.summary()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).with_name("train.yaml")))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one train.yaml value (YAML syntax), repeatable")
    args = ap.parse_args(argv)
    train(load_config(args.config, args.set))


if __name__ == "__main__":
    sys.exit(main())
