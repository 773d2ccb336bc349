"""How often the trainer's CP attention on packed documents gathers and computes, counted on torch itself.

The step model (gpuprov/sizing/operators.py attention_forwards_again, cp_gather_passes) times each layer's
attention forward and key/value all-gathers as many times as these counts; the trainer's own cp_attention,
block checkpointing and selective policy run here on one gloo rank."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gpuprov.sizing import operators  # noqa: E402

LAUNCH = Path(__file__).resolve().parents[1] / "templates" / "launch"
SDPA_FORWARDS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    sys.path.insert(0, str(LAUNCH))
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield importlib.import_module("train_attention"), importlib.import_module("train_model")
    finally:
        dist.destroy_process_group()
        sys.path.remove(str(LAUNCH))
        for name in ("train_attention", "train_model", "train_config"):
            sys.modules.pop(name, None)


class _Attention(torch.nn.Module):
    num_key_value_groups = 1
    is_causal = True

    def __init__(self, attention):
        super().__init__()
        self.attention, self.proj = attention, torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        q = self.proj(x).view(1, 2, -1, 4)
        return self.attention(self, q, q, q, mask)[0].reshape(x.shape).sin()


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.forwards += func.overloadpacket.__name__ in SDPA_FORWARDS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_cp_attention_runs_its_forward_as_counted(trainer, monkeypatch, ac):
    attention, model = trainer
    gathers = []
    real = attention.dist.all_gather
    monkeypatch.setattr(attention.dist, "all_gather", lambda *a, **k: gathers.append(1) or real(*a, **k))
    blocks = torch.nn.ModuleList([_Attention(attention.cp_attention)])
    model.apply_activation_checkpointing(blocks, ac)
    x = torch.randn(1, 6, 8, requires_grad=True)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    attention._CP_GROUP[:] = [dist.group.WORLD]
    try:
        with _Count() as counted:
            blocks[0](x, mask).sum().backward()
    finally:
        attention._CP_GROUP.clear()
    assert counted.forwards == 1 + operators.attention_forwards_again(ac, cp_gather=True)
    assert len(gathers) == 2 * operators.cp_gather_passes(ac)  # keys and values: one all-gather each per pass
