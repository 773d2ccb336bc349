"""float8 with tensor parallelism in the trainer, as torchtitan runs it: torchao's tensorwise float8
linears converted before TP, then the TP plan with torchao's float8 styles (Float8ColwiseParallel,
Float8RowwiseParallel, PrepareFloat8ModuleInput) for the blocks' linears and their inputs.

On CPU: torchao's float8 emulation (no CPU float8 matmul kernel). gloo has no float8 collectives, so
the 2-way layout is checked on a fake process group (placements and shard shapes, no numerics) and
the numerics on a 1-rank TP mesh, where the float8 styles run without communication: the TP model's
loss and gradients must equal the plain float8 model's. NCCL numerics at TP > 1 need a GPU.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("torchao.float8", reason="torchao (the test extra) is needed to test float8 with TP")
pytestmark = [pytest.mark.torch, pytest.mark.slow]

LAUNCH = Path(__file__).resolve().parents[1] / "templates" / "launch"


@pytest.fixture()
def launch(monkeypatch):
    """The trainer's parallel.py and train_model.py, imported as train.py imports them."""
    monkeypatch.syspath_prepend(str(LAUNCH))
    for name in ("parallel", "train_model", "train_config", "train_runtime"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import parallel
    import train_model

    yield parallel, train_model
    parallel._STATE.clear()


def tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from plan_fixtures import TINY_LLAMA_CONFIG

    hf = dict(TINY_LLAMA_CONFIG)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf)).float()


def _with_tp(parallel, model, world: int):
    lay = parallel.Layout(1, 1, 1, world)
    parallel._STATE[:] = [parallel.State(parallel.build_mesh("cpu", lay), lay)]
    if world == 1:  # parallelize() skips a 1-way TP layout; the plan itself is what is tested here
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, parallel.state().mesh["tp"], parallel.tp_plan(len(model.model.layers), True))
        parallel.register_positions(model)
        return model
    return parallel.parallelize(model, float8=True)


def test_float8_tp_plan_uses_torchaos_float8_styles_for_block_linears_only(launch):
    parallel, _ = launch
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    plan, plain = parallel.tp_plan(2, float8=True), parallel.tp_plan(2)
    assert plan.keys() == plain.keys()
    for name, style in plan.items():
        leaf = name.rsplit(".", 1)[-1]
        want = {"q_proj": Float8ColwiseParallel, "k_proj": Float8ColwiseParallel, "v_proj": Float8ColwiseParallel,
                "gate_proj": Float8ColwiseParallel, "up_proj": Float8ColwiseParallel, "o_proj": Float8RowwiseParallel,
                "down_proj": Float8RowwiseParallel, "self_attn": PrepareFloat8ModuleInput,
                "mlp": PrepareFloat8ModuleInput}.get(leaf)
        if want is None:  # embeddings, norms and the head: not float8 linears, the plain styles
            assert type(style) is type(plain[name]), name
        else:
            assert isinstance(style, want), name


def test_two_way_tp_shards_the_float8_linears(launch):
    """A fake 2-rank group: the conversion survives TP, weights are sharded as torchtitan shards them."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchao.float8.float8_linear import Float8Linear

    parallel, train_model = launch
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = tiny_model()
        train_model.float8_linears(model, emulate=True)
        model = _with_tp(parallel, model, 2)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        for lin, dim in ((attn.q_proj, 0), (attn.o_proj, 1), (mlp.up_proj, 0), (mlp.down_proj, 1)):
            assert isinstance(lin, Float8Linear)
            assert [p.dim for p in lin.weight.placements] == [dim]
            assert lin.weight.to_local().shape[dim] * 2 == lin.weight.shape[dim]
        assert not isinstance(model.lm_head, Float8Linear)  # the head stays bf16
    finally:
        dist.destroy_process_group()


def test_float8_tp_matches_float8_without_tp(launch):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from test_trainer import free_port

    parallel, train_model = launch
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        base = tiny_model()
        ids = torch.randint(0, base.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
        results = []
        for tp in (False, True):
            model = copy.deepcopy(base)
            train_model.float8_linears(model, emulate=True)
            if tp:
                model = _with_tp(parallel, model, 1)
            with loss_parallel() if tp else torch.enable_grad():  # step_context's, which enters it at TP > 1
                logits = model(input_ids=ids[:, :-1]).logits
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
                loss.backward()
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     for n, p in model.named_parameters()}
            loss = loss.detach()
            results.append((float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss), grads))
        (ref_loss, ref), (loss, got) = results
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        for name, g in ref.items():
            assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-7), name
    finally:
        dist.destroy_process_group()
