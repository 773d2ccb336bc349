"""The allocator's idle cache at the start of backward, replayed from the allocation order of the run's forward.

The loss's logit-sized buffers are larger than any block the forward left cached, so everything the blocks'
forwards left in the cache is reserved and idle when backward starts (allocator.py replays the rules). Two stacks
are traced, each as its code allocates and frees:

* `compiled_stranded_at_loss`: torchtitan's compiled decoder blocks under full activation checkpointing
  (pytorch/torchtitan@9dec370ad26b5f8e9a7333a0e36165018262644b torchtitan/models/llama/model.py: TransformerBlock,
  Attention with repeat_kv, FeedForward; each block compiled whole, so Inductor frees every buffer at its last use
  and fuses elementwise chains into their producers, leaving the norm outputs, the matmul and attention outputs
  and the collectives' buffers). With TP + sequence parallelism (parallelisms/parallelize_llama.py apply_tp) each
  norm output is a sequence shard all-gathered to the full sequence before the colwise matmuls, and each rowwise
  matmul's full-sequence partial output is reduce-scattered back; with float8 linears the sharded input is cast to
  float8 first and gathered in float8 (docs/float8.md at that commit: "float8 all-gather ... for TP (by default for
  Float8Linear)"). Only a block's output outlives it (full AC saves each block's input). Async TP
  (symmetric-memory fused collectives) is not replayed.
* `hf_eager_stranded_at_loss`: transformers v4.38.2 LlamaDecoderLayer / LlamaRMSNorm / LlamaSdpaAttention /
  LlamaMLP under reentrant checkpointing (the forward runs without grad: every intermediate is freed as soon as
  Python drops it), peft 0.10.0 LoRA Linear.forward (bnb Linear4bit.forward: dequantized weight, then the
  defensive clone), then LlamaForCausalLM's legacy loss (`logits.float()`, kept) up to the log-softmax gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from gpuprov.sizing import allocator
from gpuprov.sizing.allocator import CachingAllocator
from gpuprov.sizing.arch import resolve_lora_targets
from gpuprov.usercache import IntMemo


@dataclass(frozen=True)
class BlockShape:
    """One rank's view of a compiled decoder block: full-sequence tokens and widths already split over TP."""

    tokens: int  # tokens of one micro-batch on this rank, full sequence (after CP)
    hidden: int
    q: int  # query (and repeated K/V) width per TP rank
    kv: int  # K/V width per TP rank before repeat_kv
    ffn: int  # MLP width per TP rank
    tp: int
    a: int  # compute element bytes
    float8: bool


def _project_in(A: CachingAllocator, b: BlockShape):
    """Norm output (a sequence shard under SP), its float8 cast, the all-gather: the colwise matmuls' input."""
    shard = b.tokens // b.tp * b.hidden
    out = A.malloc(shard * b.a)
    if b.float8:
        cast = A.malloc(shard)
        A.free(out)
        out = cast
    if b.tp == 1:
        return out
    gathered = A.malloc(b.tokens * b.hidden * (1 if b.float8 else b.a))
    A.free(out)
    return gathered


def _project_out(A: CachingAllocator, b: BlockShape, x, width: int):
    """The rowwise matmul (float8 input cast first) and, under TP, the reduce-scatter of its partial output."""
    if b.float8:
        cast = A.malloc(b.tokens * width)
        A.free(x)
        x = cast
    out = A.malloc(b.tokens * b.hidden * b.a)
    A.free(x)
    if b.tp == 1:
        return out
    scattered = A.malloc(b.tokens // b.tp * b.hidden * b.a)
    A.free(out)
    return scattered


def _block_forward(A: CachingAllocator, b: BlockShape):
    """One block's forward: everything freed at its last use but the block's output."""
    T, a = b.tokens, b.a
    x = _project_in(A, b)
    q, k, v = A.malloc(T * b.q * a), A.malloc(T * b.kv * a), A.malloc(T * b.kv * a)
    A.free(x)
    rot = A.malloc(T * b.q * a)  # rotary q
    A.free(q)
    if b.kv < b.q:  # rotary k, then repeat_kv's expand + reshape copies of K and V at the query width
        keys, values = A.malloc(T * b.q * a), A.malloc(T * b.q * a)
        A.free(k)
        A.free(v)
    else:  # repeat_kv returns V itself
        keys, values = A.malloc(T * b.kv * a), v
        A.free(k)
    attn = A.malloc(T * b.q * a)
    for t in (rot, keys, values):
        A.free(t)
    part = _project_out(A, b, attn, b.q)
    residual = A.malloc(T // b.tp * b.hidden * a)  # x + attention, fused
    A.free(part)
    x = _project_in(A, b)
    gate, up = A.malloc(T * b.ffn * a), A.malloc(T * b.ffn * a)
    A.free(x)
    act = A.malloc(T * b.ffn * a)  # silu(gate) * up, fused
    A.free(gate)
    A.free(up)
    part = _project_out(A, b, act, b.ffn)
    out = A.malloc(T // b.tp * b.hidden * a)
    A.free(part)
    A.free(residual)
    return out


# A replay of a deep model's forward is thousands of allocator steps: each result is kept for later runs too, keyed
# by the code that replays it (this file and the allocator's).
_MEMO = IntMemo("idle-cache", __file__, allocator.__file__)


@lru_cache(maxsize=512)
def compiled_forward_idle(b: BlockShape, blocks: int, loss_requests: tuple[int, ...], freed: tuple[int, ...]) -> int:
    """Idle cache at the start of backward: `blocks` compiled block forwards (their outputs kept), then the
    loss's requests in order (bytes), of which the indices in `freed` are released again before backward."""
    key = repr((b, blocks, loss_requests, freed))
    idle = _MEMO.get(key)
    if idle is None:
        idle = _replay_forward(b, blocks, loss_requests, freed)
        _MEMO.put(key, idle)
    return idle


def _replay_forward(b: BlockShape, blocks: int, loss_requests: tuple[int, ...], freed: tuple[int, ...]) -> int:
    A = CachingAllocator()
    A.malloc(b.tokens // b.tp * b.hidden * b.a)  # the embedding's output, the first block's saved input
    for _ in range(blocks):
        _block_forward(A, b)
    handles = [A.malloc(r) for r in loss_requests]
    for i in freed:
        A.free(handles[i])
    return A.idle


def compiled_stranded_at_loss(arch: Any, s: Any, tokens: int, a: int, tp: int, blocks: int) -> int:
    """Cached blocks idle when compiled decoder blocks under full AC reach the loss (replayed by
    compiled_forward_idle); 0 where the run is not that stack.

    The requests after the blocks are the final norm's output, under TP the head's all-gathered input, the logits
    in the compute dtype (freed before backward where the loop drops them or the model upcasts its own output)
    and the fp32 logits the loss upcasts to; each fp32 logit-sized buffer is larger than any cached block, so one
    stands for all."""
    if not s.compile or s.compile_scope != "block" or s.activation_checkpointing != "full" or arch.is_moe:
        return 0
    if s.chunked_cross_entropy or a != 2 or not s.loss_upcast:
        return 0
    h, vocab = arch.hidden_size, arch.vocab_size
    shape = BlockShape(tokens=tokens, hidden=h, q=arch.q_dim // tp, kv=arch.kv_dim // tp,
                       ffn=arch.intermediate_size // tp, tp=tp, a=a, float8=bool(s.float8))
    requests = [tokens // tp * h * a] + ([tokens * h * a] if tp > 1 else [])
    requests += [tokens * vocab // tp * a, tokens * vocab // tp * 4]
    # the loop drops them (native) or the model's own .float() replaces them (transformers < 4.45, hf-legacy)
    freed = (len(requests) - 2,) if s.loss_impl in ("native", "hf-legacy") else ()
    return compiled_forward_idle(shape, blocks, tuple(requests), freed)


@dataclass(frozen=True)
class HfShape:
    """One eager HF Llama-family forward: dims, tokens and the adapters the run puts on each projection."""

    batch: int
    seq: int
    hidden: int
    q: int
    kv: int
    ffn: int
    layers: int
    vocab: int
    mask_positions: int  # transformers 4.38 Llama's dense causal mask side (0: none, as Mistral)
    qlora: bool
    rank: int
    adapted: tuple[str, ...]  # projections with a LoRA adapter
    dropout: bool  # LoRA dropout > 0: peft materialises the dropped-out input and its mask


class _HfTrace:
    """The eager forward's allocations, op by op (module docstring), on one allocator."""

    def __init__(self, s: HfShape) -> None:
        self.A, self.s, self.T = CachingAllocator(), s, s.batch * s.seq

    def swap(self, size: int, *old):
        """Allocate `size`, then free what the new tensor replaces (the order an eager op chain runs in)."""
        new = self.A.malloc(size)
        for t in old:
            self.A.free(t)
        return new

    def norm(self):  # LlamaRMSNorm: .to(fp32), pow, x * rsqrt, .to(bf16), weight *
        A, H = self.A, self.T * self.s.hidden * 2
        a = A.malloc(2 * H)
        A.free(A.malloc(2 * H))
        return self.swap(H, self.swap(H, self.swap(2 * H, a)))

    def linear(self, name: str, n_in: int, n_out: int):
        A, s, T = self.A, self.s, self.T
        out = T * n_out * 2
        if s.qlora:  # bnb MatMul4Bit: dequantized weight, output, then peft's clone
            w = A.malloc(n_in * n_out * 2)
            base = A.malloc(out)
            A.free(w)
            clone = A.malloc(out)
            A.free(base)
            base = clone
        else:
            base = A.malloc(out)
        if name not in s.adapted:
            return base
        drop = None
        if s.dropout:
            drop = A.malloc(T * n_in * 2)  # dropout output, then its bool mask
            A.free(A.malloc(T * n_in))
        a_out = self.swap(T * s.rank * 2, drop)
        scaled = self.swap(out, self.swap(out, a_out))  # lora_B output, then scaled
        return self.swap(out, base, scaled)

    def rope(self, t, width: int):  # q * cos, rotate_half (two halves, cat), * sin, sum
        t1, t2 = self.A.malloc(width), self.A.malloc(width // 2)
        t4 = self.swap(width, self.swap(width, t2))
        return self.swap(width, t1, t4, t)

    def attention(self, n):
        A, s, T = self.A, self.s, self.T
        q, k, v = self.linear("q_proj", s.hidden, s.q), self.linear("k_proj", s.hidden, s.kv), self.linear("v_proj", s.hidden, s.kv)
        qe, ke = self.rope(q, T * s.q * 2), self.rope(k, T * s.kv * 2)
        mask_slice = A.malloc(2 * s.batch * s.seq * s.seq) if s.mask_positions else None
        rep = s.q // s.kv  # repeat_kv copies under GQA, .contiguous() copies otherwise
        qc = A.malloc(T * s.q * 2)
        A.free(qe)
        kc, vc = A.malloc(T * s.kv * 2 * rep), A.malloc(T * s.kv * 2 * rep)
        A.free(ke)
        A.free(v)
        o = A.malloc(T * s.q * 2)
        for t in (qc, kc, vc, mask_slice):
            A.free(t)
        oc = A.malloc(T * s.q * 2)
        A.free(o)
        op = self.linear("o_proj", s.q, s.hidden)
        A.free(oc)
        A.free(n)
        return op

    def mlp(self, n2):
        A, s, F = self.A, self.s, self.T * self.s.ffn * 2
        g = self.linear("gate_proj", s.hidden, s.ffn)
        act = A.malloc(F)
        A.free(g)
        u = self.linear("up_proj", s.hidden, s.ffn)
        prod = A.malloc(F)
        A.free(act)
        A.free(u)
        dn = self.linear("down_proj", s.ffn, s.hidden)
        A.free(prod)
        A.free(n2)
        return dn

    def loss(self, last) -> None:
        A, H, logits = self.A, self.T * self.s.hidden * 2, self.T * self.s.vocab * 2
        _kept, p = A.malloc(2 * H), A.malloc(2 * H)  # final norm: keeps its fp32 input
        A.free(p)
        b = A.malloc(2 * H)
        c = A.malloc(H)
        A.free(b)
        normed = A.malloc(H)
        A.free(c)
        A.free(last)
        bf16 = A.malloc(logits)
        A.malloc(2 * logits)  # logits.float(), kept by the output
        A.free(bf16)
        shifted = A.malloc(2 * logits)
        A.malloc(2 * logits)  # log_softmax
        A.free(shifted)
        A.free(normed)
        A.malloc(2 * logits)  # nll_loss gradient
        A.malloc(2 * logits)  # log_softmax gradient: the peak


@lru_cache(maxsize=256)
def hf_forward(s: HfShape) -> tuple[int, int]:
    """(live, reserved) bytes after every block's forward, the final norm and the loss up to the log-softmax
    gradient: the start of backward."""
    t = _HfTrace(s)
    A, H, P = t.A, t.T * s.hidden * 2, s.mask_positions
    if P:  # _update_causal_mask: repeat (bool), .to(dtype), * min_dtype
        b = A.malloc(s.batch * P * P)
        bf = A.malloc(2 * s.batch * P * P)
        A.free(b)
        A.malloc(2 * s.batch * P * P)
        A.free(bf)
    saved = [A.malloc(H)]  # embeddings
    for _ in range(s.layers):
        op = t.attention(t.norm())
        r1 = A.malloc(H)
        A.free(op)
        dn = t.mlp(t.norm())
        saved.append(A.malloc(H))
        A.free(dn)
        A.free(r1)
    t.loss(saved.pop())
    return A.active, A.reserved


def hf_eager_stranded_at_loss(arch: Any, s: Any) -> int | None:
    """The idle cache of the traced stack at the start of backward; None where the run is not that stack (eager,
    reentrant full AC, transformers' legacy loss, a Llama-family decoder with bf16 compute)."""
    if s.compile or s.activation_checkpointing != "full" or s.loss_impl != "hf-legacy" or s.chunked_cross_entropy:
        return None
    if arch.model_type not in ("llama", "mistral") or arch.is_moe or s.precision not in ("bf16", "bf16-mixed"):
        return None
    adapted = tuple(sorted(resolve_lora_targets(s.lora_targets))) if s.task != "full" else ()
    dense = s.hf_llama_438 and arch.model_type == "llama" and arch.max_position_embeddings
    shape = HfShape(batch=s.micro_batch, seq=s.seq_len, hidden=arch.hidden_size, q=arch.q_dim, kv=arch.kv_dim,
                    ffn=arch.intermediate_size, layers=arch.num_layers, vocab=arch.vocab_size,
                    mask_positions=int(arch.max_position_embeddings) if dense else 0, qlora=s.task == "qlora",
                    rank=int(s.lora_rank or 0), adapted=adapted, dropout=float(s.lora_dropout or 0.0) > 0)
    live, reserved = hf_forward(shape)
    return reserved - live
