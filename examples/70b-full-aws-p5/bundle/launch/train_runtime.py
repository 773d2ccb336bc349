"""The process's place in the job: process group, device, mesh, and small helpers every part uses."""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import parallel
from train_config import Config, ConfigError

GiB = 2**30
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def log(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def check_torch(minimum: str) -> None:
    have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    want = tuple(int(x) for x in str(minimum).split(".")[:2])
    if have < want:
        raise ConfigError(f"torch {torch.__version__} is older than runtime.min_torch {minimum} "
                          f"(FSDP2 fully_shard(ignored_params=...) first shipped there)")


def configure_backends(cfg: Config) -> None:
    """TF32 tensor cores for fp32 matmuls when the plan sized them (about 7x fp32's rate on H100)."""
    if cfg.precision.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")
    if cfg.runtime.deterministic:
        # torchtitan's set_determinism: deterministic kernels (an error where an op has none), cuDNN
        # without autotuning, cuBLAS's fixed workspace; slower, for debugging and bisecting
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


def flight_recorder(cfg: Config) -> None:
    """NCCL flight recorder: the last N collectives per rank, dumped when a collective times out."""
    entries = cfg.runtime.flight_recorder_entries
    if entries > 0:
        # renamed TORCH_FR_BUFFER_SIZE in torch 2.8 (the old name still works, with a warning)
        new = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 8)
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE" if new else "TORCH_NCCL_TRACE_BUFFER_SIZE", str(entries))
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        if cfg.runtime.flight_recorder_dir:
            Path(cfg.runtime.flight_recorder_dir).mkdir(parents=True, exist_ok=True)
            dump = Path(cfg.runtime.flight_recorder_dir, "nccl_trace_rank_")
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
    mesh: DeviceMesh | None  # FSDP2's mesh; None for DDP / single process
    dp_rank: int  # position among the ranks that read different data
    dp_size: int
    shard_rank: int  # coordinate in the shard dimension: replicas of one shard share it
    # ranks holding different data (None: the whole world), and those whose loss partial sums add
    # up to the global loss (data x context-parallel ranks; tensor-parallel ranks hold copies)
    dp_group: object = None
    loss_group: object = None
    pp_rank: int = 0  # pipeline rank (parallel.pp > 1: launch/train_pipeline.py)
    pp_group: object = None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def grad_average(self) -> int:
        """How many ranks the gradient reduction averages over (FSDP2's mesh, DDP's world): a loss
        normalised by the global token count is scaled by it so the reduced gradient is the sum."""
        if self.mesh is not None:
            return self.mesh.size()
        return self.world


def sum_over(value: torch.Tensor, group, world: int) -> torch.Tensor:
    """SUM all-reduce of a copy (gloo has no AVG); a no-op on one process."""
    value = value.detach().clone()
    if world > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


def init_runtime(cfg: Config) -> Runtime:
    want = cfg.runtime.device
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
    if "RANK" in os.environ and not dist.is_initialized():
        flight_recorder(cfg)
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=device if use_cuda else None,
                                timeout=datetime.timedelta(seconds=cfg.runtime.pg_timeout_s))
    if cfg.model_parallel:  # TP/CP: launch/parallel.py builds the 4-D mesh
        return parallel.runtime(cfg.parallel.as_dict(), Runtime, rank, world, local_rank, device)

    par = cfg.parallel
    mesh, shard_rank = None, 0
    if par.sharding in ("fsdp", "hsdp", "zero1", "zero2"):
        if par.replicate * par.shard != world:
            raise ConfigError(
                f"parallel.replicate {par.replicate} x parallel.shard {par.shard} = {par.replicate * par.shard} GPUs, "
                f"but torchrun started {world} processes: fix train.yaml or the launch")
        if par.sharding == "hsdp":
            # Row-major: consecutive ranks (one node's GPUs) form a shard group; replicas span nodes.
            mesh = init_device_mesh(device.type, (par.replicate, par.shard), mesh_dim_names=("replicate", "shard"))
        else:
            if par.replicate != 1:
                raise ConfigError(f"parallel.sharding {par.sharding} needs parallel.replicate 1, got {par.replicate}")
            mesh = init_device_mesh(device.type, (par.shard,), mesh_dim_names=("shard",))
        shard_rank = mesh.get_local_rank("shard")
    elif par.sharding == "none" and world != 1:
        raise ConfigError(f"parallel.sharding none runs one process, torchrun started {world}")
    return Runtime(rank, world, local_rank, device, mesh, rank, world, shard_rank)


class Diagnostics:
    """runtime.profile_steps: a torch.profiler trace of those steps (chrome trace per rank, CPU and CUDA
    activity, shapes and memory); runtime.memory_snapshot_steps: the CUDA allocator's history from the
    start, dumped after that many steps (open it in pytorch.org/memory_viz). Both in runtime.trace_dir."""

    def __init__(self, cfg: Config, rank: int, cuda: bool):
        self.r, self.rank, self.cuda = cfg.runtime, rank, cuda
        self.prof: Any = None
        if self.r.memory_snapshot_steps and cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        elif self.r.memory_snapshot_steps:
            log("runtime.memory_snapshot_steps: the allocator history is CUDA's; nothing to record on CPU")

    def before(self, step: int) -> None:
        """Called before step `step` (1-based) runs."""
        if self.r.profile_steps and step == self.r.profile_steps[0]:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True, profile_memory=True)
            self.prof.__enter__()

    def after(self, step: int) -> None:
        """Called after step `step` finished."""
        out = Path(str(self.r.trace_dir))
        if self.prof is not None and step == self.r.profile_steps[1]:
            self.prof.__exit__(None, None, None)
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"trace-rank{self.rank}-steps{self.r.profile_steps[0]}-{step}.json"
            self.prof.export_chrome_trace(str(path))
            self.prof = None
            log(f"profiler trace {path}")
        if self.cuda and step == self.r.memory_snapshot_steps:
            out.mkdir(parents=True, exist_ok=True)
            path = out / f"memory-rank{self.rank}-step{step}.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            log(f"memory snapshot {path}")
