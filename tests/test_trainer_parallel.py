"""The generated trainer under tensor parallelism, for real: TP 2 x FSDP 2 on four CPU/gloo processes.

Same initialisation (a tiny saved Llama loaded by every layout), same global batch, fp32: the
TP 2 x FSDP 2 run logs the losses of FSDP 4 step for step, and it resumes from an FSDP 4 DCP
checkpoint (resharded across layouts) to the same losses FSDP 4 logged after it. Three short
torchrun launches of four processes in all; the 4-D mesh arithmetic is checked in-process.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from plan_fixtures import TINY_LLAMA_CONFIG, sample_plan
from test_trainer import finish, free_port, losses, runs, start, write_launch

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("torch")
pytest.importorskip("transformers")


def render(root: Path, *, tp: int, grad_accum: int, steps: int = 6, checkpoint_every: int = 3) -> Path:
    """A 4-GPU, one-node plan at CPU size: one model replica over all four (FSDP x TP)."""
    plan = sample_plan("aws", 1, "fsdp", "full")
    cluster = plan.cluster.model_copy(update=dict(
        gpus_per_node=4, total_gpus=4, shard_group=4, replicate=1, tp=tp, activation_checkpointing="none",
        micro_batch=1, grad_accum=grad_accum, seq_len=32, global_batch_tokens=4 * 32))
    training = plan.training.model_copy(update=dict(
        steps=steps, warmup_steps=2, learning_rate=3e-3, checkpoint_every_steps=checkpoint_every, log_every_steps=1))
    return write_launch(plan.model_copy(update=dict(cluster=cluster, training=training)), root)


def _base(tmp: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(TINY_LLAMA_CONFIG)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    model.to(torch.float32).save_pretrained(tmp / "base")
    return tmp / "base"


def _args(base: Path, *extra: str) -> tuple[str, ...]:
    return ("--set", "data.synthetic=true", "--set", "data.synthetic_samples=8", "--set", "model.init=pretrained",
            "--set", f"model.pretrained_path={base}",
            "--set", "precision.param_dtype=float32", "--set", "precision.reduce_dtype=float32", *extra)


def test_tp2_fsdp2_matches_fsdp4_and_resumes_from_its_checkpoint(tmp_path):
    base = _base(tmp_path)
    fsdp = render(tmp_path / "fsdp4", tp=1, grad_accum=1)
    finish(start(fsdp, *_args(base), port=free_port()))
    (ref,) = runs(fsdp)
    assert ref[0]["mesh"] == [4]
    ref_loss = losses(ref)
    assert len(ref_loss) == 6

    # TP 2 x FSDP 2 from the same weights: two data-parallel ranks x 2 micro-batches = the same 4 samples
    tp = render(tmp_path / "tp2", tp=2, grad_accum=2)
    assert "tp: 2" in (tp / "train.yaml").read_text() and (tp / "parallel.py").is_file()
    out = finish(start(tp, *_args(base), port=free_port()))
    (run,) = runs(tp)
    assert run[0]["world"] == 4 and run[0]["mesh"] == [2]  # FSDP over dp_shard x cp = 2
    assert "pretrained:" in out
    tp_loss = losses(run)
    assert tp_loss.keys() == ref_loss.keys()
    for step in ref_loss:
        assert tp_loss[step] == pytest.approx(ref_loss[step], rel=1e-5, abs=1e-6), (step, tp_loss, ref_loss)
    assert ref_loss[6] < ref_loss[1]  # it trains (a fixed 8-sample stream)

    # resume TP 2 x FSDP 2 from FSDP 4's step-3 checkpoint: steps 4-6 as FSDP 4 logged them
    (step3,) = [c for c in (tmp_path / "fsdp4" / "scratch" / "checkpoints").glob("*/step-00000003")]
    root = tmp_path / "from-fsdp4"
    shutil.copytree(step3, root / step3.name)
    resume = render(tmp_path / "resume", tp=2, grad_accum=2)
    out = finish(start(resume, *_args(base, "--set", f"checkpoint.dir={root}"), port=free_port()))
    assert "resumed from" in out and "step 3" in out
    (again,) = runs(resume)
    again_loss = losses(again)
    assert sorted(again_loss) == [4, 5, 6]
    for step in again_loss:
        assert again_loss[step] == pytest.approx(ref_loss[step], rel=1e-5, abs=1e-6), (step, again_loss, ref_loss)


@pytest.fixture(scope="module")
def layout_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "templates" / "launch" / "parallel.py"
    spec = importlib.util.spec_from_file_location("gpuprov_parallel_unit", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_mesh_shape_is_checked_against_the_world(layout_module):
    m = layout_module
    par = dict(sharding="hsdp", replicate=2, shard=8, tp=4, cp=2)
    assert m.layout_from(par, 16).shape == (1, 2, 1, 2, 4)  # (pp, dp_replicate, dp_shard, cp, tp)
    assert m.layout_from(dict(par, sharding="fsdp", replicate=1, shard=16, cp=1), 16).shape == (1, 1, 4, 1, 4)
    # pipeline stages are the outer dimension: shard counts one stage's GPUs
    assert m.layout_from(dict(par, sharding="fsdp", replicate=1, shard=8, cp=1, pp=2), 16).shape == (2, 1, 2, 1, 4)
    with pytest.raises(SystemExit, match=r"pp 2 x dp_replicate 1 x dp_shard 4 x cp 1 x tp 4 = 32 GPUs"):
        m.layout_from(dict(par, sharding="fsdp", replicate=1, shard=16, cp=1, pp=2), 16)
    with pytest.raises(SystemExit, match="torchrun started 8 processes"):
        m.layout_from(par, 8)
    with pytest.raises(SystemExit, match="not a multiple of tp 4 x cp 2"):
        m.layout_from(dict(par, shard=4), 8)
    with pytest.raises(SystemExit, match="sharding fsdp or hsdp"):
        m.layout_from(dict(par, sharding="ddp"), 16)
    assert not m.enabled(dict(tp=1, cp=1)) and m.enabled(dict(tp=2))


def test_tp_plan_covers_every_linear_and_norm(layout_module):
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = dict(TINY_LLAMA_CONFIG)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    plan = layout_module.tp_plan(len(model.model.layers))
    names = dict(model.named_modules())
    assert set(plan) <= set(names)  # every entry names a real module
    linears = {n for n, mod in names.items() if isinstance(mod, torch.nn.Linear)}
    norms = {n for n, mod in names.items() if type(mod).__name__.endswith("RMSNorm")}
    assert linears <= set(plan) and norms <= set(plan)
    with pytest.raises(SystemExit, match="does not divide the model's num_key_value_heads 2"):
        layout_module.check_divisible(model.config, 4)


def test_world_mesh_names_fit_the_trainer(layout_module):
    """One gloo process, a 1x1x1x1 mesh: FSDP's mesh carries train.py's names ("replicate", "shard"),
    which its HSDP replica check and all-reduce switch look up."""
    import torch.distributed as dist

    from test_trainer import free_port

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        m = layout_module
        mesh = m.build_mesh("cpu", m.Layout(1, 1, 1, 1))
        assert mesh.mesh_dim_names == m.MESH_DIMS
        hsdp = m.fsdp_mesh(mesh, "hsdp")
        assert hsdp.mesh_dim_names == ("replicate", "shard") and hsdp.get_group("replicate") is not None
        assert m.fsdp_mesh(mesh, "fsdp").mesh_dim_names == ("shard",)
        assert mesh["dp"].size() == 1 and mesh["tp"].size() == 1
    finally:
        dist.destroy_process_group()
