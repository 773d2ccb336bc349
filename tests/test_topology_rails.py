"""topology.svg for 8-32 NICs per node: one line per rail per node, TP groups drawn, and a legend
that names only what the picture shows."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.dom.minidom
from pathlib import Path


def bundle(tmp_path: Path, *args: str) -> tuple[str, dict]:
    import json

    out = tmp_path / "b"
    r = subprocess.run([sys.executable, "-m", "gpuprov", "generate", *args, "-o", str(out)], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    svg = (out / "topology.svg").read_text()
    xml.dom.minidom.parseString(svg)  # well-formed
    return svg, json.loads((out / "plan.json").read_text())


def _legend(svg: str) -> list[str]:
    tail = svg.split(">Legend:</text>", 1)[1]
    return re.findall(r">([^<]+)</text>", tail)


def test_32_nics_per_node_draw_one_line_per_rail_and_tp_groups(tmp_path: Path):
    svg, plan = bundle(tmp_path, "--model", "70b", "--from-scratch", "--tokens", "20B", "--tp", "4", "--cloud", "aws",
                       "--gpu", "h100-80gb")
    c = plan["cluster"]
    assert plan["instance"]["network_cards"] == 32 and c["nodes"] > 1 and c["tp"] == 4
    drawn = min(c["nodes"], 4)
    rail_lines = svg.count('stroke="#c77800"')  # NIC box -> rail switch
    assert rail_lines == drawn * c["gpus_per_node"]  # 8 per node, not 32
    assert svg.count('stroke="#c0392b" stroke-width="1.5"') == drawn * c["gpus_per_node"] // c["tp"]
    legend = _legend(svg)
    assert "tensor-parallel group" in legend and "HSDP shard group" not in legend


def test_legend_names_only_what_is_drawn(tmp_path: Path):
    svg, plan = bundle(tmp_path, "--model", "8b", "--task", "lora", "--tokens", "100M", "--cloud", "aws")
    assert plan["cluster"]["nodes"] == 1
    legend = _legend(svg)
    assert "GPU" in legend
    assert not {"fabric rail / switch", "tensor-parallel group", "HSDP shard group"} & set(legend)
    assert ("NVLink / NVSwitch" in legend) == bool(plan["gpu"]["nvlink_gbytes_per_s"])
