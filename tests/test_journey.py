"""The user's path from `generate` to a cluster Ansible can reach, per target (issue 27).

For each cloud and on-prem, one node and several, and every purchase option the catalog sells for
the chosen type: `gpuprov generate` -> the user's terraform.tfvars (the example, filled in) ->
`gpuprov validate --offline` (no failure) -> `gpuprov up --dry-run` (no missing value, a connection
path) -> the `terraform output -json` that bundle's module gives after apply (a recorded fixture,
tests/data/terraform_output/) -> the inventory `up` writes from it -> the real `ansible-inventory
--list`, where every node has an address, a user, a port and a connection path (a ProxyJump /
ProxyCommand, or a public address).

The fixtures are checked against the modules they stand for: their output names against the
module's `output` blocks, and their values against the shape of each output's expression as
Terraform's own configuration loader reads it, so a changed output breaks this test, not a user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprov.bringup import write_inventory
from gpuprov.catalog import bringup as cat
from gpuprov.catalog.instances import get_instance
from terraform_support import load_module, plans, render_to, source_text

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = Path(__file__).resolve().parent / "data" / "terraform_output"
ANSIBLE_INVENTORY = Path(sys.executable).parent / "ansible-inventory"
MODULE_PLAN = {"aws": "aws-p5-2", "gcp": "gcp-a3mega-2", "azure": "azure-2", "oci": "oci-2",
               "gcp-flex": "gcp-a3ultra-4"}
# Outputs recorded for a bundle generate writes from a rehearsal's arguments (tests/rehearsal/fixtures/):
# checked against the module of that very bundle.
REHEARSAL_BUNDLE = {"aws-g5": "aws-g5", "gcp-g2": "gcp-g2"}
# An output recorded after `up` had Terraform replace a lost node: `<bundle>-<n>-replaced`, the same
# module's output with replaced_nodes set (held to that module like the rest).
REPLACED = "-replaced"


# ---- the shape of an output, from Terraform's loader ------------------------------------------

ANY = ("any",)


def _literal(node: dict, directory: Path) -> tuple:
    text = source_text(directory, node).strip()
    if text == "null":
        return ("null",)
    if text in ("true", "false"):
        return ("bool",)
    if text.startswith('"'):
        return ("string",)
    return ("number",) if text[:1].isdigit() else ANY


def _key(item: dict) -> str | None:
    wrapped = item["KeyExpr"].get("Wrapped") or {}
    steps = wrapped.get("Traversal") or []
    return steps[0]["Name"] if len(steps) == 1 and not item["KeyExpr"].get("ForceNonLiteral", True) else None


def shape(node: object, module: dict, directory: Path, depth: int = 0) -> tuple:
    """What value an expression can produce: object keys, maps, lists, nullable parts, strings."""
    if not isinstance(node, dict) or depth > 12:
        return ANY
    again = lambda n: shape(n, module, directory, depth + 1)  # noqa: E731
    if "Items" in node:  # { key = value }
        keys = {_key(item): again(item["ValueExpr"]) for item in node["Items"]}
        return ("map", ANY) if None in keys else ("object", keys)
    if "CollExpr" in node and "ValExpr" in node:  # for expression: { for ... : k => v } or [ for ... : v ]
        return ("map" if node.get("KeyExpr") else "list", again(node["ValExpr"]))
    if "Condition" in node and "TrueResult" in node:
        true, false = again(node["TrueResult"]), again(node["FalseResult"])
        if true == ("null",):
            return ("nullable", false)
        return ("nullable", true) if false == ("null",) else ("either", true, false)
    if "Parts" in node:  # "${...}" template
        return ("string",)
    if "Val" in node:
        return _literal(node, directory)
    steps = node.get("Traversal") or []
    if len(steps) == 2 and steps[0].get("Name") == "local" and "Source" not in node:
        return again(module["Locals"][steps[1]["Name"]]["Expr"])
    if node.get("Name") == "one":  # one(x[*].y): null when the resource's count is 0
        return ("nullable", ANY)
    return ANY


def conforms(value: object, want: tuple, where: str) -> list[str]:
    kind = want[0]
    if kind == "any":
        return []
    if kind == "nullable":
        return [] if value is None else conforms(value, want[1], where)
    if kind == "either":
        first, second = conforms(value, want[1], where), conforms(value, want[2], where)
        return [] if not first or not second else first
    simple = {"string": str, "bool": bool, "number": (int, float), "null": type(None)}
    if kind in simple:
        return [] if isinstance(value, simple[kind]) else [f"{where}: {value!r} is not {kind}"]
    if kind == "list":
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [p for i, v in enumerate(value) for p in conforms(v, want[1], f"{where}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where}: not an object"]
    if kind == "map":
        return [p for k, v in value.items() for p in conforms(v, want[1], f"{where}.{k}")]
    keys = want[1]
    problems = [f"{where}: has {k!r}, the output does not" for k in sorted(set(value) - set(keys))]
    problems += [f"{where}: lacks {k!r}" for k in sorted(set(keys) - set(value))]
    return problems + [p for k in set(keys) & set(value) for p in conforms(value[k], keys[k], f"{where}.{k}")]


def can_be_null(want: tuple) -> bool:
    if want[0] == "either":
        return can_be_null(want[1]) or can_be_null(want[2])
    return want[0] in ("nullable", "any", "null")


def tf_type(value: object) -> object:
    """Terraform's JSON type notation of a value (as `terraform output -json` prints it)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "dynamic"
    if isinstance(value, list):
        return ["tuple", [tf_type(v) for v in value]]
    return ["object", {k: tf_type(v) for k, v in value.items()}]


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> dict:
    loaded = {}
    for kind, plan in MODULE_PLAN.items():
        directory = render_to(tmp_path_factory.mktemp(kind) / kind, plans()[plan])
        loaded[kind] = (directory, load_module(directory))
    for kind, fixture in REHEARSAL_BUNDLE.items():
        args = json.loads((REPO / "tests" / "rehearsal" / "fixtures" / f"{fixture}.json").read_text())["generate"]
        bundle = tmp_path_factory.mktemp(kind) / "bundle"
        made = subprocess.run([sys.executable, "-m", "gpuprov", "generate", *args, "-o", str(bundle)], cwd=REPO,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert made.returncode == 0, made.stderr
        loaded[kind] = (bundle / "terraform", load_module(bundle / "terraform"))
    return loaded


def _fixture(name: str) -> dict:
    return json.loads((OUTPUTS / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(p.stem for p in OUTPUTS.glob("*.json")))
def test_recorded_output_matches_the_module_it_stands_for(name, modules):
    base = name.removesuffix(REPLACED)
    directory, module = modules[base.rsplit("-", 1)[0]]  # gcp-flex-2: the flex-start module
    outputs = _fixture(name)
    declared = module["Outputs"]
    assert set(outputs) <= set(declared), f"outputs the module does not declare: {set(outputs) - set(declared)}"
    for missing in set(declared) - set(outputs):  # Terraform leaves null outputs out of `output -json`
        assert can_be_null(shape(declared[missing]["Expr"], module, directory)), missing
    for key, entry in outputs.items():
        assert set(entry) == {"sensitive", "type", "value"} and entry["sensitive"] is False
        assert entry["type"] == tf_type(entry["value"]), key
        assert conforms(entry["value"], shape(declared[key]["Expr"], module, directory), key) == []


def test_a_drifted_fixture_is_caught(modules):
    """The check fails when the module's inventory gains or loses a host variable."""
    directory, module = modules["azure"]
    value = _fixture("azure-2")["ansible_inventory"]["value"]
    want = shape(module["Outputs"]["ansible_inventory"]["Expr"], module, directory)
    host = next(iter(value["all"]["children"]["gpu_nodes"]["hosts"].values()))
    host["ansible_hostname"] = host.pop("ansible_host")
    problems = conforms(value, want, "ansible_inventory")
    assert any("lacks 'ansible_host'" in p for p in problems) and any("ansible_hostname" in p for p in problems)


# ---- the journey --------------------------------------------------------------------------------

# The GPU each journey asks for, and so the catalog type whose purchase options it walks.
JOURNEY_GPU = {"aws": ("h100-80gb", "p5.48xlarge"), "gcp": ("h200-141gb", "a3-ultragpu-8g"),
               "azure": ("h100-80gb", "Standard_ND96isr_H100_v5"), "oci": ("h100-80gb", "BM.GPU.H100.8")}
HELD_FLAGS = {"aws": ["--capacity-reservation-id", "cr-0123456789abcdef0"], "gcp": ["--reservation", "my-reservation"]}
# What the user adds to the example tfvars: a reservation's zone on AWS (it lives in one).
HELD_TFVARS = {"aws": 'availability_zone = "us-east-1d"\n', "gcp": ""}


def _cases() -> list[tuple[str, int, str | None]]:
    cases = []
    for cloud, (_, instance) in JOURNEY_GPU.items():
        for option in cat.offered_options(get_instance(instance)):
            cases += [(cloud, 1, option), (cloud, 2, option)]
    return cases + [("onprem", 1, None), ("onprem", 2, None)]


def gpuprov(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def _hosts_file(tmp_path: Path, nodes: int) -> Path:
    path = tmp_path / "hosts.yaml"
    lines = []
    for i in range(nodes):
        lines += [f"- name: gpu-node-{i}", f"  address: 10.20.0.{10 + i}", "  user: ubuntu"]
        if i == 0:
            lines.append("  port: 2222")
    path.write_text("\n".join(lines) + "\n")
    return path


def _generate(tmp_path: Path, cloud: str, nodes: int, option: str | None) -> Path:
    root = tmp_path / "infra"
    args = ["generate", "--model", "llama-3.1-8b", "--task", "lora", "-o", str(root)]
    if cloud == "onprem":
        args += ["--hosts", str(_hosts_file(tmp_path, nodes)), "--gpus", str(8 * nodes)]
        if nodes > 1:
            args += ["--shared-nfs", "nfs-server:/export/gpu"]
    else:
        args += ["--cloud", cloud, "--gpu", JOURNEY_GPU[cloud][0], "--gpus", str(8 * nodes), "--purchase", option]
        if cat.offers(get_instance(JOURNEY_GPU[cloud][1]))[cat.offered_options(get_instance(JOURNEY_GPU[cloud][1]))
                                                            .index(option)].price_per_hour_usd is None:
            args += ["--objective", "time"]  # no public price (spot, Capacity Blocks): cost cannot rank it
        if option in ("reservation", "capacity-block"):
            args += HELD_FLAGS[cloud]
    result = gpuprov(*args)
    assert result.returncode == 0, result.stderr
    plan = json.loads((root / "plan.json").read_text())
    assert plan["cluster"]["nodes"] == nodes
    if cloud != "onprem":
        assert plan["instance"]["name"] == JOURNEY_GPU[cloud][1] and plan["purchase"]["option"] == option
    return root


def _fill_tfvars(root: Path, cloud: str, option: str | None) -> None:
    """What the user does first: copy the example and fill it in (here: its placeholders as they are)."""
    tf = root / "terraform"
    text = (tf / "terraform.tfvars.example").read_text()
    if option in ("reservation", "capacity-block"):
        text += HELD_TFVARS[cloud]
    (tf / "terraform.tfvars").write_text(text)


def _inventory_from_output(root: Path, cloud: str, nodes: int, option: str | None) -> None:
    """`up`'s inventory step, given what `terraform output -json ansible_inventory` prints for this bundle."""
    name = f"{cloud}-flex-{nodes}" if option == "flex-start" else f"{cloud}-{nodes}"
    value = _fixture(name)["ansible_inventory"]["value"]
    assert write_inventory(root, json.dumps(value)) == nodes


def _ansible_inventory(root: Path) -> dict:
    proc = subprocess.run([str(ANSIBLE_INVENTORY), "-i", str(root / "ansible" / "inventory.yml"), "--list"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "ANSIBLE_HOME": str(root / ".ansible"), "ANSIBLE_NOCOLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _connection(hostvars: dict, name: str, onprem: bool = False) -> str:
    """How Ansible reaches the node: a proxy, or a public address (fails the test otherwise)."""
    import ipaddress

    for key in ("ansible_host", "ansible_user", "ansible_port"):
        assert hostvars.get(key), f"{name}: {key} missing in {hostvars}"
    args = hostvars.get("ansible_ssh_common_args") or ""
    if "ProxyJump=" in args or "ProxyCommand=" in args:
        return args
    if onprem:  # the user's own hosts: the address they gave is the one they reach
        return "direct"
    try:
        public = ipaddress.ip_address(hostvars["ansible_host"]).is_global
    except ValueError:
        public = False
    assert public, f"{name}: {hostvars['ansible_host']} is private and nothing leads to it"
    return "direct"


def gcp_node_requests(root: Path, workdir: Path) -> dict:
    """How the bundle asks GCP for its nodes, as Terraform evaluates the module's own count,
    resize_by and target_size expressions with the user's terraform.tfvars."""
    from terraform_support import evaluate

    tf = root / "terraform"
    module = load_module(tf)
    resources = module["ManagedResources"]

    def attr(address: str, name: str) -> str:
        return source_text(tf, resources[address]["Config"]["Attributes"][name]["Expr"])

    outputs = {"instances": attr("google_compute_instance.node", "count"),
               "groups": attr("google_compute_instance_group_manager.flex", "count"),
               "group_size": attr("google_compute_instance_group_manager.flex", "target_size"),
               "requests": attr("google_compute_resize_request.flex", "count"),
               "resize_by": attr("google_compute_resize_request.flex", "resize_by")}
    flex = source_text(tf, module["Locals"]["flex_group"]["Expr"])
    code, values, error = evaluate(workdir, tf, outputs, (tf / "terraform.tfvars").read_text(),
                                   locals_={"flex_group": flex})
    assert code == 0, error
    return values


@pytest.mark.slow
@pytest.mark.parametrize("cloud, nodes, option", _cases(), ids=[f"{c}-{n}-{o or 'hosts'}" for c, n, o in _cases()])
def test_journey(cloud, nodes, option, tmp_path):
    root = _generate(tmp_path, cloud, nodes, option)
    if cloud != "onprem":
        _fill_tfvars(root, cloud, option)
    validate = gpuprov("validate", str(root), "--offline")
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert not [ln for ln in validate.stdout.splitlines() if ln.startswith("fail")]
    dry = gpuprov("up", str(root), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "note:" not in dry.stdout, dry.stdout  # no missing value, no missing connection path
    if cloud != "onprem":
        assert "terraform apply" in dry.stdout
        _inventory_from_output(root, cloud, nodes, option)
    if cloud == "gcp":  # flex-start capacity: one all-or-nothing request for every node, no lone VMs
        asked = gcp_node_requests(root, tmp_path / "eval")
        if option == "flex-start":
            assert asked == {"instances": 0, "groups": 1, "group_size": 0, "requests": 1, "resize_by": nodes}
        else:
            assert (asked["instances"], asked["groups"], asked["requests"]) == (nodes, 0, 0)
    listed = _ansible_inventory(root)
    hosts = listed["gpu_nodes"]["hosts"]
    assert len(hosts) == nodes
    paths = {name: _connection(listed["_meta"]["hostvars"][name], name, cloud == "onprem") for name in hosts}
    if cloud in ("azure", "oci"):  # the head the bundle creates is the jump host
        assert all(p.startswith("-o ProxyJump=") for p in paths.values()), paths
    if cloud == "onprem":
        assert listed["_meta"]["hostvars"]["gpu-node-0"]["ansible_port"] == 2222
    if nodes > 1:
        mount = next(iter(listed["_meta"]["hostvars"].values())).get("shared_storage_mount")
        assert mount and mount["mount_point"] == "/shared", mount


def test_up_refuses_before_terraform_when_no_connection_path_exists(tmp_path):
    """Azure without bastion_cidr: the head could not be reached, so nothing is planned or bought."""
    from gpuprov.bringup import StepFailed, bring_up
    from gpuprov.plan import Plan

    root = tmp_path / "infra"
    result = gpuprov("generate", "--model", "llama-3.1-8b", "--task", "lora", "--cloud", "azure", "--gpus", "8",
                     "-o", str(root))
    assert result.returncode == 0, result.stderr
    (root / "terraform" / "terraform.tfvars").write_text('ssh_public_key = "ssh-ed25519 AAAA x@y"\n')
    plan = Plan.model_validate_json((root / "plan.json").read_text())
    ran: list[str] = []
    import gpuprov.bringup as bringup

    original = bringup.run_step
    bringup.run_step = lambda r, step, echo: ran.append(step.name) or 0
    try:
        with pytest.raises(StepFailed) as refused:
            bring_up(root, plan, echo=lambda line: None)
    finally:
        bringup.run_step = original
    assert ran == ["terraform-init"]  # init downloads providers only; plan and apply never ran
    assert "bastion_cidr" in str(refused.value) and "terraform-plan" in str(refused.value)
    dry = gpuprov("up", str(root), "--dry-run")
    assert "stops before terraform plan" in dry.stdout and "bastion_cidr" in dry.stdout
    # given the CIDR, the path exists
    (root / "terraform" / "terraform.tfvars").write_text(
        'ssh_public_key = "ssh-ed25519 AAAA x@y"\nbastion_cidr = "203.0.113.7/32"\n')
    assert "stops before" not in gpuprov("up", str(root), "--dry-run").stdout


def test_an_output_inventory_without_a_path_is_refused(tmp_path):
    from gpuprov.bringup import StepFailed

    (tmp_path / "ansible").mkdir()
    value = _fixture("azure-2")["ansible_inventory"]["value"]
    value["all"]["vars"]["ansible_ssh_common_args"] = ""  # private addresses, no jump host
    with pytest.raises(StepFailed, match="no connection path"):
        write_inventory(tmp_path, json.dumps(value))
    assert not (tmp_path / "ansible" / "inventory.yml").exists()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["aws", "gcp", "azure", "oci", "onprem"])
def test_default_70b_bundle_validates(target, tmp_path):
    """Issue 27's done-when: `gpuprov generate --model 70b --cloud X -o d && gpuprov validate d` exits 0
    (on-prem: the example's two hosts and the site's NFS export for the checkpoints)."""
    root = tmp_path / "d"
    where = ["--cloud", target] if target != "onprem" else [
        "--hosts", str(REPO / "examples" / "7b-full-onprem" / "hosts.yaml"), "--shared-nfs", "nfs-server:/export/gpu"]
    generated = gpuprov("generate", "--model", "70b", *where, "-o", str(root))
    assert generated.returncode == 0, generated.stderr
    validate = gpuprov("validate", str(root))
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert not [ln for ln in validate.stdout.splitlines() if ln.startswith("fail")]
