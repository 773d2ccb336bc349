#!/usr/bin/env python3
"""gpuprov's FSDP2 trainer for Hugging Face causal LMs, configured by train.yaml.

Standalone on purpose: the cluster runs it without gpuprov installed. Needs torch >= 2.7
(runtime.min_torch), transformers, numpy, safetensors and PyYAML; peft for LoRA; bitsandbytes
(CUDA) for QLoRA; torchao for float8.

    torchrun --nnodes N --nproc-per-node G ... train.py --config train.yaml [--set batch.seq_len=2048 ...]
    torchrun ... train.py --export-from step-N    # or "latest": write an HF model / PEFT adapter

The files beside this one, one job each (the layout follows torchtitan's train.py):
  train_config.py      train.yaml as typed sections; a wrong or unknown key is a one-line error
  train_runtime.py     process group, device, DeviceMesh (1-D FSDP, 2-D HSDP), logging helpers
  parallel.py          tensor / context / pipeline parallelism on torchtitan's mesh (parallel.tp, cp, pp > 1)
  train_pipeline.py    pipeline stages (torch.distributed.pipelining, 1F1B / Interleaved1F1B): the split,
                       the schedule over the step's micro-batches, the grad norm and the export
  train_model.py       model on the meta device, LoRA, AC, compile, float8, fully_shard, init or
                       pretrained safetensors onto the shards, and the loss (token_loss_sum)
  train_data.py        memory-mapped token windows, loss masks, document ids from the recorded sample starts
  train_attention.py   per-document positions and masks in every layout (CP: keys/values all-gathered)
  train_optim.py       AdamW (fused on CUDA), linear warmup + cosine decay
  train_checkpoint.py  DCP (async) save / resume with the data position; HF / PEFT export
  train_metrics.py     the log line and metrics.jsonl: loss, tokens/s, MFU, peak memory, skipped steps
  train.py (here)      train_step (one optimizer step) and the loop around it

The loss of a step is the mean over every trained (unmasked) token of the global batch: each
micro-batch's summed cross-entropy is divided by the count of trained tokens across all ranks and
micro-batches (all-reduced first), as torchtitan and transformers' num_items_in_batch do, so the
gradient is the same on 1 GPU or 1,000, with or without accumulation.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the train_*.py files beside this one

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parallel  # noqa: E402
import train_pipeline  # noqa: E402
from train_checkpoint import (  # noqa: E402,F401
    Checkpointer, TrainState, check_shared_dir, export_dir, export_model, latest_checkpoint, load_checkpoint,
    copy_tokenizer, resolve_checkpoint, write_adapter, write_hf_model, write_merged)
from train_config import Config, ConfigError, DataSection, load_config  # noqa: E402,F401
from train_attention import document_mask, document_positions, model_inputs  # noqa: E402,F401
from train_data import Batch, TokenWindows  # noqa: E402,F401
from train_metrics import Metrics, flops_per_token  # noqa: E402,F401
from train_model import (  # noqa: E402,F401
    LOSS_CHUNKS, ChunkedLossHead, apply_activation_checkpointing, apply_compile, apply_float8, apply_lora,
    batch_loss_sum, build_model, cast_frozen, check_attention, count_params, depth_scale_residuals, install_chunked_loss,
    next_token_loss, param_dtypes, prepare_model, pretrained_path, token_loss_sum, unwrap, verify_replicas)
from train_optim import build_optimizer, lr_at  # noqa: E402,F401
from train_runtime import (  # noqa: E402,F401
    DTYPES, Diagnostics, GarbageCollection, Runtime, check_torch, configure_backends, init_runtime, log, sum_over)


@dataclass
class StepResult:
    loss: float  # mean cross-entropy over the global batch's trained tokens
    grad_norm: float
    tokens: int  # trained (labelled) tokens in the global batch
    skipped: bool  # loss or gradient norm not finite: no optimizer step


def grad_sync(model: torch.nn.Module, rt: Runtime, last: bool):
    """Gradient reduction across data-parallel ranks only after the last micro-batch where it can
    wait: HSDP reduce-scatters inside the shard group every micro-batch (gradients stay sharded)
    and all-reduces across replicas (the inter-node hop) once per step; DDP skips its all-reduce."""
    if rt.mesh is not None and rt.mesh.ndim == 2:
        model.set_requires_all_reduce(last)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def layout_context(cfg: Config, batch: Batch):
    """TP: loss_parallel; CP: the batch sharded along the sequence (launch/parallel.py). Yields the
    batch this rank computes."""
    return parallel.step_context(batch) if cfg.model_parallel else contextlib.nullcontext(batch)


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A loss under TP is a replicated DTensor: its plain value."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def global_token_count(batches: list[Batch], rt: Runtime) -> int:
    """Trained tokens in the whole global batch: every micro-batch of every data-parallel rank."""
    local = torch.tensor(sum(int(b.labelled) for b in batches), dtype=torch.float64 if not rt.is_cuda else torch.float32,
                         device=rt.device)
    return int(sum_over(local, rt.dp_group, rt.world))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Batch], cfg: Config,
               rt: Runtime, amp=None, float8: bool = False) -> StepResult:
    """One optimizer step over this rank's micro-batches (gradient accumulation).

    Each micro-batch's summed loss is divided by the global count of trained tokens and scaled by
    the number of ranks the gradient reduction averages over, so the reduced gradient is that of
    the global token-mean loss whatever the layout. A step whose global loss or gradient norm is
    not finite changes no weight (its data is still consumed).
    """
    n_global = global_token_count(batches, rt)
    scale = rt.grad_average / max(1, n_global)
    pipe = getattr(model, "pipeline", None)
    if pipe is not None:  # parallel.pp: the schedule runs every micro-batch's forward and backward
        inputs, labels, documents = stacked(batches, rt.device)
        with parallel.step_context(Batch(inputs, labels)):
            loss_sum = pipe.run(inputs, labels, scale, documents=documents)
    else:
        loss_sum = accumulate(model, batches, cfg, rt, scale, amp)
    loss_v = float(sum_over(loss_sum, rt.loss_group, rt.world)) / max(1, n_global)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = cfg.optimizer.grad_clip if cfg.optimizer.grad_clip > 0 else float("inf")
    if pipe is not None:
        grad_norm = float(train_pipeline.grad_norm_and_clip(params, clip, pipe.group))
    else:
        grad_norm = float(local_value(torch.nn.utils.clip_grad_norm_(params, clip)))
    # the loss and the norm are global (the same on every rank), so every rank decides alike
    skipped = not (torch.isfinite(torch.tensor(loss_v)) and torch.isfinite(torch.tensor(grad_norm)))
    if not skipped:
        optimizer.step()
        if float8:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_v, grad_norm, n_global, skipped)


def accumulate(model: torch.nn.Module, batches: list[Batch], cfg: Config, rt: Runtime, scale: float,
               amp=None) -> torch.Tensor:
    """Forward and backward of each micro-batch in turn; returns this rank's summed cross-entropy."""
    loss_sum = torch.zeros((), device=rt.device)
    for m, batch in enumerate(batches):
        batch = batch.to(rt.device)
        with grad_sync(model, rt, last=m == len(batches) - 1), layout_context(cfg, batch) as local:
            with amp or contextlib.nullcontext():
                loss = batch_loss_sum(model, local)
            (loss * scale).backward()
        loss_sum += local_value(loss.detach()).float()
    return loss_sum


def stacked(batches: list[Batch], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The micro-batches as one batch (the pipeline schedule splits it back, in order): inputs, labels
    and document ids (None without recorded documents)."""
    docs = None if batches[0].documents is None else torch.cat([b.documents for b in batches]).to(device)
    return (torch.cat([b.inputs for b in batches]).to(device), torch.cat([b.labels for b in batches]).to(device), docs)


def step_batches(data: TokenWindows, samples_seen: int, cfg: Config, rt: Runtime) -> list[Batch]:
    """This rank's micro-batches of the global batch that starts at sample `samples_seen`."""
    micro = cfg.batch.micro_batch
    return [data.micro_batch(samples_seen + (m * rt.dp_size + rt.dp_rank) * micro, micro)
            for m in range(cfg.batch.grad_accum)]


@torch.no_grad()
def validation_loss(model, data: TokenWindows, cfg: Config, rt: Runtime) -> float:
    """Token-mean loss over data.validation.batches micro-batches per rank."""
    model.eval()
    micro, total, count = cfg.batch.micro_batch, torch.zeros((), device=rt.device), 0
    pipe = getattr(model, "pipeline", None)
    batches = [data.micro_batch((b * rt.dp_size + rt.dp_rank) * micro, micro) for b in range(cfg.data.validation.batches)]
    if pipe is not None:  # the schedule's forward-only pass, grad_accum micro-batches at a time
        n = cfg.batch.grad_accum
        # whole rounds of n: padded with micro-batches that carry no label (no loss, not counted)
        pad = Batch(batches[0].inputs, torch.full_like(batches[0].labels, -100), documents=batches[0].documents)
        batches += [pad] * (-len(batches) % n)
        for r in range(0, len(batches), n):
            inputs, labels, documents = stacked(batches[r:r + n], rt.device)
            with parallel.step_context(Batch(inputs, labels)):
                total += pipe.run(inputs, labels, 1.0, train=False, documents=documents)
        count = sum(int(b.labelled) for b in batches)
    for batch in batches if pipe is None else ():
        batch = batch.to(rt.device)
        with layout_context(cfg, batch) as local:
            loss = batch_loss_sum(model, local)
        total += local_value(loss).float()
        count += int(batch.labelled)
    model.train()
    n = int(sum_over(torch.tensor(float(count), device=rt.device), rt.dp_group, rt.world))
    return float(sum_over(total, rt.loss_group, rt.world)) / max(1, n)


def mixed_precision(cfg: Config, rt: Runtime):
    """Mixed precision outside FSDP2 (DDP, one process) comes from autocast; FSDP2 casts via its policy."""
    if rt.mesh is None and cfg.precision.param_dtype != cfg.precision.master_dtype:
        return torch.autocast(rt.device.type, dtype=DTYPES[cfg.precision.param_dtype])
    return None


@dataclass
class Run:
    """Everything the loop needs, built once."""

    cfg: Config
    rt: Runtime
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainState
    data: TokenWindows
    val: TokenWindows | None
    metrics: Metrics
    checkpointer: Checkpointer
    float8: bool


def setup(cfg: Config) -> Run:
    check_torch(cfg.runtime.min_torch)
    configure_backends(cfg)
    rt = init_runtime(cfg)
    if not rt.is_cuda:
        # DTensor warns that CPU random ops are not offset-tracked; materialise() handles the seeding.
        warnings.filterwarnings("ignore", message="DTensor random")
    ck_root = Path(cfg.checkpoint.dir)
    check_shared_dir(ck_root, rt)
    # Find the run's own checkpoint first: a full-training resume then never reads the pretrained files.
    latest = latest_checkpoint(ck_root, rt) if cfg.checkpoint.resume else None
    model, fp8 = prepare_model(cfg, rt, from_checkpoint=latest is not None)
    optimizer = build_optimizer(model, cfg, rt)
    state = TrainState(model, optimizer, frozen_ok=cfg.task.kind != "full", flatten=cfg.parallel.pp > 1)
    if latest is not None:
        load_checkpoint(state, latest)
        log(f"resumed from {latest} at step {state.step} (samples seen {state.samples_seen})")
    verify_replicas(model, rt)
    vocab, b = unwrap(model).config.vocab_size, cfg.batch
    data = TokenWindows(cfg.data, b.seq_len, vocab, cfg.training.seed)
    val = TokenWindows.validation(cfg.data, b.seq_len, vocab, cfg.training.seed)
    metrics = Metrics(cfg, rt, b.micro_batch * b.grad_accum * rt.dp_size * b.seq_len, b.seq_len)
    run = Run(cfg, rt, model, optimizer, state, data, val, metrics, Checkpointer(cfg, rt), fp8)
    announce(run)
    return run


def announce(run: Run) -> None:
    cfg, rt, par, b = run.cfg, run.rt, run.cfg.parallel, run.cfg.batch
    total, trainable, names = count_params(run.model)
    mesh = None if rt.mesh is None else list(rt.mesh.shape)
    run.metrics.write({"event": "start", "step": run.state.step, "world": rt.world, "device": rt.device.type,
                       "sharding": par.sharding, "mesh": mesh, "total_params": total, "trainable_params": trainable,
                       "trainable": names, "data": run.data.path or "synthetic", "dtypes": param_dtypes(run.model),
                       "document_attention": run.data.documents})
    pipe = f"pipeline {par.pp} x {par.pp_schedule} (params counted: this rank's stages), " if par.pp > 1 else ""
    log(f"{cfg.model.name}: {total:,} params ({trainable:,} trainable), task {cfg.task.kind}, "
        f"{par.sharding} on {rt.world} x {rt.device.type} mesh {None if mesh is None else tuple(mesh)}, {pipe}"
        f"AC {par.activation_checkpointing}, micro-batch {b.micro_batch} x accum {b.grad_accum} x seq {b.seq_len}, "
        f"data {run.data.path or 'synthetic'}")
    if run.data.path and not run.data.documents and cfg.data.document_attention and run.data.meta.get("eos_token_id") is not None:
        log(f"data: {run.data.path} records no sample boundaries (.starts beside the .bin files): one causal "
            "sequence per window; run this bundle's prepare_data.py again for per-document attention")


def train(cfg: Config) -> None:
    run = setup(cfg)
    st, every_log, every_ck = run.state, cfg.logging.every_steps, cfg.checkpoint.every_steps
    every_val = cfg.data.validation.every_steps if run.val is not None else 0
    amp = mixed_precision(cfg, run.rt)
    collector = GarbageCollection(cfg.runtime.gc_every_steps)
    diag = Diagnostics(cfg, run.rt.rank, run.rt.is_cuda)
    run.model.train()
    streak = 0  # non-finite steps in a row
    while st.step < cfg.schedule.steps:
        lr = lr_at(st.step, cfg)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        diag.before(st.step + 1)
        result = train_step(run.model, run.optimizer, step_batches(run.data, st.samples_seen, cfg, run.rt), cfg,
                            run.rt, amp, run.float8)
        st.step += 1
        diag.after(st.step)
        st.samples_seen += cfg.batch.micro_batch * cfg.batch.grad_accum * run.rt.dp_size
        st.skipped += result.skipped
        streak = streak + 1 if result.skipped else 0
        if result.skipped:
            log(f"step {st.step:6d} | skipped: loss {result.loss} / grad norm {result.grad_norm} not finite")
        if streak > cfg.training.max_consecutive_nonfinite:
            raise SystemExit(f"train.py: {streak} steps in a row had a non-finite loss or gradient norm "
                             f"(training.max_consecutive_nonfinite {cfg.training.max_consecutive_nonfinite}): "
                             "lower optimizer.lr or check the data")
        collector.step(st.step)
        run.metrics.step_done(st.step, result.loss, result.grad_norm, lr, every_log, st.skipped)
        if every_val and (st.step % every_val == 0 or st.step == cfg.schedule.steps):
            with run.metrics.paused(), amp or contextlib.nullcontext():
                v = validation_loss(run.model, run.val, cfg, run.rt)
            run.metrics.write({"step": st.step, "val_loss": v})
            log(f"step {st.step:6d} | validation loss {v:.4f}")
        if every_ck > 0 and (st.step % every_ck == 0 or st.step == cfg.schedule.steps):
            with run.metrics.paused():
                log(f"checkpoint {run.checkpointer.save(st)}")
    finish(run)


def finish(run: Run) -> None:
    run.checkpointer.wait()
    if run.cfg.export.at_end:
        export_model(run.model, run.cfg, run.rt, export_dir(run.cfg, f"step-{run.state.step:08d}"),
                     merged=run.cfg.export.merged)
    run.metrics.summary()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def export(cfg: Config, name: str, merged: bool) -> None:
    """--export-from: load one DCP checkpoint onto the sharded model and write it in HF format."""
    check_torch(cfg.runtime.min_torch)
    rt = init_runtime(cfg)
    path = resolve_checkpoint(name, Path(cfg.checkpoint.dir), rt)
    model, _ = prepare_model(cfg, rt, from_checkpoint=True)
    state = TrainState(model, build_optimizer(model, cfg, rt), frozen_ok=cfg.task.kind != "full",
                       flatten=cfg.parallel.pp > 1)
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
