"""Pipeline parallelism for gpuprov's trainer (parallel.pp > 1), as torchtitan runs it.

* Stages: the blocks split into pp x v stages (v = 1 for 1F1B, 2 for Interleaved1F1B), the first
  stage num_layers // stages blocks, the middle ones one more while the remainder lasts, the last the
  rest; rank r runs stages r, r + pp, ... (pytorch/torchtitan@9dec370ad26b5f8e9a7333a0e36165018262644b
  torchtitan/parallelisms/pipelining_utils.py generate_split_points, stage_ids_this_rank "loop").
  gpuprov's estimate splits them the same way (gpuprov/sizing/pipeline.py split_layers).
* Each stage is a pruned copy of the whole model, built on the meta device (torchtitan
  pipeline_llama.py): the embedding on the first stage only, the final norm and head on the last,
  the blocks kept under their global index (model.layers.<i>), so pretrained files and checkpoints
  keep Hugging Face names whatever the split.
* FSDP2 per stage with no reshard after forward (torchtitan apply_fsdp under PP);
  torch.distributed.pipelining then skips gradient sync and reshard for every micro-batch but the
  last (stage.py backward_maybe_with_nosync), as the plan sizes it.
* The schedule runs the step's micro-batches (batch.grad_accum of batch.micro_batch samples). The last
  stage's forward ends in the micro-batch's summed cross-entropy, taken as the unpipelined trainer
  takes it (chunked head, or fp32 cross-entropy with the logits freed at once), so no logits wait in
  the schedule's kept outputs; the schedule backpropagates it times the step's scale (global token
  count, as train.py) with its own 1/n gradient scaling off: gradients equal the unpipelined trainer's.
* torch 2.7 (what the bundle installs) and later: step(return_outputs=...) and schedule.eval exist
  only in later releases, so the forward-only pass sets the schedule's backward flag off itself.
* The gradient norm sums the squared norms of all stages over the pipeline group (torchtitan
  clip_grad_norm_ with pp_mesh).
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from train_config import Config, ConfigError

SCHEDULES = {"1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B"}


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "Interleaved1F1B" else 1


def split_layers(num_layers: int, total_stages: int) -> list[int]:
    """Blocks per stage, as torchtitan's generate_split_points places the split points."""
    base, extra = divmod(num_layers, total_stages)
    out = []
    for i in range(total_stages - 1):
        n = base
        if i > 0 and extra > 0:
            n, extra = base + 1, extra - 1
        out.append(n)
    out.append(num_layers - sum(out))
    return out


def stage_bounds(num_layers: int, total_stages: int) -> list[tuple[int, int]]:
    """[start, stop) block indices of every stage."""
    bounds, start = [], 0
    for n in split_layers(num_layers, total_stages):
        bounds.append((start, start + n))
        start += n
    return bounds


def stage_ids(pp_rank: int, pp: int, per_rank: int) -> tuple[int, ...]:
    return tuple(pp_rank + s * pp for s in range(per_rank))


def check(cfg: Config, config) -> None:
    """One-line refusals for what this pipeline does not run."""
    par = cfg.parallel
    if par.pp_schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule {par.pp_schedule!r} is not one of {', '.join(SCHEDULES)}")
    if cfg.task.kind != "full":
        raise ConfigError("parallel.pp runs full training only (LoRA/QLoRA adapters train data-parallel)")
    if par.sharding not in ("fsdp", "hsdp"):
        raise ConfigError(f"parallel.pp needs sharding fsdp or hsdp, not {par.sharding}")
    if par.cp > 1:  # the stages would need ring attention's load-balanced positions; not built here
        raise ConfigError("parallel.pp does not combine with parallel.cp in this trainer: use one of them")
    layers = int(config.num_hidden_layers)
    total = par.pp * stages_per_rank(par.pp_schedule)
    if total > layers:
        raise ConfigError(f"parallel.pp {par.pp} x {stages_per_rank(par.pp_schedule)} stage(s) per rank = {total} "
                          f"stages, more than the model's {layers} blocks")
    n = cfg.batch.grad_accum
    if par.pp_schedule == "Interleaved1F1B" and n % par.pp:
        raise ConfigError(f"Interleaved1F1B needs batch.grad_accum ({n} micro-batches) to be a multiple of parallel.pp {par.pp}")
    if getattr(config, "tie_word_embeddings", False):
        raise ConfigError("parallel.pp puts the embedding and the head on different stages: tied embeddings need an untied model")


# ---------------------------------------------------------------------------- stage models


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
        raise ConfigError(f"parallel.pp needs a Llama-family model (model.embed_tokens / layers / norm / rotary_emb); "
                          f"got {type(model).__name__}")
    return inner


def prune(model: torch.nn.Module, start: int, stop: int, first: bool, last: bool) -> torch.nn.Module:
    """A copy of the (meta) model holding one stage: blocks [start, stop) under their global names."""
    stage = copy.deepcopy(model)
    inner = _decoder(stage)
    inner.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in range(start, stop)})
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        stage.lm_head = None
    stage.forward = types.MethodType(stage_forward, stage)
    return stage


def stage_forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                  documents: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids (first stage) or hidden states in; hidden states out, or on the last stage the
    micro-batch's summed cross-entropy (shape [1]).

    The same steps as the model's own forward (transformers LlamaModel.forward): positions, causal
    mask and rotary tables for the whole sequence, then this stage's blocks. Under TP the hidden
    states are sequence-sharded (s / tp tokens), so the sequence length comes from the stage. The
    loss is taken inside the last stage, as train_model.token_loss_sum takes it (chunked head or
    fp32 cross-entropy, logits freed before backward), so no stage keeps logits between micro-batches.
    `documents` (the micro-batch's document ids): positions and mask per document, as the
    unpipelined trainer builds them (train_attention.model_inputs)."""
    inner = self.model
    h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    seq = h.shape[1] * self.gpuprov_seq_shards
    if documents is not None:
        from train_attention import model_inputs

        kw = model_inputs(self.config._attn_implementation, documents)
        positions, mask = kw["position_ids"], kw.get("attention_mask")
    else:
        positions = torch.arange(seq, device=h.device).unsqueeze(0)
        masks = sys.modules[type(inner).__module__].create_causal_mask
        shape = h.new_empty((h.shape[0], seq, 0))  # only its batch, length, dtype and device are read
        mask = masks(config=self.config, inputs_embeds=shape, attention_mask=None, cache=None, position_ids=positions)
    rope = inner.rotary_emb(h, position_ids=positions)
    for block in inner.layers.values():
        out = block(h, attention_mask=mask, position_embeddings=rope, position_ids=positions)
        h = out[0] if isinstance(out, tuple) else out
    if inner.norm is None:
        return h
    return loss_sum(self, inner.norm(h), labels).reshape(1)  # [1]: the schedule concatenates outputs


def loss_sum(stage: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    from train_model import ChunkedLossHead

    head = stage.lm_head
    if isinstance(head, ChunkedLossHead):
        head.labels = labels
        try:
            return head(h)  # the head returns the summed loss, chunk by chunk
        finally:
            head.labels = None
    logits = head(h)
    cap = getattr(stage.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    del logits
    return loss


class StageModels(torch.nn.ModuleList):
    """This rank's stage models (one, or two under Interleaved1F1B): what train.py, the optimizer and
    the checkpoints see as "the model"."""

    @property
    def config(self):
        return self[0].config

    def get_output_embeddings(self):
        return None  # the head is the last stage's: its forward ends in the loss (stage_forward)


def hf_key(name: str) -> str:
    """A StageModels parameter's name without the stage index ("1.model.layers.9..." -> "model.layers.9...")."""
    head, _, rest = name.partition(".")
    return rest if head.isdigit() else name


# ---------------------------------------------------------------------------- the schedule


@dataclass
class Pipeline:
    """The schedule over this rank's stages, and where the step's loss comes from."""

    schedule: object
    first: bool  # this rank runs stage 0 (feeds the token ids)
    last: bool  # this rank runs the last stage (its outputs are the losses)
    group: object  # the pipeline process group (grad-norm sums, forward-only sends)
    stages: dict = field(default_factory=dict)  # global stage index -> this rank's stage model
    total: int = 1  # stages in the pipeline
    hidden_dtype: torch.dtype = torch.float32  # what flows between stages (FSDP's compute dtype)
    micro_batches: int = 1  # per step: batch.grad_accum
    scale: float = 1.0  # the current step's loss scale (train.py: grad_average / global token count)
    losses: list = field(default_factory=list)

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the schedule backpropagates: the last stage's summed cross-entropy, scaled."""
        return output.sum() * self.scale

    def run(self, inputs: torch.Tensor, labels: torch.Tensor, scale: float, train: bool = True,
            documents: torch.Tensor | None = None) -> torch.Tensor:
        """Forward (and backward) of every micro-batch; the summed cross-entropy on the last stage, 0 elsewhere.
        Labels go to every stage as a keyword (only the last reads them), document ids too (every
        stage masks its attention); the schedule splits them."""
        self.scale, self.losses = scale, []
        docs = {} if documents is None else {"documents": documents}
        args = (inputs,) if self.first else ()
        sched = self.schedule
        if train:
            extra = {"return_outputs": False} if _takes(sched.step, "return_outputs") else {}
            sched.step(*args, target=labels if self.last else None, losses=self.losses if self.last else None,
                       labels=labels, **docs, **extra)
            outputs = self.losses
        else:
            outputs, scale = self.forward_only(inputs, labels, documents), 1.0
        if not self.last:
            return torch.zeros((), device=labels.device)
        return torch.stack([_local(x).detach().float().sum() for x in outputs]).sum() / scale

    def forward_only(self, inputs: torch.Tensor, labels: torch.Tensor,
                     documents: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Every micro-batch through every stage in stage order, sends and receives blocking (validation).
        Torch 2.7's 1F1B schedules always run backward (schedule.eval came later), so this walks the
        stages itself; every rank loops over the same stages, so each send meets its receive."""
        pp, rank, out = dist.get_world_size(self.group), dist.get_rank(self.group), []
        peer = lambda r: dist.get_global_rank(self.group, r)  # noqa: E731
        docs = self.schedule_chunks(documents) if documents is not None else [None] * self.micro_batches
        for ids, lab, doc in zip(self.schedule_chunks(inputs), self.schedule_chunks(labels), docs):
            h = ids
            for g in range(self.total):
                owner, prev = g % pp, (g - 1) % pp
                if owner != rank:
                    continue
                if g > 0 and prev != rank:
                    shape = (ids.shape[0], ids.shape[1] // self.stages[g].gpuprov_seq_shards, self.stages[g].config.hidden_size)
                    h = torch.empty(shape, dtype=self.hidden_dtype, device=ids.device)
                    dist.recv(h, src=peer(prev), group=self.group)
                h = self.stages[g](h, labels=lab, **({} if doc is None else {"documents": doc}))
                if g < self.total - 1 and (g + 1) % pp != rank:
                    dist.send(h.contiguous(), dst=peer((g + 1) % pp), group=self.group)
            if self.last:
                out.append(h)
        return out

    def schedule_chunks(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The micro-batches the schedule would make of a stacked batch (equal splits along the batch)."""
        return list(t.tensor_split(self.micro_batches))


def _takes(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(stages: list[torch.nn.Module], ids: tuple[int, ...], total: int, cfg: Config, device: torch.device,
          group) -> Pipeline:
    """PipelineStage per stage model, and the schedule over batch.grad_accum micro-batches."""
    from torch.distributed.pipelining import PipelineStage, schedules

    pipe_stages = [PipelineStage(m, i, total, device, group=group) for m, i in zip(stages, ids)]
    cls = getattr(schedules, SCHEDULES[cfg.parallel.pp_schedule])
    pipe = Pipeline(schedule=None, first=0 in ids, last=total - 1 in ids, group=group,
                    stages=dict(zip(ids, stages)), total=total, hidden_dtype=hidden_dtype(cfg),
                    micro_batches=cfg.batch.grad_accum)
    multi = stages_per_rank(cfg.parallel.pp_schedule) > 1
    pipe.schedule = cls(pipe_stages if multi else pipe_stages[0], n_microbatches=cfg.batch.grad_accum,
                        loss_fn=pipe.loss_fn, scale_grads=False)
    return pipe


def hidden_dtype(cfg: Config) -> torch.dtype:
    from train_runtime import DTYPES

    return DTYPES[cfg.precision.param_dtype]  # FSDP2's MixedPrecisionPolicy computes every stage in it


def grad_norm_and_clip(params: list[torch.Tensor], max_norm: float, group) -> torch.Tensor:
    """The whole model's gradient norm (every stage's squared norm summed over the pipeline group), then
    clip by it. clip_grad_norm_ with no limit gives this stage's norm over its DTensor shards (torch 2.7
    has no get_total_norm / clip_grads_with_norm_)."""
    norm = _local(torch.nn.utils.clip_grad_norm_(params, float("inf"))).float()
    squared = norm ** 2
    dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    norm = squared.sqrt()
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:  # a non-finite norm gives no coefficient below 1: that step is skipped anyway
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


# ---------------------------------------------------------------------------- building this rank's stages


def prepare_stages(cfg: Config, rt, from_checkpoint: bool) -> tuple[StageModels, bool]:
    """This rank's stages as they train: float8, then per stage TP, AC, compile, FSDP2 and the weights,
    in the order prepare_model uses for the whole model; then the PipelineStages and the schedule."""
    import parallel
    from train_model import (apply_activation_checkpointing, apply_compile, apply_float8, build_model,
                             install_chunked_loss, materialise, transformer_blocks)

    whole, on_meta = build_model(cfg, rt)
    check(cfg, whole.config)
    install_chunked_loss(whole, cfg)
    fp8 = apply_float8(whole, cfg, rt)
    par = cfg.parallel
    total = par.pp * stages_per_rank(par.pp_schedule)
    bounds = stage_bounds(int(whole.config.num_hidden_layers), total)
    ids = stage_ids(rt.pp_rank, par.pp, stages_per_rank(par.pp_schedule))
    models = StageModels()
    for i in ids:
        stage = prune(whole, *bounds[i], first=i == 0, last=i == total - 1)
        stage.gpuprov_seq_shards = par.tp  # sequence parallelism splits the hidden states tp ways
        stage = parallel.parallelize(stage, fp8)
        blocks = transformer_blocks(stage)
        apply_activation_checkpointing(blocks, par.activation_checkpointing)
        apply_compile(blocks, cfg, rt)
        shard_stage(stage, blocks, cfg, rt)
        materialise(stage, on_meta, cfg, rt, from_checkpoint)
        models.append(stage)
    del whole
    models.pipeline = build(list(models), ids, total, cfg, rt.device, rt.pp_group)
    return models, fp8


def shard_stage(stage: torch.nn.Module, blocks: torch.nn.Module, cfg: Config, rt) -> None:
    """FSDP2 on one stage: each block, then the stage (embedding / final norm / head with it), none
    resharded after forward: the stage's micro-batches reuse the gathered weights (torchtitan
    apply_fsdp: reshard_after_forward = not pp_enabled)."""
    from torch.distributed.fsdp import fully_shard

    from train_model import fsdp_kwargs

    kw = fsdp_kwargs(stage, cfg, rt)
    for block in blocks.children():
        fully_shard(block, reshard_after_forward=False, **kw)
    fully_shard(stage, reshard_after_forward=False, **kw)


# ---------------------------------------------------------------------------- export


def export_stages(models: StageModels, cfg: Config, rt, out) -> None:
    """Hugging Face format from the stages: the first rank of each pipeline rank's group streams its
    stages' weights into safetensors shards of at most export.max_shard_gb (one tensor gathered at
    a time), rank 0 names them in pipeline order and writes the index (model.safetensors.index.json,
    what from_pretrained reads for a sharded checkpoint) and config.json."""
    from train_checkpoint import SafetensorsShards, name_shards, write_hf_config
    from train_model import hf_name
    from train_runtime import DTYPES

    dtype = DTYPES[cfg.export.dtype]
    writer = rt.rank % (rt.world // cfg.parallel.pp) == 0  # pp is the mesh's outer dimension: a stage's ranks are consecutive
    shards = SafetensorsShards(out, int(cfg.export.max_shard_gb * 1e9), tag=f"pp{rt.pp_rank:05d}") if writer else None
    for k, v in models.state_dict().items():
        # one tensor at a time: all of a stage's ranks gather it, its first rank keeps it on the host
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        if writer:
            shards.add(hf_name(hf_key(k)), full.detach().to("cpu", dtype).contiguous())
        del full
    parts: list = [None] * rt.world
    dist.all_gather_object(parts, (rt.pp_rank, shards.finish()) if writer else None)
    if rt.rank == 0:
        name_shards(out, [p for _, stage in sorted(x for x in parts if x) for p in stage])
        write_hf_config(models.config, cfg, out)
