"""Fine-tuning is the default case: a named model's pretrained weights, with a published recipe's
batch, learning rate and warmup; from scratch is explicit (--from-scratch, init: random)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov.errors import GpuprovError
from gpuprov.recipes import batch_sequences, dataset_tokens, global_batch_tokens, recipe
from gpuprov.spec import TrainingSpec


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def plan_json(*args: str) -> dict:
    r = run("plan", *args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _dp(cluster: dict) -> int:
    return cluster["total_gpus"] // (cluster.get("tp", 1) * cluster.get("cp", 1))


def test_8b_lora_on_100m_tokens_plans_the_recipes_batch_for_its_gpu_count():
    p = plan_json("--model", "8b", "--task", "lora", "--tokens", "100M")
    r = recipe(None, "lora")
    c, t = p["cluster"], p["training"]
    seqs, source = batch_sequences(None, "lora", _dp(c))
    assert c["global_batch_tokens"] == seqs * c["seq_len"] and c["seq_len"] == 4096
    assert t["steps"] == -(-100_000_000 // c["global_batch_tokens"]) and t["steps"] >= 100
    assert t["learning_rate"] == pytest.approx(r["learning_rate"]) and t["warmup_steps"] <= t["steps"] // 2
    assert p["spec"]["init"] == "pretrained"
    if _dp(c) == 1:  # one GPU: torchtune's single-device recipe, 2 per device x 8 accumulation
        assert (seqs, t["steps"]) == (16, 1526) and "8B_lora_single_device.yaml" in source
    assert any(source in n for n in p["notes"])


@pytest.mark.parametrize("task,dp,seqs,file", [
    ("lora", 1, 16, "8B_lora_single_device.yaml"), ("lora", 2, 32, "8B_lora.yaml"), ("lora", 8, 32, "8B_lora.yaml"),
    ("full", 1, 2, "8B_full_single_device.yaml"), ("full", 3, 6, "8B_full.yaml"), ("full", 16, 8, "8B_full.yaml"),
    ("qlora", 1, 16, "8B_qlora_single_device.yaml"), ("qlora", 4, 16, "8B_qlora_single_device.yaml")])
def test_torchtune_batch_is_per_device_up_to_the_launch_line(task, dp, seqs, file):
    """torchtune's batch_size is per device: global = batch_size x accumulation x ranks, the single-device
    recipe on one rank, the launch line's global batch beyond its --nproc_per_node."""
    n, source = batch_sequences("torchtune", task, dp)
    assert n == seqs and f"llama3_1/{file} @ " in source


def test_plan_on_two_gpus_takes_the_distributed_recipes_batch():
    p = plan_json("--model", "8b", "--task", "lora", "--tokens", "100M", "--gpu", "l4-24gb", "--gpus", "2", "--cloud", "gcp")
    c = p["cluster"]
    assert c["total_gpus"] == 2 and c["global_batch_tokens"] == 32 * 4096
    assert p["training"]["steps"] == -(-100_000_000 // (32 * 4096))


def test_each_task_takes_its_recipe_and_from_scratch_takes_pretraining():
    lora, full = TrainingSpec(task="lora"), TrainingSpec(task="full")
    # a fine-tune's batch is the recipe's for the data-parallel ranks the plan picks
    assert lora.global_batch_tokens is None and full.global_batch_tokens is None
    assert global_batch_tokens(lora, 1) == 16 * 4096 and global_batch_tokens(full, 4) == 8 * 4096
    scratch = TrainingSpec(init="random")
    assert scratch.global_batch_tokens == 4 * 2**20 and scratch.tokens == 10**10
    assert global_batch_tokens(TrainingSpec(task="qlora", recipe="axolotl"), 8) == 8 * 4096
    assert TrainingSpec(global_batch=64, seq_len=2048).global_batch_tokens == 64 * 2048
    assert global_batch_tokens(TrainingSpec(global_batch=64, seq_len=2048), 1) == 64 * 2048
    assert TrainingSpec().model == "llama-3.1-8b"  # a current default model, not Llama 2


def test_recipes_cite_a_source_and_date_for_every_task():
    from gpuprov.catalog import load_data

    data = load_data("recipes.yaml")
    tasks_of = {"full", "lora", "qlora"}
    for name, framework in data["recipes"].items():
        assert tasks_of <= set(framework), name
        for size in [framework, *framework.get("by_size", [])]:
            assert set(size) & tasks_of, name
            if size is not framework or "by_size" in framework:  # sized entries say their size and dataset
                assert size["params"] > 0 and size["dataset_examples"] > 0 and size["dataset_source"], name
            for task in set(size) & tasks_of:
                r = size[task]
                assert r["source"] and r["date"] and r["learning_rate"] > 0
                assert r["batch_size"] > 0 and r["gradient_accumulation_steps"] > 0 and r["devices"] > 0
                assert r.get("single_device", {}).get("source", "x")
    assert {"torchtune", "axolotl", "trl"} <= set(data["recipes"])


def test_dataset_and_epochs_size_the_run(tmp_path: Path):
    spec = TrainingSpec(task="lora", dataset="50M", epochs=2)
    assert spec.tokens == 100_000_000 and spec.dataset_tokens == 50_000_000
    # epochs default to the recipe's
    assert TrainingSpec(task="full", dataset="10M").tokens == 10_000_000 * recipe(None, "full")["epochs"]
    # a prepared data directory counts exactly; a raw file is estimated from its size
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps({"train_samples": 1000, "seq_len": 4096}))
    assert dataset_tokens(str(data), tmp_path).tokens == 4_096_000
    (tmp_path / "raw.jsonl").write_bytes(b"x" * 4000)
    size = dataset_tokens("raw.jsonl", tmp_path)
    assert size.tokens == 1000 and size.how == "estimated"
    with pytest.raises(GpuprovError):
        dataset_tokens("missing.jsonl", tmp_path)


def test_dataset_in_a_spec_file_is_relative_to_the_file_and_the_plan_shows_steps(tmp_path: Path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"train_samples": 24_414, "seq_len": 4096}))
    (tmp_path / "gpuprov.yaml").write_text("model: 8b\ntask: lora\ndataset: d\nepochs: 2\n")
    r = run("plan", "-f", str(tmp_path / "gpuprov.yaml"), "--json", cwd=Path("/"))
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["spec"]["dataset_tokens"] == 24_414 * 4096 and p["training"]["tokens"] == 2 * 24_414 * 4096
    text = run("plan", "-f", str(tmp_path / "gpuprov.yaml"), cwd=Path("/")).stdout
    assert f"{p['training']['steps']:,} optimizer steps" in text.splitlines()[0]


@pytest.mark.parametrize("args, word", [
    (("--from-scratch", "--task", "lora"), "--task full"),
    (("--dataset", "10M", "--tokens", "5M"), "not both"),
    (("--epochs", "2"), "--dataset"),
    (("--dataset", "no-such-file.jsonl"), "neither a token count"),
])
def test_bad_budget_input_is_one_line_exit_2(args, word, tmp_path: Path):
    r = run("plan", *args, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and word in r.stderr


def test_from_scratch_plans_pretraining_and_the_plan_records_init():
    p = plan_json("--model", "8b", "--from-scratch", "--tokens", "1B", "--cloud", "aws")
    assert p["spec"]["init"] == "random" and p["cluster"]["global_batch_tokens"] == 4 * 2**20
    assert p["training"]["learning_rate"] == pytest.approx(3e-4)


@pytest.mark.parametrize("args", [
    ("--model", "8b", "--task", "lora", "--tokens", "100M", "--cloud", "aws"),  # one node: boot disk
    ("--model", "70b", "--task", "full", "--tokens", "100M", "--cloud", "aws"),  # FSx for Lustre, checkpoints
    ("--model", "8b", "--task", "full", "--tokens", "1B", "--cloud", "gcp", "--purchase", "spot", "--gpus", "16"),
])
def test_plan_cost_line_adds_up(args):
    """steps x step time + start-up + checkpoint writes + preemption = the hours; compute + storage =
    the cost; the printed line says the same numbers."""
    import re

    r = run("plan", *args)
    assert r.returncode == 0, r.stderr
    p = plan_json(*args)
    run_ = p["run"]
    parts = (run_["train_hours"], run_["startup_hours"], run_["checkpoint_hours"] or 0.0, run_["preemption_hours"])
    assert sum(parts) == pytest.approx(p["time_hours"], rel=1e-9)
    assert run_["train_hours"] == pytest.approx(p["training"]["steps"] * p["throughput"]["step_time_s"] / 3600)
    assert run_["compute_usd"] + run_["storage_usd"] == pytest.approx(p["cost_usd"], rel=1e-9)
    nodes, price = p["cluster"]["nodes"], p["instance"]["price_per_hour_usd"]
    assert run_["compute_usd"] == pytest.approx(p["time_hours"] * nodes * price, rel=1e-9)
    assert run_["storage_usd"] > 0  # boot disks at least
    line = next(ln for ln in r.stdout.splitlines() if "h start-up" in ln)
    m = re.search(r"([\d,]+) optimizer steps x ([\d.]+) s = ([\d.]+) h \+ ([\d.]+) h start-up(.*?) = ([\d.,]+) h", line)
    assert m, line
    steps, step_s, train_h, start_h = (float(m.group(i).replace(",", "")) for i in range(1, 5))
    extra = sum(float(v) / (60 if unit == "min" else 1)
                for v, unit in re.findall(r"\+ ([\d.]+) (h|min) (?:checkpoint writes|expected preemption)", m.group(5)))
    assert steps == p["training"]["steps"] and train_h == pytest.approx(steps * step_s / 3600, abs=0.01)
    assert float(m.group(6)) == pytest.approx(train_h + start_h + extra, abs=0.06) == pytest.approx(p["time_hours"], abs=0.06)


def test_the_shared_filesystem_is_priced_from_the_catalog():
    """70B full on AWS: several nodes share an FSx for Lustre filesystem; its size x the catalog's
    price x the run's hours is in the cost, and one checkpoint's write at its throughput in the hours."""
    from gpuprov.catalog import load_data

    p = plan_json("--model", "70b", "--task", "full", "--tokens", "100M", "--cloud", "aws")
    assert p["cluster"]["nodes"] > 1 and p["shared_storage"]["kind"] == "fsx-lustre"
    prices = load_data("storage_prices.yaml")
    fsx, disk = prices["shared"]["fsx-lustre"], prices["boot_disk"]["aws"]
    size, hours = p["shared_storage"]["size_gib"], p["time_hours"]
    per_month = size * fsx["price_usd_per_gib_month"] + p["cluster"]["nodes"] * 512 * disk["price_usd_per_gib_month"]
    assert p["run"]["storage_usd"] == pytest.approx(per_month / prices["hours_per_month"] * hours, rel=1e-6)
    ckpt = p["model"]["trainable_params"] * 16  # host_rules checkpoint_bytes_per_param
    write_h = ckpt / (fsx["write_mb_per_s_per_tib"] * size / 1024 * 1e6) / 3600
    assert p["run"]["checkpoint_hours"] == pytest.approx(write_h, rel=1e-6)  # async: the final save is waited for
    assert any(n.startswith("Storage in the cost: shared filesystem fsx-lustre") for n in p["notes"])


def test_undated_storage_prices_are_flagged_with_a_fixed_clock():
    import datetime as dt

    from gpuprov.commands.plan import price_warnings
    from gpuprov.commands.spec_options import spec_from_flags
    from gpuprov.planning.assemble import make_plan

    plan = make_plan(spec_from_flags(None, None, {"model": "70b", "task": "full", "tokens": "100M", "cloud": "aws"}))
    warned = price_warnings(plan, dt.date(2026, 12, 5))
    assert any("fsx-lustre price" in w and "undated" in w for w in warned)
    assert any("boot disk price" in w for w in warned)


def test_a_presets_hf_id_resolves_without_the_cache_and_names_the_base_weights(tmp_path: Path):
    import os

    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "empty-cache"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "meta-llama/Llama-3.1-8B", "--task",
                        "lora", "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["model"]["params"] == 8030261248 and p["training"]["base_weights"] == "meta-llama/Llama-3.1-8B"
    assert p["training"]["init"] == "pretrained"
    # the short name names the same weights; from scratch names none
    assert plan_json("--model", "8b", "--task", "lora")["training"]["base_weights"] == "meta-llama/Llama-3.1-8B"
    assert plan_json("--model", "8b", "--from-scratch", "--tokens", "1B")["training"]["base_weights"] is None


def test_train_yaml_init_follows_the_plan(tmp_path: Path):
    from ruamel.yaml import YAML

    for extra, init in ((("--task", "lora"), "pretrained"), (("--from-scratch", "--tokens", "1B"), "random")):
        out = tmp_path / init
        r = run("generate", "--model", "8b", "--cloud", "aws", *extra, "-o", str(out))
        assert r.returncode == 0, r.stderr
        cfg = YAML(typ="safe").load((out / "launch" / "train.yaml").read_text())
        assert cfg["model"]["init"] == init


def test_lora_bundle_fetches_its_base_weights_once_without_writing_the_token(tmp_path: Path):
    import os

    from ruamel.yaml import YAML

    out = tmp_path / "infra"
    assert run("generate", "--model", "8b", "--task", "lora", "--cloud", "aws", "-o", str(out)).returncode == 0
    cfg = YAML(typ="safe").load((out / "launch" / "train.yaml").read_text())
    dest = cfg["model"]["pretrained_path"]
    assert cfg["model"]["init"] == "pretrained" and dest.endswith("/models/meta-llama/Llama-3.1-8B")
    script = (out / "launch" / "fetch_weights.sh").read_text().replace(dest, str(tmp_path / "weights"))
    (out / "launch" / "fetch_weights.sh").write_text(script)
    stub = tmp_path / "stub"
    (stub / "huggingface_hub").mkdir(parents=True)
    (stub / "huggingface_hub" / "errors.py").write_text(  # the library's classes, same hierarchy
        "class RepositoryNotFoundError(Exception): pass\n"
        "class GatedRepoError(RepositoryNotFoundError): pass\n"
        "class RevisionNotFoundError(Exception): pass\n")
    (stub / "huggingface_hub" / "__init__.py").write_text(  # writes a whole safetensors file, metadata = id@rev
        "import json, os, pathlib, struct\n"
        "def snapshot_download(repo_id, revision, local_dir, allow_patterns):\n"
        "    d = pathlib.Path(local_dir); (d / 'config.json').write_text('{}')\n"
        "    head = json.dumps({'__metadata__': {'from': repo_id + '@' + revision},\n"
        "                       'w': {'dtype': 'U8', 'shape': [4], 'data_offsets': [0, 4]}}).encode()\n"
        "    (d / 'model.safetensors').write_bytes(struct.pack('<Q', len(head)) + head + bytes(4))\n"
        "    pathlib.Path(os.environ['CALLS']).open('a').write('x')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(stub), "HF_TOKEN": "hf_secret_value",
           "CALLS": str(tmp_path / "calls")}
    for _ in range(2):
        r = subprocess.run(["bash", str(out / "launch" / "fetch_weights.sh")], capture_output=True, text=True,
                           env=env, timeout=60)
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text() == "x"  # fetched once; the second run found the finished copy
    assert b'"from": "meta-llama/Llama-3.1-8B@main"' in (tmp_path / "weights" / "model.safetensors").read_bytes()
    written = "".join(p.read_bytes().decode(errors="replace") for p in (tmp_path / "weights").rglob("*") if p.is_file())
    assert "hf_secret_value" not in written + (out / "launch" / "fetch_weights.sh").read_text()
    assert "hf_secret_value" not in r.stdout + r.stderr


@pytest.mark.slow
def test_the_trainer_refuses_in_one_line_when_the_base_weights_are_missing(tmp_path: Path):
    out = tmp_path / "infra"
    assert run("generate", "--model", "8b", "--task", "lora", "--cloud", "aws", "-o", str(out)).returncode == 0
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import train\n"
            "cfg = train.load_config(sys.argv[2], [f'model.pretrained_path={sys.argv[3]}'])\n"
            "train.pretrained_path(cfg)\n")
    r = subprocess.run([sys.executable, "-c", code, str(out / "launch"), str(out / "launch" / "train.yaml"),
                        str(tmp_path / "not-fetched")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "config.json" in r.stderr


def test_the_recipe_is_the_one_published_for_the_models_size():
    assert "llama3_1/70B_lora.yaml" in recipe(None, "lora", 70_553_706_496)["source"]
    assert "llama3_1/70B_full.yaml" in recipe(None, "full", 70_553_706_496)["source"]
    assert "llama3_1/8B_lora.yaml" in recipe(None, "lora", 8_030_261_248)["source"]
    # nearest in ratio: a 34B model is nearer 70B than 8B (34/8 = 4.3 > 70.6/34 = 2.1)
    assert "70B" in recipe(None, "lora", 34_000_000_000)["source"]
    # no 70B QLoRA recipe for Llama 3.1: the size that publishes one
    assert "8B_qlora" in recipe(None, "qlora", 70_553_706_496)["source"]
    assert recipe(None, "full", 70_553_706_496)["epochs"] == 3  # the 70B config's, not the 8B's 1


@pytest.mark.parametrize("model, task, rows, samples", [("70b", "lora", 52_002, 2 * 1 * 8),
                                                        ("8b", "lora", 51_760, 2 * 8 * 2)])
def test_warmup_is_the_recipes_fraction_of_the_run(model, task, rows, samples):
    r = run("plan", "--model", model, "--task", task, "--dataset", "20M", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    steps, warmup = p["training"]["steps"], p["training"]["warmup_steps"]
    assert warmup == round(steps * 100 / (rows / samples))  # num_warmup_steps 100 of the recipe's own run
    assert 0 < warmup < steps / 10
    note = next(n for n in p["notes"] if n.startswith("Fine-tuning"))
    assert f"{'70B' if model == '70b' else '8B'}_" in note and "warmup" in note
