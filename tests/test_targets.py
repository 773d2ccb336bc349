"""The target registry is the one list of targets, and the planner obeys each target's limits:
`plan` never chooses what `generate` refuses."""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import click
import pytest

from gpuprov import plan as plan_module
from gpuprov import spec as spec_module
from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import CLOUDS as CATALOG_CLOUDS
from gpuprov.catalog.instances import list_instances
from gpuprov.commands.generate import generate
from gpuprov.commands.instances import instances as instances_command
from gpuprov.commands.plan import plan as plan_command
from gpuprov.commands.spec_options import spec_from_flags
from gpuprov.errors import GpuprovError
from gpuprov.planner import make_plan
from gpuprov.render.terraform import render_terraform
from gpuprov.resources import templates_dir
from gpuprov.targets import CHOICES, CLOUDS, NAMES, TARGETS, Limits, get_target


def _cloud_choices(command: click.Command) -> tuple[str, ...]:
    option = next(p for p in command.params if "--cloud" in getattr(p, "opts", ()))
    assert isinstance(option.type, click.Choice)
    return tuple(option.type.choices)


def test_names_agree_everywhere():
    assert get_args(plan_module.CloudName) == NAMES
    assert get_args(spec_module.Cloud) == CHOICES == (*NAMES, "any")
    assert CATALOG_CLOUDS == NAMES
    for command in (plan_command, generate, instances_command):
        assert _cloud_choices(command) == CHOICES, command.name


def test_every_catalog_entry_has_exactly_one_target():
    for inst in list_instances():
        assert [t.name for t in TARGETS.values() if t.serves(inst)] == [inst.cloud], inst.name


@pytest.mark.parametrize("name", CLOUDS)
def test_terraform_targets_have_templates_and_image_keys(name):
    target = get_target(name)
    assert (templates_dir() / "terraform" / name).is_dir()
    assert target.tfvars is not None
    image = cat.image(name)
    assert all(key in image for key in target.image_ref_keys)


def test_unknown_target_is_a_one_line_error():
    with pytest.raises(GpuprovError, match="unknown target"):
        get_target("k8s")


LIMITED = [name for name, t in TARGETS.items() if t.limits.max_nodes is not None]


def test_some_target_has_a_limit():
    assert "azure" in LIMITED


@pytest.mark.parametrize("name", LIMITED)
def test_plan_obeys_the_targets_limit_and_generate_renders_it(name, monkeypatch):
    """With --max-nodes well above the target's limit and a run that wants many nodes, the plan stays
    within the limit and renders; without the limit the same search would have gone past it."""
    cap = TARGETS[name].limits.max_nodes
    assert cap is not None
    spec = spec_from_flags(None, None, {"model": "70b", "tokens": "1000B", "cloud": name, "init": True,
                                        "max_nodes": cap + 60, "objective": "time"})  # init: --from-scratch
    plan = make_plan(spec)
    assert plan.cluster.nodes <= cap
    assert render_terraform(plan)  # generate's renderer accepts what plan chose
    target = TARGETS[name]
    monkeypatch.setattr(target, "limits", replace(target.limits, max_nodes=None))
    unlimited = make_plan(spec)
    assert unlimited.cluster.nodes > cap  # the case exercises the limit
    monkeypatch.setattr(target, "limits", Limits(max_nodes=cap, why="a test limit"))
    with pytest.raises(GpuprovError, match=f"plan at most {cap} nodes"):
        render_terraform(unlimited)


def test_onprem_caps_nodes_at_the_hosts_listed():
    onprem = get_target("onprem")
    assert onprem.node_cap(16, hosts=3) == 3
    assert onprem.node_cap(2, hosts=3) == 2
    assert onprem.node_cap(16) == 16


@pytest.mark.parametrize("name", NAMES)
def test_the_plan_records_the_targets_decisions(name, tmp_path):
    """plan.json carries what the target decided; the renderers read that record."""
    from gpuprov.render.ansible import render_ansible
    from gpuprov.render.launch import render_launch

    hosts = None
    if name == "onprem":
        hosts = tmp_path / "hosts.yaml"
        hosts.write_text("".join(f"- {{name: gpu{i}, address: 10.0.0.{i + 1}, gpu: h100-80gb, gpus: 8}}\n"
                                 for i in range(4)), encoding="utf-8")
    plan = make_plan(spec_from_flags(None, str(hosts) if hosts else None,
                                     {"model": "70b", "cloud": name, "tokens": "20B"}))
    p = plan.provisioning
    assert p is not None and p.target == name and p.provisioner == TARGETS[name].provisioner
    # a fabric the hosts file does not state (plan.fabric.probe) gets no role
    assert p.fabric_role == (None if plan.fabric.probe else TARGETS[name].fabric_role(plan.fabric.name))
    assert (plan.fabric.probe is not None) == (name == "onprem")
    assert p.checkpoint_root == ("/shared" if plan.cluster.nodes > 1 else plan.storage.mount_point)
    import yaml

    site = yaml.safe_load(render_ansible(plan)["site.yml"])
    roles = [r["role"] if isinstance(r, dict) else r for play in site for r in play.get("roles", [])]
    assert (p.fabric_role in roles) if p.fabric_role else not {"efa", "infiniband", "gcp_rdma"} & set(roles)
    train = yaml.safe_load(render_launch(plan)["train.yaml"])
    assert train["checkpoint"]["dir"].startswith(p.checkpoint_root + "/checkpoints/")
    assert bool(render_terraform(plan)) == (p.provisioner == "terraform")
    infra = plan.infra
    assert infra is not None and infra.target == name
    assert infra.inputs == (TARGETS[name].terraform_inputs(plan) if p.provisioner == "terraform" else {})
    # what Terraform reads survives plan.json: the renderer fills the same templates from a reloaded plan
    reloaded = plan_module.Plan.model_validate_json(plan.model_dump_json())
    assert reloaded.infra == infra and render_terraform(reloaded) == render_terraform(plan)
