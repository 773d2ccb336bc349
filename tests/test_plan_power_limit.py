"""`--gpu-power-limit W` and an on-prem host's `power_limit_w`: the plan times the GPUs at the clocks the
limit holds (catalog/data/throughput.yaml power) and says which limit it used. Through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

H100 = ("--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpus", "8", "--cloud", "aws", "--micro-batch", "2",
        "--activation-checkpointing", "selective")


def plan(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--json", *args], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def stock() -> dict:
    return plan(*H100)


def test_a_cap_below_tdp_slows_the_same_cluster(stock):
    capped = plan(*H100, "--gpu-power-limit", "500")
    assert stock["throughput"]["gpu_power_w"] == 700 and capped["throughput"]["gpu_power_w"] == 500
    assert capped["cluster"]["instance_type"] == stock["cluster"]["instance_type"]
    assert capped["throughput"]["tokens_per_s"] < stock["throughput"]["tokens_per_s"]
    assert capped["time_hours"] > stock["time_hours"]
    lower = plan(*H100, "--gpu-power-limit", "350")
    assert lower["throughput"]["tokens_per_s"] < capped["throughput"]["tokens_per_s"]


def test_a_limit_at_or_above_tdp_changes_nothing(stock):
    over = plan(*H100, "--gpu-power-limit", "900")
    assert over["throughput"]["gpu_power_w"] == 700
    assert over["throughput"]["tokens_per_s"] == stock["throughput"]["tokens_per_s"]


def test_an_onprem_hosts_power_limit(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("- {name: gpu-a, address: 10.0.0.10, gpu: h100-80gb, gpus: 8, power_limit_w: 500}\n"
                     "- {name: gpu-b, address: 10.0.0.11, gpu: h100-80gb, gpus: 8}\n")
    d = plan("--model", "llama-3.1-8b", "--hosts", str(hosts), "--gpus", "16")
    assert d["throughput"]["gpu_power_w"] == 500  # the capped host sets the synchronous step's pace
    free = tmp_path / "free.yaml"
    free.write_text(hosts.read_text().replace(", power_limit_w: 500", ""))
    assert plan("--model", "llama-3.1-8b", "--hosts", str(free), "--gpus", "16")["throughput"]["gpu_power_w"] == 700


@pytest.mark.parametrize("value", ["0", "-5", "watts"])
def test_bad_limit_exits_2(value):
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--gpu-power-limit", value], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--gpu-power-limit" in r.stderr and "Traceback" not in r.stderr


def test_explain_says_which_limit_it_timed():
    r = subprocess.run([sys.executable, "-m", "gpuprov", "explain", *H100, "--gpu-power-limit", "500"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "at the 500 W power limit (TDP 700 W)" in r.stdout
