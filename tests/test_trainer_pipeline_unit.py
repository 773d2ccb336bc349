"""The trainer's pipeline split and its refusals, in-process (the runs themselves: test_trainer_layouts.py).

The trainer splits the blocks and assigns stages to ranks exactly as gpuprov's estimate does (both
follow torchtitan's generate_split_points and stage_ids_this_rank), so the plan sizes the stages the
bundle runs."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
LAUNCH = Path(__file__).resolve().parents[1] / "templates" / "launch"


@pytest.fixture(scope="module")
def tp():
    sys.path.insert(0, str(LAUNCH))
    try:
        yield importlib.import_module("train_pipeline")
    finally:
        sys.path.remove(str(LAUNCH))
        for name in ("train_pipeline", "train_config"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("layers,pp,schedule", [
    (layers, pp, schedule) for layers in (4, 32, 80, 126) for pp in (2, 4, 8) for schedule in ("1F1B", "Interleaved1F1B")
    if pp * (2 if schedule == "Interleaved1F1B" else 1) <= layers])  # more stages than blocks: refused (below)
def test_the_split_and_the_stage_ranks_match_the_estimate(tp, layers, pp, schedule):
    from gpuprov.sizing import pipeline

    v = tp.stages_per_rank(schedule)
    assert v == pipeline.stages_per_rank(schedule)
    assert tuple(tp.split_layers(layers, pp * v)) == pipeline.split_layers(layers, pp * v)
    bounds = tp.stage_bounds(layers, pp * v)
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    # every stage on exactly one rank, rank r holding r, r + pp, ... (the estimate's `mine`)
    owners = [s for r in range(pp) for s in tp.stage_ids(r, pp, v)]
    assert sorted(owners) == list(range(pp * v))
    assert tp.stage_ids(1, pp, v) == tuple(1 + s * pp for s in range(v))


def _cfg(task: str = "full", accum: int = 4, **par):
    parallel = dict(pp=2, pp_schedule="1F1B", sharding="fsdp", tp=1, cp=1) | par
    return SimpleNamespace(parallel=SimpleNamespace(**parallel), task=SimpleNamespace(kind=task),
                           batch=SimpleNamespace(grad_accum=accum))


@pytest.mark.parametrize("change,message", [
    (dict(task="lora"), "full training only"),
    (dict(sharding="ddp"), "needs sharding fsdp or hsdp"),
    (dict(pp=3, pp_schedule="Interleaved1F1B"), "6 stages, more than the model's 4 blocks"),
    (dict(pp_schedule="Interleaved1F1B", accum=3), "multiple of parallel.pp 2"),
    (dict(pp_schedule="GPipe"), "not one of 1F1B, Interleaved1F1B"),
    (dict(cp=2), "does not combine with parallel.cp"),
])
def test_layouts_it_does_not_run_are_refused_in_one_line(tp, change, message):
    cfg = _cfg(**change)
    config = SimpleNamespace(num_hidden_layers=4, tie_word_embeddings=False)
    with pytest.raises(SystemExit, match=message):
        tp.check(cfg, config)
    tp.check(_cfg(), config)  # the plain layout passes
    with pytest.raises(SystemExit, match="tied embeddings"):
        tp.check(_cfg(), SimpleNamespace(num_hidden_layers=4, tie_word_embeddings=True))
