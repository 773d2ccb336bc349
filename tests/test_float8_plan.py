"""Float8 in the plan: the measured speed-up per GPU class, its memory, and one stack for both."""

from __future__ import annotations

import math

import pytest
import yaml

from gpuprov.catalog import load_data
from gpuprov.catalog.gpus import get_gpu, list_gpus
from gpuprov.catalog.models import get_model
from gpuprov.planner import make_plan
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.throughput import compute_seconds, float8_gain, float8_linear_gain, flops_per_token, gpu_class
from gpuprov.sizing.types import TrainSetup
from gpuprov.spec import TrainingSpec
from gpuprov.sizing.setup import setup_from_plan

F8 = load_data("throughput.yaml")["float8"]


def test_gain_is_the_measured_ratio_at_each_measured_size_and_between_them():
    h100 = get_gpu("h100-80gb")
    points = F8["gain_by_class"]["hopper"]["points"]
    for billions, gain in points:
        assert float8_gain(h100, int(billions * 1e9))[0] == pytest.approx(gain)
    # between two measurements: on the straight line in log(size); outside: the nearest measurement
    (b0, g0), (b1, g1) = points[1], points[2]
    mid = int(math.sqrt(b0 * b1) * 1e9)
    assert float8_gain(h100, mid)[0] == pytest.approx((g0 + g1) / 2)
    assert float8_gain(h100, 10**8)[0] == pytest.approx(points[0][1])
    assert float8_gain(h100, 10**13)[0] == pytest.approx(points[-1][1])


def test_only_gpu_classes_with_a_published_measurement_get_a_gain():
    measured = set(F8["gain_by_class"])
    for gpu in list_gpus():
        found = float8_gain(gpu, 8 * 10**9)
        assert (found is not None) == (gpu_class(gpu) in measured), gpu.slug
        if found:
            assert "@" in found[1]  # a file at a commit


def _plan(**kw):
    return make_plan(TrainingSpec(**{"model": "llama-3.1-8b", "tokens": 10**11, "cloud": "aws", **kw}))


def test_float8_plan_times_compute_by_the_gain_and_runs_float8():
    from gpuprov.render.launch import render_launch

    off = _plan(gpus=["h100-80gb"])
    on = _plan(gpus=["h100-80gb"], float8=True)
    assert not off.stack.float8 and on.stack.float8
    gain = float8_gain(get_gpu("h100-80gb"), get_model("llama-3.1-8b").params)[0]
    same_shape = (off.cluster.micro_batch, off.cluster.activation_checkpointing, off.cluster.total_gpus) == (
        on.cluster.micro_batch, on.cluster.activation_checkpointing, on.cluster.total_gpus)
    assert same_shape  # 8B on one 8 x H100 node either way: the ratio below is float8's alone
    # the measured step gain is turned into the linears' own speed-up: the blocks' GEMMs run that much faster,
    # the output head's GEMM, attention and the memory-bound work stay bf16 and take as long as before
    arch = get_model("llama-3.1-8b")
    linear_gain = float8_linear_gain(arch, gain)
    t_off, t_on = off.throughput.step_terms_s, on.throughput.step_terms_s
    assert 1.0 < t_off["gemm"] / t_on["gemm"] < linear_gain
    assert t_on["attention"] == pytest.approx(t_off["attention"])
    assert t_on["memory_bound"] == pytest.approx(t_off["memory_bound"])
    assert off.throughput.compute_time_s > on.throughput.compute_time_s
    assert on.time_hours < off.time_hours
    train = yaml.safe_load(render_launch(on)["train.yaml"])
    assert train["efficiency"]["float8"] is True and train["efficiency"]["compile"] is True
    assert any(n.startswith("float8 on") for n in on.notes)
    assert on.throughput.float8_gain == pytest.approx(linear_gain) and off.throughput.float8_gain == 1.0
    # the plan's memory is the estimate of the stack it runs (float8 gathers included)
    assert estimate_memory(get_model("llama-3.1-8b"), setup_from_plan(on)).per_gpu_bytes == on.memory.per_gpu_bytes


@pytest.mark.parametrize("kw, why", [
    (dict(gpus=["a100-80gb"]), "no published float8 speed-up covers a100-80gb"),
    (dict(gpus=["h100-80gb"], task="lora"), "full bf16-mixed training, not lora bf16-mixed"),
    (dict(gpus=["h100-80gb"], precision="bf16"), "not full bf16"),
    (dict(model="mixtral-8x7b", gpus=["h100-80gb"], tokens=10**9), "dense models"),
])
def test_float8_stays_off_where_no_measurement_covers_the_run_and_says_why(kw, why):
    p = _plan(float8=True, **kw)
    assert not p.stack.float8 and p.throughput.float8_gain == 1.0
    note = next(n for n in p.notes if n.startswith("float8 allowed but off"))
    assert why in note


def test_float8_with_tp_runs_float8_in_the_plan_and_the_bundle():
    """TP 8 no longer turns float8 off: the trainer converts before TP and uses torchao's float8 TP
    styles (tests/test_float8_tp.py), so the plan times the gain and train.yaml asks for both."""
    from gpuprov.render.launch import render_launch

    p = _plan(float8=True, model="llama-3.1-405b", gpus=["h100-80gb"], tokens=10**9, tp=8)
    assert p.cluster.tp == 8 and p.stack.float8 and p.throughput.float8_gain > 1.0
    assert any("float8 TP styles at TP 8" in n for n in p.notes)
    cfg = yaml.safe_load(render_launch(p)["train.yaml"])
    assert cfg["parallel"]["tp"] == 8 and cfg["efficiency"]["float8"] is True


def test_float8_gathers_the_block_linears_at_one_byte():
    arch = get_model("llama-3.1-8b")
    base = dict(task="full", gpus=8, sharding="fsdp", compile=True, fsdp_version=2)
    bf16 = estimate_memory(arch, TrainSetup(**base)).breakdown["gathered_params"]
    fp8 = estimate_memory(arch, TrainSetup(**base, float8=True)).breakdown["gathered_params"]
    units = 1 + load_data("memory_constants.yaml")["fsdp"]["prefetch_units"]
    gather = load_data("memory_constants.yaml")["float8"]["gather_bytes"]
    assert bf16 - fp8 == units * arch.layer_linear_params() * (2 - gather)
    # nothing else moves: torchao saves the high-precision input for backward
    a = estimate_memory(arch, TrainSetup(**base)).breakdown
    b = estimate_memory(arch, TrainSetup(**base, float8=True)).breakdown
    assert {k for k in a if a[k] != b[k]} <= {"gathered_params", "allocator_fragmentation", "total"}


def test_the_training_env_has_the_torchao_apply_float8_imports():
    from pathlib import Path

    env = load_data("software.yaml")["python_env"]
    assert any(r.startswith("torchao==") for r in env["requirements"])
    role = yaml.safe_load((Path(__file__).resolve().parent.parent / "ansible/roles/training_env/defaults/main.yml")
                          .read_text())
    assert "torchao" in role["training_env_imports"]


def test_plan_cli_takes_float8(tmp_path):
    from click.testing import CliRunner

    from gpuprov.cli import cli as main

    r = CliRunner().invoke(main, ["plan", "--model", "llama-3.1-8b", "--tokens", "10B", "--cloud", "aws",
                                  "--gpu", "h100-80gb", "--float8", "--json"])
    assert r.exit_code == 0, r.output
    import json

    assert json.loads(r.output)["stack"]["float8"] is True
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text("model: llama-3.1-8b\ntokens: 10000000000\ncloud: aws\ngpus: [h100-80gb]\nfloat8: true\n")
    r = CliRunner().invoke(main, ["plan", "-f", str(spec), "--no-float8", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["stack"]["float8"] is False
