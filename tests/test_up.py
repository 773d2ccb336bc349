"""`gpuprov up`: exact commands, in order, through fake terraform/ansible-playbook executables
(real subprocesses on PATH that record their argv and working directory), failure and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bundle_fixtures import standin_renderers
from gpuprov import bundle
from gpuprov.bringup import terraform_steps
from plan_fixtures import sample_plan

# AWS's shape: instance ids behind the SSM ProxyCommand (tests/data/terraform_output/ records each cloud's).
INVENTORY = {"all": {"vars": {"ansible_user": "ubuntu", "ansible_port": 22, "ansible_ssh_common_args":
                              '-o ProxyCommand="aws ssm start-session --target %h --document-name AWS-StartSSHSession '
                              '--parameters portNumber=%p --region us-east-1"'},
                     "children": {"gpu_nodes": {"hosts": {
                         "node-0": {"ansible_host": "i-0a1b2c3d4e5f60001", "private_ip": "10.1.0.10"},
                         "node-1": {"ansible_host": "i-0a1b2c3d4e5f60002", "private_ip": "10.1.0.11"}}}}}}

FAKE = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    name = os.path.basename(sys.argv[0])
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps({{"argv": [name] + sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
    key = " ".join([name] + sys.argv[1:])
    fail = os.environ.get("FAKE_FAIL")
    if fail and fail in key:
        print("fake failure: " + key, file=sys.stderr)
        sys.exit(3)
    if name == "terraform" and sys.argv[1:2] == ["output"]:
        print(os.environ.get("FAKE_OUTPUT", "{{}}"))
    if name == "ansible" and "sbatch --parsable" in key:  # Ansible's ad-hoc output of sbatch --parsable
        print("node-0 | CHANGED | rc=0 >>\\n4242")
    if name == "ansible" and "scontrol show job" in key:  # the recorded job, as slurmctld knows it
        state = os.environ.get("FAKE_JOB_STATE")
        print("node-0 | CHANGED | rc=0 >>\\n" + ("JobId=4242 JobName=x JobState=%s Restarts=1" % state if state
                                               else "slurm_load_jobs error: Invalid job id specified"))
    """)

CLOUD_COMMANDS = [
    (["terraform", "init", "-input=false", "-no-color"], "terraform"),
    (["terraform", "plan", "-input=false", "-no-color", "-out=tfplan"], "terraform"),
    (["terraform", "apply", "-input=false", "-no-color", "tfplan"], "terraform"),
    (["terraform", "output", "-no-color", "-json", "ansible_inventory"], "terraform"),
    (["ansible", "gpu_nodes", "-i", "inventory.yml", "-m", "ansible.builtin.wait_for_connection", "-a", "timeout=900"],
     "ansible"),
    (["ansible-playbook", "-i", "inventory.yml", "site.yml", "--skip-tags", "health"], "ansible"),
    (["ansible-playbook", "-i", "inventory.yml", "site.yml", "--tags", "health"], "ansible"),
    # the last step: the training job submitted on the first node (sbatch under Slurm)
    (["ansible", "gpu_nodes[0]", "-i", "inventory.yml", "-m", "ansible.builtin.command", "-a",
      "sbatch --parsable slurm.sbatch chdir=/shared/jobs/gpuprov-tiny-llama-full/launch"], "ansible"),
]


# A later run on a cluster an earlier one created first reads the nodes Terraform recorded, to find
# any the cloud lost (gpuprov/lost_nodes.py, tests/test_lost_nodes.py); the fake's outputs record none.
LOOK = (["terraform", "output", "-no-color", "-json"], "terraform")


@pytest.fixture
def fakes(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("terraform", "ansible", "ansible-playbook"):
        path = bin_dir / name
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", FAKE_LOG=str(log), FAKE_OUTPUT=json.dumps(INVENTORY))
    env.pop("FAKE_FAIL", None)
    return {"env": env, "log": log}


def _bundle(tmp_path: Path, cloud: str = "aws", nodes: int = 2, name: str = "infra") -> Path:
    root = tmp_path / name
    bundle.write_bundle(root, bundle.build_bundle(sample_plan(cloud, nodes=nodes), standin_renderers()), force=True)
    return root


def _up(root: Path, env: dict, *args: str, fail: str | None = None) -> subprocess.CompletedProcess:
    env = dict(env)
    if fail:
        env["FAKE_FAIL"] = fail
    return subprocess.run([sys.executable, "-m", "gpuprov", "up", str(root), *args], capture_output=True,
                          text=True, env=env, timeout=60)


def _calls(log: Path, root: Path) -> list[tuple[list[str], str]]:
    if not log.exists():
        return []
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [(row["argv"], Path(row["cwd"]).relative_to(root.resolve()).as_posix()) for row in rows]


def test_python_terraform_runs_exactly_our_argv(tmp_path: Path) -> None:
    from python_terraform import Terraform

    tf = Terraform(working_dir=str(tmp_path), terraform_bin_path="terraform")
    for step in terraform_steps(tmp_path):
        assert tf.generate_cmd_string(step.argv[1], *step.argv[2:]) == step.argv
    # why not its helpers: plan()/apply() pass an empty variables dict, which becomes a temporary
    # -var-file, and destroy() adds -force (rejected by Terraform >= 1.0)
    defaults = tf.generate_cmd_string("apply", **tf._generate_default_options({}))
    assert any(arg.startswith("-var-file=") for arg in defaults)
    tf.temp_var_files.clean_up()


def test_dry_run_prints_every_command_in_order_and_runs_nothing(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    result = _up(root, fakes["env"], "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stdout.splitlines() if ln[:1].isdigit()]
    expected = [f"{n}. (cd {cwd} && {' '.join(argv)})" for n, (argv, cwd) in enumerate(CLOUD_COMMANDS, 1)]
    expected[3] += "  > ansible/inventory.yml"
    expected = [ln.replace("gpu_nodes[0]", "'gpu_nodes[0]'").replace("-a sbatch --parsable slurm.sbatch chdir=/shared/jobs/gpuprov-tiny-llama-full/launch",
                                                                        "-a 'sbatch --parsable slurm.sbatch chdir=/shared/jobs/gpuprov-tiny-llama-full/launch'")
                for ln in expected]
    assert lines == expected
    assert "watch: gpuprov status" in result.stdout
    price = sample_plan("aws", nodes=2).purchase.price_per_hour_usd
    assert f"running cost: ${2 * price:,.2f}/h (2 x ${price:,.2f}/h, on-demand)" in result.stdout
    assert _calls(fakes["log"], root) == []
    assert not (root / bundle.UP_STATE_NAME).exists()


def test_full_run_exact_commands_inventory_and_training_command(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    result = _up(root, fakes["env"])
    assert result.returncode == 0, result.stderr + result.stdout
    assert _calls(fakes["log"], root) == [(argv, cwd) for argv, cwd in CLOUD_COMMANDS]
    from ruamel.yaml import YAML

    assert YAML(typ="safe").load((root / "ansible" / "inventory.yml").read_text()) == INVENTORY
    assert "[7/8] health check" in result.stdout and "training submitted: Slurm job 4242" in result.stdout
    assert f"gpuprov status {root}" in result.stdout
    state = json.loads((root / bundle.UP_STATE_NAME).read_text())
    assert state["completed"] == ["terraform-init", "terraform-plan", "terraform-apply", "inventory",
                                  "wait-nodes", "ansible-site", "health", "submit"]
    assert state["job"]["id"] == "4242"
    # the state file and the written inventory are not drift
    assert bundle.compare_bundle(root, bundle.build_bundle(sample_plan("aws", nodes=2), standin_renderers())) == []


def test_failure_stops_with_advice_and_rerun_resumes(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    failed = _up(root, fakes["env"], fail="terraform apply")
    assert failed.returncode == 1
    assert "Traceback" not in failed.stderr
    assert "step 3/8 'terraform-apply' failed (exit 3)" in failed.stderr
    assert "quota" in failed.stderr and "re-run `gpuprov up" in failed.stderr
    assert [argv[1] for argv, _ in _calls(fakes["log"], root)] == ["init", "plan", "apply"]
    fakes["log"].unlink()
    resumed = _up(root, fakes["env"])
    assert resumed.returncode == 0, resumed.stderr
    assert "terraform init (providers, backend): done in an earlier run, skipped" in resumed.stdout
    assert _calls(fakes["log"], root) == [(argv, cwd) for argv, cwd in CLOUD_COMMANDS[2:]]
    fakes["log"].unlink()
    again = _up(root, fakes["env"])  # everything done: nothing runs but the look for lost nodes
    assert again.returncode == 0 and _calls(fakes["log"], root) == [LOOK]
    fakes["log"].unlink()
    restarted = _up(root, fakes["env"], "--restart")
    # the recorded job is asked for first; Slurm no longer knows it: a new one is submitted
    calls = [argv for argv, _ in _calls(fakes["log"], root)]
    assert restarted.returncode == 0 and len(calls) == 10 and calls[0] == LOOK[0]
    assert "scontrol show job --oneliner 4242" in calls[8][-1] and "sbatch" in calls[9][-1]


@pytest.mark.parametrize("job_state, submits", [("RUNNING", 0), ("PENDING", 0), ("REQUEUED", 0),
                                                 ("COMPLETED", 1), ("FAILED", 1), (None, 1)])
def test_restart_submits_no_second_job_while_the_first_runs(tmp_path: Path, fakes: dict, job_state, submits) -> None:
    root = _bundle(tmp_path)
    assert _up(root, fakes["env"]).returncode == 0
    fakes["log"].unlink()
    env = dict(fakes["env"], **({"FAKE_JOB_STATE": job_state} if job_state else {}))
    again = _up(root, env, "--restart")
    assert again.returncode == 0, again.stderr
    calls = [" ".join(argv) for argv, _ in _calls(fakes["log"], root)]
    assert sum("sbatch --parsable" in c for c in calls) == submits
    assert sum("scontrol show job --oneliner 4242" in c for c in calls) == 1
    state = json.loads((root / bundle.UP_STATE_NAME).read_text())
    assert state["job"]["id"] == "4242" and "submit" in state["completed"]
    if not submits:
        assert f"job 4242 of an earlier run is {job_state}; not submitted again" in again.stdout
    # a later run with everything done asks nothing of the job and submits nothing
    fakes["log"].unlink()
    assert _up(root, env).returncode == 0 and _calls(fakes["log"], root) == [LOOK]


def test_health_failure_exit_1(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    result = _up(root, fakes["env"], fail="--tags health")
    assert result.returncode == 1
    assert "'health' failed" in result.stderr and "replace or reboot" in result.stderr


def test_bad_inventory_output_is_a_clear_failure(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    env = dict(fakes["env"], FAKE_OUTPUT='{"all": {}}')
    result = _up(root, env)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "all.children.gpu_nodes.hosts" in result.stderr
    assert not (root / "ansible" / "inventory.yml").exists()


def test_regenerated_bundle_starts_over(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    assert _up(root, fakes["env"], fail="ansible-playbook").returncode == 1
    _bundle(tmp_path, nodes=3)  # new lock
    fakes["log"].unlink()
    result = _up(root, fakes["env"])
    assert result.returncode == 0, result.stderr
    assert "starting from the first step" in result.stdout
    calls = _calls(fakes["log"], root)
    assert calls[0] == LOOK and len(calls) == 9


def test_onprem_skips_terraform(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path, cloud="onprem")
    dry = _up(root, fakes["env"], "--dry-run")
    assert "(cd terraform" not in dry.stdout and "sbatch --parsable" in dry.stdout
    result = _up(root, fakes["env"])
    assert result.returncode == 0, result.stderr
    assert _calls(fakes["log"], root) == [(argv, cwd) for argv, cwd in CLOUD_COMMANDS[4:]]


def test_missing_terraform_is_a_clear_error(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    (tmp_path / "bin" / "terraform").unlink()
    result = _up(root, fakes["env"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "terraform not found" in result.stderr


def test_not_a_bundle(tmp_path: Path, fakes: dict) -> None:
    result = _up(tmp_path, fakes["env"])
    assert result.returncode == 2 and "not a gpuprov bundle" in result.stderr


def test_required_terraform_variables_are_asked_for_before_plan(tmp_path: Path, fakes: dict) -> None:
    from gpuprov.bringup import required_variables

    renderers = standin_renderers()
    renderers[0] = ("terraform", lambda plan: {
        "main.tf": 'output "ansible_inventory" {\n  value = {}\n}\n',
        "variables.tf": 'variable "subnet_id" {\n  type = string\n  validation {\n    condition = true\n'
                        '    error_message = "x"\n  }\n}\n\nvariable "region" {\n  type    = string\n'
                        '  default = "us-east-1"\n}\n',
        "terraform.tfvars.example": 'subnet_id = "subnet-0"\n'})
    root = tmp_path / "infra"
    bundle.write_bundle(root, bundle.build_bundle(sample_plan("aws"), renderers))
    assert required_variables(root / "terraform") == ["subnet_id"]
    dry = _up(root, fakes["env"], "--dry-run")
    assert "note: terraform needs values first" in dry.stdout and "subnet_id" in dry.stdout
    result = _up(root, fakes["env"])
    assert result.returncode == 1 and "terraform.tfvars.example" in result.stderr
    assert [argv[1] for argv, _ in _calls(fakes["log"], root)] == ["init"]  # stopped before plan
    (root / "terraform" / "terraform.tfvars").write_text('subnet_id = "subnet-123"\n')
    fakes["log"].unlink()
    resumed = _up(root, fakes["env"])
    assert resumed.returncode == 0, resumed.stderr
    assert [argv[1] for argv, _ in _calls(fakes["log"], root)][:1] == ["plan"]
    # terraform.tfvars is the user's: a regeneration keeps it and check does not call it drift
    bundle.write_bundle(root, bundle.build_bundle(sample_plan("aws"), renderers))
    assert (root / "terraform" / "terraform.tfvars").is_file()
    env = dict(fakes["env"], TF_VAR_subnet_id="subnet-9")
    (root / "terraform" / "terraform.tfvars").unlink()
    dry = _up(root, env, "--dry-run").stdout
    # the only note left: the cluster an earlier run created is looked at for lost nodes first
    assert [line for line in dry.splitlines() if line.startswith("note:")] == [
        "note: this cluster exists: `up` first asks aws which recorded nodes still run (terraform output -json, "
        "then its CLI) and replaces lost ones, from terraform plan on"]


def test_hand_edits_are_noted_before_bring_up(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    (root / "ansible" / "site.yml").write_text((root / "ansible" / "site.yml").read_text() + "# mine\n")
    result = _up(root, fakes["env"], "--dry-run")
    assert result.returncode == 0 and "1 file(s) changed since `gpuprov generate` (ansible/site.yml)" in result.stderr


DESTROY = (["terraform", "destroy", "-input=false", "-no-color", "-auto-approve"], "terraform")


def _down(root: Path, env: dict, *args: str, fail: str | None = None) -> subprocess.CompletedProcess:
    env = dict(env, **({"FAKE_FAIL": fail} if fail else {}))
    return subprocess.run([sys.executable, "-m", "gpuprov", "down", str(root), *args], capture_output=True,
                          text=True, env=env, timeout=60, input="")


def test_down_dry_run_prints_the_destroy_and_runs_nothing(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    result = _down(root, fakes["env"], "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"1. (cd terraform && {' '.join(DESTROY[0])})"]
    assert _calls(fakes["log"], root) == []


def test_down_destroys_with_ups_arguments_and_resets_progress(tmp_path: Path, fakes: dict) -> None:
    from python_terraform import Terraform

    from gpuprov.bringup import destroy_step

    root = _bundle(tmp_path)
    assert _up(root, fakes["env"]).returncode == 0
    fakes["log"].unlink()
    refused = _down(root, fakes["env"])  # no --yes and no terminal to ask: one line, nothing destroyed
    assert refused.returncode == 2 and "--yes" in refused.stderr and _calls(fakes["log"], root) == []
    assert len(refused.stderr.strip().splitlines()) == 1
    result = _down(root, fakes["env"], "--yes")
    assert result.returncode == 0, result.stderr
    assert _calls(fakes["log"], root) == [DESTROY]
    assert not (root / bundle.UP_STATE_NAME).exists()
    # the flags up gives plan and apply, and nothing python-terraform would add
    step = destroy_step(root)
    assert step.argv[2:4] == CLOUD_COMMANDS[1][0][2:4]
    assert Terraform(working_dir=str(root)).generate_cmd_string("destroy", *step.argv[2:]) == step.argv


def test_down_failure_is_exit_1_with_advice(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path)
    result = _down(root, fakes["env"], "--yes", fail="terraform destroy")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "'terraform-destroy' failed (exit 3)" in result.stderr


def _release_calls(job_id: str | None) -> list[tuple[list[str], str]]:
    from gpuprov.job import cancel_command
    from gpuprov.release import STOP_SLURM

    cancel = [(["ansible", "gpu_nodes[0]", "-i", "inventory.yml", "-m", "ansible.builtin.shell", "-a",
                cancel_command("slurm", job_id)], "ansible")] if job_id else []
    return cancel + [(["ansible", "gpu_nodes", "-i", "inventory.yml", "--become", "-m", "ansible.builtin.shell", "-a",
                       STOP_SLURM], "ansible")]


def test_down_on_prem_stops_the_job_and_the_bundles_slurm_and_keeps_the_hosts(tmp_path: Path, fakes: dict) -> None:
    """The hosts are the owner's: nothing is destroyed, but the job `up` submitted is cancelled and the
    Slurm daemons the bundle enabled are stopped and disabled (before, `down` said "nothing to destroy"
    and left the job on the GPUs)."""
    root = _bundle(tmp_path, cloud="onprem")
    assert _up(root, fakes["env"]).returncode == 0
    fakes["log"].unlink()
    refused = _down(root, fakes["env"])  # no --yes and no terminal to ask: one line, nothing stopped
    assert refused.returncode == 2 and "--yes" in refused.stderr and _calls(fakes["log"], root) == []
    dry = _down(root, fakes["env"], "--dry-run")
    assert dry.returncode == 0 and len(dry.stdout.splitlines()) == 2 and _calls(fakes["log"], root) == []
    result = _down(root, fakes["env"], "--yes")
    assert result.returncode == 0, result.stderr
    assert _calls(fakes["log"], root) == _release_calls("4242")
    assert not (root / bundle.UP_STATE_NAME).exists() and (root / "ansible" / "inventory.yml").is_file()
    again = _down(root, fakes["env"], "--yes")  # no job recorded any more: the daemons only
    assert again.returncode == 0 and _calls(fakes["log"], root)[2:] == _release_calls(None)


def test_down_on_prem_failure_is_exit_1_and_keeps_the_job_record(tmp_path: Path, fakes: dict) -> None:
    root = _bundle(tmp_path, cloud="onprem")
    assert _up(root, fakes["env"]).returncode == 0
    result = _down(root, fakes["env"], "--yes", fail="scancel")
    assert result.returncode == 1 and "Traceback" not in result.stderr and "'cancel-job' failed" in result.stderr
    assert json.loads((root / bundle.UP_STATE_NAME).read_text())["job"]["id"] == "4242"


def test_rerun_hint_quotes_the_bundle_path(tmp_path: Path, fakes: dict) -> None:
    """The hint is pasted into a shell: a bundle folder with a space or `;` stays one word."""
    import shlex

    root = _bundle(tmp_path, name="my infra;x")
    failed = _up(root, fakes["env"], fail="terraform apply")
    assert failed.returncode == 1
    assert f"re-run `gpuprov up {shlex.quote(str(root))}` to continue" in failed.stderr


def test_down_asks_on_a_terminal_and_no_destroys_nothing(tmp_path: Path, fakes: dict) -> None:
    """Answered "n" at the prompt: exit 1, "nothing destroyed" (it was exit 130, as for Ctrl-C)."""
    import os

    root = _bundle(tmp_path)
    master, slave = os.openpty()
    os.write(master, b"n\n")
    try:
        result = subprocess.run([sys.executable, "-m", "gpuprov", "down", str(root)], stdin=slave,
                                capture_output=True, text=True, env=fakes["env"], timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert result.returncode == 1, result.stderr
    assert "Destroy every resource" in result.stdout and "nothing destroyed" in result.stderr
    assert _calls(fakes["log"], root) == []
