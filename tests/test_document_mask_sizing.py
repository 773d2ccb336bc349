"""Per-document attention's masks and CP key/value gathers in the memory estimate (gpuprov's trainer only)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpuprov.catalog.models import get_model
from gpuprov.sizing import activations, memory, parallel
from gpuprov.sizing.setup import make_setup
from gpuprov.sizing.types import TrainSetup
from gpuprov.stack import choose_stack

MIB = 2**20
ARCH = get_model("llama-3.1-8b")  # 32 layers, 32 query heads, 8 KV heads of 128


def _moments(s: TrainSetup) -> dict[str, dict[str, int]]:
    """Every candidate moment's live terms, by its name (what estimate_memory takes the largest of)."""
    shard = parallel.fsdp_degree(s, s.gpus)
    a = 4 if s.precision == "fp32" else 2
    x = memory._Ctx(arch=ARCH, s=s, w=memory.model_states(ARCH, s, shard), shard=shard, a=a,
                    tokens=s.seq_len * s.micro_batch)
    return {p.name: p.terms for p in parallel.apply(ARCH, s, memory._phases(x), x.tokens, a)}


def _backward(s: TrainSetup) -> dict[str, int]:
    return next(t for name, t in _moments(s).items() if name.startswith("backward of the last block"))


def test_sdpa_seq_8192_holds_a_bool_mask_and_one_bf16_bias_in_backward() -> None:
    s = TrainSetup(seq_len=8192, micro_batch=1, gpus=1, sharding="none", activation_checkpointing="full",
                   document_mask=True)
    moments = _moments(s)
    loss = next(t for name, t in moments.items() if name.startswith("start of backward"))
    assert loss["document_mask"] == 64 * MIB  # 8192 x 8192 booleans, one tensor for all 32 layers
    assert loss["attention_bias"] == 0  # each checkpointed block's bias went with its forward
    back = _backward(s)
    assert back["document_mask"] == 64 * MIB and back["attention_bias"] == 128 * MIB  # the recomputed block's bf16 bias
    step = next(t for name, t in moments.items() if name.startswith("optimizer step"))
    assert step.get("document_mask", 0) == 0 and step.get("attention_bias", 0) == 0
    plain = _backward(replace(s, document_mask=False))
    assert plain["document_mask"] == 0 and plain["attention_bias"] == 0


def test_without_checkpointing_every_eager_block_keeps_its_bias() -> None:
    s = TrainSetup(seq_len=4096, micro_batch=2, gpus=1, sharding="none", activation_checkpointing="none",
                   document_mask=True)
    est = memory.estimate_memory(ARCH, s)
    assert est.breakdown["attention_bias"] == 32 * 2 * 4096 * 4096 * 2
    assert est.breakdown["document_mask"] == 2 * 4096 * 4096
    plain = memory.estimate_memory(ARCH, replace(s, document_mask=False))
    assert plain.breakdown["document_mask"] == 0 and plain.breakdown["attention_bias"] == 0
    assert est.per_gpu_bytes - plain.per_gpu_bytes >= 32 * 2 * 4096 * 4096 * 2
    compiled = activations.document_masks(ARCH, replace(s, compile=True), 2)
    assert compiled.bias_saved == 0 and compiled.bias_transient == 2 * 4096 * 4096 * 2


def test_cp_gathers_keys_and_values_instead_of_the_ring() -> None:
    s = TrainSetup(seq_len=8192, micro_batch=1, gpus=8, cp=2, sharding="fsdp", document_mask=True)
    back = _backward(s)
    assert back["document_mask"] == 8192 * 4096  # this rank's 4096 queries against the whole window
    assert back["attention_bias"] == 8192 * 4096 * 2
    # GQA keys and values repeated to 32 heads x 128 (a mask turns off SDPA's own GQA), the whole window, + grads
    assert back["cp_kv_gather"] == 4 * 8192 * 4096 * 2 and back["cp_ring_buffers"] == 0
    ring = _backward(replace(s, document_mask=False))
    assert ring["cp_kv_gather"] == 0 and ring["cp_ring_buffers"] > 0 and ring["document_mask"] == 0
    tp = _backward(replace(s, tp=2))
    assert tp["cp_kv_gather"] == back["cp_kv_gather"] // 2  # heads split over TP
    assert tp["document_mask"] == back["document_mask"]  # the sequence is gathered before attention


def test_pipeline_keeps_one_mask_per_micro_batch_in_flight() -> None:
    s = TrainSetup(seq_len=4096, micro_batch=1, gpus=8, pp=4, sharding="fsdp", grad_accumulation_steps=8,
                   activation_checkpointing="full", document_mask=True)
    one = 4096 * 4096
    masks = {t["document_mask"] for name, t in _moments(s).items() if "backward of micro-batch" in name}
    assert masks and all(m % one == 0 for m in masks) and max(masks) == 4 * one  # rank 0 of 1F1B: pp in flight


@pytest.mark.parametrize("model_type, masked", [("llama", True), ("gemma2", False)])
def test_only_gpuprovs_sdpa_trainer_builds_the_mask(model_type: str, masked: bool) -> None:
    shape = dict(task="full", seq_len=8192, micro_batch=1, gpus=8, gpus_per_node=8, sharding="fsdp")
    stack = choose_stack("full", "bf16-mixed", model_type)
    assert make_setup(grad_accum=1, framework="gpuprov", stack=stack, **shape).document_mask is masked
    for other in ("torchtitan", "torchtune"):
        assert make_setup(grad_accum=1, framework=other, **shape).document_mask is False
