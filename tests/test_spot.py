"""Spot is priced and planned: dated, sourced prices per region; preemption in the expected time;
`--purchase spot` plans, prices and renders on AWS, GCP and Azure; stale prices are flagged."""

from __future__ import annotations

import datetime as dt
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov import spot


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_purchase_spot_plans_and_prices_on_each_cloud(cloud):
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", cloud,
            "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["purchase"]["option"] == "spot" and p["purchase"]["preemptible"]
    recorded = spot.price(p["instance"]["name"], cloud, p["cluster"]["region"])
    assert recorded is not None and p["instance"]["price_per_hour_usd"] == pytest.approx(recorded.usd)
    assert p["run"]["compute_usd"] == pytest.approx(p["time_hours"] * p["cluster"]["nodes"] * recorded.usd, rel=1e-6)
    assert p["cost_usd"] == pytest.approx(p["run"]["compute_usd"] + p["run"]["storage_usd"], rel=1e-9)
    # the time includes the expected preemption losses on top of steps x step time + start-up
    train_h = p["training"]["steps"] * p["throughput"]["step_time_s"] / 3600
    assert p["time_hours"] > train_h + 0.25


def test_several_regions_per_cloud_and_region_picks_its_price():
    from gpuprov.catalog import load_data

    prices = load_data("spot.yaml")["prices"]
    by_cloud = {"aws": "p5.48xlarge", "gcp": "a3-highgpu-8g", "azure": "Standard_ND96asr_v4"}
    for cloud, name in by_cloud.items():
        assert len(prices[name]) >= 3, cloud
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", "aws",
            "--region", "us-east-2", "--gpu", "h100-80gb", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["cluster"]["region"] == "us-east-2"
    assert p["instance"]["price_per_hour_usd"] == pytest.approx(prices[p["instance"]["name"]]["us-east-2"])


def test_preemption_overhead_grows_with_nodes_and_checkpoint_interval():
    one, many = spot.overhead_hours(10, 1, 1.0), spot.overhead_hours(10, 32, 1.0)
    assert 0 < one < many
    assert spot.overhead_hours(10, 8, 0.25) < spot.overhead_hours(10, 8, 2.0)
    rate = spot.interruption_rate_per_node_hour()
    load = 8 * rate * (0.5 + 0.25)
    assert spot.overhead_hours(10, 8, 1.0) == pytest.approx(10 * load / (1 - load))


def test_on_demand_or_spot_picks_spot_when_it_is_cheaper():
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "on-demand,spot",
            "--cloud", "aws", "--gpu", "h100-80gb", "--json")
    p = json.loads(r.stdout)
    assert p["purchase"]["option"] == "spot" and p["cost_usd"] is not None


def test_stale_or_undated_price_is_flagged_in_plan_output():
    assert spot.stale("2025-06-04", dt.date(2026, 12, 5)) and spot.stale(None)
    assert spot.stale("2026-11-30", dt.date(2026, 12, 5)) is None
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", "gcp")
    assert r.returncode == 0, r.stderr
    assert any("WARNING" in ln and "spot price" in ln and "undated" in ln for ln in r.stdout.splitlines())
    line = next(ln for ln in r.stdout.splitlines() if "h start-up" in ln)
    assert re.search(r"\+ [\d.]+ (h|min) expected preemption = ", line), line


@pytest.mark.parametrize("cloud, needle", [
    ("aws", r'variable "purchase_option" \{[^}]*default\s*=\s*"spot"'),
    ("gcp", r'variable "purchase_option" \{[^}]*default\s*=\s*"spot"'),
    ("azure", r'variable "purchase_option" \{[^}]*default\s*=\s*"spot"'),
])
def test_generate_renders_the_terraform_spot_path(cloud, needle, tmp_path: Path):
    out = tmp_path / cloud
    r = run("generate", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", cloud,
            "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert re.search(needle, (out / "terraform" / "variables.tf").read_text(), re.S)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["purchase"]["option"] == "spot"


def test_a_dated_spot_price_is_flagged_only_past_the_limit_with_a_fixed_clock():
    """The AWS snapshot carries its date: a plan read soon after it has no warning for it; 91 days on, one."""
    from gpuprov.commands.plan import price_warnings
    from gpuprov.commands.spec_options import spec_from_flags
    from gpuprov.planning.assemble import make_plan

    plan = make_plan(spec_from_flags(None, None, {"model": "8b", "task": "lora", "tokens": "100M",
                                                  "purchase": "spot", "cloud": "aws"}))
    dated = spot.price(plan.instance.name, "aws", plan.cluster.region)
    assert dated is not None and dated.date and plan.instance.price_date == dated.date
    when = dt.date.fromisoformat(dated.date)
    fresh = [w for w in price_warnings(plan, when + dt.timedelta(days=90)) if "spot price" in w]
    old = [w for w in price_warnings(plan, when + dt.timedelta(days=91)) if "spot price" in w]
    assert fresh == [] and len(old) == 1 and "91 days old" in old[0]


def test_objective_time_on_spot_prices_what_has_a_price_and_says_what_has_none():
    """--objective time used to pick spot with cost "-" and no word: a priced spot offer keeps its cost;
    an offer with no recorded spot price is named as such in the Notes."""
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", "gcp",
            "--gpu", "h100-80gb", "--objective", "time", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["purchase"]["option"] == "spot" and p["cost_usd"] is not None and p["cost_usd"] > 0
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", "gcp",
            "--objective", "time", "--json")
    p = json.loads(r.stdout)
    named = any(n.startswith(f"Spot: no spot price recorded for {p['instance']['name']}") for n in p["notes"])
    assert named == (p["cost_usd"] is None)


def test_one_gpu_types_have_spot_prices_and_are_ranked_on_spot():
    """One-GPU AWS types (g5, g6e) carry SkyPilot's spot prices: a LoRA of 8B on spot ranks them by cost
    beside the 8-GPU nodes, none is noted as unpriced."""
    for name in ("g5.xlarge", "g6e.xlarge", "g6e.2xlarge"):
        assert spot.price(name, "aws", "us-east-1") is not None
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", "aws",
            "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    one_gpu = [c for c in p["candidates"] if c["gpus_per_node"] == 1]
    assert one_gpu and all(c["purchase"] == "spot" and c["cost_usd"] is not None for c in one_gpu)
    assert not [n for n in p["notes"] if "no recorded spot price" in n or "no public on-demand price" in n]


def test_a_missing_spot_price_is_said_as_such_and_objective_time_plans_it():
    """GCP sells the B200 machine (A4) on spot but no snapshot has a price for it: `--objective cost` names
    the missing price (not "no instance matches"); `--objective time` plans the run unpriced."""
    assert spot.price("a4-highgpu-8g", "gcp", "us-central1") is None
    args = ("plan", "--model", "8b", "--tokens", "100M", "--purchase", "spot", "--cloud", "gcp", "--gpu", "b200")
    r = run(*args)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "a4-highgpu-8g (no recorded spot price in us-central1)" in r.stderr and "--objective time" in r.stderr
    assert "no instance in the catalog matches" not in r.stderr
    r = run(*args, "--objective", "time", "--json")
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["instance"]["name"] == "a4-highgpu-8g" and p["purchase"]["option"] == "spot" and p["cost_usd"] is None


def _spot_rows():
    from gpuprov.catalog import load_data

    return load_data("spot.yaml")


def test_every_spot_row_is_a_catalogued_type_priced_from_a_sourced_snapshot():
    """Each price row names an instance type of the catalog, regions of its cloud and a positive price, and
    its cloud's snapshot says where the figures come from (a public file at a commit) and when, or why
    it cannot say: a row no snapshot sources, or a region the cloud does not have, fails here."""
    from gpuprov.catalog import load_data
    from gpuprov.catalog.instances import get_instance

    data, regions = _spot_rows(), load_data("regions.yaml")
    for name, by_region in data["prices"].items():
        inst = get_instance(name)
        snap = data["snapshots"].get(inst.cloud)
        assert snap and re.search(r"@ [0-9a-f]{40}", snap["source"]), (name, inst.cloud)
        assert snap.get("date") or snap.get("date_basis"), (name, inst.cloud)
        assert by_region and set(by_region) <= set(regions[inst.cloud]["regions"]), name
        assert all(float(p) > 0 for p in by_region.values()), name
        if inst.price_per_hour_usd and inst.region in by_region:  # spot is a discount off the list rate
            assert float(by_region[inst.region]) < inst.price_per_hour_usd, name


def test_gcp_h200_and_l4_machines_are_priced_on_spot():
    """A3 Ultra (8 x H200) and G2 (L4) are host + GPU rows of the GCP snapshot: a spot plan on them has a
    cost, and that cost is the recorded price."""
    for gpu, name in (("h200", "a3-ultragpu-8g"), ("l4", "g2-standard-4")):
        task = ("--task", "lora") if gpu == "l4" else ()
        r = run("plan", "--model", "8b", *task, "--tokens", "100M", "--purchase", "spot", "--cloud", "gcp",
                "--gpu", gpu, "--json")
        assert r.returncode == 0, r.stderr
        p = json.loads(r.stdout)
        recorded = spot.price(p["instance"]["name"], "gcp", p["cluster"]["region"])
        assert p["instance"]["name"].startswith(name.rsplit("-", 1)[0]) and recorded is not None
        assert p["instance"]["price_per_hour_usd"] == pytest.approx(recorded.usd) and p["cost_usd"] > 0


def test_oci_bare_metal_gpu_shapes_are_not_offered_preemptible():
    """OCI sells preemptible capacity at a fixed discount but not for bare metal shapes (spot.yaml
    oci_preemptible): no OCI bare metal GPU shape is offered on spot, and `--purchase spot --cloud oci`
    says there is nothing to buy instead of planning one."""
    from gpuprov.catalog.bringup import offered_options
    from gpuprov.catalog.instances import list_instances

    rule = _spot_rows()["oci_preemptible"]
    assert rule["source"] and rule["date"] and 0 < rule["discount"] < 1
    bare_metal = [i for i in list_instances("oci") if i.name.startswith("BM.")]
    assert bare_metal and not rule["bare_metal"]
    assert all("spot" not in offered_options(i) for i in bare_metal)
    r = run("plan", "--model", "8b", "--task", "lora", "--tokens", "100M", "--purchase", "spot", "--cloud", "oci")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_instances_lists_the_spot_price_beside_the_on_demand_one():
    r = run("instances", "--json")
    assert r.returncode == 0, r.stderr
    rows = {i["name"]: i for i in json.loads(r.stdout)}
    assert rows["g5.xlarge"]["spot"]["price_per_hour_usd"] == pytest.approx(spot.price("g5.xlarge", "aws", "us-east-1").usd)
    assert rows["g5.xlarge"]["spot"]["other_regions"]["us-west-2"] < rows["g5.xlarge"]["price_per_hour_usd"]
    b200 = rows["a4-highgpu-8g"]["spot"]
    assert b200["sold"] and b200["price_per_hour_usd"] is None
    assert rows["a3-ultragpu-8g"]["spot"]["price_per_hour_usd"] == pytest.approx(
        spot.price("a3-ultragpu-8g", "gcp", "us-central1").usd)
    assert not rows["p5e.48xlarge"]["spot"]["sold"]  # Capacity Blocks only
    table = run("instances", "--cloud", "aws").stdout.splitlines()
    col = table[0].index("spot $/h")
    cells = {ln.split()[1]: ln[col:col + 8].strip() for ln in table[1:] if ln.startswith("aws ")}
    assert float(cells["g5.xlarge"]) == pytest.approx(rows["g5.xlarge"]["spot"]["price_per_hour_usd"], abs=0.005)
    assert cells["p5e.48xlarge"] == "-"
