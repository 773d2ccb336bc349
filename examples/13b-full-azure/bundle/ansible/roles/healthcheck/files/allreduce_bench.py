"""All-reduce bus bandwidth across every rank of a torchrun job: the multi-node fabric probe.

Run under torchrun on every node at once (the healthcheck role starts it). Rank 0 prints one line
`GPUPROV_ALLREDUCE {json}` with the world size, message size, the measured algorithm and bus
bandwidth (nccl-tests' definition: busbw = algbw * 2 * (n - 1) / n) and whether the sum was right.
The backend is nccl on GPUs; gloo on CPUs exercises the same code where no GPU is present.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=1 << 30, help="bytes per all-reduce")
    parser.add_argument("--iters", type=int, default=20, help="timed all-reduces")
    parser.add_argument("--warmup", type=int, default=5, help="untimed all-reduces first")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    return parser.parse_args(argv)


def _device(torch, backend: str):
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(args: argparse.Namespace) -> dict | None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(args.backend)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        device = _device(torch, args.backend)
        check = torch.ones(1024, dtype=torch.float32, device=device)
        dist.all_reduce(check)
        correct = bool(torch.all(check == world).item())
        data = torch.ones(max(1, args.bytes // 4), dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(data)
        _sync(torch, device)
        dist.barrier()
        began = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(data)
        _sync(torch, device)
        seconds = (time.perf_counter() - began) / max(1, args.iters)
        size = data.numel() * data.element_size()
        algbw = size / seconds / 1e9
        busbw = algbw * 2 * (world - 1) / world if world > 1 else 0.0
        if rank != 0:
            return None
        return {"world": world, "bytes": size, "seconds": seconds, "algbw_gbytes_per_s": round(algbw, 3),
                "busbw_gbytes_per_s": round(busbw, 3), "correct": correct, "backend": args.backend}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    result = measure(_args(argv))
    if result is not None:
        print("GPUPROV_ALLREDUCE " + json.dumps(result), flush=True)
        return 0 if result["correct"] else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
