"""One-shot bring-up of a bundle: terraform init/plan/apply, inventory, ansible site, health check.

Each step is a fixed argument list (printed by --dry-run exactly as run). Terraform runs through
python-terraform's `Terraform.cmd` with positional arguments only: its plan()/apply()/destroy()
helpers add an empty `-var-file` and a `-force` flag that Terraform >= 1.0 rejects, so the
argument lists are built here and checked against what python-terraform will execute.

Progress is recorded in `.gpuprov-up.json` in the bundle after every step, so a re-run resumes
at the step that failed. The state is tied to the lock's hash: a regenerated bundle starts over
(Terraform and Ansible are idempotent, so starting over is safe, only slower).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpuprov.bundle import LOCK_NAME, UP_STATE_NAME
from gpuprov.errors import GpuprovError
from gpuprov.safefile import read_bytes, read_text, write_atomic

TF_PLAN_FILE = "tfplan"
INVENTORY = "inventory.yml"


class StepFailed(GpuprovError):
    """A bring-up step exited non-zero (exit 1: the cluster is not ready, the input was fine)."""

    exit_code = 1


@dataclass
class Step:
    name: str
    title: str
    argv: list[str]
    cwd: Path
    hint: str  # what to do when it fails
    kind: str = "run"  # run | terraform | inventory
    extra: dict = field(default_factory=dict)


def terraform_steps(root: Path) -> list[Step]:
    tf = root / "terraform"
    common = ["-input=false", "-no-color"]
    return [
        Step("terraform-init", "terraform init (providers, backend)", ["terraform", "init", *common], tf,
             "check network access to the provider registry and the backend settings in terraform/", "terraform"),
        Step("terraform-plan", "terraform plan (saved to terraform/tfplan)",
             ["terraform", "plan", *common, f"-out={TF_PLAN_FILE}"], tf,
             "check cloud credentials (aws sts get-caller-identity / gcloud auth list / az account show) "
             "and GPU quota in the region", "terraform"),
        Step("terraform-apply", "terraform apply tfplan (creates the cluster; billing starts)",
             ["terraform", "apply", *common, TF_PLAN_FILE], tf,
             "read the error above: usually GPU capacity or quota; a capacity reservation "
             "(capacity_reservation_id / reservation in the spec) helps", "terraform"),
        Step("inventory", "ansible/inventory.yml from the terraform output",
             ["terraform", "output", "-no-color", "-json", "ansible_inventory"], tf,
             "run `terraform -chdir=terraform output` and check the ansible_inventory output exists", "inventory"),
    ]


# New nodes take minutes to boot and start sshd (or the SSM agent): Ansible starts only when every
# node answers.
NODE_WAIT_S = 900


def ansible_steps(root: Path, ansible_playbook: str = "ansible-playbook") -> list[Step]:
    ansible = root / "ansible"
    # a separate health playbook where the bundle has one, else the health-tagged roles of site.yml
    health = (["health.yml"] if (ansible / "health.yml").is_file() else ["site.yml", "--tags", "health"])
    return [
        Step("wait-nodes", f"wait until every node answers (up to {NODE_WAIT_S // 60} min)",
             ["ansible", "gpu_nodes", "-i", INVENTORY, "-m", "ansible.builtin.wait_for_connection",
              "-a", f"timeout={NODE_WAIT_S}"], ansible,
             "a node did not answer: check it booted (cloud console), the SSM agent / IAP / bastion access "
             "and the key (ansible -i ansible/inventory.yml gpu_nodes -m ping)"),
        Step("ansible-site", "ansible-playbook site.yml (driver, fabric, NCCL, storage)",
             [ansible_playbook, "-i", INVENTORY, "site.yml", "--skip-tags", "health"], ansible,
             "fix the failing task shown above (SSH access: ansible -i ansible/inventory.yml gpu_nodes -m ping)"),
        Step("health", "health check (GPUs, fabric, NCCL all-reduce)",
             [ansible_playbook, "-i", INVENTORY, *health], ansible,
             "a node failed its health check: replace or reboot it (see the failed host above)"),
    ]


def build_steps(root: Path, cloud: str) -> list[Step]:
    steps = [] if cloud == "onprem" else terraform_steps(root)
    return steps + ansible_steps(root)


STAGE_PLAYBOOK = "stage.yml"


def staging_steps(root: Path, plan, ansible_playbook: str = "ansible-playbook") -> list[Step]:
    """Fetch the base weights, put the dataset on the cluster, prepare it (plan.staging; one tag of
    ansible/stage.yml each). A bundle written before stage.yml existed stages nothing."""
    from gpuprov.staging import staging_of

    ansible = root / "ansible"
    if not (ansible / STAGE_PLAYBOOK).is_file():
        return []
    st = staging_of(plan)
    run = [ansible_playbook, "-i", INVENTORY, STAGE_PLAYBOOK, "--tags"]
    steps = []
    if st.weights_dir and st.weights_local:
        steps.append(Step("fetch-weights", f"copy the base weights folder {st.weights_local} (from the bundle) to "
                          f"{st.weights_dir} and check it whole", [*run, "weights"], ansible,
                          "the folder needs config.json and its *.safetensors (save_pretrained writes them); on the "
                          "first node launch/fetch_weights.sh checks the copy", "stage"))
    elif st.weights_dir:
        steps.append(Step("fetch-weights", f"fetch the base weights {st.weights_repo} to {st.weights_dir} (once; "
                          "HF_TOKEN from your environment, passed on stdin)", [*run, "weights"], ansible,
                          "a gated model needs its licence accepted and HF_TOKEN exported; on the first node "
                          "launch/fetch_weights.sh shows the download", "stage"))
    if st.dataset_kind in ("local", "s3", "gs", "az"):
        how = "copy" if st.dataset_kind == "local" else f"download ({st.download_argv[0]} on the node)"
        what = "the prepared dataset" if st.dataset_prepared else "the dataset"
        steps.append(Step("stage-data", f"{how} {what} {st.dataset_source} to {st.dataset_raw}",
                          [*run, "data"], ansible,
                          "check the source exists and the nodes may read it (their instance identity)", "stage"))
    if st.data_dir and not st.dataset_prepared:
        steps.append(Step("prepare-data", f"tokenize the dataset into {st.data_dir} (prepare_data.py, "
                          "train.yaml data.path)", [*run, "prepare"], ansible,
                          "on the first node, launch/stage_data.sh prepare shows the failing record", "stage"))
    return steps


def local_dataset_problem(plan, root: Path | None = None) -> str | None:
    """Why a local dataset or base folder `up` copies is not there to copy (None: they are, or nothing
    is copied). A relative base folder is the bundle's (`root`), as plan.json's model path."""
    from gpuprov.staging import staging_of

    st = staging_of(plan)
    if st.weights_local and root is not None:
        folder = Path(st.weights_local) if Path(st.weights_local).is_absolute() else root / st.weights_local
        if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
            return (f"the base weights folder {st.weights_local} (from the bundle) has no config.json and "
                    "*.safetensors on this machine: `up` copies it to the cluster from there")
    if st.dataset_kind != "local" or not st.dataset_source:
        return None
    path = Path(st.dataset_source)
    if not path.is_file() and not path.is_dir():
        return f"the dataset {st.dataset_source} is not on this machine: `up` copies it to the cluster from there"
    return None


def job_steps(root: Path, plan) -> list[Step]:
    """The last step: submit the training job (gpuprov/job.py decides how; none: started by hand)."""
    from gpuprov import job

    argv = job.submit_argv(plan)
    if argv is None:
        return []
    title = ("submit the training job (sbatch slurm.sbatch on the first node)" if job.job_kind(plan) == "slurm"
             else "start training (launch/train.sh on the node, in the background)")
    return [Step("submit", title, argv, root / "ansible",
                 f"read the error above; the job files are at {job.log_file(plan, None).rsplit('/', 1)[0]} "
                 "and the launch/ copy from site.yml (tag job)", "submit")]


def destroy_step(root: Path) -> Step:
    """`terraform destroy` with the arguments `up` gave plan and apply (no prompt: `down` asks)."""
    return Step("terraform-destroy", "terraform destroy (deletes every resource of the bundle; billing stops)",
                ["terraform", "destroy", "-input=false", "-no-color", "-auto-approve"], root / "terraform",
                "read the error above; a resource created outside Terraform inside the network (an ENI, a "
                "disk) can block deletion: delete it, then re-run `gpuprov down`", "terraform")


def cost_per_hour(plan) -> str:
    """The cluster's running cost as the plan prices it ('' when it has no price)."""
    price = plan.purchase.price_per_hour_usd if plan.purchase.price_per_hour_usd is not None \
        else plan.instance.price_per_hour_usd
    if price is None or plan.cluster.cloud == "onprem":
        return ""
    return (f"running cost: ${price * plan.cluster.nodes:,.2f}/h ({plan.cluster.nodes} x ${price:,.2f}/h, "
            f"{plan.purchase.option}); `gpuprov down` stops it")


def tear_down(root: Path, plan, *, dry_run: bool = False, echo: Callable[[str], None] = print) -> None:
    if plan.cluster.cloud == "onprem":  # the hosts are the owner's: gpuprov/release.py stops what runs there
        raise GpuprovError("internal: an on-prem bundle has nothing to destroy (gpuprov.release)")
    step = destroy_step(root)
    if dry_run:
        echo(f"1. {display(step, root)}")
        return
    echo(f"[1/1] {step.title}")
    echo(f"  $ {display(step, root)}")
    code = run_step(root, step, echo)
    if code != 0:
        raise StepFailed(f"'{step.name}' failed (exit {code}). Next: {step.hint}")
    (root / UP_STATE_NAME).unlink(missing_ok=True)  # a later `up` starts from the first step
    from gpuprov.lost_nodes import forget_replaced

    forget_replaced(root)
    # the inventory described the nodes just destroyed: kept, a new cluster's every node would look
    # like a replacement joining this one (gpuprov/joining.py)
    (root / "ansible" / INVENTORY).unlink(missing_ok=True)
    echo("destroyed: no resource of this bundle is left running")


def training_command(root: Path, plan) -> str:
    """What starts training once the nodes are ready (printed, not run: it is a long job)."""
    launch = root / "launch"
    lines = []
    if (launch / "train.sh").is_file():
        # train.sh reads ../ansible/inventory.yml for the node order, so each node needs the bundle
        lines.append(f"  on every node ({plan.cluster.nodes}), from a copy of this bundle:  launch/train.sh")
    if (launch / "slurm.sbatch").is_file():
        lines.append(f"  or under Slurm:  cd {launch} && sbatch slurm.sbatch")
    return "\n".join(lines) or f"see {launch}/ for the launch scripts"


_JINJA = re.compile(r"\{[{%#]")
_VARIABLE = re.compile(r'^variable\s+"([A-Za-z0-9_-]+)"\s*\{', re.M)


def required_variables(tf: Path) -> list[str]:
    """Terraform variables declared without a default (terraform plan -input=false needs a value)."""
    required = []
    for path in sorted(tf.glob("*.tf")):
        text = read_text(path, what="Terraform file")
        for match in _VARIABLE.finditer(text):
            depth, index = 1, match.end()
            while depth and index < len(text):  # the block's body, braces matched
                depth += {"{": 1, "}": -1}.get(text[index], 0)
                index += 1
            body = text[match.end():index - 1]
            top_level = re.sub(r"\{[^{}]*\}", "", re.sub(r"\{[^{}]*\}", "", body))  # drop nested blocks
            if not re.search(r"^\s*default\s*=", top_level, re.M):
                required.append(match.group(1))
    return required


def missing_variables(tf: Path) -> list[str]:
    """Required variables set neither in terraform.tfvars / *.auto.tfvars(.json) nor as TF_VAR_*."""
    given = ""
    for path in [tf / "terraform.tfvars", tf / "terraform.tfvars.json", *sorted(tf.glob("*.auto.tfvars*"))]:
        if os.path.lexists(path):
            given += read_text(path, what="variables file") + "\n"
    return [name for name in required_variables(tf)
            if f"TF_VAR_{name}" not in os.environ
            and not re.search(rf'^\s*"?{re.escape(name)}"?\s*[=:]', given, re.M)]


def _variables_hint(tf: Path, missing: list[str]) -> str:
    example = tf / "terraform.tfvars.example"
    start = (f"cp {example} {tf / 'terraform.tfvars'} and fill in" if example.is_file()
             else f"write {tf / 'terraform.tfvars'} with")
    return f"{start} {', '.join(missing)} (or export {', '.join('TF_VAR_' + m for m in missing)})"


# ---------------------------------------------------------------- state


def lock_digest(root: Path) -> str:
    return hashlib.sha256(read_bytes(root / LOCK_NAME, what="lock")).hexdigest()


def read_state(root: Path) -> dict:
    path = root / UP_STATE_NAME
    if not os.path.lexists(path):
        return {}
    try:  # a FIFO, device or symlink there is refused (exit 2), never read
        state = json.loads(read_text(path, limit=1 << 20, what="state file"))
    except (ValueError, RecursionError):
        return {}  # a damaged state only costs a full re-run
    return state if isinstance(state, dict) else {}


def write_state(root: Path, state: dict) -> None:
    write_atomic(root / UP_STATE_NAME, json.dumps(state, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------- running


def _terraform(cwd: Path):
    from python_terraform import Terraform

    return Terraform(working_dir=str(cwd), terraform_bin_path=shutil.which("terraform") or "terraform")


def _inherit_streams() -> bool:
    try:
        sys.stdout.fileno()
        sys.stderr.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


def run_terraform(step: Step, echo: Callable[[str], None]) -> tuple[int, str]:
    """Run through python-terraform, positional arguments only (see module docstring)."""
    tf = _terraform(step.cwd)
    subcommand, args = step.argv[1], step.argv[2:]
    built = tf.generate_cmd_string(subcommand, *args)
    if built[1:] != step.argv[1:]:  # python-terraform must run exactly what --dry-run shows
        raise GpuprovError(f"internal: python-terraform would run {built!r}, expected {step.argv!r}")
    capture = step.kind == "inventory" or not _inherit_streams()
    try:
        code, out, err = tf.cmd(subcommand, *args, capture_output=capture)
    except FileNotFoundError:
        raise StepFailed("terraform not found on PATH: install Terraform >= 1.5 "
                         "(https://developer.hashicorp.com/terraform/install)") from None
    if capture and step.kind != "inventory":
        echo((out or "") + (err or ""))
    elif step.kind == "inventory" and code != 0:
        echo(err or "")
    return code, out or ""


def write_inventory(root: Path, output_json: str) -> int:
    """The Terraform output (a map shaped like a YAML inventory) as ansible/inventory.yml."""
    import io

    from ruamel.yaml import YAML

    try:
        inventory = json.loads(output_json)
    except ValueError:
        raise StepFailed("terraform output ansible_inventory is not JSON") from None
    try:
        hosts = inventory["all"]["children"]["gpu_nodes"]["hosts"]
    except (KeyError, TypeError):
        raise StepFailed("terraform output ansible_inventory lacks all.children.gpu_nodes.hosts") from None
    if not isinstance(hosts, dict) or not hosts:
        raise StepFailed("terraform output ansible_inventory lists no hosts")
    from gpuprov import joining

    # replaced nodes (a new name or address) join drained until their health check passes
    joining.mark(inventory, joining.joining_nodes(joining.read_inventory(root / "ansible" / INVENTORY), inventory))
    yaml = YAML(typ="safe", pure=True)
    yaml.default_flow_style = False
    buffer = io.StringIO()
    yaml.dump(inventory, buffer)
    text = buffer.getvalue()
    if _JINJA.search(text):  # Ansible templates inventory values: a marker would run at the first step
        raise StepFailed("terraform output ansible_inventory holds a Jinja marker ({{, {% or {#); refused")
    from gpuprov.reach import inventory_problems

    unreachable = inventory_problems(inventory)
    if unreachable:
        raise StepFailed("terraform output ansible_inventory gives no connection path: " + "; ".join(unreachable[:3])
                         + " (set bastion_cidr, bastion_host or ssh_cidr in terraform/terraform.tfvars and re-run)")
    # a fresh mkstemp file renamed over it: never half-written, never through a planted symlink
    write_atomic(root / "ansible" / INVENTORY,
                 "# written by `gpuprov up` from `terraform output ansible_inventory`\n" + text)
    return len(hosts)


def run_step(root: Path, step: Step, echo: Callable[[str], None]) -> int:
    if step.kind in ("terraform", "inventory"):
        code, out = run_terraform(step, echo)
        if code == 0 and step.kind == "inventory":
            count = write_inventory(root, out)
            echo(f"  ansible/{INVENTORY}: {count} host(s)")
        return code
    tool = shutil.which(step.argv[0]) or shutil.which(step.argv[0], path=os.path.dirname(sys.executable))
    if tool is None:
        raise StepFailed(f"{step.argv[0]} not found on PATH: pip install ansible-core")
    if not (step.cwd / INVENTORY).is_file():
        raise StepFailed(f"{step.cwd / INVENTORY} is missing: re-run `gpuprov up` from the start (--restart)")
    env = dict(os.environ, ANSIBLE_FORCE_COLOR="0")
    if step.kind == "stage":  # JSON results: a failure's message stays on one line to quote
        return _run_stage(tool, step, dict(env, ANSIBLE_CALLBACK_RESULT_FORMAT="json"), echo)
    if step.kind == "submit":  # its output carries the job id
        from gpuprov.job import parse_submission

        proc = subprocess.run([tool, *step.argv[1:]], cwd=step.cwd, env=env, capture_output=True, text=True)
        echo(proc.stdout + proc.stderr)
        step.extra["job_id"] = parse_submission(proc.stdout) if proc.returncode == 0 else None
        return proc.returncode if step.extra["job_id"] or proc.returncode else 1
    return subprocess.run([tool, *step.argv[1:]], cwd=step.cwd, env=env).returncode


# the one line a staging script gives for its failure (the stage_inputs role's fail message)
_STAGE_REASON = re.compile(r"((?:fetch_weights|stage_data|prepare_data\.py): [^\n\"]+)")


def _run_stage(tool: str, step: Step, env: dict, echo: Callable[[str], None]) -> int:
    """ansible-playbook stage.yml, its output shown as it comes and kept for the failure's one line."""
    lines = []
    with subprocess.Popen([tool, *step.argv[1:]], cwd=step.cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout or ():
            lines.append(line)
            echo(line.rstrip("\n"))
    if proc.returncode:
        found = _STAGE_REASON.findall("".join(lines[-200:]))
        if found:
            step.extra["reason"] = found[-1].strip().rstrip("'").strip()
    return proc.returncode


def _connection_problem(root: Path, plan) -> str | None:
    """Why the nodes this bundle creates could not be reached with its Terraform values (None: they can)."""
    from gpuprov.preflight import tfvars
    from gpuprov.reach import connection_problem

    return connection_problem(plan, tfvars(root))


def _recorded_job(state: dict) -> bool:
    job = state.get("job")
    return isinstance(job, dict) and str(job.get("id", "")).isdigit()


def active_job_state(root: Path, plan, job_id: str) -> str | None:
    """The scheduler state of a job an earlier `up` submitted while it still holds or waits for nodes
    (None: it ended, Slurm forgot it, or the first node cannot be asked: a new job is submitted)."""
    from gpuprov import job, job_status

    kind = job.job_kind(plan)
    argv = job.query_argv(plan, job_id)
    tool = shutil.which(argv[0]) or shutil.which(argv[0], path=os.path.dirname(sys.executable))
    if kind is None or tool is None or not (root / "ansible" / INVENTORY).is_file():
        return None
    try:
        proc = subprocess.run([tool, *argv[1:]], cwd=root / "ansible", capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, ANSIBLE_FORCE_COLOR="0"))
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        return None
    state = job_status.job_summary(kind, proc.stdout.split(">>", 1)[-1])["state"]
    return state if state in job.ACTIVE_STATES or (kind == "direct" and state == "RUNNING") else None


def _replaced_lost_nodes(root: Path, plan, echo: Callable[[str], None]) -> bool:
    """On a cluster an earlier run created (its inventory written), whether nodes the cloud no longer
    runs were found and listed for Terraform to replace (gpuprov/lost_nodes.py)."""
    from gpuprov import joining
    from gpuprov.lost_nodes import replace_lost

    lost = replace_lost(root, plan, echo) if _looks_for_lost(root, plan) else []
    joining.expect(root / "ansible" / INVENTORY, lost)  # they join drained, even at the same address
    return bool(lost)


def _looks_for_lost(root: Path, plan) -> bool:
    from gpuprov.lost_nodes import looks_for_lost

    return (root / "ansible" / INVENTORY).is_file() and looks_for_lost(plan)


def _still_drained(root: Path, step: Step) -> str:
    """What a failed health step leaves: nodes that joined stay drained in Slurm ("" when none)."""
    from gpuprov import joining

    names = joining.listed(joining.read_inventory(root / "ansible" / INVENTORY)) if step.name == "health" else []
    if not names:
        return ""
    return (f". Node(s) {', '.join(names)} joined the cluster and stay drained in Slurm until they pass "
            f"(scontrol show node {names[0]} gives the reason); a passing node is resumed by the health step")


def _resumed(root: Path, echo: Callable[[str], None]) -> None:
    from gpuprov import joining

    names = joining.clear(root / "ansible" / INVENTORY)
    if names:
        echo(f"  node(s) {', '.join(names)} passed the health check and take jobs (resumed in Slurm)")


def display(step: Step, root: Path) -> str:
    where = step.cwd.relative_to(root).as_posix() if step.cwd.is_relative_to(root) else str(step.cwd)
    return f"(cd {shlex.quote(where)} && {shlex.join(step.argv)})"


def all_steps(root: Path, plan) -> list[Step]:
    """Every step `up` runs, in order: provision and configure, stage the job's inputs, submit."""
    return build_steps(root, plan.cluster.cloud) + staging_steps(root, plan) + job_steps(root, plan)


def dry_run_report(root: Path, plan) -> dict:
    """`up --dry-run --json`: the steps in order, what must be set first, and the training command."""
    steps = all_steps(root, plan)
    tf = root / "terraform"
    missing = missing_variables(tf) if plan.cluster.cloud != "onprem" and tf.is_dir() else []
    rows = [{"number": n, "name": s.name, "title": s.title, "kind": s.kind,
             "cwd": s.cwd.relative_to(root).as_posix() if s.cwd.is_relative_to(root) else str(s.cwd),
             "argv": list(s.argv), "command": display(s, root),
             "writes": f"ansible/{INVENTORY}" if s.kind == "inventory" else None}
            for n, s in enumerate(steps, start=1)]
    price = plan.purchase.price_per_hour_usd if plan.purchase.price_per_hour_usd is not None \
        else plan.instance.price_per_hour_usd
    submits = bool(steps) and steps[-1].kind == "submit"
    return {"bundle": str(root), "steps": rows, "missing_variables": missing,
            "unreachable": _connection_problem(root, plan),
            "training_command": None if submits else training_command(root, plan),
            "submits_job": submits,
            "running_cost_per_hour_usd": None if price is None or plan.cluster.cloud == "onprem"
            else round(price * plan.cluster.nodes, 2)}


def _print_dry_run(root: Path, plan, steps: list[Step], problems: list, echo: Callable[[str], None]) -> None:
    """`up --dry-run`: what stops `up` first, then every command in order (problems: the missing
    Terraform variables, why the nodes are unreachable, the missing local data)."""
    missing, unreachable, no_data = problems
    tf = root / "terraform"
    if missing:
        echo(f"note: terraform needs values first: {_variables_hint(tf, missing)}")
    if unreachable:
        echo(f"note: `up` stops before terraform plan: {unreachable}")
    if no_data:
        echo(f"note: `up` stops before it starts: {no_data}")
    if _looks_for_lost(root, plan):
        echo(f"note: this cluster exists: `up` first asks {plan.cluster.cloud} which recorded nodes still run "
             "(terraform output -json, then its CLI) and replaces lost ones, from terraform "
             "plan on")
    for number, step in enumerate(steps, start=1):
        suffix = (f"  > ansible/{INVENTORY}" if step.kind == "inventory"
                  else f"  # {step.name}: {step.title}" if step.kind == "stage" else "")
        echo(f"{number}. {display(step, root)}{suffix}")
    if steps[-1].kind == "submit":
        from gpuprov.job import submitted_lines

        echo("then: " + "\n".join(submitted_lines(root, plan, "<job id>")[1:]).strip())
    else:
        echo(f"{len(steps) + 1}. start training:\n{training_command(root, plan)}")
    if cost_per_hour(plan):
        echo(cost_per_hour(plan))


def bring_up(root: Path, plan, *, dry_run: bool = False, restart: bool = False,
             echo: Callable[[str], None] = print) -> None:
    steps = all_steps(root, plan)
    tf = root / "terraform"
    missing = missing_variables(tf) if plan.cluster.cloud != "onprem" and tf.is_dir() else []
    unreachable = _connection_problem(root, plan)
    no_data = local_dataset_problem(plan, root)
    if dry_run:
        _print_dry_run(root, plan, steps, [missing, unreachable, no_data], echo)
        return
    if no_data:  # refused before anything is bought
        raise StepFailed(f"{no_data}; restore it (or regenerate the bundle) and re-run "
                         f"`gpuprov up {shlex.quote(str(root))}`")
    digest = lock_digest(root)
    state = read_state(root)
    if restart or state.get("lock_sha256") != digest:
        if state and not restart:
            echo("bundle changed since the last `gpuprov up`: starting from the first step")
        # the job an earlier run submitted is kept: the submit step asks whether it still runs
        state = {"lock_sha256": digest, "completed": [], **({"job": state["job"]} if _recorded_job(state) else {})}
    done = list(state.get("completed", []))
    if _replaced_lost_nodes(root, plan, echo):  # from terraform plan on again; the job is kept
        done = [name for name in done if name == "terraform-init"]
    total = len(steps)
    for number, step in enumerate(steps, start=1):
        if step.name in done:
            echo(f"[{number}/{total}] {step.title}: done in an earlier run, skipped")
            continue
        if step.name == "terraform-plan" and missing:
            write_state(root, {**state, "completed": done, "failed": step.name})
            raise StepFailed(f"step {number}/{total} '{step.name}' needs Terraform variables: "
                             f"{_variables_hint(tf, missing)}; then re-run `gpuprov up {shlex.quote(str(root))}`")
        if step.name in ("terraform-plan", "terraform-apply") and unreachable:  # nothing bought for unreachable nodes
            write_state(root, {**state, "completed": done, "failed": step.name})
            raise StepFailed(f"step {number}/{total} '{step.name}' refused: {unreachable}; "
                             f"then re-run `gpuprov up {shlex.quote(str(root))}`")
        if step.kind == "submit" and "job" in state:
            active = active_job_state(root, plan, state["job"]["id"])
            if active:
                echo(f"[{number}/{total}] {step.title}: job {state['job']['id']} of an earlier run is {active}; "
                     "not submitted again")
                done.append(step.name)
                write_state(root, {"lock_sha256": digest, "completed": done, "job": state["job"]})
                continue
        echo(f"[{number}/{total}] {step.title}")
        echo(f"  $ {display(step, root)}")
        code = run_step(root, step, echo)
        if code != 0:
            write_state(root, {**state, "completed": done, "failed": step.name})
            why = step.extra.get("reason") or f"failed (exit {code}). Next: {step.hint}{_still_drained(root, step)}"
            raise StepFailed(f"step {number}/{total} '{step.name}' {why}; "
                             f"then re-run `gpuprov up {shlex.quote(str(root))}` to continue from this step")
        done.append(step.name)
        if step.name == "health":
            _resumed(root, echo)
        if step.extra.get("job_id"):
            state["job"] = {"id": step.extra["job_id"], "kind": step.kind}
        write_state(root, {"lock_sha256": digest, "completed": done, **({"job": state["job"]} if "job" in state else {})})
    if "job" in state:
        from gpuprov.job import submitted_lines

        echo("\n".join(submitted_lines(root, plan, state["job"]["id"])))
    else:
        echo(f"cluster ready ({plan.cluster.nodes} node(s), {plan.cluster.total_gpus} GPUs). Start training:")
        echo(training_command(root, plan))
    if cost_per_hour(plan):
        echo(cost_per_hour(plan))
