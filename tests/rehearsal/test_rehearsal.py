"""The rehearsal: `gpuprov up` on a bundle `gpuprov generate` wrote, against stand-in nodes.

GPUPROV_REHEARSAL picks the bundles (cluster.selection): ci (the default, CI's third pass) brings up
the default cloud's from-scratch bundle and brings it down; all adds the others described below.

Exactly these differ from a real bring-up, and nothing else:
- Terraform: `terraform` on PATH is tests/rehearsal/bin/terraform; apply creates nothing and
  `output -json` returns the recorded output of the cloud (fixtures/<cloud>.json, its source inside);
- Ansible's transport: the inventory's own ProxyCommand runs tests/rehearsal/bin/aws (SSM's part) or,
  for GCP, tests/rehearsal/bin/gcloud (IAP's part), which carries the SSH stream to the stand-in node
  recorded under that instance id or VM name;
- the operator's SSH key and known_hosts (ANSIBLE_PRIVATE_KEY_FILE, ANSIBLE_SSH_EXTRA_ARGS);
- the roles a stand-in cannot run are skipped by tag (SKIPPED_TAGS, each with its reason).
The inventory, hostvars, group_vars, roles and launch files stay as generate and `up` wrote them
(the test compares them with the lock and the recorded output).

The nodes: two qemu guests with the instance's vCPUs and memory (systemd, cgroup v2, munge, Debian 12's
Slurm 22.05) with the recorded private addresses on a segment of their own, the image's OS release,
the instance's GPUs and nvidia-smi as the roles look at them (standin_image.sh), /shared from the host
over virtio-9p (FSx's stand-in). The first bundle is a 2-layer Llama from scratch on 2 x g5.xlarge
(fixtures/aws-g5.json); its job runs the CPU trainer (gloo) to the first checkpoint, which
`gpuprov status` reads. The other is a LoRA fine-tune of a Hugging Face model folder on a chat JSONL
(fixtures/aws-g5.json "fine_tune"), planned on the same 2 x g5.xlarge: `up` copies the base and the
dataset to the cluster, prepares the data there, and the job trains and exports a peft adapter,
loaded here with peft. Both bundles are brought up on the same booted guests (booting costs
minutes), the fine-tune first: the next deployment's instances are the previous one's, with what its
own new filesystem would not hold removed (the previous deployment's slurmctld state, which names
its cluster); the bundles are brought down at the end, the last first.

The lost node (after the on-prem bundle, on the same guests): the from-scratch bundle with a longer
run checkpointing every 25 steps (fixtures/aws-g5.json "lost_node") is brought up; after its first
checkpoint and the next logged loss node 1's guest is killed (no shutdown: a reclaimed spot instance);
once Slurm has requeued the job, `gpuprov up` runs again: it asks the stand-in aws which recorded instances run, lists node
1 in replaced_nodes.auto.tfvars.json, the stand-in terraform's apply has a guest booted under the
recorded replacement's id, address and hostname (tests/data/terraform_output/aws-g5-2-replaced.json),
the play configures it, the job is not submitted again and resumes from its checkpoint.

The on-prem bundle (`--cloud onprem --hosts HOSTS`) is brought up on the same guests after the AWS
ones, as the site's own servers: the hosts file names each by its hostname and its address on the
private segment and declares the GPU the stand-in presents, the spec names the site's NFS export.
What differs from a real site: no Terraform runs (none is rendered); the operator's ssh reaches an
address through a ProxyCommand given in ANSIBLE_SSH_EXTRA_ARGS (tests/rehearsal/bin/site-ssh-proxy,
the site network's part) with the operator's key and known_hosts; the same tags are skipped, so the
NFS export is not mounted by the role (the stand-in's /shared is the host folder over virtio-9p, as
for FSx). The hosts' /etc/hosts is the installer's (the host's own name at 127.0.1.1). Its `down`
runs there too: the hosts stay, the job and the bundle's Slurm daemons stop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import yaml

from rehearsal import cluster

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.rehearsal]

_reason = cluster.why_not_runnable()
if _reason:
    warnings.warn(f"REHEARSAL SKIPPED: {_reason}", stacklevel=1)
    pytest.skip(f"REHEARSAL SKIPPED (no bring-up rehearsed): {_reason}", allow_module_level=True)

# Tags of site.yml/health.yml a stand-in cannot run, and why. Everything else runs as generated.
SKIPPED_TAGS = {
    "storage": "local NVMe RAID0 needs the instance's 8 instance-store drives; FSx for Lustre needs the "
               "Lustre client and an FSx server (the stand-in mounts /shared itself)",
    "gpu": "the NVIDIA driver, fabric manager and DCGM need the GPUs (tests/test_vm_gpu_roles.py runs them "
           "against stand-in packages)",
    "fabric": "EFA needs the EFA devices", "nccl": "NCCL's packages come from NVIDIA's repository",
    "gds": "GPUDirect Storage needs the GPUs", "train": "the training venv comes from PyPI (the stand-in "
           "shares the host's venv)",
    "hardware": "the node health check's GPU, DCGM, NCCL bus-bandwidth, fabric and RAID checks need the hardware "
                "(health.yml's Slurm check runs: every node answers slurmctld, a joining node is resumed)",
}
# The bundles beyond the default cloud's from-scratch one run when GPUPROV_REHEARSAL=all (README).
beyond_ci = pytest.mark.skipif(cluster.selection() != "all", reason=(
    "REHEARSAL SKIPPED for this bundle: CI rehearses the default cloud's from-scratch bundle only; "
    "GPUPROV_REHEARSAL=all adds it (about 20 minutes a bundle)"))
UP_TIMEOUT = 1500
TRAIN_TIMEOUT = 1200
SHARED = Path("/shared")  # the bundle's shared_storage mount point (the recorded output's)


def _ssh_root(node: cluster.Node, command: str, **kw) -> str:
    return node.ssh(command, **kw).stdout


def _booted(tmp_path_factory, name: str):
    """The stand-in nodes of recorded fixture `name`, booted; powered off after the module."""
    work = tmp_path_factory.mktemp(f"rehearsal-{name}")
    shared = work / "shared"
    shared.mkdir()
    cloud = cluster.Cloud(work, cluster.fixture(name), shared,
                          {"pybase": Path(sys.base_prefix).resolve(), "venv": Path(sys.prefix).resolve()})
    began = time.monotonic()
    try:
        cloud.launch_all()
        print(f"rehearsal: {len(cloud.nodes)} stand-in nodes booted in {time.monotonic() - began:.0f}s")
        yield cloud
    finally:
        cloud.close()


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    yield from _booted(tmp_path_factory, "aws-g5")


@pytest.fixture(scope="module")
def gcp(tmp_path_factory):
    yield from _booted(tmp_path_factory, "gcp-g2")


def _wait_for(path: Path, controller: cluster.Node, job_id: str, shared: Path, timeout: float) -> float:
    """Seconds until `path` appears; fails with the job's state and log when it does not."""
    began = time.monotonic()
    while not path.exists():
        if time.monotonic() - began > timeout:
            job = controller.ssh(f"scontrol show job {job_id}; sinfo -N -l", check=False).stdout
            logs = "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-4000:]}"
                             for log in sorted(shared.glob("logs/**/*.out")))
            pytest.fail(f"no {path} after {timeout}s\n{job}\n{logs}")
        time.sleep(5)
    return time.monotonic() - began


def _gpuprov(cloud: cluster.Cloud, *args: str, timeout: float = 120,
             transport: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = cloud.env()
    env.update({f"TF_VAR_{k}": v for k, v in cloud.recorded["tf_vars"].items()})
    env.update(ANSIBLE_SKIP_TAGS=",".join(SKIPPED_TAGS),
               PYTHONPATH=os.pathsep.join(sys.path), **(transport or {}))
    env["PATH"] += os.pathsep + os.path.dirname(sys.executable)  # ansible-playbook of this venv
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _up(cloud: cluster.Cloud, bundle: Path, watch: "SlurmConfWatch | None" = None,
        transport: dict[str, str] | None = None) -> tuple[int, str, list]:
    """`gpuprov up` as the user runs it; (exit code, its output, (seconds, step line) per step line)."""
    env = cloud.env()
    env.update({f"TF_VAR_{k}": v for k, v in cloud.recorded["tf_vars"].items()})
    env.update(ANSIBLE_SKIP_TAGS=",".join(SKIPPED_TAGS),
               PYTHONPATH=os.pathsep.join(sys.path), **(transport or {}))
    env["PATH"] += os.pathsep + os.path.dirname(sys.executable)
    began = time.monotonic()
    up = subprocess.Popen([sys.executable, "-m", "gpuprov", "up", str(bundle)], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    output: list[str] = []
    steps: list[tuple[float, str]] = []
    tasks: list[tuple[float, str]] = []  # Ansible's task and play headers: where the play's time goes

    def read() -> None:
        for line in up.stdout:
            output.append(line)
            if re.match(r"\[\d+/\d+\] ", line):
                steps.append((time.monotonic() - began, line.strip()))
            elif line.startswith(("TASK [", "RUNNING HANDLER [", "PLAY [", "PLAY RECAP")):
                tasks.append((time.monotonic() - began, line.strip(" *\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while up.poll() is None and not (watch and watch.found) and time.monotonic() - began < UP_TIMEOUT:
        time.sleep(2)
    if up.poll() is None:
        up.kill()
    up.wait()
    reader.join(10)
    took = time.monotonic() - began
    print(f"rehearsal: gpuprov up {bundle.name} ran {took:.0f}s (exit {up.returncode})")
    ends = [t for t, _ in steps[1:]] + [took]
    for (start, line), end in zip(steps, ends):
        print(f"rehearsal:   {end - start:5.0f}s  {line[:110]}")
    spans = sorted(((b[0] - a[0], a[1]) for a, b in zip(tasks, tasks[1:])), reverse=True)
    for seconds, name in spans[:15]:
        print(f"rehearsal:   slowest Ansible tasks: {seconds:5.0f}s  {name[:100]}")
    return up.returncode, "".join(output), steps


def _node_questions(cloud: cluster.Cloud) -> list[dict]:
    """The lost-node questions the stand-in CLI answered so far (bin/aws, bin/gcloud), oldest first."""
    log = cloud.state / "node-questions.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _terraform_calls(cloud: cluster.Cloud) -> list[str]:
    log = cloud.state / "terraform.log"  # written by the first call
    return [json.loads(line)["argv"][0] for line in log.read_text().splitlines()] if log.exists() else []


# the bundles brought up on the booted guests, in order (brought down at the end, the last first)
WALKED: list[Path] = []


class SlurmConfWatch(threading.Thread):
    """Reads slurm.conf on the controller while `up` runs: once the role has written it, a NodeAddr
    that is not the node's private address is a fault the rest of `up` can only time out on."""

    def __init__(self, node: cluster.Node, private: dict[str, str]):
        super().__init__(daemon=True)
        self.node, self.private, self.found, self.text = node, private, None, ""
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(10):
            text = self.node.ssh("cat /etc/slurm/slurm.conf 2>/dev/null", check=False, timeout=30).stdout
            addrs = re.findall(r"^NodeName=(\S+) NodeAddr=(\S+)", text, re.M)
            if addrs:
                self.text = text
                wrong = [f"{name}: NodeAddr={addr}" for name, addr in addrs if addr not in self.private.values()]
                if wrong:
                    self.found = wrong
                return


def _as_new_instances(cloud: cluster.Cloud, controller: cluster.Node, previous: Path) -> None:
    """The booted guests stand for the next deployment's instances: the previous bundle's job has
    ended and its controller state (on its shared filesystem, naming its cluster), checkpoints and logs
    are gone, as a new deployment's own filesystem would not hold them (a run of the same name would
    otherwise find the earlier run's checkpoint and the test its files). Nothing of either bundle is
    touched."""
    began = time.monotonic()
    while _ssh_root(controller, "squeue --noheader --all --format=%i", check=False).split():
        assert time.monotonic() - began < 600, _ssh_root(controller, "squeue --all", check=False)
        time.sleep(5)
    group_vars = yaml.safe_load((previous / "ansible" / "group_vars" / "all.yml").read_text())
    state = Path(group_vars["slurm_state_save_location"])
    for node in cloud.nodes.values():
        node.ssh("systemctl stop slurmctld slurmd", check=False)
    controller.ssh(f"rm -rf {state}")
    train = yaml.safe_load((previous / "launch" / "train.yaml").read_text())
    for path in (train["checkpoint"]["dir"], group_vars["slurm_log_dir"]):
        shutil.rmtree(cloud.shared / Path(path).relative_to(SHARED), ignore_errors=True)


@beyond_ci
def test_up_fine_tunes_a_model_folder_on_chat_data_to_an_adapter_peft_loads(aws, tmp_path):
    """generate --model <a Hugging Face model folder> --task lora --export-merged --dataset chat.jsonl,
    then `up`: the base and the dataset copied to the cluster, the data prepared there with the model's
    chat template, the job trains and exports; the adapter gives the trainer's logits in peft, the
    merged model in transformers."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from finetune_inputs import make_base, sample_tokens, trainer_model, write_chat

    user = tmp_path  # the user's folder: the model mirror, the data and the bundle side by side
    base, chat = make_base(user / "tiny-llama"), write_chat(user / "chat.jsonl")
    bundle = user / "bundle"
    made = subprocess.run([sys.executable, "-m", "gpuprov", "generate", "--model", str(base), "--dataset", str(chat),
                           *aws.recorded["fine_tune"]["generate"], "-o", str(bundle)],
                          capture_output=True, text=True, timeout=120, cwd=user)
    assert made.returncode == 0, made.stderr
    plan = json.loads((bundle / "plan.json").read_text())
    st, train = plan["staging"], yaml.safe_load((bundle / "launch" / "train.yaml").read_text())
    assert plan["instance"]["name"] == aws.recorded["instance_type"] and plan["cluster"]["nodes"] == len(aws.hosts())
    names = list(aws.hosts())
    controller = aws.node(names[0])
    if WALKED:
        _as_new_instances(aws, controller, WALKED[-1])
    calls_before = len(_terraform_calls(aws))

    returncode, log, steps = _up(aws, bundle)
    WALKED.append(bundle)
    assert returncode == 0, log[-6000:]
    assert _terraform_calls(aws)[calls_before:] == ["init", "plan", "apply", "output"]
    checked = subprocess.run([sys.executable, "-m", "gpuprov", "check", str(bundle)], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert checked.returncode == 0, checked.stdout + checked.stderr  # no generated file was edited
    ran = [line for _, line in steps]
    for title in ("the base weights", "the dataset", "tokenize"):  # fetch-weights, stage-data, prepare-data
        assert any(title in line and "skipped" not in line for line in ran), ran

    # staged on the shared filesystem: the base whole, the chat data tokenized with its loss mask
    on_host = lambda path: aws.shared / Path(path).relative_to(SHARED)  # noqa: E731
    assert train["model"]["pretrained_path"] == st["weights_dir"] and train["data"]["path"] == st["data_dir"]
    assert {p.name for p in base.iterdir()} <= {p.name for p in on_host(st["weights_dir"]).iterdir()}
    meta = json.loads((on_host(st["data_dir"]) / "meta.json").read_text())
    assert meta["loss_mask"] and meta["train_samples"] > 0, meta

    # the job trains to its last step and exports the adapter; `status` reads it COMPLETED
    job_id = json.loads((bundle / ".gpuprov-up.json").read_text())["job"]["id"]
    last = int(train["schedule"]["steps"])
    export = on_host(train["checkpoint"]["dir"]) / "export" / f"step-{last:08d}"
    trained = _wait_for(export / "adapter_config.json", controller, job_id, aws.shared, timeout=TRAIN_TIMEOUT)
    print(f"rehearsal: the fine-tune job exported step {last}'s adapter {trained:.0f}s after `up` submitted it")
    began = time.monotonic()
    while True:
        status = _gpuprov(aws, "status", str(bundle), "--json", timeout=300)
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        if report["job"]["state"] not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING"):
            break
        assert time.monotonic() - began < 300, report
        time.sleep(10)
    print("rehearsal: gpuprov status --json:", json.dumps(report)[:2000])
    assert report["job"]["id"] == job_id and report["job"]["state"] == "COMPLETED", report
    assert report["step"] == last and report["steps"] == last, report

    # here, as the user loads it: peft's adapter on the base gives the trainer's own logits
    model, exported = trainer_model(bundle / "launch", on_host, st, train)
    assert exported == export
    tokens = sample_tokens(base, chat)
    with torch.no_grad():
        want = model(input_ids=tokens).logits
        # the trainer keeps the frozen base in bf16 (task.frozen_dtype): peft's base is that base
        frozen = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).float()
        adapter = PeftModel.from_pretrained(frozen, export).eval()(input_ids=tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(export / "merged", dtype=torch.float32).eval()(
            input_ids=tokens).logits
        untrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)(input_ids=tokens).logits
    changed = (untrained - want).abs().max().item()
    print(f"rehearsal: the adapter moved the logits by up to {changed:.3g}; peft's differ from the trainer's by "
          f"{(adapter - want).abs().max().item():.3g}, the merged model's by {(merged - want).abs().max().item():.3g}")
    assert changed > 1e-3  # the job trained the adapter
    torch.testing.assert_close(adapter, want, rtol=0, atol=1e-4)
    # the merged weights are W + BA rounded once to bf16 (export.dtype), as in tests/test_finetune_journey.py
    torch.testing.assert_close(merged, want, rtol=0, atol=5e-3)


def _from_scratch(cloud: cluster.Cloud, tmp_path: Path, walked: list[Path]) -> Path:
    """generate from the fixture's arguments, `up` on the booted stand-ins (the previous deployment on
    them, if any, cleared as a new one's filesystem would be), every node registered in Slurm from the
    role's own files, one job submitted, a second `up` submits nothing, the job reaches its first
    checkpoint and `status --json` reads it. `cloud`: the booted stand-ins; returns the bundle."""
    recorded = cloud.recorded
    bundle = tmp_path / "bundle"
    made = subprocess.run([sys.executable, "-m", "gpuprov", "generate", *recorded["generate"], "-o", str(bundle)],
                          capture_output=True, text=True, timeout=120, cwd=cluster.REPO)
    assert made.returncode == 0, made.stderr
    names = list(cloud.hosts())
    controller = cloud.node(names[0])
    private = {name: cloud.private_ip(name) for name in names}
    if walked:
        _as_new_instances(cloud, controller, walked[-1])
    calls_before = len(_terraform_calls(cloud))

    watch = SlurmConfWatch(controller, private)
    watch.start()
    returncode, log, _ = _up(cloud, bundle, watch)
    watch.done.set()
    walked.append(bundle)
    # issue 40 item 1: slurm.conf must address each node by the private address the inventory carries
    assert not watch.found, (f"slurm.conf addresses nodes by what Ansible reaches them by, not their private "
                             f"addresses {private}: {watch.found}; slurmd cannot resolve the controller\n"
                             f"{watch.text}")
    assert returncode == 0, log[-6000:]

    # Terraform was asked exactly what `up` asks a real one; the inventory is the recorded output
    assert _terraform_calls(cloud)[calls_before:] == ["init", "plan", "apply", "output"]
    inventory = yaml.safe_load((bundle / "ansible" / "inventory.yml").read_text())
    assert inventory == recorded["outputs"]["ansible_inventory"]["value"]
    checked = subprocess.run([sys.executable, "-m", "gpuprov", "check", str(bundle)], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert checked.returncode == 0, checked.stdout + checked.stderr  # no generated file was edited

    # Slurm, from the role's own files: every node registered and usable
    sinfo = _ssh_root(controller, "sinfo --noheader --Node --format='%N %t'")
    states = dict(line.split() for line in sinfo.splitlines())
    assert len(states) == len(names) and set(states.values()) <= {"idle", "mix", "alloc"}, sinfo
    # the cgroup settings the plan's Slurm build for the image's OS supports (Ubuntu 22.04's 21.08: none)
    build = yaml.safe_load((bundle / "ansible" / "group_vars" / "all.yml").read_text())["slurm_builds"][
        f"{recorded['image']['os_id']}-{recorded['image']['os_version']}"]
    slurm_conf = _ssh_root(controller, "cat /etc/slurm/slurm.conf")
    assert f"ProctrackType={build['proctrack']}" in slurm_conf.splitlines()
    cgroup_conf = _ssh_root(controller, "cat /etc/slurm/cgroup.conf")
    assert (f"CgroupPlugin={build['cgroup_plugin']}" in cgroup_conf) if build["cgroup_plugin"] else \
        "CgroupPlugin" not in cgroup_conf
    assert _ssh_root(controller, "stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs"

    # `up` submitted the job once and recorded it; a second `up` submits nothing more
    state = json.loads((bundle / ".gpuprov-up.json").read_text())
    job_id = state["job"]["id"]
    assert f"JobId={job_id}" in _ssh_root(controller, f"scontrol show job {job_id}")
    questions = _node_questions(cloud)
    again = _gpuprov(cloud, "up", str(bundle), timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    # it asked the cloud's CLI once which recorded nodes still run, about every recorded instance,
    # was answered (every one runs) and listed none for Terraform to replace
    asked = _node_questions(cloud)[len(questions):]
    recorded_ids = recorded["outputs"]["instance_ids"]["value"]
    reached_as = recorded_ids if recorded["cloud"] == "aws" else recorded["outputs"]["node_names"]["value"]
    assert [sorted(q["asked"]) for q in asked] == [sorted(reached_as)], (asked, again.stdout[-3000:])
    assert not (bundle / "terraform" / "replaced_nodes.auto.tfvars.json").exists()
    assert json.loads((bundle / ".gpuprov-up.json").read_text())["job"]["id"] == job_id
    jobs = _ssh_root(controller, "squeue --noheader --all --format=%i").split()
    assert jobs == [job_id], jobs

    # the job trains from the shared filesystem to the first checkpoint, and `status` reads it
    train = yaml.safe_load((bundle / "launch" / "train.yaml").read_text())
    on_host = lambda path: cloud.shared / Path(path).relative_to(SHARED)  # noqa: E731
    last = int(train["schedule"]["steps"])
    first_checkpoint = min(int(train["checkpoint"]["every_steps"]), last)
    checkpoint = on_host(train["checkpoint"]["dir"]) / f"step-{first_checkpoint:08d}" / ".metadata"  # DCP's
    trained = _wait_for(checkpoint, controller, job_id, cloud.shared, timeout=TRAIN_TIMEOUT)
    print(f"rehearsal: the job reached step {first_checkpoint}'s checkpoint {trained:.0f}s after `up` submitted it")
    status = _gpuprov(cloud, "status", str(bundle), "--json", timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    print("rehearsal: gpuprov status --json:", json.dumps(report)[:2000])
    steps = [json.loads(line) for line in on_host(train["logging"]["metrics_file"]).read_text().splitlines()
             if '"loss"' in line]
    assert steps and steps[-1]["step"] == last and all(0 < s["loss"] < 100 for s in steps)  # finite, not NaN
    assert report["job"]["id"] == job_id and report["step"] >= first_checkpoint and report["steps"] == last, report
    return bundle


def test_up_on_aws_trains_to_a_checkpoint_and_submits_once(aws, tmp_path):
    _from_scratch(aws, tmp_path, WALKED)


# The on-prem bundle: the site's hosts file names the two stand-in nodes by their hostnames and their
# addresses on the private segment; each declares the GPU the stand-in presents (standin_image.sh:
# one NVIDIA A10G, catalog slug a10g-24gb) and the site's NFS export is the shared filesystem.
ONPREM_GPU = "a10g-24gb"
ONPREM_NFS = "nfs-server:/export/gpu"  # not served here: the storage tag is skipped (SKIPPED_TAGS)
ONPREM_GENERATE = ["--model", "tests/rehearsal/fixtures/tiny-llama/config.json", "--from-scratch", "--cloud", "onprem",
                   "--shared-nfs", ONPREM_NFS, "--gpus", "2", "--seq-len", "128",
                   "--dataset", "tests/rehearsal/fixtures/tiny-data", "--epochs", "1", "--global-batch", "4",
                   "--pp", "1"]


def _site_transport(cloud: cluster.Cloud) -> dict[str, str]:
    """How the operator's ssh reaches an on-prem host here: a ProxyCommand that carries the stream to
    the stand-in node holding the address the inventory names (tests/rehearsal/bin/site-ssh-proxy),
    the operator's key and known_hosts. The inventory itself connects to ADDRESS:22 as generated."""
    ports = {cloud.private_ip(name): cloud.node(name).port for name in cloud.hosts()}
    (cloud.state / "site-hosts.json").write_text(json.dumps(ports))
    known = cloud.workdir / "home" / ".ssh" / "known_hosts"
    return {"ANSIBLE_SSH_EXTRA_ARGS": f"-o UserKnownHostsFile={known} "
                                      f"-o 'ProxyCommand={cluster.SHIMS / 'site-ssh-proxy'} %h %p'"}


@beyond_ci
def test_up_on_prem_hosts_trains_to_a_checkpoint_and_down_stops_it(aws, tmp_path):
    """generate --cloud onprem --hosts HOSTS (the same two stand-in nodes as the site's servers), `up`
    with no Terraform, the job to its first checkpoint, `status --json`, then `down`: the job and the
    Slurm the bundle started are stopped, the hosts and the checkpoints stay (they are the owner's)."""
    names = list(aws.hosts())
    controller = aws.node(names[0])
    if WALKED:
        _as_new_instances(aws, controller, WALKED[-1])
    # the site names each host by its hostname (slurmd finds its node by it) and its address
    hosts = [{"name": aws.node(n).ssh("hostname -s").stdout.strip(), "address": aws.private_ip(n),
              "user": aws.login_user(), "gpu": ONPREM_GPU, "gpus": aws.recorded["gpus_per_node"]} for n in names]
    # the site's hosts as Ubuntu's installer leaves them: the host's own name at 127.0.1.1, first in
    # /etc/hosts (subiquity's HOSTS_CONTENT); the other names resolve as the site's DNS gives them
    for name, host in zip(names, hosts):
        aws.node(name).ssh(f"sed -i '/^127\\.0\\.1\\.1[[:space:]]/d; 1a 127.0.1.1 {host['name']}' /etc/hosts")
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(hosts, sort_keys=False))
    bundle = tmp_path / "bundle"
    made = subprocess.run([sys.executable, "-m", "gpuprov", "generate", *ONPREM_GENERATE, "--hosts", str(hosts_file),
                           "-o", str(bundle)], capture_output=True, text=True, timeout=120, cwd=cluster.REPO)
    assert made.returncode == 0, made.stderr
    plan = json.loads((bundle / "plan.json").read_text())
    assert plan["cluster"]["cloud"] == "onprem" and plan["cluster"]["nodes"] == len(names), plan["cluster"]
    inventory = yaml.safe_load((bundle / "ansible" / "inventory.yml").read_text())
    rendered = inventory["all"]["children"]["gpu_nodes"]["hosts"]
    assert {h: v["ansible_host"] for h, v in rendered.items()} == {h["name"]: h["address"] for h in hosts}
    transport = _site_transport(aws)
    calls_before = len(_terraform_calls(aws))

    private = {h["name"]: h["address"] for h in hosts}
    watch = SlurmConfWatch(controller, private)
    watch.start()
    returncode, log, _ = _up(aws, bundle, watch, transport=transport)
    watch.done.set()
    assert not watch.found, f"slurm.conf NodeAddr is not the hosts' addresses {private}: {watch.found}\n{watch.text}"
    assert returncode == 0, log[-6000:]
    assert len(_terraform_calls(aws)) == calls_before  # on-prem: the hosts file is the inventory, no Terraform
    assert yaml.safe_load((bundle / "ansible" / "inventory.yml").read_text()) == inventory
    checked = subprocess.run([sys.executable, "-m", "gpuprov", "check", str(bundle)], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert checked.returncode == 0, checked.stdout + checked.stderr  # no generated file was edited

    for name, host in zip(names, hosts):  # what the rendezvous and gloo take for the node's address
        assert _ssh_root(aws.node(name), "hostname --ip-address").split()[0] == host["address"]
    sinfo = _ssh_root(controller, "sinfo --noheader --Node --format='%N %t'")
    states = dict(line.split() for line in sinfo.splitlines())
    assert set(states) == set(private) and set(states.values()) <= {"idle", "mix", "alloc"}, sinfo
    assert _ssh_root(controller, "stat -fc %T /sys/fs/cgroup").strip() == "cgroup2fs"

    job_id = json.loads((bundle / ".gpuprov-up.json").read_text())["job"]["id"]
    train = yaml.safe_load((bundle / "launch" / "train.yaml").read_text())
    on_host = lambda path: aws.shared / Path(path).relative_to(SHARED)  # noqa: E731
    last = int(train["schedule"]["steps"])
    first_checkpoint = min(int(train["checkpoint"]["every_steps"]), last)
    checkpoint = on_host(train["checkpoint"]["dir"]) / f"step-{first_checkpoint:08d}" / ".metadata"
    trained = _wait_for(checkpoint, controller, job_id, aws.shared, timeout=TRAIN_TIMEOUT)
    print(f"rehearsal: on-prem: the job reached step {first_checkpoint}'s checkpoint {trained:.0f}s after `up` "
          "submitted it")
    status = _gpuprov(aws, "status", str(bundle), "--json", timeout=300, transport=transport)
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    print("rehearsal: on-prem: gpuprov status --json:", json.dumps(report)[:2000])
    assert report["job"]["id"] == job_id and report["step"] >= first_checkpoint and report["steps"] == last, report

    # `down` on-prem: the hosts stay (they are the owner's); what the bundle started on them stops
    began = time.monotonic()
    down = _gpuprov(aws, "down", str(bundle), "--yes", timeout=600, transport=transport)
    print(f"rehearsal: on-prem: gpuprov down ran {time.monotonic() - began:.0f}s:\n{down.stdout}")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (bundle / ".gpuprov-up.json").exists()
    assert len(_terraform_calls(aws)) == calls_before and len(aws.running()) == len(names)
    for name in names:
        node = aws.node(name)
        active = node.ssh("systemctl is-active slurmctld slurmd", check=False).stdout.split()
        assert "active" not in active, (name, active)
        gone = time.monotonic() + 120  # the job's processes end once Slurm has signalled them
        while node.ssh("pgrep -f '[t]rain.py'", check=False).returncode != 1:
            assert time.monotonic() < gone, node.ssh("ps -ef", check=False).stdout
            time.sleep(5)
    assert checkpoint.exists()  # the checkpoints on the site's filesystem are kept


def _job(controller: cluster.Node, job_id: str) -> dict[str, str]:
    """scontrol's fields of the job ({}: Slurm no longer knows it)."""
    out = controller.ssh(f"scontrol -o show job {job_id}", check=False).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def _checkpoints(on_host: Path) -> list[int]:
    """The steps of the complete checkpoints (DCP's .metadata written last) in a checkpoint dir."""
    return sorted(int(p.parent.name.split("-")[1]) for p in on_host.glob("step-*/.metadata"))


def _starts(metrics: Path) -> list[list[dict]]:
    """The metrics file per start of the trainer: its "start" record, then what it logged."""
    runs: list[list[dict]] = []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "start":
            runs.append([])
        if runs:
            runs[-1].append(record)
    return runs


def _requeued(controller: cluster.Node, job_id: str, killed_at: float) -> None:
    """Waits until Slurm has requeued the job (Restarts counts it; it waits for its nodes again)."""
    while not (int(_job(controller, job_id).get("Restarts", 0)) >= 1
               and _job(controller, job_id).get("JobState") in ("PENDING", "REQUEUED", "REQUEUE_HOLD")):
        assert time.monotonic() - killed_at < 900, (_job(controller, job_id), _ssh_root(controller, "sinfo -N -l"))
        time.sleep(5)
    sinfo = _ssh_root(controller, "sinfo --noheader --Node --format='%N %t'")
    print(f"rehearsal: lost node: job {job_id} requeued {time.monotonic() - killed_at:.0f}s after the kill "
          f"({_job(controller, job_id).get('Reason')}); sinfo: {sinfo.split()}")


def _replaced_and_configured(aws: cluster.Cloud, bundle: Path, lost: str, asked: list[dict], calls: list[str]) -> None:
    """What the second `up` did, from state: asked the cloud about every recorded instance once, listed
    exactly the lost node for Terraform, which read its state, planned, applied and gave the new
    output; the replacement runs under the new id; the play configured it and the controller."""
    recorded_ids = aws.recorded["outputs"]["instance_ids"]["value"]
    assert [sorted(q["asked"]) for q in asked] == [sorted(recorded_ids)], asked
    assert json.loads(asked[0]["answer"]) == [[recorded_ids[0], "running"]]
    listed = json.loads((bundle / "terraform" / "replaced_nodes.auto.tfvars.json").read_text())
    assert listed["replaced_nodes"]["names"] == [lost], listed
    # `terraform output -json` (the recorded nodes), then from plan on (init is kept from the first run)
    assert calls == ["output", "plan", "apply", "output"], calls
    replaced = aws.recorded["replaced"]["outputs"]
    new_id = replaced["ansible_inventory"]["value"]["all"]["children"]["gpu_nodes"]["hosts"][lost]["ansible_host"]
    new_ip = aws.private_ip(lost)
    assert aws.transport_id(lost) == new_id and new_id in aws.running() and recorded_ids[1] not in aws.running()
    inventory = yaml.safe_load((bundle / "ansible" / "inventory.yml").read_text())
    assert inventory == replaced["ansible_inventory"]["value"]  # the joining list cleared once healthy
    # both nodes render the new address, slurmctld holds it, the replacement runs slurmd as the node
    for name in aws.hosts():
        conf = _ssh_root(aws.node(name), "cat /etc/slurm/slurm.conf")
        assert f"NodeName={lost} NodeAddr={new_ip} " in conf, (name, conf)
    assert _ssh_root(aws.node(lost), "hostname").strip() == lost
    controller = aws.node(list(aws.hosts())[0])
    node = dict(f.split("=", 1) for f in _ssh_root(controller, f"scontrol -o show node {lost}").split() if "=" in f)
    assert node["NodeAddr"] == new_ip, node


def _logged_steps(metrics: Path) -> set[int]:
    """The steps with a loss in the metrics file so far (a line still being written is not one yet)."""
    steps = set()
    for line in metrics.read_text().splitlines() if metrics.exists() else ():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            steps.add(record["step"])
    return steps


def _resumed(metrics: Path, last: int, resume_from: int) -> None:
    """The metrics file: a start at the checkpoint's step on both nodes that trained to the last step,
    its losses finite and, at the steps past the checkpoint the killed start logged (at least one), equal to
    the killed start's."""
    runs = _starts(metrics)
    losses = lambda run: {r["step"]: r["loss"] for r in run if "loss" in r}  # noqa: E731
    resumed = [run for run in runs if losses(run)][-1]
    assert runs[0][0]["step"] == 0 and resumed is not runs[0], [r[0] for r in runs]
    assert resumed[0]["step"] == resume_from and resumed[0]["world"] == 2, resumed[0]
    after = losses(resumed)
    assert max(after) == last and min(after) > resume_from, sorted(after)
    assert all(0 < loss < 100 for loss in after.values()), after  # finite, not NaN
    again = sorted(set(losses(runs[0])) & set(after))  # steps past the checkpoint the killed start had logged
    assert again, (sorted(losses(runs[0])), sorted(after))  # the walk kills after one: never an empty comparison
    for step in again:
        assert after[step] == pytest.approx(losses(runs[0])[step], rel=1e-5, abs=1e-6), step
    print(f"rehearsal: lost node: starts at steps {[r[0]['step'] for r in runs]}, resumed losses "
          f"{ {k: round(v, 4) for k, v in sorted(after.items())} }")


LOST_NODE = "GPUPROV_REHEARSAL_LOST_NODE"  # =1 runs the lost-node walk (with GPUPROV_REHEARSAL=all)


@beyond_ci
@pytest.mark.skipif(os.environ.get(LOST_NODE) != "1", reason=(
    f"REHEARSAL SKIPPED for the lost-node walk: it takes about 76 minutes alone on an idle 2-core host (it passed "
    f"end to end there on 2026-12-07, then killing the node before a loss past the checkpoint was logged); "
    f"{LOST_NODE}=1 runs it"))
def test_up_replaces_a_lost_node_and_the_requeued_job_resumes(aws, tmp_path):
    """A node dies mid-job (no shutdown); Slurm requeues the job; `gpuprov up` run again finds the
    node lost, has Terraform replace it under its name (a new instance id and address), replays the
    play, submits nothing, and the requeued job resumes from its checkpoint on the replacement."""
    bundle = tmp_path / "bundle"
    made = subprocess.run([sys.executable, "-m", "gpuprov", "generate", *aws.recorded["lost_node"]["generate"], "-o",
                           str(bundle)], capture_output=True, text=True, timeout=120, cwd=cluster.REPO)
    assert made.returncode == 0, made.stderr
    names = list(aws.hosts())
    controller, lost = aws.node(names[0]), names[1]
    if WALKED:
        _as_new_instances(aws, controller, WALKED[-1])
    returncode, log, _ = _up(aws, bundle)
    WALKED.append(bundle)
    assert returncode == 0, log[-6000:]
    job_id = json.loads((bundle / ".gpuprov-up.json").read_text())["job"]["id"]
    train = yaml.safe_load((bundle / "launch" / "train.yaml").read_text())
    on_host = lambda path: aws.shared / Path(path).relative_to(SHARED)  # noqa: E731
    last, every = int(train["schedule"]["steps"]), int(train["checkpoint"]["every_steps"])
    assert every < last, train["checkpoint"]  # checkpoints before the end to resume from
    ckpt_dir, metrics = on_host(train["checkpoint"]["dir"]), on_host(train["logging"]["metrics_file"])
    trained = _wait_for(ckpt_dir / f"step-{every:08d}" / ".metadata", controller, job_id, aws.shared, TRAIN_TIMEOUT)
    # a loss logged past the checkpoint, so the resumed start logs that step again and the two can be compared
    past = (every // int(train["logging"]["every_steps"]) + 1) * int(train["logging"]["every_steps"])
    assert past < last, (past, last)
    deadline = time.monotonic() + TRAIN_TIMEOUT
    while past not in _logged_steps(metrics):
        assert time.monotonic() < deadline, f"no loss logged at step {past}"
        time.sleep(5)

    aws.kill(lost)  # the instance is gone: no shutdown, nothing saved (a reclaimed spot node)
    killed_at = time.monotonic()
    print(f"rehearsal: lost node: step {every}'s checkpoint {trained:.0f}s after submission; killed {lost} "
          f"(checkpoints {_checkpoints(ckpt_dir)})")
    _requeued(controller, job_id, killed_at)
    resume_from = _checkpoints(ckpt_dir)[-1]
    questions, calls = len(_node_questions(aws)), len(_terraform_calls(aws))
    returncode, log, _ = _up(aws, bundle)
    assert returncode == 0, log[-6000:]
    _replaced_and_configured(aws, bundle, lost, _node_questions(aws)[questions:], _terraform_calls(aws)[calls:])
    # nothing submitted again: the recorded job is the only one
    assert json.loads((bundle / ".gpuprov-up.json").read_text())["job"]["id"] == job_id
    assert _ssh_root(controller, "squeue --noheader --all --format=%i").split() == [job_id]

    began = time.monotonic()  # the requeued job resumes on both nodes and trains to the end
    while _job(controller, job_id).get("JobState") != "COMPLETED":
        state = _job(controller, job_id)
        assert state.get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING"), state
        assert time.monotonic() - began < TRAIN_TIMEOUT * 1.5, (state, _ssh_root(controller, "sinfo -N -l"))
        time.sleep(10)
    print(f"rehearsal: lost node: the resumed job completed {time.monotonic() - began:.0f}s after the second up")
    _resumed(metrics, last, resume_from)


def test_down_leaves_nothing(aws):
    """`down` destroys what `up` created: each bundle brought up here, the last first; here every
    stand-in node is powered off."""
    assert WALKED, "no bundle was brought up"
    for bundle in reversed(WALKED):
        down = _gpuprov(aws, "down", str(bundle), "--yes", timeout=600)
        assert down.returncode == 0, down.stdout + down.stderr
        assert not (bundle / ".gpuprov-up.json").exists()
        assert aws.running() == [] and not (aws.state / "applied").exists()
        assert json.loads((aws.state / "terraform.log").read_text().splitlines()[-1])["argv"][0] == "destroy"


# After the AWS guests are down (module order): the GCP shape on stand-ins of its own.
@beyond_ci
def test_up_on_gcp_trains_to_a_checkpoint_and_down_leaves_nothing(gcp, tmp_path):
    """The same from-scratch bundle planned on GCP (2 x g2-standard-4), its own stand-ins: Ansible
    reaches each VM by name through the inventory's IAP ProxyCommand (tests/rehearsal/bin/gcloud),
    the nodes call each other by their VM names; then `down` destroys them."""
    bundle = _from_scratch(gcp, tmp_path, [])
    down = _gpuprov(gcp, "down", str(bundle), "--yes", timeout=600)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (bundle / ".gpuprov-up.json").exists()
    assert gcp.running() == [] and not (gcp.state / "applied").exists()
    assert json.loads((gcp.state / "terraform.log").read_text().splitlines()[-1])["argv"][0] == "destroy"
