"""Framework presets (catalog/data/frameworks.yaml): every setting a valid, cited TrainSetup field."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from gpuprov.catalog import load_data
from gpuprov.catalog.models import get_model
from gpuprov.errors import GpuprovError
from gpuprov.sizing import frameworks
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.types import TrainSetup

REPO = Path(__file__).resolve().parents[1]
CITED = re.compile(r"^[\w.-]+/[\w.-]+ (v[\d.]+ )?[\w./-]+(@[0-9a-f]{40})?[ (]")
SHAPES = [(task, sharding) for task in ("full", "lora", "qlora") for sharding in ("none", "fsdp")]


def entries():
    return load_data("frameworks.yaml")["frameworks"]


@pytest.mark.parametrize("name", list(entries()))
def test_every_setting_is_a_stack_field_with_a_source_at_a_commit(name) -> None:
    entry = entries()[name]
    blocks = [entry.get("settings") or {}] + [rule["settings"] for rule in entry.get("when", []) or []]
    assert entry["title"] and (entry.get("inherits") in (None, *entries()))
    for block in blocks:
        for field, item in block.items():
            assert field in frameworks.STACK_FIELDS, field
            source = item["source"]
            if source.startswith("gpuprov "):
                path = source.split()[1]  # the bundle's own files, which must exist
                assert (REPO / path).is_file(), source
            else:
                assert CITED.match(source) and "@" in source or " v" in source, source


@pytest.mark.parametrize("name", list(entries()))
@pytest.mark.parametrize("task, sharding", SHAPES)
def test_every_preset_builds_a_valid_setup_the_estimator_accepts(name, task, sharding) -> None:
    stack = {k: v.value for k, v in frameworks.preset_settings(name, {"task": task, "sharding": sharding}).items()}
    stack.setdefault("sharding", sharding)
    gpus = 1 if stack["sharding"] == "none" else 8
    setup = TrainSetup(task=task, gpus=gpus, seq_len=1024, **stack)
    est = estimate_memory(get_model("llama-3.1-8b"), setup)
    assert est.per_gpu_bytes == sum(est.breakdown.values()) > 0


def test_explicit_values_override_the_preset_and_when_rules_apply() -> None:
    defaults = {f.name: getattr(TrainSetup(), f.name) for f in fields(TrainSetup) if f.name in frameworks.STACK_FIELDS}
    values, applied = frameworks.resolve("torchtitan", {"activation_checkpointing": "full"}, defaults)
    assert values["activation_checkpointing"] == "full" and "activation_checkpointing" not in applied
    assert values["shard_embeddings"] is True and applied["shard_embeddings"].source.startswith("pytorch/torchtitan")
    # litgpt: one device runs no checkpoint_wrapper; a quantized run is bf16-true without autocast
    single, _ = frameworks.resolve("litgpt", {}, defaults, lambda v: {"task": "lora", "sharding": "none"})
    assert single["activation_checkpointing"] == "none"
    q, _ = frameworks.resolve("litgpt", {}, defaults, lambda v: {"task": "qlora", "sharding": "fsdp"})
    assert q["precision"] == "bf16" and q["autocast_fp32_params"] is False
    # inheritance: axolotl is the HF Trainer plus its examples' choices
    ax = frameworks.preset_settings("axolotl")
    assert ax["loss_impl"].value == "native" and ax["activation_checkpointing"].value == "full"
    with pytest.raises(GpuprovError, match="unknown framework"):
        frameworks.preset_settings("megatron")


def test_gpuprov_preset_is_what_the_planner_sizes() -> None:
    from gpuprov.sizing.setup import make_setup

    s = make_setup(task="qlora", seq_len=2048, micro_batch=1, gpus=8, gpus_per_node=8, sharding="fsdp",
                   activation_checkpointing="full", grad_accum=2)
    for field, value in frameworks.gpuprov_stack("qlora", "fsdp").items():
        assert getattr(s, field) == value, field
    assert s.qlora_base_replicated and s.grad_accumulation_steps == 2


def test_gpuprov_preset_matches_the_bundled_trainer_code() -> None:
    """The trainer's source says what the preset claims (a drift here means the preset lies)."""
    train = "\n".join(p.read_text() for p in sorted((REPO / "templates" / "launch").glob("train*.py")))
    stack = frameworks.gpuprov_stack("full", "fsdp")
    assert ("fully_shard(" in train) == (stack["fsdp_version"] == 2)
    assert "MixedPrecisionPolicy(" in train and stack["autocast_fp32_params"] is False
    assert ("replace_blocks(blocks, torch.compile)" in train) == stack["compile"]  # each block compiled
    assert ("fully_shard(embed" in train) == stack["shard_embeddings"]
    assert ("del logits" in train) == (stack["loss_impl"] == "native")
    assert ".float()" in train and stack["loss_upcast"] is True
    assert ('"fused": True' in train) == (stack["optimizer_impl"] == "fused")
    yaml = (REPO / "templates" / "launch" / "train.yaml.j2").read_text()
    assert "dropout: {{ stack.lora_dropout | y }}" in yaml  # the Plan's Stack, which test_stack holds to this preset


@pytest.mark.parametrize("task,tp", [("full", 1), ("lora", 1), ("qlora", 1), ("full", 4)])
def test_gpuprov_preset_is_the_plans_stack(task: str, tp: int) -> None:
    """`estimate --framework gpuprov` and the Plan's Stack (gpuprov/stack.py) size one trainer, with
    tensor parallelism too (the trainer does not chunk the loss under TP; the preset said it did)."""
    from gpuprov.stack import choose_stack, setup_fields

    fields = setup_fields(choose_stack(task, "bf16-mixed", "llama", tp), tp)
    preset = frameworks.gpuprov_stack(task, "fsdp", tp)
    if tp > 1:
        assert preset["chunked_cross_entropy"] is False
    assert {k: fields[k] for k in preset} == preset
    # float8: the planner decides it per GPU (a measured gain on that class), not the preset
    assert set(fields) - set(preset) <= {"chunked_cross_entropy", "activation_offloading", "compile_scope",
                                         "qlora_base_replicated", "float8"}


def test_plan_and_estimate_agree_on_the_qlora_base_and_the_stack() -> None:
    """`gpuprov plan` sizes what `estimate --framework gpuprov` sizes, replicated NF4 base included."""
    import json
    import subprocess
    import sys

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    plan = json.loads(cli("plan", "--model", "llama-2-7b", "--task", "qlora", "--json"))
    c = plan["cluster"]
    est = json.loads(cli("estimate", "--model", "llama-2-7b", "--task", "qlora", "--framework", "gpuprov", "--json",
                         "--gpu", c["gpu"], "--gpus", str(c["total_gpus"]), "--gpus-per-node", str(c["gpus_per_node"]),
                         "--sharding", c["sharding"], "--activation-checkpointing", c["activation_checkpointing"],
                         "--micro-batch", str(c["micro_batch"]), "--seq-len", str(c["seq_len"]),
                         "--grad-accumulation", str(c["grad_accum"])))
    assert est["per_gpu_bytes"] == plan["memory"]["per_gpu_bytes"]
    assert est["setup"]["qlora_base"] == "replicated"
    assert any("QLoRA base" in n and "every GPU" in n for n in plan["notes"])
    other = json.loads(cli("plan", "--model", "llama-2-7b", "--task", "qlora", "--framework", "fsdp-qlora", "--json"))
    assert any("sized for the fsdp-qlora stack" in n for n in other["notes"])
    assert not any("QLoRA base" in n for n in other["notes"])


def test_plan_and_estimate_agree_on_a_tensor_parallel_layout() -> None:
    """The plan's TP x FSDP layout, given to `estimate --framework gpuprov`, is the same figure."""
    import json
    import subprocess
    import sys

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    plan = cli("plan", "--model", "70b", "--tp", "4", "--json")
    c = plan["cluster"]
    assert c["tp"] == 4
    est = cli("estimate", "--model", "70b", "--framework", "gpuprov", "--json", "--gpu", c["gpu"],
              "--gpus", str(c["total_gpus"]), "--gpus-per-node", str(c["gpus_per_node"]), "--tp", "4",
              "--sharding", c["sharding"], "--activation-checkpointing", c["activation_checkpointing"],
              "--micro-batch", str(c["micro_batch"]), "--seq-len", str(c["seq_len"]),
              "--grad-accumulation", str(c["grad_accum"]))
    assert est["per_gpu_bytes"] == plan["memory"]["per_gpu_bytes"]
    assert est["setup"]["chunked_cross_entropy"] is False
