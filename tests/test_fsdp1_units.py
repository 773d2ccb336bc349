"""FSDP1's gathered blocks, observed on CPU/gloo, against what the analytic model assumes.

The estimate sizes FSDP1 (FullyShardedDataParallel, flat parameters) as FSDP2: the current block and
`fsdp.prefetch_units` more gathered at once, and the root unit (embeddings, final norm, head) kept
unsharded from forward to backward. Two processes run one LoRA step of a tiny Llama the way the
frameworks wrap it (AnswerDotAI/fsdp_qlora: each trainable LoRA linear its own unit, reentrant AC;
accelerate/Lightning: one unit per decoder layer, use_orig_params=True, non-reentrant AC), with
FlatParamHandle.unshard/reshard counted. A change in PyTorch's prefetch or root handling fails here.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from gpuprov.catalog import load_data  # noqa: E402
from ports import free_port  # noqa: E402

LAYERS = 4
WRAPS = ("fsdp-qlora", "per-block")


def _model(wrap: str):
    import torch.nn as nn
    from peft import LoraConfig, get_peft_model
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import _or_policy, lambda_auto_wrap_policy, transformer_auto_wrap_policy
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    cfg = LlamaConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    model = model.to(torch.bfloat16)  # pure bf16 (fsdp_qlora precision bf16, Lightning bf16-true): one flat dtype
    blocks = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=(LlamaDecoderLayer,))
    if wrap == "fsdp-qlora":
        def trainable_leaf(m: nn.Module) -> bool:
            return not list(m.children()) and getattr(m, "weight", None) is not None and m.weight.requires_grad
        policy = functools.partial(_or_policy, policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=trainable_leaf), blocks])
        orig = False
    else:
        policy, orig = blocks, True
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=policy,
                use_orig_params=orig, limit_all_gathers=True, device_id=torch.device("cpu"))


def _observe(wrap: str) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _model(wrap)
    impl = CheckpointImpl.REENTRANT if wrap == "fsdp-qlora" else CheckpointImpl.NO_REENTRANT
    if impl is CheckpointImpl.REENTRANT:
        model.enable_input_require_grads()  # as fsdp_qlora train.py does before reentrant AC
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    root = model._handle  # the outermost FSDP unit: embeddings, final norm, head
    block_numel = max(h.flat_param._unpadded_unsharded_size.numel() for h in _handles(model) if h is not root)
    live: set[int] = set()
    seen = {"max_blocks": 0, "root_reshards_in_forward": 0, "root_unsharded_at_backward": None}
    phase = {"forward": True}
    unshard, reshard = FlatParamHandle.unshard, FlatParamHandle.reshard

    def counted_unshard(self):
        out = unshard(self)
        if self is not root and self.flat_param._unpadded_unsharded_size.numel() == block_numel:
            live.add(id(self))
            seen["max_blocks"] = max(seen["max_blocks"], len(live))
        return out

    def counted_reshard(self, free_unsharded_flat_param):
        out = reshard(self, free_unsharded_flat_param)
        if free_unsharded_flat_param:
            live.discard(id(self))
            if self is root and phase["forward"]:
                seen["root_reshards_in_forward"] += 1
        return out

    FlatParamHandle.unshard, FlatParamHandle.reshard = counted_unshard, counted_reshard
    try:
        ids = torch.randint(0, 128, (1, 32))
        out = model(ids, labels=ids)
        phase["forward"] = False
        # FSDP1 "reshards" the root after forward without freeing it (free_unsharded_flat_param=False): the
        # padded unsharded storage stays allocated and backward reuses it without an all-gather
        seen["root_unsharded_at_backward"] = root.flat_param._full_param_padded.untyped_storage().size() > 0
        out.loss.backward()
    finally:
        FlatParamHandle.unshard, FlatParamHandle.reshard = unshard, reshard
    return seen


def _handles(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [m._handle for m in FSDP.fsdp_modules(model) if m._handle is not None]


def _worker(rank: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = {wrap: _observe(wrap) for wrap in WRAPS}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh)


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> dict:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp1") / "units.json"
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2)
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.slow
@pytest.mark.parametrize("wrap", WRAPS)
def test_fsdp1_gathers_the_blocks_the_estimate_counts(observed, wrap):
    expected = 1 + load_data("memory_constants.yaml")["fsdp"]["prefetch_units"]
    assert observed[wrap]["max_blocks"] == expected, observed[wrap]


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.slow
def test_fsdp1_root_stays_gathered_from_forward_to_backward(observed, wrap):
    assert observed[wrap]["root_reshards_in_forward"] == 0, observed[wrap]
    assert observed[wrap]["root_unsharded_at_backward"] is True, observed[wrap]
