"""What a run reports: loss, tokens/s, MFU (the planner's formula) and peak memory every N steps,
as a text line for people and a JSON line (logging.metrics_file) for tools.

Metrics file, one JSON object per line: {"event": "start", ...} once per launch; then per logged
step {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_memory_reserved_bytes",
"peak_memory_allocated_bytes", "skipped_steps"}; {"step", "val_loss"} per validation;
{"event": "end", ...} at the end. "skipped_steps" counts the steps so far whose loss or gradient
norm was not finite (no optimizer step was taken). The same scalars go to TensorBoard
(logging.tensorboard_dir) and, when train.yaml names them, to wandb (logging.wandb_project) and
MLflow (logging.mlflow_tracking_uri), each imported only then.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from train_config import Config, ConfigError, MfuSection
from train_runtime import GiB, Runtime, log

class Metrics:
    """Loss, tokens/s, MFU and peak memory every N steps; JSON lines for tools, text for people."""

    def __init__(self, cfg: Config, rt: Runtime, tokens_per_step: int, seq_len: int):
        self.rt, self.tokens_per_step = rt, tokens_per_step
        self.flops_per_token = flops_per_token(cfg.mfu, seq_len)
        self.peak_flops = float(cfg.mfu.peak_tflops_per_gpu) * 1e12
        self.plan = cfg.plan_estimate
        path = cfg.logging.metrics_file
        self.file = None
        if path and rt.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a")
        self.tb = None
        if cfg.logging.tensorboard_dir and rt.rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(cfg.logging.tensorboard_dir)
        self.trackers = trackers(cfg) if rt.rank == 0 else []
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
        if "step" in record:
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            for log_fn, _ in self.trackers:
                log_fn(scalars, record["step"])

    def peak_memory(self) -> tuple[int | None, int | None]:
        if not self.rt.is_cuda:
            return None, None
        t = torch.tensor([torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()],
                         device=self.rt.device)
        if self.rt.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the busiest GPU, as the planner sizes it
        return int(t[0]), int(t[1])

    def step_done(self, step: int, loss: float, grad_norm: float, lr: float, every: int, skipped: int = 0) -> None:
        """`loss`: the step's global token-mean loss; `skipped`: non-finite steps so far (not stepped)."""
        self.steps += 1
        if step % every:
            return
        loss_v = loss
        if self.rt.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - self.t0
        tps = self.tokens_per_step * self.steps / elapsed
        # The planner's MFU: model FLOPs per token (no recompute) over the cluster's dense peak.
        mfu = tps * self.flops_per_token / (self.rt.world * self.peak_flops)
        reserved, allocated = self.peak_memory()
        rec = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tps,
               "mfu": mfu, "peak_memory_reserved_bytes": reserved, "peak_memory_allocated_bytes": allocated,
               "skipped_steps": skipped}
        self.write(rec)
        mem = "n/a (cpu)" if reserved is None else f"{reserved / GiB:.2f} GiB reserved"
        log(f"step {step:6d} | loss {loss_v:.4f} | lr {lr:.3e} | grad norm {grad_norm:.3f} | "
            f"{tps:,.0f} tokens/s | MFU {100 * mfu:.1f}% | peak memory {mem} | skipped {skipped}")
        self.t0, self.steps = time.perf_counter(), 0

    def summary(self) -> None:
        reserved, allocated = self.peak_memory()
        plan_mem = self.plan.memory_per_gpu_bytes
        rec = {"event": "end", "peak_memory_reserved_bytes": reserved, "peak_memory_allocated_bytes": allocated,
               "plan_memory_per_gpu_bytes": plan_mem}
        self.write(rec)
        for _, finish in self.trackers:
            finish()
        if reserved is not None and plan_mem:
            log(f"peak GPU memory {reserved / GiB:.2f} GiB reserved ({allocated / GiB:.2f} GiB allocated) "
                f"vs planned {plan_mem / GiB:.2f} GiB per GPU")


def trackers(cfg: Config) -> list[tuple]:
    """(log(scalars, step), finish()) for each tracker train.yaml names: wandb and MLflow, imported
    only then; a named one that is not installed is a one-line error."""
    out, lg = [], cfg.logging
    config = {"model": cfg.model.name, "task": cfg.task.kind, "seq_len": cfg.batch.seq_len,
              "micro_batch": cfg.batch.micro_batch, "grad_accum": cfg.batch.grad_accum}
    if lg.wandb_project:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("logging.wandb_project needs wandb (pip install wandb)") from exc
        run = wandb.init(project=lg.wandb_project, config=config)
        out.append((lambda scalars, step: run.log(scalars, step=step), run.finish))
    if lg.mlflow_tracking_uri:
        try:
            import mlflow
        except ImportError as exc:
            raise ConfigError("logging.mlflow_tracking_uri needs mlflow (pip install mlflow)") from exc
        mlflow.set_tracking_uri(lg.mlflow_tracking_uri)
        mlflow.start_run()
        mlflow.log_params(config)
        out.append((lambda scalars, step: mlflow.log_metrics(scalars, step=step), mlflow.end_run))
    return out


def flops_per_token(mfu: MfuSection, seq_len: int) -> float:
    """The plan's model FLOPs per token at the seq_len actually run (attention grows with it)."""
    total, attn = mfu.flops_per_token, mfu.attention_flops_per_token or 0.0
    plan_seq = mfu.plan_seq_len or seq_len
    return total - attn + attn * seq_len / plan_seq
