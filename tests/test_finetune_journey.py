"""A fine-tune as a user runs it, on this machine: a Hugging Face model folder and a chat JSONL ->
`gpuprov generate` -> the bundle's own staging scripts -> its train.sh (torchrun, 2 CPU processes,
gloo) -> the export -> loaded with peft and transformers, giving the trainer's logits.

Nothing in the bundle is edited. What differs from a cluster is only the transport: the files the
bundle's ansible/stage.yml copies (the base folder, the dataset) are copied here by the test, and
the bundle's cluster paths (/scratch/...) are folders of the test in a mount namespace (sandbox_fs).
The base is made here with transformers (no download: HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from finetune_inputs import CHATML, make_base, sample_tokens, trainer_model, write_chat
from ports import free_port
from sandbox_fs import available, sandboxed

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(300)]
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("user")
    make_base(where / "tiny-llama")
    write_chat(where / "chat.jsonl")
    return where


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, **kwargs)
    assert proc.returncode == 0, f"{argv[-3:]}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def on_cluster(cluster: Path, path: str) -> Path:
    """Where a cluster path of the bundle lives in this test."""
    return cluster / PurePosixPath(path).relative_to("/").as_posix().split("/", 1)[1]


def journey(tmp: Path, inputs: Path, task: str, epochs: int, *train_args: str) -> tuple[Path, dict, dict]:
    """generate -> stage -> train, as the bundle runs them; (bundle, plan.json's staging, train.yaml)."""
    if (why := available()) is not None:
        pytest.skip(f"the bundle's cluster paths need a mount namespace: {why}")
    bundle = tmp / "bundle"
    # `--model` a local folder and `--dataset` a local file, as a user with both on disk
    run([sys.executable, "-m", "gpuprov", "generate", "--model", str(inputs / "tiny-llama"), "--task", task,
         "--dataset", str(inputs / "chat.jsonl"), "--seq-len", "64", "--epochs", str(epochs), "--cloud", "gcp",
         "--gpus", "2", "--max-nodes", "1", "-o", str(bundle)], cwd=tmp, env=ENV)
    st = json.loads((bundle / "plan.json").read_text())["staging"]
    cfg = yaml.safe_load((bundle / "launch" / "train.yaml").read_text())
    assert cfg["model"]["pretrained_path"] == st["weights_dir"] and cfg["data"]["path"] == st["data_dir"]
    top = "/" + PurePosixPath(st["weights_dir"]).parts[1]  # the checkpoint root's top folder (/scratch)
    assert cfg["checkpoint"]["dir"].startswith(top + "/") and st["data_dir"].startswith(top + "/")
    cluster = tmp / "cluster"
    cluster.mkdir()

    # stage.yml's copy tasks (the transport): the base folder `up` copies from the bundle's path to it
    assert (bundle / "ansible" / ".." / st["weights_local"]).resolve() == (inputs / "tiny-llama").resolve()
    shutil.copytree(inputs / "tiny-llama", on_cluster(cluster, st["weights_dir"]))
    on_cluster(cluster, st["dataset_raw"]).parent.mkdir(parents=True)
    shutil.copy(st["dataset_source"], on_cluster(cluster, st["dataset_raw"]))

    launch = bundle / "launch"
    env = dict(ENV, PYTHON=sys.executable, OMP_NUM_THREADS="1", GPUPROV_MAX_RESTARTS="0",
               GPUPROV_HEAD_PORT=str(free_port()))
    box = lambda *argv: sandboxed(list(argv), {top: cluster}, launch, tmp / "root")  # noqa: E731
    (tmp / "root").mkdir()
    assert "already complete" in run(box("./fetch_weights.sh"), env=env).stdout
    run(box("./stage_data.sh", "download"), env=env)
    assert "prepared into" in run(box("./stage_data.sh", "prepare"), env=env).stdout
    meta = json.loads((on_cluster(cluster, st["data_dir"]) / "meta.json").read_text())
    assert meta["loss_mask"] and meta["train_samples"] > 0
    # every step's loss logged; a tiny random base learns at a higher rate than the recipe's for a real one
    run(box("./train.sh", "--set", "logging.every_steps=1", "--set", "optimizer.lr=3e-3", *train_args), env=env)
    return cluster, st, cfg


def losses(cluster: Path, cfg: dict) -> list[float]:
    lines = on_cluster(cluster, cfg["logging"]["metrics_file"]).read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def test_lora_from_a_local_folder_to_a_peft_adapter_and_a_merged_model(tmp_path, inputs):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cluster, st, cfg = journey(tmp_path, inputs, "lora", 24, "--set", "export.merged=true")
    loss = losses(cluster, cfg)
    assert len(loss) >= 30 and sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.1, loss
    model, export = trainer_model(tmp_path / "bundle" / "launch", lambda p: on_cluster(cluster, p), st, cfg)
    assert (export / "adapter_config.json").is_file() and (export / "merged" / "config.json").is_file()
    tokens = sample_tokens(inputs / "tiny-llama", inputs / "chat.jsonl")
    # the trainer keeps the frozen base in bf16 (task.frozen_dtype): peft's base is that base
    base = AutoModelForCausalLM.from_pretrained(inputs / "tiny-llama", dtype=torch.bfloat16).float()
    with torch.no_grad():
        want = model(input_ids=tokens).logits
        adapter = PeftModel.from_pretrained(base, export).eval()(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()(
            input_ids=tokens).logits
        untrained = AutoModelForCausalLM.from_pretrained(inputs / "tiny-llama", dtype=torch.float32)(
            input_ids=tokens).logits
    assert (untrained - want).abs().max() > 0.1  # the adapter changed the model (0.5 when measured)
    torch.testing.assert_close(adapter, want, rtol=0, atol=1e-4)  # measured: equal
    # the merged weights are W + BA rounded once to bf16 (export.dtype): 7e-4 when measured
    torch.testing.assert_close(merged, want, rtol=0, atol=5e-3)


def test_full_fine_tune_from_a_local_folder_to_a_transformers_model(tmp_path, inputs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cluster, st, cfg = journey(tmp_path, inputs, "full", 12)
    loss = losses(cluster, cfg)
    assert len(loss) >= 30 and sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.1, loss
    model, export = trainer_model(tmp_path / "bundle" / "launch", lambda p: on_cluster(cluster, p), st, cfg)
    tokens = sample_tokens(inputs / "tiny-llama", inputs / "chat.jsonl")
    with torch.no_grad():
        for p in model.parameters():  # the export's dtype (bf16), as the reference
            p.copy_(p.to(torch.bfloat16).float())
        want = model(input_ids=tokens).logits
        got = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()(input_ids=tokens).logits
        untrained = AutoModelForCausalLM.from_pretrained(inputs / "tiny-llama", dtype=torch.float32)(
            input_ids=tokens).logits
    assert (untrained - got).abs().max() > 0.1  # training changed the weights
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert AutoTokenizer.from_pretrained(export).chat_template == CHATML
