"""AWS launches every node in one all-or-nothing request (issue 40, item 8): an EC2 Fleet of type
instant whose minimum target capacity is the node count, so a capacity error leaves no node running
and billing. Read from the module Terraform's own loader returns; the purchase option's blocks are
evaluated by Terraform from the rendered variables."""

from __future__ import annotations

import pytest

from gpuprov.catalog import bringup as cat
from plan_fixtures import sample_plan
from terraform_support import REQUIRED_INPUTS, evaluate, load_module, render_to, source_text

FACT = cat.node_launch("aws")
OPTIONS = FACT["capacity_types"]


def _dynamic(body: dict, name: str) -> dict:
    found = [b for b in body.get("Blocks") or [] if b["Type"] == "dynamic" and b["Labels"] == [name]]
    assert len(found) == 1, name
    return found[0]["Body"]


def _attr(directory, body: dict, name: str) -> str:
    return source_text(directory, body["Attributes"][name]["Expr"]).strip()


def _content(body: dict) -> dict:
    return next(b["Body"] for b in body["Blocks"] if b["Type"] == "content")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    directory = render_to(tmp_path_factory.mktemp("aws") / "aws", sample_plan("aws", nodes=4))
    module = load_module(directory)
    return directory, module


def test_nodes_come_from_one_instant_fleet_and_no_lone_instance(fleet):
    directory, module = fleet
    managed = module["ManagedResources"]
    # the only lone instance is a lost node's replacement, one per name gpuprov up lists (none at first)
    assert [a for a, r in managed.items() if r["Type"] == "aws_instance"] == ["aws_instance.replacement"]
    assert source_text(directory, managed["aws_instance.replacement"]["ForEach"]) == "local.replaced"
    fleets = [a for a, r in managed.items() if r["Type"] == FACT["request"]]
    assert fleets == ["aws_ec2_fleet.nodes"]
    body = managed["aws_ec2_fleet.nodes"]["Config"]
    assert "Count" not in managed["aws_ec2_fleet.nodes"] or managed["aws_ec2_fleet.nodes"]["Count"] is None
    assert _attr(directory, body, "type") == f'"{FACT["fleet_type"]}"'
    # down terminates what the fleet launched
    assert _attr(directory, body, "terminate_instances") == str(FACT["terminate_on_delete"]).lower()
    target = next(b["Body"] for b in body["Blocks"] if b["Type"] == "target_capacity_specification")
    assert FACT["min_target_capacity"] == "node_count"
    assert _attr(directory, target, "total_target_capacity") == "var.node_count"
    assert _attr(directory, target, "default_target_capacity_type") == "local.capacity_type"
    for name in ("on_demand_options", "spot_options"):
        content = _content(_dynamic(body, name))
        assert _attr(directory, content, "min_target_capacity") == f"{name}.value"
        assert _attr(directory, content, "single_instance_type") == "true"
        assert _attr(directory, content, "single_availability_zone") == "true"
    # a new size is a new request (an instant fleet cannot be modified): the fleet is replaced
    triggers = source_text(directory, managed["aws_ec2_fleet.nodes"]["TriggersReplacement"][0])
    assert triggers == "terraform_data.fleet_request"
    request = _attr(directory, managed["terraform_data.fleet_request"]["Config"], "input")
    assert "node_count = var.node_count" in request and "capacity_type = local.capacity_type" in request
    # every output reads the fleet's instances
    for output in ("instance_ids", "private_ips", "node_names", "ansible_inventory"):
        assert "local.nodes" in source_text(directory, module["Outputs"][output]["Expr"])


@pytest.mark.slow
@pytest.mark.parametrize("option", sorted(cat.node_launch("aws")["capacity_types"]))
def test_minimum_capacity_is_the_node_count_for_every_purchase_option(option, fleet, tmp_path):
    """Terraform evaluates which options block the fleet gets and its minimum: all nodes or none."""
    directory, module = fleet
    body = module["ManagedResources"]["aws_ec2_fleet.nodes"]["Config"]
    locals_ = {name: source_text(directory, module["Locals"][name]["Expr"]) for name in ("market_type", "capacity_type")}
    outputs = {name: _attr(directory, _dynamic(body, name), "for_each") for name in ("on_demand_options", "spot_options")}
    outputs["capacity_type"] = "local.capacity_type"
    outputs["node_count"] = "var.node_count"
    code, values, error = evaluate(tmp_path, directory, outputs, {**REQUIRED_INPUTS["aws"], "purchase_option": option,
                                                                  "node_count": 3}, locals_=locals_)
    assert code == 0, error
    assert values["capacity_type"] == OPTIONS[option]
    chosen = "spot_options" if option == "spot" else "on_demand_options"
    other = "on_demand_options" if option == "spot" else "spot_options"
    assert values[chosen] == [3] and values[other] == []
