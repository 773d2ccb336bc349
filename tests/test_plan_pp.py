"""`gpuprov plan --pp N`: the pipeline layout reaches the plan, the estimate and the bundle; bad combinations exit 2."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuprov.catalog import load_data
from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.planner import make_plan
from gpuprov.planning.space import _layouts, pipeline_micro_batches
from gpuprov.render.launch import render_launch
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.setup import arch_from_plan, setup_from_plan
from gpuprov.spec import TrainingSpec


LAUNCH = Path(__file__).resolve().parents[1] / "templates" / "launch"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True)


def _one_line_error(p: subprocess.CompletedProcess, *words: str) -> None:
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, p.stderr


def _estimate_args(plan) -> list[str]:
    """`gpuprov estimate` flags for the plan's own layout (the bundle's trainer's stack)."""
    c = plan.cluster
    args = ["estimate", "--model", plan.spec.model, "--gpu", c.gpu, "--gpus", str(c.total_gpus),
            "--gpus-per-node", str(c.gpus_per_node), "--sharding", c.sharding, "--micro-batch", str(c.micro_batch),
            "--grad-accumulation", str(c.grad_accum), "--seq-len", str(c.seq_len), "--activation-checkpointing",
            c.activation_checkpointing, "--tp", str(c.tp), "--cp", str(c.cp), "--pp", str(c.pp),
            "--pp-schedule", c.pp_schedule, "--framework", "gpuprov", "--json"]
    if c.sharding == "hsdp":  # estimate's shard group: one replica's GPUs over every stage
        args += ["--shard-group", str(c.shard_group * c.pp)]
    return args


@pytest.mark.parametrize("schedule,pp,kw", [
    ("1F1B", 2, dict(gpu_count=8)),
    ("Interleaved1F1B", 2, dict(gpu_count=8)),
    ("Interleaved1F1B", 4, dict(gpu_count=16, global_batch=32)),  # the recipe gives 2 sequences per rank: < pp
    ("1F1B", 2, dict(gpu_count=32, objective="time")),  # HSDP per stage on this spec
])
def test_plan_pp_fixes_the_degree_fills_the_pipeline_and_sizes_what_estimate_sizes(schedule, pp, kw):
    spec = TrainingSpec(model="llama-3.1-8b", tokens=10**9, pp=pp, pp_schedule=schedule, **kw)
    plan = make_plan(spec)
    c = plan.cluster
    assert (c.pp, c.pp_schedule) == (pp, schedule)
    assert c.grad_accum >= pp and (schedule == "1F1B" or c.grad_accum % pp == 0), c
    assert c.sharding in load_data("trainer.yaml")["pipeline"]["shardings"]
    if kw.get("objective") == "time":  # the case that covers HSDP: estimate's shard group spans the stages
        assert c.sharding == "hsdp" and c.replicate > 1, c
    assert c.pp * c.replicate * c.shard_group == c.total_gpus
    assert c.shard_group % (c.tp * c.cp) == 0
    dp = c.total_gpus // (c.tp * c.cp * c.pp)
    assert c.global_batch_tokens == c.micro_batch * c.grad_accum * c.seq_len * dp
    assert any(n.startswith(f"Pipeline: PP {pp} {schedule}") for n in plan.notes)
    assert plan.throughput.step_time_s > 0 and plan.throughput.tokens_per_s > 0
    # the estimate the plan shows is `gpuprov estimate`'s for the same layout, and validate's
    est = json.loads(_cli(*_estimate_args(plan)).stdout)
    assert est["per_gpu_bytes"] == plan.memory.per_gpu_bytes
    assert est["breakdown"] == plan.memory.breakdown and est["breakdown"]["pp_stage_outputs"] > 0
    setup = setup_from_plan(plan)
    assert (setup.pp, setup.pp_schedule, setup.grad_accumulation_steps) == (pp, schedule, c.grad_accum)
    again = estimate_memory(arch_from_plan(plan), setup, get_gpu(c.gpu).memory_bytes)
    assert again.per_gpu_bytes == plan.memory.per_gpu_bytes


def test_long_sequences_under_pp_get_no_context_parallelism():
    """The planner tries CP from 16k tokens, but the trainer's pipeline runs without it."""
    kw = dict(model="llama-3.1-8b", tokens=10**9, seq_len=65536, gpu_count=16, global_batch=16)
    assert make_plan(TrainingSpec(**kw)).cluster.cp > 1  # without PP this spec trains with CP
    plan = make_plan(TrainingSpec(**kw, pp=2))
    assert plan.cluster.pp == 2 and plan.cluster.cp == 1


def test_hsdp_layouts_under_pp_keep_whole_stages():
    """Every layout the search walks with PP is FSDP or HSDP whose replica holds whole TP x CP x PP groups."""
    lays = _layouts(32, 8, 4, [(1, 1), (4, 1)], pp=2)
    assert {lay.sharding for lay in lays} == {"fsdp", "hsdp"}
    assert all(lay.pp == 2 and lay.sg % (lay.tp * lay.cp * 2) == 0 and 32 % lay.sg == 0 for lay in lays)
    assert {lay.sharding for lay in _layouts(32, 8, 4, [(1, 1)])} >= {"ddp", "zero2"}  # without PP: as before


@pytest.mark.parametrize("pp,schedule,wanted,got", [
    (1, "1F1B", 3, 3), (1, "1F1B", 0, 1), (4, "1F1B", 2, 4), (4, "1F1B", 9, 9),
    (4, "Interleaved1F1B", 9, 8), (4, "Interleaved1F1B", 11, 12), (4, "Interleaved1F1B", 1, 4),
])
def test_pipeline_micro_batches_fill_the_pipeline_and_suit_the_schedule(pp, schedule, wanted, got):
    assert pipeline_micro_batches(pp, schedule, wanted) == got


def test_train_yaml_carries_the_pipeline_and_a_mesh_of_every_gpu():
    plan = make_plan(TrainingSpec(model="llama-3.1-8b", tokens=10**9, gpu_count=16, pp=4, global_batch=32,
                                  pp_schedule="Interleaved1F1B"))
    cfg = yaml.safe_load(render_launch(plan)["train.yaml"])
    par, batch = cfg["parallel"], cfg["batch"]
    assert (par["pp"], par["pp_schedule"]) == (4, "Interleaved1F1B")
    assert par["pp"] * par["replicate"] * par["shard"] == plan.cluster.total_gpus == 16
    assert batch["grad_accum"] == plan.cluster.grad_accum and batch["grad_accum"] % 4 == 0
    flat = yaml.safe_load(render_launch(make_plan(TrainingSpec(model="llama-3.1-8b", tokens=10**9,
                                                               gpu_count=8)))["train.yaml"])
    assert (flat["parallel"]["pp"], flat["parallel"]["pp_schedule"]) == (1, "1F1B")
    # the trainer reads it and builds a mesh of exactly the plan's GPUs
    pytest.importorskip("torch")
    sys.path.insert(0, str(LAUNCH))
    try:
        cfg_mod, par_mod = importlib.import_module("train_config"), importlib.import_module("parallel")
        read = cfg_mod.from_dict(cfg)
        assert (read.parallel.pp, read.parallel.pp_schedule) == (4, "Interleaved1F1B")
        lay = par_mod.layout_from(read.parallel.as_dict(), plan.cluster.total_gpus)
        assert lay.world == 16 and lay.shape[0] == 4
    finally:
        sys.path.remove(str(LAUNCH))
        for name in ("train_config", "parallel"):
            sys.modules.pop(name, None)


def test_plan_cli_and_spec_file_take_pp(tmp_path):
    p = _cli("plan", "--model", "8b", "--gpus", "8", "--pp", "2", "--pp-schedule", "Interleaved1F1B", "--json")
    assert p.returncode == 0, p.stderr
    c = json.loads(p.stdout)["cluster"]
    assert (c["pp"], c["pp_schedule"]) == (2, "Interleaved1F1B") and c["grad_accum"] % 2 == 0
    text = _cli("plan", "--model", "8b", "--gpus", "8", "--pp", "2")
    assert text.returncode == 0 and "layout PP2 x " in text.stdout, text.stderr
    spec = tmp_path / "gpuprov.yaml"
    spec.write_text("model: llama-3.1-8b\ngpu_count: 8\npp: 2\npp_schedule: Interleaved1F1B\n")
    c = json.loads(_cli("plan", "-f", str(spec), "--json").stdout)["cluster"]
    assert (c["pp"], c["pp_schedule"]) == (2, "Interleaved1F1B")
    spec.write_text("model: llama-3.1-8b\npp: 2\npp_schedule: GPipe\n")
    _one_line_error(_cli("plan", "-f", str(spec)), "pp_schedule")


def test_pipeline_combinations_the_trainer_cannot_run_exit_2_in_one_line():
    _one_line_error(_cli("plan", "--model", "8b", "--pp", "2", "--task", "lora"), "--pp", "--task full")
    _one_line_error(_cli("plan", "--model", "8b", "--pp", "2", "--task", "qlora"), "--pp", "--task full")
    layers = get_model("llama-3.1-8b").num_layers  # 32 blocks: 2 x 17 interleaved stages are too many
    _one_line_error(_cli("plan", "--model", "8b", "--pp", "17", "--pp-schedule", "Interleaved1F1B"),
                    "Interleaved1F1B", f"{layers} layers", "--pp-schedule 1F1B")
    _one_line_error(_cli("plan", "--model", "8b", "--pp", str(layers + 1)), f"{layers} layers")
    # what the trainer's pipeline refuses (catalog trainer.yaml pipeline: with_cp, tied_embeddings)
    assert get_model("llama-3.2-1b").tie_word_embeddings
    _one_line_error(_cli("plan", "--model", "llama-3.2-1b", "--pp", "2"), "--pp", "ties them")
    _one_line_error(_cli("plan", "--model", "8b", "--pp", "2", "--cp", "2", "--seq-len", "32768"), "--cp")
    bad = _cli("plan", "--model", "8b", "--pp", "2", "--pp-schedule", "GPipe")  # click's usage error, as every choice's
    assert bad.returncode == 2 and "--pp-schedule" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    # a batch too small to fill the pipeline on any cluster: says so instead of "nothing fits"
    _one_line_error(_cli("plan", "--model", "8b", "--gpus", "16", "--tp", "1", "--pp", "2", "--global-batch", "4"),
                    "--pp 2 leaves no batch shape", "--global-batch")
    # the sizing's own refusal of a data-parallel mode PP does not run (plan never picks one)
    _one_line_error(_cli("estimate", "--model", "8b", "--gpus", "8", "--pp", "2", "--sharding", "ddp"),
                    "--sharding ddp")


def test_generate_pp_bundle_validates(tmp_path):
    out = tmp_path / "b"
    g = _cli("generate", "--model", "8b", "--gpus", "8", "--pp", "2", "--cloud", "aws", "-o", str(out))
    assert g.returncode == 0, g.stderr
    assert "PP2 x FSDP 4" in g.stderr  # the one layout label, on the summary line
    par = yaml.safe_load((out / "launch" / "train.yaml").read_text())["parallel"]
    assert par["pp"] == 2 and par["pp"] * par["replicate"] * par["shard"] == 8
    v = _cli("validate", str(out), "--offline")
    assert v.returncode == 0, v.stdout + v.stderr
    assert any(line.startswith("ok    plan fits") for line in v.stdout.splitlines()), v.stdout


def test_explain_counts_the_pipeline_in_ranks_and_step():
    args = ("--model", "8b", "--gpus", "8", "--pp", "2")
    c = json.loads(_cli("plan", *args, "--json").stdout)["cluster"]
    p = _cli("explain", *args)
    assert p.returncode == 0, p.stderr
    ranks = next(ln for ln in p.stdout.splitlines() if "tokens per step =" in ln)
    dp = c["total_gpus"] // (c["tp"] * c["cp"] * c["pp"])
    assert f"x {dp} data-parallel ranks" in ranks and f"= {c['global_batch_tokens']:,};" in ranks, ranks
    step = next(ln for ln in p.stdout.splitlines() if ln.strip().startswith("step = "))
    assert "pipeline bubble" in step, step


# ---------------------------------------------------------------- the planner proposes PP itself


def _pp_spec(**kw) -> TrainingSpec:
    return TrainingSpec(**{"model": "llama-3.1-70b", "task": "full", "tokens": 20_000_000_000, "gpus": ["a100-40gb"],
                           "global_batch": 512, **kw})


def test_the_planner_proposes_pp_where_it_is_cheapest_with_its_bubble_in_the_time():
    """70B on A100 80GB nodes with a 512-sequence batch: the search finds a pipeline cheaper than every
    TP x FSDP layout (--pp 1), and the pipeline's bubble is part of the step it is timed with."""
    def spec(**kw):
        return _pp_spec(gpus=["a100-80gb"], **kw)

    proposed, flat = make_plan(spec()), make_plan(spec(pp=1))
    assert proposed.cluster.pp > 1 and flat.cluster.pp == 1
    assert proposed.cost_usd < flat.cost_usd
    # the same layout asked for with --pp and the same GPU count gives the same run: the proposal is a plan the
    # trainer runs (with --pp alone the search may also take node counts the pipeline's stages do not divide)
    fixed = make_plan(spec(pp=proposed.cluster.pp, gpu_count=proposed.cluster.total_gpus))
    assert (fixed.cluster.tp, fixed.cluster.nodes, fixed.cost_usd) == (
        proposed.cluster.tp, proposed.cluster.nodes, proposed.cost_usd)
    assert make_plan(spec(pp=proposed.cluster.pp)).cost_usd <= proposed.cost_usd
    note = next(n for n in proposed.notes if n.startswith("Pipeline (proposed by the planner"))
    bubble = float(note.split("bubble ((p-1)/(v m) of the compute) is ")[1].split(" s")[0])
    assert 0 < bubble < proposed.throughput.step_time_s
    assert proposed.cluster.nodes % proposed.cluster.pp == 0  # stages span whole nodes


def test_no_pp_is_proposed_where_the_trainer_cannot_pipeline():
    """LoRA, a tied-embedding model and an MoE keep PP 1 whatever the batch (trainer.yaml pipeline)."""
    from gpuprov.planning.space import pipeline_degrees

    assert pipeline_degrees(_pp_spec(), get_model("llama-3.1-70b"))[0] == (1, 2, 4, 8)
    assert pipeline_degrees(_pp_spec(task="lora"), get_model("llama-3.1-70b"))[0] == (1,)
    assert pipeline_degrees(_pp_spec(pp=1), get_model("llama-3.1-70b"))[0] == (1,)
    tied = next(m for m in ("llama-3.2-1b", "qwen2.5-0.5b", "gemma-2-2b") if _known(m) and get_model(m).tie_word_embeddings)
    assert pipeline_degrees(_pp_spec(model=tied), get_model(tied))[0] == (1,)
    moe = next(m for m in ("mixtral-8x7b",) if _known(m))
    assert pipeline_degrees(_pp_spec(model=moe), get_model(moe))[0] == (1,)
    assert make_plan(_pp_spec(task="lora")).cluster.pp == 1
    # an untied dense family whose blocks the trainer's stages are not tested on (trainer.yaml model_families)
    for untested in ("phi-3-medium", "olmo-2-13b"):
        arch = get_model(untested)
        assert not arch.tie_word_embeddings and not arch.is_moe
        assert pipeline_degrees(_pp_spec(model=untested), arch)[0] == (1,)


def _known(name: str) -> bool:
    try:
        get_model(name)
        return True
    except Exception:  # noqa: BLE001 - a preset this catalog does not hold
        return False


def test_the_search_with_pp_never_does_worse_than_without():
    """PP is added to the space, nothing is taken out: for specs where no pipeline wins, the plan is the
    --pp 1 plan."""
    for kw in (dict(gpus=None, global_batch=None), dict(model="llama-3.1-405b", gpus=None, global_batch=None),
               dict(gpus=["h100-80gb"], global_batch=None)):
        a, b = make_plan(_pp_spec(**kw)), make_plan(_pp_spec(pp=1, **kw))
        assert a.cost_usd <= b.cost_usd
        if a.cluster.pp == 1:
            assert (a.cluster.instance_type, a.cluster.nodes, a.cluster.tp, a.cost_usd) == (
                b.cluster.instance_type, b.cluster.nodes, b.cluster.tp, b.cost_usd)
