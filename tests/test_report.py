"""render_report: README (plan, memory, alternatives, checklist, how to apply) and topology.svg."""

from __future__ import annotations

import re

import xml.etree.ElementTree as ET

import pytest

from gpuprov.plan import Alternative
from gpuprov.render.report import render_report
from plan_fixtures import sample_plan

SVG = "{http://www.w3.org/2000/svg}"


def test_readme_explains_the_plan() -> None:
    plan = sample_plan("aws", nodes=2)
    plan = plan.model_copy(update={"alternatives": [Alternative(
        cloud="gcp", instance_type="a3-megagpu-8g", gpu="h100-80gb", nodes=2, total_gpus=16, sharding="hsdp",
        time_hours=3.0, cost_usd=530.0, reason="dearer")], "notes": ["18 B/param overstates LoRA"]})
    readme = render_report(plan)["README.md"]
    for needle in ("# Tiny Llama (test): full training on 16 x NVIDIA H100", "| activations | 50.0 GiB | 83.3% |",
                   "**total per GPU** | **60.0 GiB**", "## Configurations considered", "a3-megagpu-8g",
                   "dearer", "chosen (objective: cost)", "## Host checklist", "host RAM >= 1.5x GPU memory",
                   "18 B/param overstates LoRA", "export FI_EFA_USE_HUGE_PAGE=0", "terraform init",
                   "gpuprov up . --dry-run", "$551", "p5.48xlarge"):
        assert needle in readme, needle


def test_onprem_readme_skips_terraform_and_lists_hosts() -> None:
    readme = render_report(sample_plan("onprem", nodes=2))["README.md"]
    assert "terraform init" not in readme and "owned hardware" in readme
    assert "`gpu0`: 10.0.0.10" in readme and "Bill of materials" in readme


@pytest.mark.parametrize("cloud,nodes", [("aws", 1), ("aws", 2), ("gcp", 12), ("onprem", 3), ("azure", 8)])
def test_topology_is_valid_svg_showing_the_cluster(cloud: str, nodes: int) -> None:
    plan = sample_plan(cloud, nodes=nodes)
    svg = render_report(plan)["topology.svg"]
    assert svg == render_report(plan)["topology.svg"]
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    gpus = [t for t in texts if t and t.startswith("G") and t[1:].isdigit()]
    assert len(gpus) == 8 * min(nodes, 4)
    assert any("NVSwitch" in t for t in texts)
    assert any("RAID0" in t for t in texts)
    if nodes > 4:
        assert f"+ {nodes - 4} more nodes" in texts
    if nodes == 1:
        assert any("single node" in t for t in texts)
    else:
        assert any(t.startswith(f"{plan.fabric.name}: 8 rails") for t in texts)
    if cloud == "onprem":
        assert any(t.startswith("gpu0:") for t in texts)


def test_topology_escapes_text() -> None:
    plan = sample_plan("aws")
    plan = plan.model_copy(update={"model": plan.model.model_copy(update={"display_name": "A<&>\"B"})})
    ET.fromstring(render_report(plan)["topology.svg"])  # well-formed despite the markup characters


@pytest.mark.parametrize("cloud,nodes", [("aws", 1), ("aws", 4), ("gcp", 5), ("azure", 32)])
def test_topology_shapes_stay_inside_the_canvas(cloud: str, nodes: int) -> None:
    root = ET.fromstring(render_report(sample_plan(cloud, nodes=nodes))["topology.svg"])
    width, height = int(root.get("width")), int(root.get("height"))
    for rect in root.iter(f"{SVG}rect"):
        x, y, w, h = (int(rect.get(k)) for k in ("x", "y", "width", "height"))
        assert 0 <= x and x + w <= width and 0 <= y and y + h <= height, rect.attrib
    for line in root.iter(f"{SVG}line"):
        assert all(0 <= int(line.get(k)) <= width for k in ("x1", "x2"))
        assert all(0 <= int(line.get(k)) <= height for k in ("y1", "y2"))
    for text in root.iter(f"{SVG}text"):
        assert 0 <= int(text.get("x")) <= width and 0 < int(text.get("y")) <= height


def test_readme_nccl_snippet_exports_before_and_after_the_vendor_profile() -> None:
    plan = sample_plan("gcp", nodes=2)
    fabric = plan.fabric.model_copy(update={"nccl_env_profile": "/var/lib/tcpxo/lib64/nccl-env-profile.sh",
                                             "nccl_env": {"NCCL_LIB_DIR": "/var/lib/tcpxo/lib64"}})
    readme = render_report(plan.model_copy(update={"fabric": fabric}))["README.md"]
    snippet = readme.split("NCCL environment", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    lines = [line for line in snippet.splitlines() if line]
    source = lines.index("source /var/lib/tcpxo/lib64/nccl-env-profile.sh")
    assert "export NCCL_LIB_DIR=/var/lib/tcpxo/lib64" in lines[:source]
    assert lines[-1] == "export NCCL_LIB_DIR=/var/lib/tcpxo/lib64"


def _rects(root, fill: str) -> list[tuple[int, int, int, int]]:
    return [tuple(int(r.get(k)) for k in ("x", "y", "width", "height")) for r in root.iter(f"{SVG}rect")
            if r.get("fill") == fill]


def test_topology_has_a_legend_memory_and_cost() -> None:
    plan = sample_plan("aws", nodes=2)
    root = ET.fromstring(render_report(plan)["topology.svg"])
    texts = [t.text or "" for t in root.iter(f"{SVG}text")]
    assert "Legend:" in texts
    for entry in ("GPU", "NVLink / NVSwitch", "NIC box (its count when more than one)", "local NVMe RAID0",
                  "fabric rail / switch"):
        assert entry in texts
    # the legend names only what is drawn: an HSDP outline only when the plan shards in groups
    assert ("HSDP shard group" in texts) == (plan.cluster.sharding == "hsdp")
    summary = next(t for t in texts if t.startswith("memory per GPU:"))
    assert f"{plan.memory.per_gpu_bytes / 2**30:,.1f} GiB peak" in summary and f"${plan.cost_usd:,.0f}" in summary


@pytest.mark.parametrize("cloud", ["aws", "gcp", "oci"])
def test_topology_draws_as_many_nics_as_the_caption_says(cloud: str) -> None:
    plan = sample_plan(cloud, nodes=2)
    root = ET.fromstring(render_report(plan)["topology.svg"])
    boxes = len(_rects(root, "#f5a623")) - 1  # the legend's swatch
    gpus, nics = plan.cluster.gpus_per_node, plan.instance.network_cards
    assert boxes == 2 * min(gpus, nics)  # one box (and one rail line) per GPU rail, two nodes drawn
    counts = [int(t.text[:-1]) for t in root.iter(f"{SVG}text") if re.fullmatch(r"\d+x", t.text or "")]
    assert sum(counts) + (boxes - len(counts)) == 2 * nics  # the boxes hold every NIC
    caption = next(t.text for t in root.iter(f"{SVG}text") if (t.text or "").startswith(f"{plan.fabric.name}: "))
    assert f"over {plan.instance.network_cards} NICs" in caption


def test_rail_lines_at_32_nodes_cross_no_other_node() -> None:
    root = ET.fromstring(render_report(sample_plan("azure", nodes=32))["topology.svg"])
    nodes = _rects(root, "#f4f6fb")
    lines = [tuple(int(ln.get(k)) for k in ("x1", "y1", "x2", "y2")) for ln in root.iter(f"{SVG}line")
             if ln.get("stroke") == "#c77800"]
    assert lines and len(nodes) == 4

    def crosses(line, rect) -> bool:  # sample the segment: any point strictly inside the rectangle
        x1, y1, x2, y2 = line
        x, y, w, h = rect
        return any(x < x1 + (x2 - x1) * t / 50 < x + w and y < y1 + (y2 - y1) * t / 50 < y + h for t in range(51))

    for line in lines:
        inside = [r for r in nodes if crosses(line, r)]
        assert len(inside) <= 1  # only the node the NIC sits in
        assert all(r[0] <= line[0] <= r[0] + r[2] for r in inside)


def test_topology_outlines_each_hsdp_shard_group() -> None:
    plan = sample_plan("gcp", nodes=4)  # shard group = one node: 4 groups
    root = ET.fromstring(render_report(plan)["topology.svg"])
    groups = [r for r in root.iter(f"{SVG}rect") if r.get("stroke") == "#7b3fa0" and r.get("stroke-width") == "2"]
    assert len(groups) == 4
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "shard group 0" in texts and "shard group 3" in texts
    fsdp = ET.fromstring(render_report(sample_plan("gcp", nodes=4, sharding="fsdp"))["topology.svg"])
    assert not [r for r in fsdp.iter(f"{SVG}rect") if r.get("stroke-width") == "2"]
