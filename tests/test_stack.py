"""The Plan's Stack is one description of the training run: the memory estimate sized it and
launch/train.yaml runs it. For every example spec, both are held to the Plan's stack."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import yaml

from gpuprov.render.launch import render_launch
from gpuprov.sizing.setup import setup_from_plan
from gpuprov.stack import choose_stack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from regen_examples import example_dirs, example_spec  # noqa: E402

EXAMPLES = example_dirs()


@pytest.fixture(scope="module", params=EXAMPLES, ids=lambda d: d.name)
def example_plan(request):
    from gpuprov.commands.generate import make_plan

    return make_plan(example_spec(request.param))


def test_examples_exist():
    assert len(EXAMPLES) >= 5


def test_estimate_sized_the_plans_stack(example_plan):
    """Rebuilt from the Plan alone (cluster + stack), the estimator gives the plan's own figure:
    the planner sized exactly this stack. A stack field the planner ignored would change it."""
    from gpuprov.catalog.models import get_model
    from gpuprov.sizing.memory import estimate_memory

    plan = example_plan
    est = estimate_memory(get_model(plan.spec.model), setup_from_plan(plan))
    assert est.per_gpu_bytes == plan.memory.per_gpu_bytes
    assert dict(est.breakdown) == plan.memory.breakdown
    # and the figure depends on the stack: the other compile choice would be sized differently
    for change in ({"compile": not plan.stack.compile},):
        other = estimate_memory(get_model(plan.spec.model), dataclasses.replace(setup_from_plan(plan), **change))
        assert other.per_gpu_bytes != plan.memory.per_gpu_bytes, change


def test_train_yaml_runs_the_plans_stack(example_plan):
    plan, s = example_plan, example_plan.stack
    setup = setup_from_plan(plan)
    cfg = yaml.safe_load(render_launch(plan)["train.yaml"])
    e = cfg["efficiency"]
    assert (e["compile"], e["chunked_cross_entropy"], e["loss"]) == (setup.compile, setup.chunked_cross_entropy,
                                                                     setup.loss_impl)
    assert e["float8"] == s.float8
    assert cfg["parallel"]["activation_checkpointing"] == setup.activation_checkpointing
    assert cfg["parallel"]["offload"] == setup.offload and cfg["optimizer"]["name"] == setup.optimizer
    assert cfg["task"]["lora"]["dropout"] == setup.lora_dropout
    p = cfg["precision"]
    assert (p["param_dtype"], p["reduce_dtype"], p["master_dtype"], p["tf32"]) == (
        s.param_dtype, s.reduce_dtype, s.master_dtype, s.tf32)
    assert set(p) == {"param_dtype", "reduce_dtype", "master_dtype", "tf32"}
    assert cfg["task"]["frozen_dtype"] == s.frozen_dtype
    assert (s.frozen_dtype == "bfloat16") == (plan.task == "lora")
    if plan.task != "full":
        assert any("bf16 frozen base" in a or "NF4" in a for a in plan.memory.assumptions)
    assert s.qlora_base_replicated == (plan.task == "qlora") == setup.qlora_base_replicated
    assert cfg["model"]["attn_implementation"] == s.attention != "eager"
    assert cfg["batch"]["micro_batch"] == setup.micro_batch and cfg["batch"]["seq_len"] == setup.seq_len
    assert cfg["batch"]["grad_accum"] == setup.grad_accumulation_steps
    assert cfg["checkpoint"]["async"] == s.async_checkpoint and cfg["runtime"]["min_torch"] == s.min_torch
    if plan.cluster.nodes > 1:
        assert cfg["checkpoint"]["dir"].startswith("/shared/")


def test_stack_choices_follow_the_catalog():
    from gpuprov.catalog import load_data

    facts = load_data("trainer.yaml")
    assert choose_stack("full", "bf16-mixed", "gemma2").attention == facts["attention"]["by_model_type"]["gemma2"]
    assert choose_stack("full", "bf16-mixed", "llama").attention == facts["attention"]["default"] == "sdpa"
    assert choose_stack("qlora", "bf16-mixed", "llama").compile is ("qlora" in facts["compile"]["tasks"])
    assert choose_stack("full", "fp32", "llama").tf32 and not choose_stack("full", "bf16-mixed", "llama").tf32
    assert all(facts[k]["source"] for k in ("torch", "attention", "compile"))


def test_train_extra_floor_is_the_trainers():
    """pyproject's `train` extra promises the torch the trainer checks for (runtime.min_torch)."""
    import re

    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    train = re.search(r'^train = \[(.*)\]', text, re.M).group(1)
    assert f'"torch>={choose_stack("full", "bf16-mixed", "llama").min_torch}"' in train


def test_the_plan_names_the_attention_kernel_the_trainer_runs(example_plan):
    """The Stack says which kernel computes attention for the plan's layout, from the inputs the trainer
    builds (train_attention.model_inputs): SDPA gets a dense per-document mask (not FlashAttention's
    backend, which takes none), flash_attention_2 per-document positions; a note says how the step time
    counts that kernel's attention (a masked one: every score tile)."""
    import importlib.util

    from gpuprov.stack import attention_kernel

    torch = pytest.importorskip("torch")
    path = Path(__file__).resolve().parent.parent / "templates" / "launch" / "train_attention.py"
    spec = importlib.util.spec_from_file_location("train_attention_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model_inputs = module.model_inputs

    stack, cp = example_plan.stack, example_plan.cluster.cp
    assert stack.attention_kernel == attention_kernel(stack.attention, cp)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2]])
    given = model_inputs(stack.attention, docs)
    masked = "attention_mask" in given and given["attention_mask"].shape == (1, 1, 6, 6)
    assert masked == ("dense per-document mask" in stack.attention_kernel)
    assert ("all-gathered over the CP group" in stack.attention_kernel) == (cp > 1)
    notes = [n for n in example_plan.notes if n.startswith("Attention: ")]
    assert len(notes) == (1 if masked or cp > 1 else 0)
    if notes:
        share = example_plan.throughput.attention_flops_per_token / example_plan.throughput.flops_per_token
        assert f" {share:.0%} of the model FLOPs" in notes[0] and stack.attention_kernel in notes[0]
        # a masked run's step time counts the whole square (operators.Layout.every_tile)
        assert ("counts every score tile" in notes[0]) == masked
