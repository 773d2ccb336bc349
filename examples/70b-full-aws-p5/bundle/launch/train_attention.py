"""Document attention for packed data, the same in every layout.

prepare_data.py records where every sample starts (`<shard>.starts`); train_data.py turns that into
a document id per token of a window (never inferred from an EOS token: a chat template may put EOS
inside a sample). From the ids come, as torchtitan builds its document masks:

* positions that restart at each document (rotary embeddings see each sample from 0);
* a causal mask that keeps attention inside each document: a 4-D mask handed to the Hugging Face
  model (transformers uses a 4-D mask as given), boolean for SDPA, additive for eager;
  flash_attention_2 takes the restarting positions instead (its varlen path, as transformers does).

Layouts: one process, FSDP, HSDP and DDP feed the model the whole window. Tensor parallelism
all-gathers the sequence before attention, so the whole window's mask fits it; a pipeline stage
builds the mask for its micro-batch from the same ids (train_pipeline.stage_forward). Context
parallelism shards the window into 2 x cp load-balanced chunks (rank r: chunks r and 2cp-1-r, as
torch's context_parallel); attention all-gathers keys and values over the CP group and scores this
rank's queries against the whole window under the mask, the all-gather context parallelism the
Llama 3 paper describes for document masks (arXiv 2407.21783, section 3.3.2).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils.checkpoint

CP_ATTENTION = "gpuprov_cp"  # the attention implementation name registered with transformers


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Position ids restarting at each document: ids [7 7 7 8 8] -> [0 1 2 0 1]."""
    s = documents.shape[-1]
    idx = torch.arange(s, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first


def document_mask(documents: torch.Tensor, q_index: torch.Tensor | None = None,
                  k_index: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [b, 1, q, k]: query i sees key j when both lie in one document and j <= i.

    `documents` holds the whole window's ids [b, s]; q_index / k_index the window positions of the
    queries and keys (context parallelism: this rank's chunks, and the all-gathered order)."""
    s = documents.shape[-1]
    q = torch.arange(s, device=documents.device) if q_index is None else q_index
    k = torch.arange(s, device=documents.device) if k_index is None else k_index
    same = documents[:, q].unsqueeze(-1) == documents[:, k].unsqueeze(-2)
    return (same & (k.unsqueeze(0) <= q.unsqueeze(1))).unsqueeze(1)


def model_inputs(impl: str, documents: torch.Tensor | None, positions: torch.Tensor | None = None,
                 q_index: torch.Tensor | None = None, k_index: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> dict:
    """The keyword arguments that give the model per-document positions and masks (none without
    documents: one causal sequence per window)."""
    if documents is None:
        return {} if positions is None else {"position_ids": positions}
    if positions is None:
        positions = document_positions(documents)
    if impl == "flash_attention_2":
        return {"position_ids": positions}  # transformers' varlen path splits at each restart
    mask = document_mask(documents, q_index, k_index)
    if impl == "eager":  # eager adds its mask to the scores
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
    return {"position_ids": positions, "attention_mask": mask}


# ---------------------------------------------------------------------------- context parallel


def cp_query_index(seq: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Window positions of CP rank `rank`'s tokens: chunks rank and 2cp-1-rank of 2cp (load-balanced
    causal work, as torch's context_parallel shards)."""
    if seq % (2 * cp):
        from train_config import ConfigError

        raise ConfigError(f"parallel.cp {cp}: batch.seq_len {seq} must be a multiple of 2 x cp = {2 * cp}")
    c = seq // (2 * cp)
    idx = torch.arange(seq, device=device)
    return torch.cat([idx[rank * c:(rank + 1) * c], idx[(2 * cp - 1 - rank) * c:(2 * cp - rank) * c]])


def cp_key_index(seq: int, cp: int, device=None) -> torch.Tensor:
    """Window positions of the keys after the all-gather: every rank's chunks, in rank order."""
    return torch.cat([cp_query_index(seq, cp, r, device) for r in range(cp)])


class _GatherSeq(torch.autograd.Function):
    """All-gather along the sequence (dim 2 of [b, heads, s, d]); backward sums every rank's
    gradient for this rank's slice (reduce-scatter on NCCL; gloo has none: all-reduce and slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.n, ctx.rank = group, dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ctx.n)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        chunks = [c.contiguous() for c in grad.chunk(ctx.n, dim=2)]
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(chunks[0])
            dist.reduce_scatter(out, chunks, group=ctx.group)
            return out, None
        full = torch.cat(chunks, dim=2)
        dist.all_reduce(full, group=ctx.group)
        return full.chunk(ctx.n, dim=2)[ctx.rank].contiguous(), None


_CP_GROUP: list = []  # the CP process group while a documents step runs (parallel.step_context)


def cp_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA over the whole window's keys: this rank's queries, keys and values gathered from the CP
    group (when a documents step runs; otherwise plain SDPA, which torch's ring attention wraps)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _CP_GROUP:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    group = _CP_GROUP[0]

    def gathered(q, k, v, mask):
        k, v = _GatherSeq.apply(k, group), _GatherSeq.apply(v, group)
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0]

    # backward gathers again rather than keep every layer's whole-window keys and values: what stays
    # is this rank's q, k, v (as under ring attention) and the one mask all layers share
    out = torch.utils.checkpoint.checkpoint(gathered, query, key, value, attention_mask, use_reentrant=False)
    return out, None


def use_cp_attention(model: torch.nn.Module) -> None:
    """Register cp_attention with transformers and switch the model's attention to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = CP_ATTENTION
