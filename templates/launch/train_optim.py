"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch

from train_config import Config, ConfigError
from train_runtime import Runtime

def build_optimizer(model: torch.nn.Module, cfg: Config, rt: Runtime) -> torch.optim.Optimizer:
    opt = cfg.optimizer
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)  # no weight decay on norms and biases
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps)
    if opt.name == "adamw":
        # Fused on CUDA: one kernel updates in place, where PyTorch's foreach default holds a
        # state-sized temporary at the step (the plan's memory estimate assumes fused). Works on
        # DTensor shards. With CPU offload the step runs on host tensors: PyTorch's default there.
        fused = rt.is_cuda and cfg.parallel.offload == "none"
        return torch.optim.AdamW(groups, **kw, **({"fused": True} if fused else {}))
    if opt.name == "adamw-8bit":
        if not rt.is_cuda:
            raise ConfigError("optimizer adamw-8bit needs CUDA (torchao's 8-bit AdamW)")
        try:
            from torchao.optim import AdamW8bit
        except ImportError as exc:
            raise ConfigError("optimizer adamw-8bit needs torchao (pip install torchao)") from exc
        return AdamW8bit(groups, **kw)
    raise ConfigError(f"unknown optimizer.name {opt['name']!r}")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to optimizer.lr, then cosine decay to lr * min_lr_ratio at the last step
    (0-based `step`: the last step is schedule.steps - 1)."""
    lr, s = cfg.optimizer.lr, cfg.schedule
    warmup, last, floor = s.warmup_steps, s.steps - 1, s.min_lr_ratio
    if step < warmup:
        return lr * (step + 1) / warmup
    # steps run 0 .. steps - 1: the last one trains at exactly lr * min_lr_ratio
    progress = min(1.0, (step - warmup) / max(1, last - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


