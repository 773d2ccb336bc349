"""Tensor, context and pipeline parallelism as per-GPU memory terms (torchtitan's 2-D/3-D layouts).

The mesh is torchtitan's: world = dp_replicate x dp_shard x cp x tp (x pp), FSDP shards over
dp_shard x cp (torchtitan parallel_dims.py, mesh "dp_shard_cp"). The FSDP estimate in memory.py
runs with that shard degree; this module then scales its phases to one (tp, cp, pp) rank:

* TP (torchtitan@9dec370 torchtitan/parallelisms/parallelize_llama.py `apply_tp`): q/k/v, gate/up
  colwise, o/down rowwise, embedding rowwise, output colwise, so every linear and the embedding /
  head hold 1/tp of their weights; the RMSNorm weights are replicated on every TP rank
  (SequenceParallel keeps them whole).
* Sequence parallelism: with TP+SP every activation of a block is split tp ways (Korthikanti et
  al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.2.2 and
  Table 2: sbh(34/t) per layer). Megatron stores only the sequence shard of each linear's input
  and all-gathers it again in backward; DTensor's ColwiseParallel saves the gathered (full
  sequence) input the matmul consumed, so without checkpointing the attention's and the MLP's
  gathered inputs are held whole (term `tp_gathered_inputs`); with checkpointing only the block
  being recomputed holds them.
* Loss parallel (torchtitan `loss_parallel`): logits stay sharded over the vocabulary (1/tp).
* CP (ring attention, torch 2.13 torch/distributed/tensor/experimental/_context_parallel/
  _attention.py): each rank holds seq_len/cp tokens; backward keeps fp32 dq/dk/dv accumulators
  (`accum_dtype = float32` under `convert_to_f32`), the K/V chunk it sends and the one it
  receives (`kv_rotater`), and the fp32 dK/dV chunks in flight (`dkv_rotater`): term
  `cp_ring_buffers`, one block at a time. gpuprov's trainer on packed documents runs no ring: each
  layer all-gathers the window's keys and values under the document mask (term `cp_kv_gather`).
* PP (torch.distributed.pipelining under torchtitan, Schedule1F1B or ScheduleInterleaved1F1B): pipeline.py
  walks each rank's forwards and backwards in the schedule's order and records what the rank holds at each
  backward (blocks gathered, gradients whole or already reduced, activations in flight, kept outputs); each
  such moment is sized here; the busiest wins.

Pure arithmetic on the estimate's phases: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from gpuprov.errors import GpuprovError
from gpuprov.sizing import idle_cache, pipeline

# Terms proportional to the parameters one rank holds before FSDP shards them.
_PARAM_TERMS = ("parameters", "gradients", "optimizer_states", "fp32_master", "comm_buckets",
                "autocast_weight_cache", "optimizer_step_transient")
# Per-token activation terms: split over the sequence (CP) and over TP (+SP).
_ACT_TERMS = ("activations", "activation_transient", "logits", "cross_entropy")
PARALLEL_TERMS: tuple[str, ...] = ("tp_gathered_inputs", "tp_backward_buffers", "cp_ring_buffers", "cp_kv_gather",
                                   "pp_stage_outputs")


@dataclass(frozen=True)
class Layout:
    """How one model replica is split: tensor, context, pipeline and data-parallel ranks."""
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1  # gpus / (tp * cp * pp): the FSDP/HSDP/DDP ranks of one model replica's shard

    @property
    def model_parallel(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def model_shards(self) -> int:
        """Ways TP and PP split the weights (CP ranks hold the same weights, FSDP-sharded)."""
        return self.tp * self.pp

    @property
    def active(self) -> bool:
        return self.model_parallel > 1


def layout(setup: Any) -> Layout:
    return _layout(getattr(setup, "tp", 1) or 1, getattr(setup, "cp", 1) or 1, getattr(setup, "pp", 1) or 1, setup.gpus)


@lru_cache(maxsize=1024)
def _layout(tp: int, cp: int, pp: int, gpus: int) -> Layout:  # the planner asks thousands of times
    return Layout(tp=tp, cp=cp, pp=pp, dp=max(1, gpus // max(1, tp * cp * pp)))


def validate(arch: Any, setup: Any) -> None:
    """One-line errors for layouts the trainer cannot build."""
    for flag in ("tp", "cp", "pp"):
        v = getattr(setup, flag, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise GpuprovError(f"--{flag} must be a positive integer, got {v!r}")
    lay = layout(setup)
    if not lay.active:
        return
    mp = lay.model_parallel
    if setup.gpus % mp:
        raise GpuprovError(f"--tp {lay.tp} x --cp {lay.cp} x --pp {lay.pp} = {mp} does not divide {setup.gpus} GPUs")
    if setup.task != "full":
        raise GpuprovError("--tp/--cp/--pp apply to --task full (LoRA/QLoRA adapters are not tensor-parallel here)")
    if setup.sharding not in ("fsdp", "hsdp", "none"):
        raise GpuprovError(f"--sharding {setup.sharding} does not combine with --tp/--cp/--pp; use fsdp or hsdp")
    if setup.sharding == "none" and lay.dp > 1:
        raise GpuprovError(f"--sharding none leaves {lay.dp} data-parallel ranks; use fsdp or hsdp")
    if lay.tp > 1:
        for name, value in (("attention heads", arch.num_attention_heads), ("key/value heads", arch.num_kv_heads),
                            ("intermediate size", arch.intermediate_size)):
            if value % lay.tp:
                raise GpuprovError(f"--tp {lay.tp} does not divide the {value} {name} of {arch.name}")
        if setup.seq_len % lay.tp:
            raise GpuprovError(f"sequence parallelism splits --seq-len {setup.seq_len} {lay.tp} ways: pick a multiple of --tp")
    if lay.cp > 1 and setup.seq_len % (2 * lay.cp):
        raise GpuprovError(f"context parallelism (load-balanced ring) needs --seq-len a multiple of 2 x --cp = {2 * lay.cp}")
    if lay.pp > arch.num_layers:
        raise GpuprovError(f"--pp {lay.pp} exceeds the {arch.num_layers} layers of {arch.name}")
    schedule = _schedule(setup)
    if schedule not in pipeline.SCHEDULES:
        raise GpuprovError(f"pipeline schedule {schedule!r} is not one of {', '.join(pipeline.SCHEDULES)}")
    if lay.pp > 1 and schedule == "Interleaved1F1B":
        n = int(getattr(setup, "grad_accumulation_steps", 1) or 1)
        if 2 * lay.pp > arch.num_layers:
            raise GpuprovError(f"Interleaved1F1B runs 2 x --pp {lay.pp} stages, more than the {arch.num_layers} layers of {arch.name}")
        if n % lay.pp:  # torch ScheduleInterleaved1F1B raises on this
            raise GpuprovError(f"Interleaved1F1B needs the micro-batches ({n}) to be a multiple of --pp {lay.pp}")
    if setup.sharding == "hsdp":
        group = setup.shard_group if setup.shard_group is not None else min(setup.gpus_per_node, setup.gpus)
        if group % (lay.tp * lay.pp):
            raise GpuprovError(f"hsdp shard group of {group} GPUs is not a multiple of --tp x --pp = {lay.tp * lay.pp}")


def fsdp_degree(setup: Any, shard: int) -> int:
    """FSDP shard degree once TP and PP have taken their ranks (CP ranks stay in FSDP)."""
    lay = layout(setup)
    return max(1, shard // (lay.tp * lay.pp))


def communicators(setup: Any) -> int:
    """NCCL communicators a rank holds: one per mesh dimension larger than one (at least one)."""
    lay = layout(setup)
    return max(1, sum(1 for d in (lay.tp, lay.cp, lay.pp, lay.dp) if d > 1))


# ---------------------------------------------------------------------------- stage shapes


def _norm_params(arch: Any) -> int:
    return arch.norm_params()  # a block's norms: TP leaves them whole


_NONE: pipeline.Part = (0, False, False)


@dataclass(frozen=True)
class Stage:
    """One moment of one (tp, cp, pp) rank: what it holds when a backward starts (pipeline.Moment in bytes' terms)."""

    name: str
    layers: int  # blocks on this rank (their sharded states)
    embedding: bool
    head: bool  # this backward starts at the loss: final norm, output head and logits live
    in_flight: int  # micro-batches of activations held
    held: pipeline.Part = _NONE  # (blocks, embedding, head) whose sharded states the rank holds
    gathered: pipeline.Part = _NONE  # ... that FSDP holds gathered now
    grads: pipeline.Part = _NONE  # ... whose gradients are whole (unsharded) now
    reduced: pipeline.Part = _NONE  # ... already reduce-scattered this step (sharded fp32 gradients)
    act_layers: int = 0  # blocks x micro-batches of saved activations
    outputs: int = 0  # hidden-sized tensors pipelining keeps (output_chunks, receive buffers)
    logit_chunks: int = 0  # the last stage's kept outputs (vocab-sharded logits)
    end: bool = False  # the step's backwards are done (optimizer step, output merge)


def _schedule(setup: Any) -> str:
    return getattr(setup, "pp_schedule", "1F1B") or "1F1B"


def stages(arch: Any, setup: Any, lay: Layout | None = None) -> list[Stage]:
    """Every candidate peak: the whole model for pp 1, else each pipeline rank's busiest backwards and its end."""
    lay = lay or layout(setup)
    if lay.pp == 1:
        whole = (arch.num_layers, True, True)
        return [Stage("", arch.num_layers, True, True, 1, whole, whole, whole, _NONE, arch.num_layers)]
    n = int(getattr(setup, "grad_accumulation_steps", 1) or 1)
    fsdp = setup.sharding in ("fsdp", "hsdp")
    keeps_logits = bool(getattr(setup, "pp_keeps_logits", False))  # else the last stage's forward ends in its loss
    out = []
    for m in pipeline.moments(arch.num_layers, lay.pp, n, _schedule(setup), fsdp):
        name = (f"pipeline rank {m.rank} after its last backward" if m.end else
                f"pipeline stage {m.stage} (rank {m.rank}), backward of micro-batch {m.micro_batch}")
        out.append(Stage(name, m.held[0], m.held[1], m.loss, m.in_flight, m.held, m.gathered, m.grads, m.reduced,
                         m.act_layers, m.outputs, m.logit_chunks if keeps_logits else 0, m.end))
    return out


def _part_params(arch: Any, part: pipeline.Part, tp: int, layer_params: int) -> float:
    """Parameters of (blocks, embedding, head) one TP rank holds: linears split tp ways, norms whole."""
    blocks, emb, head = part
    norms = _norm_params(arch)
    held = blocks * ((layer_params - norms) / tp + norms)
    held += arch.embedding_params / tp if emb else 0.0
    if head:
        held += arch.hidden_size  # final norm, replicated
        held += (arch.lm_head_params or (0 if emb else arch.embedding_params)) / tp  # a tied head's own copy
    return held


def _stage_phase(arch: Any, lay: Layout, st: Stage, terms: dict[str, int], a: int, layer_params: int,
                 shard: int, piped_fsdp: bool) -> dict[str, int]:
    t, c = lay.tp, lay.cp
    frac = {k: _part_params(arch, getattr(st, k), t, layer_params) / arch.params
            for k in ("held", "gathered", "grads", "reduced")}
    out = dict(terms)
    for k in _PARAM_TERMS:
        if k in out:
            out[k] = int(out[k] * frac["held"])
    if piped_fsdp and "gradients" in out:
        # whole fp32 gradients of the stages between first and last backward, plus the sharded ones of every
        # stage the rank holds: FSDP2 allocates them on the reduce-scatter stream (foreach_reduce: reduce_output,
        # kept as the sharded .grad) and the caching allocator serves a stream only from its own blocks
        # (c10/cuda/CUDACachingAllocator.cpp get_free_block), so after the first step that stream keeps them
        # reserved mid-step too, as memory.py counts them for FSDP without PP.
        whole = terms["gradients"]  # the whole model's, unsharded (memory_weights: grad shard 1 under PP)
        out["gradients"] = int(whole * frac["grads"] + whole / shard * frac["held"])
    root_all = arch.params - arch.blocks_params()
    if "gathered_params" in out and out["gathered_params"]:
        root_bytes = a * root_all
        layer_part = max(0, out["gathered_params"] - root_bytes)
        norms = _norm_params(arch)
        lf = ((layer_params - norms) / t + norms) / layer_params
        root_share = (_part_params(arch, (0,) + st.gathered[1:], t, layer_params) / root_all) if root_all else 0
        if piped_fsdp:  # every block was counted gathered: this rank keeps the stages it has gathered now
            layer_part *= st.gathered[0] / arch.num_layers
        else:
            root_share = (_part_params(arch, (0,) + st.held[1:], t, layer_params) / root_all) if root_all else 0
        out["gathered_params"] = int(layer_part * lf + root_bytes * root_share)
    if "reduce_scatter_buffers" in out:
        norms = _norm_params(arch)
        out["reduce_scatter_buffers"] = int(out["reduce_scatter_buffers"] * ((layer_params - norms) / t + norms) / layer_params)
    for k in _ACT_TERMS:
        if k not in out:
            continue
        v = out[k] / (t * c)
        if k == "activations":
            v *= st.act_layers / arch.num_layers
        if k in ("logits", "cross_entropy") and not st.head:
            v = 0
        out[k] = int(v)
    return out


def _gathered_inputs(arch: Any, setup: Any, lay: Layout, st: Stage, tokens: int, a: int, phase: str) -> int:
    """DTensor ColwiseParallel saves the all-gathered (full sequence) input of attention and MLP; the
    output head (ColwiseParallel, input_layouts Shard(1)) saves the gathered final-norm output until
    its backward, which comes right after the loss's."""
    if lay.tp == 1:
        return 0
    full = (tokens / lay.cp) * a * arch.hidden_size * (1 - 1 / lay.tp)  # one full-sequence hidden tensor
    head = int(full) if (st.head and phase == "a") else 0
    if setup.activation_checkpointing == "none":
        return int(2 * full * st.act_layers) + head
    return int(2 * full) if phase == "b" else head  # the block being recomputed


def tp_backward_buffers(arch: Any, setup: Any, tokens: int, a: int) -> int:
    """Full-sequence gradients of the block running backward under TP + SP. The backward of the
    rowwise reduce-scatter (Partial -> Shard(1)) all-gathers the output gradient to the full sequence,
    and the colwise matmuls' input gradient is a full-sequence Partial until its reduce-scatter; where
    two matmuls share the gathered input (q/k/v, w1/w3) autograd adds their two full-sequence gradients
    (torch/distributed/tensor/_redistribute.py Redistribute.backward; torch/csrc/autograd InputBuffer):
    three such tensors at once."""
    lay = layout(setup)
    if lay.tp == 1:
        return 0
    return int(3 * (tokens / lay.cp) * a * arch.hidden_size * (1 - 1 / lay.tp))


def ring_buffers(arch: Any, setup: Any, tokens: int, a: int) -> int:
    """Ring attention's backward of one block: fp32 dq/dk/dv, K/V sent + received, fp32 dK/dV in flight.
    None where the trainer gathers keys and values under a document mask instead (cp_kv_gather)."""
    lay = layout(setup)
    if lay.cp == 1 or getattr(setup, "document_mask", False):
        return 0
    local = tokens / lay.cp
    kv = (arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim) / lay.tp
    q = arch.q_dim / lay.tp
    per_token = 2 * a * 2 * kv + 4 * (q + 2 * kv) + 2 * 4 * 2 * kv
    return int(local * per_token)


def cp_kv_gather(arch: Any, setup: Any, tokens: int, a: int) -> int:
    """Per-document attention under CP (gpuprov templates/launch/train_attention.py cp_attention): each layer
    all-gathers the whole window's keys and values over the CP group and scores this rank's queries against them
    under the mask, inside a checkpoint, so backward gathers them again one layer at a time and reduce-scatters
    their gradients. With a mask transformers repeats GQA keys and values to the query heads before SDPA
    (transformers integrations/sdpa_attention.py use_gqa_in_sdpa: only without an attention_mask), so the block
    running backward holds the whole window's repeated K and V that SDPA saved and their two gradients, at the
    TP rank's heads: 4 x tokens x attended K/V width / tp."""
    lay = layout(setup)
    if lay.cp == 1 or not getattr(setup, "document_mask", False):
        return 0
    kv = arch.q_dim if arch.num_kv_heads < arch.num_attention_heads else arch.kv_dim
    return int(4 * tokens * kv / lay.tp * a)


def stage_outputs(arch: Any, lay: Layout, st: Stage, tokens: int, a: int, merged: bool = False) -> int:
    """What torch.distributed.pipelining keeps beside the blocks' saved tensors (pipeline.py): each non-last
    stage's outputs of this step and its per-micro-batch receive buffers (hidden-sized, sequence-split over TP and
    CP), and the last stage's outputs: the logits, vocabulary-sharded under loss parallel, twice over while the
    step merges them (stage.py output_chunks, PipelineScheduleSingle.step -> _merge_outputs)."""
    if lay.pp == 1:
        return 0
    local = tokens / lay.cp
    hidden = local / lay.tp * arch.hidden_size * a
    logits = local * arch.vocab_size / lay.tp * a
    return int(st.outputs * hidden + st.logit_chunks * logits * (2 if merged else 1))


def _stranded_at_loss(arch: Any, setup: Any, lay: Layout, st: Stage, tokens: int, a: int, whole: dict[str, int]) -> int:
    """The allocator's idle cache when this rank's loss starts (memory.py's floor on fragmentation), at the
    rank's shapes: compiled blocks are replayed with their TP buffers (idle_cache.py); the eager closed form,
    sized on the whole sequence and width, shrinks with the rank's tokens and widths. No loss, no floor."""
    if not st.head:
        return 0
    if setup.compile:
        return idle_cache.compiled_stranded_at_loss(arch, setup, int(tokens / lay.cp), a, lay.tp, st.act_layers)
    return int(whole.get("allocator_fragmentation", 0) / (lay.tp * lay.cp))


def _shard(setup: Any) -> int:
    """FSDP shard degree (memory.py's): gpus, or the HSDP group, over the TP x PP ranks."""
    group = setup.gpus
    if setup.sharding == "hsdp":
        group = setup.shard_group if setup.shard_group is not None else min(setup.gpus_per_node, setup.gpus)
    return fsdp_degree(setup, group)


def apply(arch: Any, setup: Any, phases: list[Any], tokens: int, a: int) -> list[Any]:
    """The phases of every candidate moment of one (tp, cp, pp) rank; the caller takes the largest."""
    lay = layout(setup)
    if not lay.active:
        return list(phases)
    out = []
    layer_params = arch.layer_params()
    ring = ring_buffers(arch, setup, tokens, a)
    gather = cp_kv_gather(arch, setup, tokens, a)
    saved_bias = setup.activation_checkpointing == "none" and not setup.compile  # activations.document_masks
    tp_grads = tp_backward_buffers(arch, setup, tokens, a)
    piped = lay.pp > 1 and setup.sharding in ("fsdp", "hsdp")  # memory_weights.pipeline_keeps_stage
    shard = _shard(setup)
    for st in stages(arch, setup, lay):
        tags = "abc" if lay.pp == 1 else ("ab" if not st.end else ("cm" if st.logit_chunks else "c"))
        for tag in tags:
            ph = phases["abc".index(tag if tag != "m" else "c")]
            terms = _stage_phase(arch, lay, st, ph.terms, a, layer_params, shard, piped)
            if tag == "m":  # the last stage merging its outputs as the step returns, before the optimizer step
                terms["optimizer_step_transient"] = 0
            terms["tp_gathered_inputs"] = _gathered_inputs(arch, setup, lay, st, tokens, a, tag) if tag in "ab" else 0
            terms["tp_backward_buffers"] = tp_grads if tag == "b" else 0
            terms["cp_ring_buffers"] = ring if tag == "b" else 0
            terms["cp_kv_gather"] = gather if tag == "b" else 0
            _document_terms(terms, st, arch.num_layers, saved_bias)
            terms["pp_stage_outputs"] = stage_outputs(arch, lay, st, tokens, a, merged=tag == "m")
            if tag == "a":
                terms["allocator_fragmentation"] = _stranded_at_loss(arch, setup, lay, st, tokens, a, ph.terms)
            base = "end of step (outputs merged)" if tag == "m" else ph.name
            name = f"{base}, {st.name}" if st.name else base
            out.append(replace(ph, name=name, terms=terms))
    return out


def _document_terms(terms: dict[str, int], st: Stage, layers: int, saved_bias: bool) -> None:
    """Per-document masks at one rank (activations.document_masks sized them at this rank's CP queries; TP
    gathers the sequence before attention, so they stay whole): a boolean mask for each micro-batch in flight,
    and, where every block keeps its bias, the biases of the blocks whose activations the rank holds."""
    if terms.get("document_mask"):
        terms["document_mask"] = int(terms["document_mask"] * st.in_flight)
    if terms.get("attention_bias") and saved_bias:
        terms["attention_bias"] = int(terms["attention_bias"] * st.act_layers / layers)


def assumptions(arch: Any, setup: Any) -> list[str]:
    lay = layout(setup)
    if not lay.active:
        return ["no tensor/pipeline/context parallelism: each GPU processes micro-batch x seq-len tokens"]
    out = [f"layout tp {lay.tp} x cp {lay.cp} x pp {lay.pp} x data-parallel {lay.dp} (FSDP over dp x cp, torchtitan's mesh)"]
    if lay.tp > 1:
        out.append(
            f"TP {lay.tp} + sequence parallelism (torchtitan plan): linears, embedding and head split {lay.tp} ways, RMSNorm"
            " weights replicated; block activations split tp ways (Korthikanti et al. 2022, Table 2) except the"
            " all-gathered attention/MLP inputs DTensor saves at full sequence (and the head's, until its backward);"
            " loss parallel keeps logits vocab-sharded, its backward holding four fp32 vocab-shard copies"
            " (torch loss.py _nll_loss_and_log_softmax_backward); a block's backward holds three full-sequence"
            " gradients (the all-gathered output gradient, the colwise inputs' partial gradients and their sum)"
        )
    if lay.cp > 1 and getattr(setup, "document_mask", False):
        out.append(
            f"CP {lay.cp} under document masks: {setup.seq_len // lay.cp} tokens per rank; each layer all-gathers the"
            " window's keys and values over the CP group (again in backward, under a checkpoint) and reduce-scatters"
            " their gradients; the block in backward holds the whole window's repeated K/V and their gradients"
        )
    elif lay.cp > 1:
        out.append(
            f"CP {lay.cp} ring attention: {setup.seq_len // lay.cp} tokens per rank; backward holds fp32 dq/dk/dv"
            " accumulators and K/V + fp32 dK/dV chunks in flight (torch context_parallel)"
        )
    if lay.pp > 1:
        sched = _schedule(setup)
        n = int(getattr(setup, "grad_accumulation_steps", 1) or 1)
        v = pipeline.stages_per_rank(sched)
        out.append(
            f"PP {lay.pp} {sched}, {n} micro-batches, {v} stage(s) per rank (blocks split as torchtitan's"
            " generate_split_points); each rank's forwards and backwards in the schedule's order (torch pipelining"
            " schedules.py), its saved activations, kept stage outputs (output_chunks"
            + (": the last stage's logits for every micro-batch, merged as the step returns" if setup.pp_keeps_logits
               else "; the last stage's forward ends in its loss, so it keeps no logits") +
            ") and per-micro-batch receive buffers sized at each backward; the busiest rank is reported"
        )
        if setup.sharding in ("fsdp", "hsdp"):
            out.append(
                "FSDP under PP (torchtitan + torch.distributed.pipelining): no reshard after forward, and no reshard or"
                " gradient sync after each micro-batch's backward, so a stage keeps its blocks gathered from its first"
                " forward and its gradients unsharded (fp32 reduce dtype) from its first to its last backward, where"
                " it reduce-scatters and reshards"
            )
    return out
