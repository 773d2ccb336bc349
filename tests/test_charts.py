"""The plan's pictures: memory.svg (per-GPU peak by estimator term) and cost.svg (the candidates' cost
against hours, chosen marked, Pareto front joined), parsed as XML; in the bundle and from `plan --svg`."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from gpuprov.candidates import pareto_front
from gpuprov.planner import make_plan
from gpuprov.render.charts import render_cost_svg, render_memory_svg
from gpuprov.render.report import render_report
from gpuprov.spec import TrainingSpec

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def plan():
    return make_plan(TrainingSpec(model="llama-3.1-70b", tokens=20_000_000_000))


def test_memory_bar_stacks_every_term_in_proportion(plan):
    root = ET.fromstring(render_memory_svg(plan))
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("data-term")]
    terms = {k: v for k, v in plan.memory.breakdown.items() if v > 0}
    assert [b.get("data-term") for b in bars] == list(terms)
    assert [int(b.get("data-bytes")) for b in bars] == list(terms.values())
    total = next(r for r in root.iter(f"{SVG}rect") if r.get("data-total-bytes"))
    scale = float(total.get("width")) / int(total.get("data-total-bytes"))  # pixels per byte of the whole GPU
    for b in bars:  # the widths are the terms' sizes, at one scale
        assert float(b.get("width")) == pytest.approx(int(b.get("data-bytes")) * scale, abs=0.01)
    # segments touch, left to right, and the stack ends at the per-GPU peak
    xs = [(float(b.get("x")), float(b.get("width"))) for b in bars]
    assert all(abs(x0 + w0 - x1) < 0.02 for (x0, w0), (x1, _) in zip(xs, xs[1:]))
    end = xs[-1][0] + xs[-1][1] - xs[0][0]
    assert end / float(total.get("width")) == pytest.approx(plan.memory.per_gpu_bytes / plan.memory.gpu_memory_bytes,
                                                            abs=1e-3)
    usable = next(ln for ln in root.iter(f"{SVG}line") if ln.get("data-usable-bytes"))
    assert int(usable.get("data-usable-bytes")) == int(plan.memory.gpu_memory_bytes * (1 - plan.memory.safety_margin))


def test_cost_chart_marks_the_chosen_run_and_the_pareto_front(plan):
    root = ET.fromstring(render_cost_svg(plan))
    dots = list(root.iter(f"{SVG}circle"))
    priced = [r for r in plan.candidates if r.cost_usd is not None]
    assert len(dots) == len(priced) >= 3
    chosen = [d for d in dots if d.get("data-chosen") == "true"]
    row = next(r for r in plan.candidates if r.chosen)
    assert len(chosen) == 1 and chosen[0].get("data-instance") == row.instance_type
    assert float(chosen[0].get("data-cost")) == row.cost_usd
    # the Pareto front the plan carries is the brute-force one over its rows
    front = {i for i, r in enumerate(plan.candidates) if r.pareto}
    assert front == pareto_front([(r.time_hours, r.cost_usd) for r in plan.candidates]) and front
    assert {d.get("data-instance") for d in dots if d.get("data-pareto") == "true"} == {
        plan.candidates[i].instance_type for i in front}
    line = next(root.iter(f"{SVG}polyline"))
    points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert len(points) == len(front) == int(line.get("data-pareto"))
    assert [x for x, _ in points] == sorted(x for x, _ in points)  # drawn along time
    # cheaper is higher up: a dearer dot sits lower on the page (y grows downwards)
    by_cost = sorted(dots, key=lambda d: float(d.get("data-cost")))
    assert [float(d.get("cy")) for d in by_cost] == sorted((float(d.get("cy")) for d in by_cost), reverse=True)


def test_pareto_front_keeps_what_nothing_beats_on_both():
    pts = [(10.0, 100.0), (5.0, 200.0), (12.0, 150.0), (5.0, 200.0), (20.0, None), (4.0, 300.0)]
    assert pareto_front(pts) == {0, 1, 3, 5}


def test_pictures_escape_text(plan):
    odd = plan.model_copy(update={
        "model": plan.model.model_copy(update={"display_name": 'A<&>"B'}),
        "candidates": [r.model_copy(update={"instance_type": "x<&>'y"}) for r in plan.candidates]})
    for text in (render_cost_svg(odd), render_memory_svg(odd)):
        root = ET.fromstring(text)
        assert root.tag == f"{SVG}svg"
    assert any(d.get("data-instance") == "x<&>'y" for d in ET.fromstring(render_cost_svg(odd)).iter(f"{SVG}circle"))


def test_bundle_carries_the_pictures_and_links_them(plan):
    files = render_report(plan)
    for name in ("memory.svg", "cost.svg", "topology.svg"):
        ET.fromstring(files[name])
        assert f"]({name})" in files["README.md"]


def test_plan_svg_writes_the_pictures_without_a_bundle(tmp_path: Path):
    out = tmp_path / "pics"
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "8b", "--svg", str(out), "--json"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["cost.svg", "memory.svg", "topology.svg"]
    for p in out.iterdir():
        ET.parse(p)
    (tmp_path / "afile").write_text("x")
    r = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "8b", "--svg", str(tmp_path / "afile")],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and "not a folder" in r.stderr and not r.stdout
