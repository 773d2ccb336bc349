"""GitOps that works in CI: `check` rebuilds from plan.json's model config (no HF cache, no config
file of the machine that generated), paths are stored relative to the bundle, the Terraform
backend is a spec field rendered into backend.tf, and the lock guards the gpuprov version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

QWEN = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "vocab_size": 152064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
REPO = Path(__file__).resolve().parents[1]


def run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=180,
                          env=full, cwd=cwd)


def test_hf_id_bundle_checks_in_a_clean_environment(tmp_path: Path):
    snap = tmp_path / "cache" / "models--acme--custom-7b" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(QWEN))
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("0123abcd")
    made = run("generate", "--model", "acme/custom-7b", "--task", "lora", "--cloud", "aws", "-o",
               str(tmp_path / "infra"), env={"HF_HUB_CACHE": str(tmp_path / "cache")})
    assert made.returncode == 0, made.stderr
    plan = json.loads((tmp_path / "infra" / "plan.json").read_text())
    assert str(tmp_path) not in json.dumps(plan)  # no path of this machine in the plan
    assert "0123abcd" in plan["model"]["source"]  # the config's revision
    clean = run("check", str(tmp_path / "infra"), env={"HF_HUB_CACHE": str(tmp_path / "no-cache")})
    assert clean.returncode == 0, clean.stdout + clean.stderr


def test_config_path_bundle_checks_after_moving_the_checkout(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "models").mkdir(parents=True)
    (repo / "models" / "config.json").write_text(json.dumps(QWEN))
    (repo / "gpuprov.yaml").write_text("model: models/config.json\ntask: lora\ncloud: gcp\n")
    made = run("generate", "-f", str(repo / "gpuprov.yaml"), "-o", str(repo / "infra"))
    assert made.returncode == 0, made.stderr
    lock = json.loads((repo / "infra" / "gpuprov.lock").read_text())
    assert lock["spec"]["model"] == "../models/config.json"  # relative, not /tmp/.../models/config.json
    moved = tmp_path / "elsewhere"
    shutil.move(str(repo), moved)
    (moved / "models" / "config.json").unlink()  # CI has only the bundle
    checked = run("check", str(moved / "infra"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_an_edited_plan_json_pins_nothing(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "models").mkdir(parents=True)
    (repo / "models" / "config.json").write_text(json.dumps(QWEN))
    assert run("generate", "--model", str(repo / "models" / "config.json"), "--task", "lora", "--cloud", "aws",
               "-o", str(repo / "infra")).returncode == 0
    (repo / "models" / "config.json").unlink()
    plan = repo / "infra" / "plan.json"
    plan.write_text(plan.read_text().replace('"hidden_size": 3584', '"hidden_size": 1024'))
    r = run("check", str(repo / "infra"))
    assert r.returncode == 2 and "not found" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_terraform_backend_is_rendered_not_drift(tmp_path: Path):
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text("model: 8b\ntask: lora\ncloud: aws\nterraform_backend:\n  type: s3\n  config: {bucket: st, "
                    "key: gpuprov/8b.tfstate, region: us-east-1, use_lockfile: true}\n")
    made = run("generate", "-f", str(spec), "-o", str(tmp_path / "infra"))
    assert made.returncode == 0, made.stderr
    backend = (tmp_path / "infra" / "terraform" / "backend.tf").read_text()
    assert 'backend "s3" {' in backend and 'bucket       = "st"' in backend and "use_lockfile = true" in backend
    assert run("check", str(tmp_path / "infra")).returncode == 0
    from gpuprov.commands.gitops import check_terraform_fmt

    status, detail = check_terraform_fmt(tmp_path / "infra")
    assert status in ("ok", "skip"), detail
    bad = tmp_path / "bad.yaml"
    bad.write_text('model: 8b\nterraform_backend: {type: s3, config: {"Bucket Name": x}}\n')
    r = run("plan", "-f", str(bad))
    assert r.returncode == 2 and "terraform_backend" in r.stderr


def test_lock_guards_the_gpuprov_version(tmp_path: Path):
    assert run("generate", "--model", "8b", "--task", "lora", "--cloud", "aws", "-o", str(tmp_path / "b")).returncode == 0
    lock_path = tmp_path / "b" / "gpuprov.lock"
    lock = json.loads(lock_path.read_text())
    lock["gpuprov_version"] = "0.0.1"
    lock_path.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    r = run("check", str(tmp_path / "b"))
    assert r.returncode == 2 and "gpuprov 0.0.1" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    anyway = run("check", str(tmp_path / "b"), "--any-version")
    assert anyway.returncode == 1 and "made by gpuprov 0.0.1" in anyway.stdout  # the lock itself differs


def test_tar_output_stores_the_config_path_relative_to_where_it_unpacks(tmp_path: Path):
    import io
    import tarfile

    repo = tmp_path / "repo"
    (repo / "models").mkdir(parents=True)
    (repo / "models" / "config.json").write_text(json.dumps(QWEN))
    full = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    made = subprocess.run([sys.executable, "-m", "gpuprov", "generate", "--model", str(repo / "models" / "config.json"),
                           "--task", "lora", "--cloud", "aws", "-o", "-"], capture_output=True, timeout=180, env=full,
                          cwd=repo)
    assert made.returncode == 0, made.stderr
    assert str(tmp_path).encode() not in made.stdout  # no path of this machine in the tar
    with tarfile.open(fileobj=io.BytesIO(made.stdout)) as tar:
        tar.extractall(repo, filter="data")  # unpacks as infra/
    lock = json.loads((repo / "infra" / "gpuprov.lock").read_text())
    assert lock["spec"]["model"] == "../models/config.json"
    (repo / "models" / "config.json").unlink()
    checked = run("check", str(repo / "infra"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
