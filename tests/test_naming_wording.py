"""Naming and wording: SkyPilot-style GPU names, spec gpus vs --gpus, one layout label everywhere,
HSDP replicas are not model states, and the LoRA activation explanation is visible."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=180)


def plan_json(*args: str) -> dict:
    r = run("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize("name, slug, total", [("H100", "h100-80gb", None), ("H100:8", "h100-80gb", 8),
                                               ("A100-80GB:8", "a100-80gb", 8), ("a100:8", "a100-40gb", 8)])
def test_skypilot_gpu_names(name, slug, total):
    p = plan_json("--model", "8b", "--task", "lora", "--tokens", "100M", "--gpu", name)
    assert p["cluster"]["gpu"] == slug and p["spec"]["gpus"] == [slug]
    if total:
        assert p["cluster"]["total_gpus"] == total == p["spec"]["gpu_count"]


def test_spec_gpus_number_says_it_is_the_count(tmp_path: Path):
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text("model: 8b\ngpus: 8\n")
    r = run("plan", "-f", str(spec))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "gpu_count: 8" in r.stderr
    spec.write_text("model: 8b\ntask: lora\ntokens: 100M\ngpus: [H100:8]\n")
    assert json.loads(run("plan", "-f", str(spec), "--json").stdout)["cluster"]["total_gpus"] == 8


def test_one_layout_label_everywhere(tmp_path: Path):
    from gpuprov.candidates import layout_label

    args = ("--model", "70b", "--tokens", "1B", "--tp", "4", "--cloud", "aws")
    p = plan_json(*args)
    c = p["cluster"]
    label = layout_label(c["sharding"], c["shard_group"], c["total_gpus"], c["tp"], c["cp"])
    text = run("plan", *args).stdout
    assert f"  layout {label}, " in text and "sharding " not in text.split("Candidates")[0]
    out = tmp_path / "b"
    gen = run("generate", *args, "-o", str(out))
    assert gen.returncode == 0 and f"{label}, " in gen.stderr
    assert f"| Parallelism | {label} |" in (out / "README.md").read_text()
    assert f"| {label} |" in (out / "topology.svg").read_text()


def test_hsdp_replicas_are_not_counted_as_model_states():
    # a thin fabric (a2-ultragpu: one 100 Gb/s NIC per node) at many nodes makes the planner shard
    # inside nodes (--pp 1: with pipeline stages allowed it pipelines across nodes instead; at 48 h the
    # 15-node run hides FSDP's transfers behind compute and keeps flat FSDP)
    args = ("--model", "8b", "--from-scratch", "--tokens", "50B", "--cloud", "gcp", "--gpu", "a100-80gb",
            "--deadline", "24", "--pp", "1")
    p = plan_json(*args)
    c = p["cluster"]
    assert c["sharding"] == "hsdp" and c["replicate"] > 1
    text = run("plan", *args).stdout
    line = next(ln for ln in text.splitlines() if "model states, one replica" in ln)
    shown = float(re.search(r": ([\d,.]+) GiB;", line).group(1).replace(",", ""))
    assert shown == pytest.approx(p["memory"]["model_states_bytes"] / c["replicate"] / 2**30, abs=0.1)
    per_param = next(n for n in p["notes"] if n.startswith("Rule of thumb"))
    assert float(re.search(r"are ([\d.]+) B/param", per_param).group(1)) < 20  # not 64 B/param


def test_lora_activation_explanation_is_visible():
    p = plan_json("--model", "8b", "--task", "lora", "--tokens", "100M", "--seq-len", "8192", "--gpu", "h100-80gb",
                  "--gpus", "8")
    noted = any(n.startswith("Why lora keeps more activations") for n in p["notes"])
    assert noted == (p["cluster"]["activation_checkpointing"] == "selective")
    r = run("estimate", "--model", "8b", "--task", "lora", "--seq-len", "8192", "--gpus", "8", "--gpu", "h100-80gb",
            "--json")
    d = json.loads(r.stdout)
    assert any("three matmuls (base, lora_A, lora_B)" in a for a in d["assumptions"])
    full = json.loads(run("estimate", "--model", "8b", "--seq-len", "8192", "--gpus", "8", "--gpu", "h100-80gb",
                          "--json").stdout)
    assert not any("three matmuls" in a for a in full["assumptions"])


def test_usable_means_the_card_less_the_margin_in_estimate_and_plan():
    """estimate shows the whole card as such; only plan says "usable", for the card less its margin."""
    import re

    est = subprocess.run([sys.executable, "-m", "gpuprov", "estimate", "--model", "8b", "--gpus", "8"],
                         capture_output=True, text=True, timeout=120)
    assert est.returncode == 0, est.stderr
    assert "usable" not in est.stdout
    card = float(re.search(r"GPU memory \(whole card\)\s+([\d.]+)", est.stdout).group(1))
    plan = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "8b", "--task", "full", "--gpu",
                           "h100-80gb", "--cloud", "aws"], capture_output=True, text=True, timeout=120)
    m = re.search(r"of ([\d.]+) GiB \(([\d.]+) usable at (\d+)% margin", plan.stdout)
    assert m, plan.stdout
    assert float(m.group(1)) == pytest.approx(card, abs=0.06)
    assert float(m.group(2)) == pytest.approx(card * (1 - int(m.group(3)) / 100), abs=0.06)
