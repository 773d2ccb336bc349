"""A node the cloud no longer runs (a reclaimed spot node, a failed host) is replaced under its name
(issue 40, item 6). `gpuprov up` on a cluster an earlier run created reads the nodes Terraform
recorded (`terraform output -json`, the recorded AWS shape of tests/data/terraform_output/), asks
the cloud which still run (aws ec2 describe-instances, a fake executable answering as the CLI does),
lists the lost names in terraform/replaced_nodes.auto.tfvars.json and runs again from `terraform
plan` on, never submitting the job a second time. The AWS module gives each listed name an instance
of its own (Terraform's loader and evaluator, the mined provider schema); no other node is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from bundle_fixtures import standin_renderers
from gpuprov import bundle, joining
from gpuprov.errors import GpuprovError
from gpuprov.lost_nodes import REPLACED_VARS, recorded_nodes
from gpuprov.targets import get_target
from plan_fixtures import sample_plan
from terraform_support import REQUIRED_INPUTS, evaluate, load_module, load_schema, render_to, source_text

DATA = Path(__file__).resolve().parent / "data" / "terraform_output"
RECORDED = json.loads((DATA / "aws-2.json").read_text())
NAMES = RECORDED["node_names"]["value"]
IDS = RECORDED["instance_ids"]["value"]
INVENTORY = RECORDED["ansible_inventory"]["value"]

FAKE = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    import yaml
    name = os.path.basename(sys.argv[0])
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps([name] + sys.argv[1:]) + "\\n")
    key = " ".join([name] + sys.argv[1:])
    if name == "terraform" and sys.argv[1:] == ["output", "-no-color", "-json"]:
        if os.environ.get("FAKE_TF_FAIL"):
            print("Error: Failed to load state: AccessDenied", file=sys.stderr)
            sys.exit(1)
        print(os.environ["FAKE_OUTPUTS"])  # every output, as `terraform output -json` prints them
    elif name == "terraform" and sys.argv[1:2] == ["output"]:
        print(json.dumps(json.loads(os.environ["FAKE_OUTPUTS"])["ansible_inventory"]["value"]))
    elif name == "gcloud":
        print(os.environ["FAKE_GCLOUD"])
    elif name == "az":
        print(os.environ["FAKE_AZ"])
    elif name == "aws":
        if os.environ.get("FAKE_AWS_FAIL"):
            print("An error occurred (UnauthorizedOperation) when calling the DescribeInstances operation: "
                  "You are not authorized to perform this operation.", file=sys.stderr)
            sys.exit(254)
        print(os.environ["FAKE_AWS"])
    elif name == "ansible-playbook":
        with open("inventory.yml") as inv, open(os.environ["FAKE_LOG"], "a") as log:
            log.write(json.dumps(["joining", *(yaml.safe_load(inv)["all"].get("vars") or {{}}).get(
                "slurm_joining_nodes", [])]) + "\\n")
        if ("health.yml" in sys.argv or sys.argv[-2:] == ["--tags", "health"]) and os.environ.get("FAKE_HEALTH_FAIL"):
            print("fatal: [%s]: FAILED! => 1 of 8 GPUs" % os.environ["FAKE_HEALTH_FAIL"])
            sys.exit(2)
    elif name == "ansible" and "sbatch --parsable" in key:
        print("node-0 | CHANGED | rc=0 >>\\n4242")
    elif name == "ansible" and "scontrol show job" in key:
        print("node-0 | CHANGED | rc=0 >>\\nJobId=4242 JobName=x JobState=%s Restarts=1" % os.environ["FAKE_JOB_STATE"])
    """)


def _states(*states: str) -> str:
    """describe-instances --query 'Reservations[].Instances[].[InstanceId,State.Name]' --output json."""
    return json.dumps([[i, s] for i, s in zip(IDS, states) if s is not None])


def _cluster(tmp_path: Path, cloud: str = "aws") -> dict:
    """A bundle `up` brought up once (every node running), its fakes and their call log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("terraform", "ansible", "ansible-playbook", "aws", "gcloud", "az"):
        (bin_dir / name).write_text(FAKE.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    root = tmp_path / "infra"
    bundle.write_bundle(root, bundle.build_bundle(sample_plan(cloud, nodes=2), standin_renderers()), force=True)
    if cloud in ("gcp", "azure"):  # the variables the bundle asks for first (Azure: who may reach the head)
        given = {**REQUIRED_INPUTS[cloud], **({"bastion_cidr": "203.0.113.7/32"} if cloud == "azure" else {})}
        (root / "terraform" / "terraform.tfvars").write_text("".join(f'{k} = "{v}"\n' for k, v in given.items()))
    recorded = json.loads((DATA / f"{cloud}-2.json").read_text())
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", FAKE_LOG=str(tmp_path / "calls.jsonl"),
               FAKE_OUTPUTS=json.dumps(recorded), FAKE_AWS=_states("running", "running"), FAKE_JOB_STATE="RUNNING",
               FAKE_GCLOUD=json.dumps([{"name": n, "status": "RUNNING"} for n in recorded["node_names"]["value"]]),
               FAKE_AZ=json.dumps([[i, "Succeeded"] for i in recorded["instance_ids"]["value"]]))
    first = _up(root, env)
    assert first.returncode == 0, first.stderr
    (tmp_path / "calls.jsonl").unlink()
    return {"root": root, "env": env, "log": tmp_path / "calls.jsonl", "bin": bin_dir}


@pytest.fixture
def cluster(tmp_path: Path) -> dict:
    return _cluster(tmp_path)


def _up(root: Path, env: dict, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", "up", str(root)], capture_output=True, text=True,
                          env={**env, **extra}, timeout=60)


def _calls(cluster: dict) -> list[str]:
    log = cluster["log"]
    calls = [" ".join(json.loads(line)) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def _replaced(root: Path) -> dict:
    return json.loads((root / "terraform" / REPLACED_VARS).read_text())


LOOK = ["terraform output -no-color -json",
        "aws ec2 describe-instances --region us-east-1 --filters Name=instance-id,Values=" + ",".join(IDS)
        + " --query Reservations[].Instances[].[InstanceId,State.Name] --output json"]


def test_every_node_running_runs_nothing_but_the_look(cluster):
    result = _up(cluster["root"], cluster["env"])
    assert result.returncode == 0, result.stderr
    assert _calls(cluster) == LOOK
    assert not (cluster["root"] / "terraform" / REPLACED_VARS).exists()


@pytest.mark.parametrize("job_state", ["PENDING", "REQUEUED", "RUNNING"])
def test_a_reclaimed_worker_is_replaced_under_its_name_and_the_job_kept(cluster, job_state):
    root = cluster["root"]
    result = _up(root, cluster["env"], FAKE_AWS=_states("running", "terminated"), FAKE_JOB_STATE=job_state)
    assert result.returncode == 0, result.stderr
    assert f"lost 1 node(s) the cloud no longer runs: {NAMES[1]}" in result.stdout
    assert _replaced(root) == {"replaced_nodes": {"names": [NAMES[1]], "node_count": 2,
                                                  "purchase_option": "on-demand"}}
    calls = _calls(cluster)
    assert calls[:2] == LOOK
    # terraform init stays done; from plan on everything runs again, on every node (slurm.conf
    # everywhere takes the new address), and the earlier job is asked about, not submitted again
    assert [c.split()[0] + " " + c.split()[1] for c in calls[2:5]] == ["terraform plan", "terraform apply",
                                                                       "terraform output"]
    assert not any(c.startswith("terraform init") for c in calls)
    assert any("site.yml --skip-tags health" in c and "--limit" not in c for c in calls)
    assert sum("scontrol show job --oneliner 4242" in c for c in calls) == 1
    assert not any("sbatch" in c for c in calls)
    assert f"job 4242 of an earlier run is {job_state}; not submitted again" in result.stdout
    state = json.loads((root / bundle.UP_STATE_NAME).read_text())
    assert state["job"]["id"] == "4242" and state["completed"][-1] == "submit"


def test_node_zero_then_a_worker_lost_later_both_stay_listed(cluster):
    root = cluster["root"]
    assert _up(root, cluster["env"], FAKE_AWS=_states("terminated", "running")).returncode == 0
    assert _replaced(root)["replaced_nodes"]["names"] == [NAMES[0]]
    # EC2 lists a terminated instance for about an hour: one it no longer lists is lost too
    again = _up(root, cluster["env"], FAKE_AWS=_states("running", None))
    assert again.returncode == 0, again.stderr
    assert _replaced(root)["replaced_nodes"]["names"] == NAMES


def test_names_replaced_under_another_fleet_request_are_dropped(cluster):
    root = cluster["root"]
    (root / "terraform" / REPLACED_VARS).write_text(json.dumps(
        {"replaced_nodes": {"names": [NAMES[0]], "node_count": 4, "purchase_option": "on-demand"}}))
    assert _up(root, cluster["env"], FAKE_AWS=_states("running", "shutting-down")).returncode == 0
    assert _replaced(root)["replaced_nodes"] == {"names": [NAMES[1]], "node_count": 2, "purchase_option": "on-demand"}


def test_stopped_and_pending_nodes_are_not_lost(cluster):
    result = _up(cluster["root"], cluster["env"], FAKE_AWS=_states("stopped", "pending"))
    assert result.returncode == 0 and _calls(cluster) == LOOK
    assert not (cluster["root"] / "terraform" / REPLACED_VARS).exists()


@pytest.mark.parametrize("how, why", [
    ("no-cli", "aws is not on PATH"),
    ("denied", "(UnauthorizedOperation)"),
    ("garbage", "answered no [[id, state], ...] list"),
])
def test_a_cloud_that_cannot_be_asked_is_a_note_and_nothing_is_replaced(cluster, how, why):
    env = dict(cluster["env"])
    if how == "no-cli":
        (cluster["bin"] / "aws").unlink()
    result = _up(cluster["root"], env, **({"FAKE_AWS_FAIL": "1"} if how == "denied" else {}),
                 **({"FAKE_AWS": "<html>"} if how == "garbage" else {}))
    assert result.returncode == 0, result.stderr
    note = next(line for line in result.stdout.splitlines() if line.startswith("note: could not ask AWS"))
    assert why in note
    assert not (cluster["root"] / "terraform" / REPLACED_VARS).exists()
    assert not any(c.startswith(("terraform plan", "ansible")) for c in _calls(cluster))


def test_no_terraform_here_is_a_note_and_the_later_steps_still_run(cluster):
    """A cluster whose Terraform steps are done, `up` run where no terraform is installed (the
    staging steps need none): the look for lost nodes is a note, not the end of `up`."""
    (cluster["bin"] / "terraform").unlink()
    result = _up(cluster["root"], cluster["env"], FAKE_AWS=_states("running", "terminated"))
    assert "terraform not found on PATH" not in result.stderr
    assert any(line.startswith("note: nodes the cloud lost are not looked for") for line in result.stdout.splitlines())
    assert not (cluster["root"] / "terraform" / REPLACED_VARS).exists()
    assert not any(c.startswith("aws") for c in _calls(cluster))


def test_a_bundle_never_applied_asks_nothing(tmp_path: Path, cluster):
    fresh = tmp_path / "fresh"
    bundle.write_bundle(fresh, bundle.build_bundle(sample_plan("aws", nodes=2), standin_renderers()), force=True)
    assert _up(fresh, cluster["env"]).returncode == 0
    assert not any(c.startswith("aws") for c in _calls(cluster))


def test_recorded_nodes_reads_terraform_output_shape():
    assert recorded_nodes(json.dumps(RECORDED)) == dict(zip(NAMES, IDS))
    assert recorded_nodes(json.dumps(INVENTORY)) == {}  # an inventory is not the outputs
    assert recorded_nodes("{}") == {} and recorded_nodes("not json") == {}
    mismatched = {**RECORDED, "instance_ids": {"value": IDS[:1]}}
    assert recorded_nodes(json.dumps(mismatched)) == {}


def test_a_preempted_gcp_vm_is_recreated_by_terraform_under_its_name(tmp_path: Path):
    cluster = _cluster(tmp_path, "gcp")
    root = cluster["root"]
    names = json.loads(cluster["env"]["FAKE_OUTPUTS"])["node_names"]["value"]
    # a spot VM is deleted on preemption: gcloud no longer lists it
    result = _up(root, cluster["env"], FAKE_GCLOUD=json.dumps([{"name": names[0], "status": "RUNNING"}]),
                 FAKE_JOB_STATE="REQUEUED")
    assert result.returncode == 0, result.stderr
    assert f"lost 1 node(s) the cloud no longer runs: {names[1]}; replacing each under its name " \
           "(Terraform recreates them)" in result.stdout
    calls = _calls(cluster)
    assert calls[1] == ("gcloud compute instances list --filter=name=(" + " ".join(names) + ") "
                        "--format=json(name,status) --project=my-project --zones=us-central1-a")
    assert calls[2].startswith("terraform plan") and not any("sbatch" in c for c in calls)
    assert not (root / "terraform" / REPLACED_VARS).exists()  # the module needs no list
    again = _up(root, cluster["env"])
    assert again.returncode == 0 and len(_calls(cluster)) == 2  # every VM back: the look only


def test_answer_rules():
    aws, gcp = get_target("aws"), get_target("gcp")
    nodes = dict(zip(NAMES, IDS))
    assert aws.lost_nodes(nodes, _states("running", "terminated")) == [NAMES[1]]
    assert aws.lost_nodes(nodes, "[]") == NAMES  # listed by no one: gone
    gcloud = json.dumps([{"name": NAMES[0], "status": "STOPPED"}, {"name": NAMES[1], "status": "RUNNING"}])
    assert gcp.lost_nodes(nodes, gcloud) == []  # stopped is not gone: Terraform would not recreate it
    for target, answer in ((aws, '{"Reservations": []}'), (aws, '[["i-1"]]'), (gcp, '[{"status": "RUNNING"}]')):
        with pytest.raises(GpuprovError):
            target.lost_nodes(nodes, answer)
    s = {"purchase": "flex-start", "region": "r", "project": "p", "zone": "z"}
    assert gcp.node_states_argv(s, nodes) is None  # a flex-start group replaces its own VMs
    for cloud in ("oci", "onprem"):  # not looked for there yet
        assert not get_target(cloud).replaces_lost_nodes


# ---------------------------------------------------------------- Azure: one VM scale set

AZURE = json.loads((DATA / "azure-2.json").read_text())
AZ_NAMES, AZ_IDS = AZURE["node_names"]["value"], AZURE["instance_ids"]["value"]


def test_an_evicted_azure_vm_comes_back_through_the_scale_set_size_and_the_job_is_kept(tmp_path: Path):
    cluster = _cluster(tmp_path, "azure")
    root = cluster["root"]
    # eviction policy Delete: the evicted VM is no longer listed by the scale set
    result = _up(root, cluster["env"], FAKE_AZ=json.dumps([[AZ_IDS[0], "Succeeded"]]), FAKE_JOB_STATE="REQUEUED")
    assert result.returncode == 0, result.stderr
    assert (f"lost 1 node(s) the cloud no longer runs: {AZ_NAMES[1]}; Terraform restores the node count, each "
            "new node under a new name, then configuring them and resuming the job") in result.stdout
    calls = _calls(cluster)
    group = "gpuprov-llama-3-1-8b-1a2b3c-rg"
    assert calls[1] == ("az vmss list-instances --subscription 00000000-0000-0000-0000-000000000000 "
                        f"--resource-group {group} --name gpuprov-llama-3-1-8b-1a2b3c-vmss "
                        "--query [].[instanceId, provisioningState] --output json")
    assert calls[2].startswith("terraform plan") and any("site.yml --skip-tags health" in c for c in calls)
    assert not any("sbatch" in c for c in calls)
    assert "job 4242 of an earlier run is REQUEUED; not submitted again" in result.stdout
    assert not (root / "terraform" / REPLACED_VARS).exists()  # the scale set's size brings it back
    again = _up(root, cluster["env"])
    assert again.returncode == 0 and len(_calls(cluster)) == 2  # every VM listed: the look only


@pytest.mark.parametrize("rows, lost", [
    ([[AZ_IDS[0], "Succeeded"], [AZ_IDS[1], "Succeeded"]], []),
    ([[AZ_IDS[0], "Succeeded"], [AZ_IDS[1], "Deleting"]], [AZ_NAMES[1]]),  # being deleted: gone
    ([[AZ_IDS[0], "Updating"], [AZ_IDS[1], "Failed"]], []),  # still there: Terraform would add no VM
    ([["7", "Succeeded"]], AZ_NAMES),  # a VM the scale set added later is none of the recorded ones
    ([], AZ_NAMES),
])
def test_azure_answer_rules(rows, lost):
    azure = get_target("azure")
    assert azure.lost_nodes(dict(zip(AZ_NAMES, AZ_IDS)), json.dumps(rows)) == lost


@pytest.mark.parametrize("answer", ["<html>", '{"value": []}', '[["0"]]', "[[0, \"Succeeded\"]]"])
def test_an_azure_answer_that_is_not_the_list_is_refused(answer):
    with pytest.raises(GpuprovError, match="az vmss list-instances answered no"):
        get_target("azure").lost_nodes(dict(zip(AZ_NAMES, AZ_IDS)), answer)


def test_azure_outputs_without_a_scale_set_id_ask_nothing():
    azure, nodes = get_target("azure"), dict(zip(AZ_NAMES, AZ_IDS))
    assert azure.node_states_argv({"outputs": {}}, nodes) is None
    assert azure.node_states_argv({"outputs": {"scale_set_id": "/subscriptions/s/resourceGroups/g"}}, nodes) is None
    assert azure.node_states_argv({"outputs": {"scale_set_id": AZURE["scale_set_id"]["value"]}}, nodes)[:3] == \
        ["az", "vmss", "list-instances"]


def test_no_az_here_is_a_note_and_nothing_is_replaced(tmp_path: Path):
    cluster = _cluster(tmp_path, "azure")
    (cluster["bin"] / "az").unlink()
    result = _up(cluster["root"], cluster["env"])
    assert result.returncode == 0, result.stderr
    note = next(line for line in result.stdout.splitlines() if line.startswith("note: could not ask Azure"))
    assert "az is not on PATH" in note
    assert not any(c.startswith(("terraform plan", "ansible")) for c in _calls(cluster))


def test_the_azure_scale_set_restores_node_count_and_the_outputs_read_it_again(tmp_path: Path):
    """What the next apply does: `instances` is node_count, nothing ignores its drift and no Try &
    Restore is configured, so Terraform plans the size back (the new VM a new instance id); the
    outputs come from the data source, read again at every plan, so the inventory takes the new VM."""
    directory = render_to(tmp_path / "azure", sample_plan("azure", nodes=2))
    mod = load_module(directory)
    vmss = mod["ManagedResources"]["azurerm_linux_virtual_machine_scale_set.nodes"]
    attrs = vmss["Config"]["Attributes"]
    assert source_text(directory, attrs["instances"]["Expr"]) == "var.node_count"
    assert not vmss["Managed"]["IgnoreChanges"] and not vmss["Managed"]["IgnoreAllChanges"]
    assert source_text(directory, attrs["eviction_policy"]["Expr"]) == 'var.purchase_option == "spot" ? "Delete" : null'
    assert "spot_restore" not in {b["Type"] for b in vmss["Config"]["Blocks"]}
    assert "spot_restore" in load_schema("azure")["resource"]["azurerm_linux_virtual_machine_scale_set"]["blocks"]
    for name in ("node_names", "instance_ids"):
        assert source_text(directory, mod["Outputs"][name]["Expr"]).startswith(
            "data.azurerm_virtual_machine_scale_set.nodes.instances[*].")
    assert source_text(directory, mod["Outputs"]["scale_set_id"]["Expr"]) == \
        "azurerm_linux_virtual_machine_scale_set.nodes.id"


# ---------------------------------------------------------------- the AWS module


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    directory = render_to(tmp_path_factory.mktemp("aws") / "aws", sample_plan("aws", nodes=3))
    return directory, load_module(directory)


def test_replacement_is_one_instance_per_listed_name_from_the_nodes_launch_template(module):
    directory, mod = module
    managed, data = mod["ManagedResources"], mod["DataResources"]
    replacement = managed["aws_instance.replacement"]
    assert source_text(directory, replacement["ForEach"]) == "local.replaced"
    body = replacement["Config"]
    template = next(b["Body"] for b in body["Blocks"] if b["Type"] == "launch_template")
    assert source_text(directory, template["Attributes"]["id"]["Expr"]) == "aws_launch_template.node.id"
    assert source_text(directory, body["Attributes"]["tags"]["Expr"]) == "{ Name = each.key }"
    # the fleet's nodes are pinned by name at launch; only those not replaced are read and tagged
    pin = managed["terraform_data.fleet_nodes"]
    assert source_text(directory, pin["TriggersReplacement"][0]) == "aws_ec2_fleet.nodes.id"
    for address in ("aws_ec2_tag.node_name", "data.aws_instance.node"):
        res = managed.get(address) or data[address]
        assert source_text(directory, res["ForEach"]) == "toset(local.fleet_names)"
        assert source_text(directory, res["Config"]["Attributes"][
            "resource_id" if address.startswith("aws_ec2_tag") else "instance_id"]["Expr"]) \
            == "terraform_data.fleet_nodes.output[each.key]"
    # both sources of an address export what the outputs read
    schema = load_schema("aws")
    for kind in ("resource", "data"):
        assert {"id", "private_ip"} <= set(schema[kind]["aws_instance"]["attributes"])
    assert "local.node_addresses[name]" in source_text(directory, mod["Locals"]["nodes"]["Expr"])


@pytest.mark.slow
@pytest.mark.parametrize("listed, node_count, option, replaced", [
    (None, 3, "spot", []),
    ({"names": ["@1"], "node_count": 3, "purchase_option": "spot"}, 3, "spot", ["@1"]),
    ({"names": ["@2", "@0", "someone-else"], "node_count": 3, "purchase_option": "on-demand"}, 3, "on-demand",
     ["@0", "@2"]),
    ({"names": ["@1"], "node_count": 3, "purchase_option": "spot"}, 4, "spot", []),  # a new fleet request
    ({"names": ["@1"], "node_count": 3, "purchase_option": "spot"}, 3, "on-demand", []),
])
def test_terraform_replaces_the_listed_names_of_the_current_fleet_request(module, tmp_path, listed, node_count,
                                                                         option, replaced):
    directory, mod = module
    body = mod["ManagedResources"]["aws_instance.replacement"]["Config"]
    market = next(b for b in body["Blocks"] if b["Type"] == "dynamic" and b["Labels"] == ["instance_market_options"])
    locals_ = {name: source_text(directory, mod["Locals"][name]["Expr"])
               for name in ("node_names", "replaced", "fleet_names", "market_type", "capacity_type")}
    outputs = {"names": "local.node_names", "replaced": "sort(local.replaced)", "fleet": "local.fleet_names",
               "market": source_text(directory, market["Body"]["Attributes"]["for_each"]["Expr"])}
    names = [f"gp-node-{i:02d}" for i in range(node_count)]

    def named(items):
        return [names[int(n[1:])] if n.startswith("@") else n for n in items]

    tfvars = {**REQUIRED_INPUTS["aws"], "name_prefix": "gp", "node_count": node_count, "purchase_option": option}
    if listed:
        tfvars["replaced_nodes"] = {**listed, "names": named(listed["names"])}
    code, values, error = evaluate(tmp_path, directory, outputs, tfvars, locals_=locals_)
    assert code == 0, error
    assert values["names"] == names
    assert values["replaced"] == named(replaced)
    assert values["fleet"] == [n for n in names if n not in values["replaced"]]
    assert values["market"] == (["spot"] if option == "spot" else [])


@pytest.mark.parametrize("cloud, replaced", [("aws", "under its name"), ("gcp", "under its name"),
                                             ("azure", "with a node under a new name (a scale set)")])
def test_the_spot_plan_says_what_happens_to_a_reclaimed_node(cloud, replaced):
    proc = subprocess.run([sys.executable, "-m", "gpuprov", "plan", "--model", "70b", "--cloud", cloud,
                           "--purchase", "spot", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["cluster"]["nodes"] > 1 and plan["purchase"]["preemptible"]
    note = next(n for n in plan["notes"] if "reclaimed node fails the Slurm job" in n)
    assert f"`gpuprov up` replaces it {replaced} and the job resumes" in note
    assert "nothing replaces a reclaimed node" not in note


def test_down_and_a_cluster_gone_forget_the_replaced_nodes(cluster):
    """A new fleet launches every node: a name still listed would get a second, billing instance."""
    root = cluster["root"]
    listed = root / "terraform" / REPLACED_VARS
    assert _up(root, cluster["env"], FAKE_AWS=_states("terminated", "running")).returncode == 0
    assert listed.exists()
    # terraform output unreadable (not what Terraform prints): the list stays
    assert _up(root, cluster["env"], FAKE_OUTPUTS="not json").returncode == 0 and listed.exists()
    # destroyed by hand (terraform destroy): the state records no outputs, and the list goes
    assert _up(root, cluster["env"], FAKE_OUTPUTS="{}").returncode == 0 and not listed.exists()
    listed.write_text(json.dumps(_replaced_example()))
    down = subprocess.run([sys.executable, "-m", "gpuprov", "down", str(root), "--yes"], capture_output=True,
                          text=True, env=cluster["env"], timeout=60)
    assert down.returncode == 0, down.stderr
    assert not listed.exists()
    # nor the inventory of the destroyed nodes: the next cluster's nodes are no replacements joining it
    assert not (root / "ansible" / "inventory.yml").exists()


def _replaced_example() -> dict:
    return {"replaced_nodes": {"names": [NAMES[0]], "node_count": 2, "purchase_option": "on-demand"}}


def test_dry_run_on_an_existing_cluster_says_it_looks_first_and_runs_nothing(cluster):
    result = subprocess.run([sys.executable, "-m", "gpuprov", "up", str(cluster["root"]), "--dry-run"],
                            capture_output=True, text=True, env=cluster["env"], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "note: this cluster exists: `up` first asks aws which recorded nodes still run" in result.stdout
    assert _calls(cluster) == []


def test_terraform_output_failing_is_a_note_and_the_list_stays(cluster):
    root = cluster["root"]
    listed = root / "terraform" / REPLACED_VARS
    listed.write_text(json.dumps(_replaced_example()))
    result = _up(root, cluster["env"], FAKE_TF_FAIL="1")
    assert result.returncode == 0, result.stderr
    assert "note: `terraform output -json` failed (above)" in result.stdout
    assert listed.exists() and not any(c.startswith("aws") for c in _calls(cluster))


# ---------------------------------------------------------------- a replaced node joins drained


def _moved(recorded: dict, index: int, address: str) -> dict:
    """The outputs after Terraform replaced node `index`: its new instance's address in the inventory."""
    moved = json.loads(json.dumps(recorded))
    hosts = moved["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"]
    name = sorted(hosts)[index]
    hosts[name] = {"ansible_host": "i-0feedfacefeedface", "private_ip": address}
    return moved


def test_a_replaced_node_joins_drained_and_a_failed_health_check_keeps_it_so(cluster):
    """The play drains a joining node before its slurmd starts and the health play resumes it only
    when it passed (the role: tests/test_slurm_role.py); `up` lists it while the check has not passed."""
    root, inventory = cluster["root"], cluster["root"] / "ansible" / "inventory.yml"
    after = json.dumps(_moved(RECORDED, 1, "10.60.16.99"))
    failed = _up(root, cluster["env"], FAKE_AWS=_states("running", "terminated"), FAKE_OUTPUTS=after,
                 FAKE_HEALTH_FAIL=NAMES[1], FAKE_JOB_STATE="REQUEUED")
    assert failed.returncode == 1
    assert (f"Node(s) {NAMES[1]} joined the cluster and stay drained in Slurm until they pass (scontrol show node "
            f"{NAMES[1]} gives the reason)") in failed.stderr
    calls = _calls(cluster)
    assert calls.count(f"joining {NAMES[1]}") == 2  # site.yml (drained there) and health.yml
    assert not any("sbatch" in c or "scontrol show job" in c for c in calls)  # stopped before the job step
    assert yaml.safe_load(inventory.read_text())["all"]["vars"]["slurm_joining_nodes"] == [NAMES[1]]
    # the node repaired: `up` goes on from the health step; the node is resumed, the job asked about
    passed = _up(root, cluster["env"], FAKE_OUTPUTS=after, FAKE_JOB_STATE="REQUEUED")
    assert passed.returncode == 0, passed.stderr
    assert f"node(s) {NAMES[1]} passed the health check and take jobs (resumed in Slurm)" in passed.stdout
    assert "job 4242 of an earlier run is REQUEUED; not submitted again" in passed.stdout
    calls = _calls(cluster)
    plays = [c for c in calls if c.startswith(("joining", "ansible-playbook"))]
    assert plays[:2] == ["ansible-playbook -i inventory.yml site.yml --tags health", f"joining {NAMES[1]}"]
    assert "site.yml --skip-tags health" not in " ".join(calls)  # configured in the run before
    assert not any("sbatch" in c for c in calls)
    listed = yaml.safe_load(inventory.read_text())["all"]
    assert "slurm_joining_nodes" not in listed["vars"] and sorted(listed["children"]["gpu_nodes"]["hosts"]) == NAMES
    assert inventory.read_text().startswith("# written by `gpuprov up`")


def test_joining_rules():
    before = {"all": {"vars": {}, "children": {"gpu_nodes": {"hosts": {
        "a": {"ansible_host": "i-1", "private_ip": "10.0.0.1"}, "b": {"ansible_host": "i-2", "private_ip": "10.0.0.2"}}}}}}

    def after(**hosts):
        return {"all": {"vars": {}, "children": {"gpu_nodes": {"hosts": hosts}}}}

    same = after(**before["all"]["children"]["gpu_nodes"]["hosts"])
    assert joining.joining_nodes(None, same) == []  # a first bring-up: nothing runs yet
    assert joining.joining_nodes(before, same) == []
    moved = after(a=before["all"]["children"]["gpu_nodes"]["hosts"]["a"], b={"ansible_host": "i-9", "private_ip": "10.0.0.9"})
    assert joining.joining_nodes(before, moved) == ["b"]  # replaced under its name (AWS, GCP)
    renamed = after(a=before["all"]["children"]["gpu_nodes"]["hosts"]["a"], c={"ansible_host": "x", "private_ip": "10.0.0.3"})
    assert joining.joining_nodes(before, renamed) == ["c"]  # a scale set's new VM (Azure)
    joining.mark(moved, ["b"])
    assert joining.joining_nodes(moved, same) == ["b"]  # not passed yet: still joining
    assert joining.joining_nodes(moved, renamed) == ["c"]  # gone again: no longer listed


def test_a_node_replaced_at_the_same_address_still_joins_drained(cluster):
    """GCP may give a recreated VM its old internal address: the lost name itself marks it joining."""
    root = cluster["root"]
    failed = _up(root, cluster["env"], FAKE_AWS=_states("terminated", "running"), FAKE_HEALTH_FAIL=NAMES[0])
    assert failed.returncode == 1 and f"Node(s) {NAMES[0]} joined the cluster" in failed.stderr
    assert f"joining {NAMES[0]}" in _calls(cluster)
    listed = yaml.safe_load((root / "ansible" / "inventory.yml").read_text())["all"]["vars"]
    assert listed["slurm_joining_nodes"] == [NAMES[0]]
