"""The stand-in facts the rehearsal adds to a recorded `terraform output` (tests/data/terraform_output/,
held to the modules by tests/test_journey.py) agree with that output and with the bundle the
rehearsal generates: one hostname per recorded node, named as the cloud names it from the
recorded private address; the image profile and GPU count the bundle's plan decided."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuprov.catalog import images
from gpuprov.catalog.instances import get_instance
from rehearsal import cluster


@pytest.mark.parametrize("name", ["aws", "aws-g5", "gcp-g2"])
def test_standin_facts_agree_with_the_recorded_output_and_the_bundle(tmp_path, name):
    recorded = cluster.fixture(name)
    cloud = recorded["cloud"]
    assert recorded["source"] and recorded["recorded"]
    outputs = recorded["outputs"]
    hosts = outputs["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"]
    assert list(recorded["hostnames"]) == list(hosts)
    if cloud == "aws":  # EC2's IP-based hostname, what slurmd registers as
        assert recorded["hostnames"] == {n: "ip-" + h["private_ip"].replace(".", "-") for n, h in hosts.items()}
        network = ipaddress.ip_network(f"{next(iter(hosts.values()))['private_ip']}/{recorded['subnet_prefix']}",
                                       strict=False)
        assert all(ipaddress.ip_address(h["private_ip"]) in network for h in hosts.values())
    if cloud == "gcp":  # a VM's hostname is its name; IAP reaches it by that name
        assert recorded["hostnames"] == {n: n for n in hosts} == {n: h["ansible_host"] for n, h in hosts.items()}
        # the variables the user gave are the ones the recorded output was made with
        tf_vars, inventory_vars = recorded["tf_vars"], outputs["ansible_inventory"]["value"]["all"]["vars"]
        assert tf_vars["ssh_user"] == inventory_vars["ansible_user"]
        assert f"--project={tf_vars['project_id']} --zone={tf_vars['zone']}" in inventory_vars["ansible_ssh_common_args"]

    out = tmp_path / "bundle"
    subprocess.run([sys.executable, "-m", "gpuprov", "generate", *recorded["generate"], "-o", str(out)], check=True,
                   capture_output=True, timeout=120, cwd=cluster.REPO)
    plan = json.loads((out / "plan.json").read_text())
    group_vars = yaml.safe_load((out / "ansible" / "group_vars" / "all.yml").read_text())
    assert plan["cluster"]["cloud"] == cloud and plan["cluster"]["nodes"] == len(hosts)
    assert group_vars["gpuprov_image_profile"] == recorded["image"]["profile"]
    assert plan["cluster"]["gpus_per_node"] == recorded["gpus_per_node"]
    assert group_vars["slurm_gpus_per_node"] == recorded["gpus_per_node"]
    # the guest is booted with the instance's vCPUs and memory: they are the catalog's for the planned type
    instance = get_instance(plan["instance"]["name"])
    assert plan["instance"]["name"] == recorded["instance_type"]
    assert (recorded["vcpus"], recorded["memory_mib"] * 2**20) == (instance.vcpus, instance.ram_bytes)
    assert recorded["gpus_per_node"] == instance.gpus
    assert images.profile(group_vars["gpuprov_image_profile"])["driver"]["version"] == recorded["image"]["driver_version"]
    if cloud == "gcp":  # the nic0 subnet the bundle's network.tf creates: var.primary_cidr's default
        variables = (out / "terraform" / "variables.tf").read_text()
        cidr = re.search(r'variable "primary_cidr" \{[^}]*?default\s*=\s*"([^"]+)"', variables).group(1)
        network = ipaddress.ip_network(cidr)
        assert recorded["subnet_prefix"] == network.prefixlen
        assert all(ipaddress.ip_address(h["private_ip"]) in network for h in hosts.values())


def _without_bundle_id(folder: Path, bundle_id: str) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text().replace(bundle_id, "<bundle id>")
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_fine_tune_bundle_fits_the_same_recorded_instances(tmp_path):
    """The rehearsal's second bundle (a LoRA fine-tune of a model folder on chat data) plans the same
    instances as the first, and its Terraform differs only by the bundle id in names and tags: the
    recorded output that tests/test_journey.py holds to the first bundle's module holds for it too."""
    pytest.importorskip("transformers")
    from finetune_inputs import make_base, write_chat

    recorded = cluster.fixture("aws-g5")
    make_base(tmp_path / "tiny-llama")
    write_chat(tmp_path / "chat.jsonl")
    bundles = {}
    for kind, args in {"scratch": recorded["generate"],
                       "fine_tune": ["--model", str(tmp_path / "tiny-llama"), "--dataset", str(tmp_path / "chat.jsonl"),
                                     *recorded["fine_tune"]["generate"]]}.items():
        out = tmp_path / kind
        subprocess.run([sys.executable, "-m", "gpuprov", "generate", *args, "-o", str(out)], check=True,
                       capture_output=True, timeout=120, cwd=cluster.REPO)
        bundles[kind] = (out, json.loads((out / "plan.json").read_text()))
    (scratch, first), (fine_tune, plan) = bundles["scratch"], bundles["fine_tune"]
    assert plan["task"] == "lora" and plan["staging"]["weights_local"] and plan["staging"]["data_dir"]
    assert plan["instance"]["name"] == recorded["instance_type"] and plan["cluster"]["nodes"] == 2
    assert plan["cluster"]["gpus_per_node"] == recorded["gpus_per_node"]
    group_vars = yaml.safe_load((fine_tune / "ansible" / "group_vars" / "all.yml").read_text())
    assert group_vars["gpuprov_image_profile"] == recorded["image"]["profile"]
    assert plan["bundle_id"] != first["bundle_id"]  # a deployment of its own (names), on the same shape
    assert _terraform_differences(scratch, fine_tune, first, plan) == []


def _terraform_differences(scratch: Path, fine_tune: Path, first: dict, plan: dict) -> list[str]:
    """Lines of the fine-tune bundle's Terraform that differ from the first bundle's other than by the
    bundle id and in comments (the plan's description: task and model)."""
    a = _without_bundle_id(scratch / "terraform", first["bundle_id"])
    b = _without_bundle_id(fine_tune / "terraform", plan["bundle_id"])
    if set(a) != set(b):
        return [f"files: {sorted(set(a) ^ set(b))}"]
    return [f"{name}: {x!r} != {y!r}" for name in a for x, y in zip(a[name].splitlines(), b[name].splitlines())
            if x != y and not x.lstrip().startswith("#")] + \
        [f"{name}: line count" for name in a if len(a[name].splitlines()) != len(b[name].splitlines())]


@pytest.mark.parametrize("name", ["aws-g5", "gcp-g2"])
def test_standin_cli_answers_the_lost_node_question_up_asks(tmp_path, name):
    """The stand-in CLI (tests/rehearsal/bin/) takes the very argv `up` asks the cloud with
    (Target.node_states_argv) and its answer parses as the target reads the real one: a running node
    is kept, one that no longer runs is lost."""
    from gpuprov.targets import get_target

    recorded = cluster.fixture(name)
    target = get_target(recorded["cloud"])
    outputs = recorded["outputs"]
    nodes = dict(zip(outputs["node_names"]["value"], outputs["instance_ids"]["value"]))
    settings = {"region": "us-east-1", "purchase": "on-demand", "project": "p", "zone": "us-central1-a"}
    argv = target.node_states_argv(settings, nodes)
    gone = list(nodes)[-1]
    state = tmp_path / "state"
    state.mkdir()
    # targets.json is keyed as the transport reaches a node: EC2 instance ids, GCP VM names
    reach = {n: (i if recorded["cloud"] == "aws" else n) for n, i in nodes.items()}
    (state / "targets.json").write_text(json.dumps({reach[n]: 22 for n in nodes if n != gone}))
    answer = subprocess.run([sys.executable, str(cluster.SHIMS / argv[0]), *argv[1:]], capture_output=True,
                            text=True, timeout=30, env={"REHEARSAL_DIR": str(state), "PATH": "/usr/bin:/bin"})
    assert answer.returncode == 0, answer.stderr
    assert target.lost_nodes(nodes, answer.stdout) == [gone]


def test_the_replaced_recording_changes_only_the_replaced_node():
    """aws-g5's recording after node 1 was replaced (fixture "replaced") is the first recording with
    that node's instance id and private address new, as aws_instance.replacement gives them: the same
    names, a new id, a free address in the node subnet; the hostname EC2 derives from it; and the name
    is the one `up` lists for Terraform (Target.replacement_vars) on finding that instance lost."""
    from gpuprov.lost_nodes import recorded_nodes
    from gpuprov.targets import get_target

    recorded = cluster.fixture("aws-g5")
    before, after = recorded["outputs"], recorded["replaced"]["outputs"]
    assert set(after) == set(before)
    hosts = lambda outputs: outputs["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"]  # noqa: E731
    old, new = hosts(before), hosts(after)
    assert list(new) == list(old) == before["node_names"]["value"] == after["node_names"]["value"]
    changed = [n for n in old if old[n] != new[n]]
    assert changed == list(recorded["replaced"]["hostnames"]) == [list(old)[1]]
    for name in changed:
        assert new[name]["ansible_host"] != old[name]["ansible_host"] and re.fullmatch(r"i-[0-9a-f]{17}",
                                                                                      new[name]["ansible_host"])
        assert new[name]["private_ip"] not in {h["private_ip"] for h in old.values()}
        network = ipaddress.ip_network(f"{old[name]['private_ip']}/{recorded['subnet_prefix']}", strict=False)
        assert ipaddress.ip_address(new[name]["private_ip"]) in network
        assert recorded["replaced"]["hostnames"][name] == "ip-" + new[name]["private_ip"].replace(".", "-")
    # every other output as before; the id and address lists follow the inventory
    same = lambda outputs: {k: v for k, v in outputs.items()  # noqa: E731
                            if k not in ("ansible_inventory", "instance_ids", "private_ips")}
    assert same(after) == same(before)
    assert after["instance_ids"]["value"] == [h["ansible_host"] for h in new.values()]
    assert after["private_ips"]["value"] == [h["private_ip"] for h in new.values()]
    inventory = lambda outputs: {k: v for k, v in outputs["ansible_inventory"]["value"]["all"].items()  # noqa: E731
                                 if k != "children"}
    assert inventory(after) == inventory(before)
    # the ids `up` asks about, the one it finds lost, the list it writes for Terraform
    nodes = recorded_nodes(json.dumps(before))
    target = get_target("aws")
    answer = json.dumps([[i, "running"] for n, i in nodes.items() if n not in changed])
    assert target.lost_nodes(nodes, answer) == changed
    vars_ = target.replacement_vars(changed, {"nodes": len(nodes), "purchase": "on-demand"}, {})
    assert vars_["replaced_nodes"]["names"] == changed


class _Standin:
    """A stand-in node that boots nothing: what Cloud keeps of a guest, and the commands run on it."""

    def __init__(self, port: int):
        self.port, self.proc, self.commands = port, subprocess.Popen(["sleep", "600"]), []

    def ssh(self, command: str, **_):
        self.commands.append(command)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    poweroff = lambda self, timeout=0: self.kill()  # noqa: E731


def _terraform(cloud: cluster.Cloud, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(cluster.SHIMS / "terraform"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={"REHEARSAL_DIR": str(cloud.state), "PATH": "/usr/bin:/bin"})


def _guestless_cloud(tmp_path, monkeypatch, recorded: dict):
    """A Cloud whose launches boot no guest: each records (name, transport id, private address, hostname)
    in the returned list and stands in with a _Standin node."""
    cloud = cluster.Cloud(tmp_path / "cloud", recorded, tmp_path / "shared", {"venv": Path(sys.prefix)})
    booted: list[tuple] = []

    def launch(name: str):
        booted.append((name, cloud.transport_id(name), cloud.private_ip(name), cloud.hostnames[name]))
        node = cloud.nodes[cloud.transport_id(name)] = _Standin(1000 + len(booted))
        cloud._write_targets()
        return node

    monkeypatch.setattr(cloud, "launch", launch)
    return cloud, booted


def test_standin_terraform_replaces_a_lost_node_under_the_recorded_replacement(tmp_path, monkeypatch):
    """The stand-in `terraform apply` with the list `up` writes for a lost node (Target.replacement_vars,
    in replaced_nodes.auto.tfvars.json beside the module) has the rehearsal boot that node's
    replacement under the replaced recording's id, address and IP-based hostname, tells the other
    node's resolver that hostname (the VPC's DNS), and `output -json` gives the replaced recording;
    the same list applied again creates nothing; destroy brings back the first recording. No guest boots:
    Cloud.launch is replaced by one that registers a stand-in node."""
    from gpuprov.lost_nodes import REPLACED_VARS, recorded_nodes
    from gpuprov.targets import get_target

    recorded = cluster.fixture("aws-g5")
    cloud, booted = _guestless_cloud(tmp_path, monkeypatch, recorded)
    try:
        for name in cloud.hosts():
            cloud.launch(name)
        first, lost = list(cloud.hosts())
        survivor = cloud.node(first)
        terraform = tmp_path / "bundle" / "terraform"
        terraform.mkdir(parents=True)
        assert _terraform(cloud, terraform, "apply", "-auto-approve").returncode == 0
        assert json.loads(_terraform(cloud, terraform, "output", "-json").stdout) == recorded["outputs"]
        cloud.kill(lost)  # the instance is gone; up finds it lost and lists it for Terraform
        nodes = recorded_nodes(json.dumps(recorded["outputs"]))
        listed = get_target("aws").replacement_vars([lost], {"nodes": len(nodes), "purchase": "on-demand"}, {})
        (terraform / REPLACED_VARS).write_text(json.dumps(listed))

        applied = _terraform(cloud, terraform, "apply", "-auto-approve")
        assert applied.returncode == 0, applied.stderr
        after = recorded["replaced"]["outputs"]
        new = after["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"][lost]
        hostname = recorded["replaced"]["hostnames"][lost]
        assert booted[2:] == [(lost, new["ansible_host"], new["private_ip"], hostname)]
        assert set(json.loads((cloud.state / "targets.json").read_text())) == {nodes[first], new["ansible_host"]}
        assert json.loads(_terraform(cloud, terraform, "output", "-json").stdout) == after
        assert cloud.hosts() == after["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"]
        # the survivor resolves the new hostname (its own list of the nodes is the play's to update)
        assert any(f"{new['private_ip']} {hostname}" in c and "/etc/hosts" in c for c in survivor.commands)

        again = _terraform(cloud, terraform, "apply", "-auto-approve")  # the same list: nothing to create
        assert again.returncode == 0 and len(booted) == 3, again.stderr
        assert _terraform(cloud, terraform, "destroy", "-auto-approve").returncode == 0
        assert cloud.running() == [] and json.loads((cloud.state / "outputs.json").read_text()) == recorded["outputs"]
    finally:
        cloud.close()


def test_standin_terraform_refuses_to_replace_a_node_that_runs(tmp_path, monkeypatch):
    """A listed node whose instance still runs would get a second instance from Terraform: the
    stand-in refuses it instead of pretending (and boots nothing)."""
    from gpuprov.lost_nodes import REPLACED_VARS
    from gpuprov.targets import get_target

    recorded = cluster.fixture("aws-g5")
    cloud, booted = _guestless_cloud(tmp_path, monkeypatch, recorded)
    try:
        for name in cloud.hosts():
            cloud.launch(name)
        terraform = tmp_path / "terraform"
        terraform.mkdir()
        listed = get_target("aws").replacement_vars([list(cloud.hosts())[1]], {"nodes": 2, "purchase": "on-demand"}, {})
        (terraform / REPLACED_VARS).write_text(json.dumps(listed))
        applied = _terraform(cloud, terraform, "apply", "-auto-approve")
        assert applied.returncode != 0 and len(booted) == 2
        assert json.loads((cloud.state / "outputs.json").read_text()) == recorded["outputs"]
    finally:
        cloud.close()


def test_the_lost_node_bundle_is_the_first_with_checkpoints_before_its_end(tmp_path):
    """The lost-node walk's bundle: the first bundle's arguments with only generate's own --epochs
    changed and --checkpoint-every added; it checkpoints before its last step, on the same instances
    (its Terraform differs from the first bundle's only by the bundle id)."""
    recorded = cluster.fixture("aws-g5")
    first, walk = recorded["generate"], recorded["lost_node"]["generate"]
    epochs = first.index("--epochs") + 1
    assert walk[:epochs] + walk[epochs + 1:len(first)] == first[:epochs] + first[epochs + 1:]
    assert walk[len(first):][0] == "--checkpoint-every" and len(walk) == len(first) + 2
    bundles = {}
    for kind, args in {"scratch": first, "lost_node": walk}.items():
        out = tmp_path / kind
        subprocess.run([sys.executable, "-m", "gpuprov", "generate", *args, "-o", str(out)], check=True,
                       capture_output=True, timeout=120, cwd=cluster.REPO)
        bundles[kind] = (out, json.loads((out / "plan.json").read_text()))
    (scratch, plan0), (lost_node, plan) = bundles["scratch"], bundles["lost_node"]
    train = yaml.safe_load((lost_node / "launch" / "train.yaml").read_text())
    # as many steps after the first checkpoint as before it: the kill lands mid-job, the resumed rest stays short
    assert train["checkpoint"]["every_steps"] == int(walk[-1]) and train["schedule"]["steps"] >= 2 * int(walk[-1])
    assert plan["instance"]["name"] == recorded["instance_type"] and plan["cluster"]["nodes"] == 2
    assert _terraform_differences(scratch, lost_node, plan0, plan) == []


def test_the_tiny_dataset_is_what_prepare_data_writes_and_the_trainer_attends_per_document():
    """tiny-data/ carries the sample starts prepare_data.py records, so the rehearsed job runs the trainer's default
    per-document attention (not the one-sequence fallback of data without them)."""
    import importlib

    launch = cluster.REPO / "templates" / "launch"
    data = cluster.FIXTURES / "tiny-data"
    meta = json.loads((data / "meta.json").read_text())
    assert meta["boundaries"] == "starts" and meta["packing"] == "stream"
    sys.path.insert(0, str(launch))
    try:
        train_data, train_config = importlib.import_module("train_data"), importlib.import_module("train_config")
        windows = train_data.TokenWindows(train_config.DataSection(path=str(data)), meta["seq_len"], meta["vocab_size"], 0)
        assert windows.documents and windows.size == meta["train_samples"]
        batch = windows.micro_batch(0, windows.size)
    finally:
        sys.path.remove(str(launch))
        for name in ("train_data", "train_config"):
            sys.modules.pop(name, None)
    # positions restart exactly where the next document starts (documents of seq_len + 1 tokens: in almost every
    # window)
    restarts = [(i, j) for i in range(windows.size) for j in range(1, meta["seq_len"]) if int(batch.positions[i, j]) == 0]
    assert len(restarts) >= windows.size - 2
    assert all(int(batch.documents[i, j]) != int(batch.documents[i, j - 1]) for i, j in restarts)
