"""Regression tests for issue 27's findings 1, 2, 4, 5 and 7 (reachability, networks, OCI, reservations,
the small ones), held against the rendered Terraform as Terraform's loader and evaluator read it."""

from __future__ import annotations

import re

import pytest

from gpuprov.catalog import bringup as cat
from terraform_support import REQUIRED_INPUTS, evaluate, load_module, plans, render_to, source_text


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            directory = render_to(tmp_path_factory.mktemp(name) / name, plans()[name])
            cache[name] = (directory, load_module(directory))
        return cache[name]
    return get


def _locals(directory, module, names, stand_ins):
    """The module's own locals, resource attributes replaced by stand-in literals."""
    out = {}
    for name in names:
        text = source_text(directory, module["Locals"][name]["Expr"])
        for pattern, literal in stand_ins.items():
            text = re.sub(pattern, literal, text)
        out[name] = text
    return out


# ---- finding 1: Azure and OCI nodes are reachable by default (the head) ----------------------------

@pytest.mark.parametrize("name, vm", [("azure-2", "azurerm_linux_virtual_machine.head"),
                                      ("oci-2", "oci_core_instance.head")])
def test_the_head_is_created_by_default_and_admits_only_bastion_cidr(name, vm, rendered):
    directory, module = rendered(name)
    assert vm in module["ManagedResources"]
    variables = (directory / "variables.tf").read_text()
    assert re.search(r'variable "create_head" \{[^}]*default\s*=\s*true', variables, re.S)
    preconditions = [source_text(directory, p["Condition"]) for p in module["ManagedResources"][vm]["Preconditions"]]
    assert "var.bastion_cidr != null" in preconditions
    assert "head" in module["Outputs"]


def test_with_ssh_cidr_there_is_no_head_by_default(rendered):
    for name in ("azure-2-ssh", "oci-2-ssh"):
        directory, _ = rendered(name)
        assert re.search(r'variable "create_head" \{[^}]*default\s*=\s*false', (directory / "variables.tf").read_text(),
                         re.S), name


def test_the_plan_carries_the_head_and_its_cost():
    plan = plans()["azure-2"]
    assert plan.access.method == "bastion" and plan.access.head.size == "Standard_B2s"
    assert plan.access.head.price_per_hour_usd > 0 and plan.access.head.source.startswith("https://")


# ---- finding 2 and 4: the network a bundle brings ----------------------------------------------------

def _oci_subnet(tmp_path, rendered, name, tfvars):
    directory, module = rendered(name)
    stand_ins = {r"one\(oci_core_subnet\.(\w+)\[\*\]\.id\)": r'"\1-subnet"',
                 r"one\(data\.oci_core_subnet\.nodes\[\*\]\.vcn_id\)": '"given-vcn"',
                 r"one\(oci_core_vcn\.this\[\*\]\.id\)": '"bundle-vcn"'}
    locals_ = _locals(directory, module, ["create_vcn", "node_subnet_id", "vcn_id"], stand_ins)
    code, values, error = evaluate(tmp_path, directory, {"subnet": "local.node_subnet_id", "vcn": "local.vcn_id"},
                                   {**REQUIRED_INPUTS["oci"], **tfvars}, locals_=locals_)
    assert code == 0, error
    return values


def test_oci_nodes_go_where_they_can_be_reached(tmp_path, rendered):
    """Finding 4: ssh_cidr puts the nodes in the public subnet of the bundle's VCN, not the private one."""
    assert _oci_subnet(tmp_path / "a", rendered, "oci-2", {}) == {"subnet": "private-subnet", "vcn": "bundle-vcn"}
    assert _oci_subnet(tmp_path / "b", rendered, "oci-2-ssh", {})["subnet"] == "public-subnet"
    given = _oci_subnet(tmp_path / "c", rendered, "oci-2", {"subnet_id": "ocid1.subnet.oc1.iad.aaaamine"})
    assert given == {"subnet": "ocid1.subnet.oc1.iad.aaaamine", "vcn": "given-vcn"}


def test_oci_a_given_private_subnet_refuses_ssh_cidr_and_the_configuration_is_replaced_first(rendered):
    directory, module = rendered("oci-2-ssh")
    config = module["ManagedResources"]["oci_core_instance_configuration.node"]
    assert config["Managed"]["CreateBeforeDestroy"] is True  # finding 4: the pool moves before the old one goes
    texts = [source_text(directory, p["Condition"]) for p in config["Preconditions"]]
    assert any("prohibit_public_ip_on_vnic" in t and "var.ssh_cidr == null" in t for t in texts)


def test_aws_brings_its_vpc_unless_a_subnet_is_named(tmp_path, rendered):
    directory, module = rendered("aws-p5-2")
    for address in ("aws_vpc.this", "aws_subnet.private", "aws_nat_gateway.this", "aws_vpc_endpoint.s3",
                    "aws_default_security_group.this"):
        assert address in module["ManagedResources"], address
    private = (directory / "vpc.tf").read_text()
    assert re.search(r'resource "aws_route_table" "private".*?nat_gateway_id\s*=\s*aws_nat_gateway', private, re.S)
    stand_ins = {r"one\(aws_subnet\.private\[\*\]\.id\)": '"subnet-bundle"',
                 r"one\(aws_vpc\.this\[\*\]\.id\)": '"vpc-bundle"',
                 r"one\(data\.aws_subnet\.nodes\[\*\]\.(\w+)\)": r'(var.subnet_id == null ? null : "given-\1")',
                 r"one\(data\.aws_vpc\.nodes\[\*\]\.cidr_block\)": '"10.9.0.0/16"',
                 r"one\(data\.aws_ec2_instance_type_offerings\.zones\[\*\]\.locations\)": '["us-east-1f", "us-east-1a"]'}
    locals_ = _locals(directory, module, ["create_vpc", "subnet_id", "vpc_id", "availability_zone"], stand_ins)
    outputs = {"subnet": "local.subnet_id", "zone": "local.availability_zone"}
    code, values, error = evaluate(tmp_path / "a", directory, outputs, REQUIRED_INPUTS["aws"], locals_=locals_)
    assert code == 0, error
    # finding 5: no zone stated -> the first zone offering the type, never null
    assert values == {"subnet": "subnet-bundle", "zone": "us-east-1a"}
    code, values, error = evaluate(tmp_path / "b", directory, outputs,
                                   {**REQUIRED_INPUTS["aws"], "subnet_id": "subnet-0123456789abcdef0"}, locals_=locals_)
    assert code == 0, error
    assert values == {"subnet": "subnet-0123456789abcdef0", "zone": "given-availability_zone"}


# ---- finding 7 -----------------------------------------------------------------------------------

def test_aws_ssh_cidr_opens_no_port_on_private_nodes(rendered):
    directory, module = rendered("aws-p5-16-cr")
    assert "ssh_cidr" not in module["Variables"]
    assert not [a for a in module["ManagedResources"] if a.startswith("aws_vpc_security_group_ingress_rule.ssh")]


def test_aws_ssh_cidr_is_refused_not_dropped():
    """AWS nodes get no public address (SSM reaches them): --ssh-cidr is refused in one line, never
    accepted and silently unused."""
    from plan_fixtures import sample_plan, with_bringup

    from gpuprov.errors import GpuprovError

    plan = sample_plan("aws", nodes=2)
    with pytest.raises(GpuprovError, match=r"--ssh-cidr 203\.0\.113\.0/24: aws nodes get no public address.*drop --ssh-cidr"):
        with_bringup(plan.model_copy(update={"spec": plan.spec.model_copy(update={"ssh_cidr": "203.0.113.0/24"})}))


def test_every_efa_interface_is_tagged(rendered):
    directory, _ = rendered("aws-p5-2")
    text = (directory / "main.tf").read_text()
    assert re.search(r'tag_specifications \{\s*resource_type = "network-interface"\s*tags\s*= local\.tags', text)


def test_oci_image_id_description_says_it_once(rendered):
    directory, _ = rendered("oci-2")
    description = re.search(r'variable "image_id" \{\s*description = "([^"]*)"', (directory / "variables.tf").read_text())
    assert description.group(1).count("Ubuntu 22.04") == 1, description.group(1)


@pytest.mark.parametrize("need_gib, size", [(900, 1024), (1100, 1280), (9984, 9984), (9990, 10240),
                                            (12000, 12800), (100000, 102400)])
def test_filestore_sizes_are_ones_the_api_takes(need_gib, size):
    entry = cat.shared_storage("gcp")
    got = cat.shared_size_gib(entry, need_gib * 2**30)
    assert got == size
    assert (1024 <= got <= 9984 and got % 256 == 0) or (10240 <= got <= 102400 and got % 2560 == 0)


@pytest.mark.parametrize("size, ok", [(0, True), (1280, True), (9984, True), (10000, False), (12032, False),
                                      (12800, True), (102400, True), (104960, False)])
def test_filestore_size_validation(size, ok, tmp_path, rendered):
    directory, _ = rendered("gcp-a3mega-2")
    code, _, error = evaluate(tmp_path, directory, {"size": "var.shared_storage_gib"},
                              {**REQUIRED_INPUTS["gcp"], "shared_storage_gib": size})
    assert (code == 0) is ok, error
