#!/usr/bin/env python3
"""What torch.autocast's cast cache holds at the end of forward under FSDP1 and FSDP2 (fp32 parameters).

    python benchmarks/autocast_cache_probe.py [--hidden 256] [--layers 8] [--world 2 4]

Runs a small stack of linear blocks on CPU with the gloo backend (one process per rank), each block its own
FSDP unit and wrapped in non-reentrant activation checkpointing, the forward under
torch.autocast("cpu", bfloat16) over fp32 parameters (CPU autocast shares cached_cast with CUDA). It counts the
bytes of live tensor storages just before and just after the autocast region exits: the difference is exactly
what autocast's cache held (exiting the region frees nothing else). gpuprov's estimate
(gpuprov/sizing/memory.py _autocast_region_cache) predicts 2 bytes x every trainable weight under FSDP2, the
same at every world size, and nothing under FSDP1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

STACKS = ("fsdp1", "fsdp1-orig-params", "fsdp2")


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _wrap(model: Model, stack: str, world: int) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if stack == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped: nn.Module = model
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                       use_orig_params=stack == "fsdp1-orig-params")
    apply_activation_checkpointing(wrapped, checkpoint_wrapper_fn=checkpoint_wrapper,
                                   check_fn=lambda m: isinstance(m, Block))
    return wrapped


def _holds(ref: int | None, ptr: int) -> bool:
    """Whether the storage behind a weak reference is alive and still at that address."""
    if ref is None or torch.UntypedStorage._expired(ref):
        return False
    return torch.UntypedStorage._new_with_weak_ptr(ref).data_ptr() == ptr


class _Storages:
    """Weak references to every tensor storage an op makes while it is active (a dispatch mode, so the casts
    autocast makes and caches in C++ are seen too); `live()` sums the bytes of those still alive."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        refs: dict[int, int] = {}
        self.refs = refs

        class Track(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        ptr = st.data_ptr()
                        if not _holds(refs.get(ptr), ptr):
                            # a storage freed, or resized to nothing as FSDP frees gathered parameters,
                            # gives its address back: the new storage there is another tensor
                            refs[ptr] = st._weak_ref()
                return out

        self.mode = Track()

    def live(self) -> int:
        total = 0
        for ptr, ref in list(self.refs.items()):
            if _holds(ref, ptr):
                total += torch.UntypedStorage._new_with_weak_ptr(ref).nbytes()
        return total


def _cached_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes freed when the autocast region exits (autocast_mode.cpp clear_cache), keeping the output alive."""
    storages = _Storages()
    with storages.mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
            inside = storages.live()
        outside = storages.live()
        y.float().pow(2).mean().backward()
    return inside - outside


def _rank(rank: int, world: int, stack: str, hidden: int, layers: int, port: int, out: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = _wrap(Model(hidden, layers), stack, world)
    x = torch.randn(64, hidden)
    _cached_bytes(model, x)  # warm-up step: lazy init
    cached = _cached_bytes(model, x)
    if rank == 0:
        out.put(cached)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    weights = args.layers * 8 * args.hidden * args.hidden
    print(f"{args.layers} blocks, {weights:,} fp32 trainable weights; full bf16 copy {2 * weights / 2**20:.3f} MiB")
    print(f"{'stack':<20}{'ranks':>6}{'cached at end of forward (MiB)':>33}{'gpuprov models (MiB)':>23}")
    ctx = mp.get_context("spawn")
    port = 29600
    for stack in STACKS:
        for world in args.world:
            port += 1
            queue = ctx.SimpleQueue()
            mp.start_processes(_rank, args=(world, stack, args.hidden, args.layers, port, queue), nprocs=world,
                               start_method="spawn")
            cached = queue.get()
            modelled = 2 * weights if stack == "fsdp2" else 0
            print(f"{stack:<20}{world:>6}{cached / 2**20:>33.3f}{modelled / 2**20:>23.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
