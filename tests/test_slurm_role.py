"""The slurm role with the real ansible-playbook on this machine (connection local, as the other
role tests): it converges, a second run changes nothing, check mode on a fresh node passes, and the
slurm.conf it writes starts real slurmctld + slurmd (Debian's slurm-wlm) with the node idle, which
the role's health tasks then confirm. Paths that would touch the machine's own Slurm (config,
munge key, munge socket) point into a scratch folder; the daemons are started by the test (no
systemd here).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import slurm_cluster
from gpuprov.job_status import JOBCOMP_SEPARATOR, job_summary
from ansible_helpers import LOCAL_INVENTORY, REPO, playbook, recap

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
if slurm_cluster.missing():
    pytest.skip(slurm_cluster.missing(), allow_module_level=True)


HOST = socket.gethostname().split(".")[0]


def _play(root: Path, name: str, tasks_from: str = "main.yml", **variables) -> str:
    (root / name).write_text(yaml.safe_dump([{
        "name": "slurm", "hosts": "gpu_nodes", "become": False, "gather_facts": True,
        "tasks": [{"name": "slurm role", "ansible.builtin.include_role": {"name": "slurm", "tasks_from": tasks_from},
                   "vars": variables}],
    }], sort_keys=False))
    return name


@pytest.fixture()
def scratch():
    root = slurm_cluster.daemon_scratch("gpuprov-slurm-role-")
    shutil.copytree(REPO / "ansible" / "roles", root / "roles")
    # the node is named as this machine is (slurmd finds its NodeName by hostname; the role keeps
    # the hostname here: slurm_set_hostname is off, as on-prem)
    host = dict(LOCAL_INVENTORY["all"]["children"]["gpu_nodes"]["hosts"]["node0"])
    (root / "local-inventory.yml").write_text(json.dumps(
        {"all": {"children": {"gpu_nodes": {"hosts": {HOST: {**host, "private_ip": "127.0.0.1"}}}}}}))
    (root / "ansible.cfg").write_text("[defaults]\nroles_path = roles\n")
    (root / "munge").mkdir()
    shutil.chown(root / "munge", "munge", "munge")
    (root / "jobcomp").mkdir()
    shutil.chown(root / "jobcomp", "slurm", "slurm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _vars(root: Path, **extra) -> dict:
    # the node list goes to a file of the test's, never this machine's /etc/hosts, and nothing to its
    # cloud-init's folder (this machine may be a cloud VM running cloud-init)
    return {"slurm_manage_services": False, "slurm_config_dir": str(root / "etc"), "slurm_hosts_file": str(root / "hosts"),
            "slurm_cloud_init_dir": str(root / "cloud"),
            "slurm_jobcomp_loc": str(root / "jobcomp" / "jobcomp.log"),
            "slurm_munge_key": str(root / "munge" / "munge.key"), "slurm_munge_socket": str(root / "munge" / "sock"),
            "slurm_gpus_per_node": 0, "slurm_cgroup": False, "slurm_plugin_dirs": [str(root / "plugins")], **extra}


def test_converges_idempotent_check_mode_and_real_daemons_take_the_node(scratch, monkeypatch):
    v = _vars(scratch)
    check = playbook(scratch, "-i", "local-inventory.yml", _play(scratch, "check.yml", **v), "--check")
    assert check.returncode == 0, check.stdout[-3000:]
    assert not (scratch / "etc" / "slurm.conf").exists()  # check mode wrote nothing

    first = playbook(scratch, "-i", "local-inventory.yml", _play(scratch, "site.yml", **v))
    assert first.returncode == 0, first.stdout[-3000:]
    assert recap(first.stdout, HOST)["changed"] > 0
    second = playbook(scratch, "-i", "local-inventory.yml", "site.yml")
    assert second.returncode == 0 and recap(second.stdout, HOST)["changed"] == 0, second.stdout[-3000:]

    conf = (scratch / "etc" / "slurm.conf").read_text()
    key = scratch / "munge" / "munge.key"
    assert key.stat().st_mode & 0o777 == 0o400 and key.owner() == "munge" and key.stat().st_size >= 32
    assert "ReturnToService=1" in conf and "PartitionName=gpu " in conf and "Gres=" not in conf
    node = next(ln for ln in conf.splitlines() if ln.startswith("NodeName="))
    fields = dict(f.split("=", 1) for f in node.split())
    assert int(fields["RealMemory"]) > 0 and int(fields["CPUs"]) == os.cpu_count()
    assert fields["NodeName"] == HOST and fields["NodeAddr"] == "127.0.0.1"  # the inventory's private_ip
    for script in ("prolog.sh", "epilog.sh"):
        assert os.access(scratch / "etc" / script, os.X_OK)
        assert subprocess.run(["sh", str(scratch / "etc" / script)]).returncode == 0  # no GPUs: nothing to end

    env = dict(os.environ, SLURM_CONF=str(scratch / "etc" / "slurm.conf"))
    subprocess.run(["runuser", "-u", "munge", "--", "munged", f"--key-file={key}", f"--socket={scratch}/munge/sock",
                    f"--pid-file={scratch}/munge/pid", f"--log-file={scratch}/munge/log",
                    f"--seed-file={scratch}/munge/seed"], check=True, timeout=30)
    # -c: slurmctld starts from a clean state (its state folder is the machine's own, and an earlier
    # run of this test left the node drained there)
    # slurmd starts late, as on a node still booting: the health play waits for it to register
    daemons = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for argv in (["slurmctld", "-D", "-c"], ["sh", "-c", "sleep 15; exec slurmd -D"])]
    try:
        monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])  # sinfo in the health tasks
        early = playbook(scratch, "-i", "local-inventory.yml", _play(scratch, "health.yml", "health.yml", **v))
        assert early.returncode == 0 and f"FAILED - RETRYING: [{HOST}]: Ask the controller" in early.stdout, early.stdout[-3000:]
        states = ""
        for _ in range(60):
            states = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%t"], env=env,
                                    capture_output=True, text=True).stdout.split()
            if states == ["idle"]:
                break
            time.sleep(0.5)
        assert states == ["idle"], Path("/var/log/slurm/slurmctld.log").read_text()[-2000:]
        # a job that ends leaves its completion record (jobcomp/filetxt), which `gpuprov status`
        # reads once slurmctld forgot the job
        job_id = subprocess.run(["sbatch", "--parsable", "--wrap=true", "-o", "/dev/null"], env=env, check=True,
                                capture_output=True, text=True).stdout.strip().split(";")[0]
        record = ""
        for _ in range(120):
            log = scratch / "jobcomp" / "jobcomp.log"
            record = next((ln for ln in (log.read_text().splitlines() if log.exists() else [])
                           if ln.startswith(f"JobId={job_id} ")), "")
            if record:
                break
            time.sleep(0.5)
        forgotten = f"slurm_load_jobs error: Invalid job id specified\n{JOBCOMP_SEPARATOR}\n{record}\n"
        assert job_summary("slurm", forgotten)["state"] == "COMPLETED", record
        assert "ExitCode=0:0" in record and fields["NodeName"] in record
        health = playbook(scratch, "-i", "local-inventory.yml", "health.yml")
        assert health.returncode == 0 and "RETRYING" not in health.stdout, health.stdout[-3000:]
        subprocess.run(["scontrol", "update", "nodename=" + fields["NodeName"], "state=drain", "reason=test"],
                       env=env, check=True)
        drained = playbook(scratch, "-i", "local-inventory.yml", "health.yml")
        assert drained.returncode != 0 and "not usable: " + fields["NodeName"] in drained.stdout
        _joining_node_waits_for_its_health_check(scratch, v, env, fields["NodeName"])
    finally:
        for d in daemons:
            d.terminate()
            d.wait(timeout=30)
        os.kill(int((scratch / "munge" / "pid").read_text()), 15)


def _node(env: dict, name: str) -> tuple[str, str]:
    """(state, reason) of a node as scontrol shows it."""
    shown = subprocess.run(["scontrol", "show", "node", "--oneliner", name], env=env, capture_output=True,
                           text=True, check=True).stdout
    fields = dict(f.split("=", 1) for f in shown.split(" Reason=")[0].split() if "=" in f)
    return fields["State"], shown.split(" Reason=", 1)[1].split(" [")[0] if " Reason=" in shown else ""


def _joining_node_waits_for_its_health_check(scratch: Path, v: dict, env: dict, name: str) -> None:
    """A node `up` lists as joining (a replacement) is drained on the controller with the reason; the
    health playbook resumes it when it passed the node health check, and a node that failed it (out
    of the play, as Ansible drops a failed host from the plays after) stays drained."""
    subprocess.run(["scontrol", "update", f"nodename={name}", "state=resume"], env=env, check=True)
    joining = {**v, "slurm_joining_nodes": [name], "slurm_controller_host": name}
    drain = playbook(scratch, "-i", "local-inventory.yml", _play(scratch, "join.yml", "joining.yml", **joining))
    assert drain.returncode == 0, drain.stdout[-3000:]
    state, reason = _node(env, name)
    assert state.startswith("IDLE+DRAIN") and reason == "gpuprov: joined the cluster, health check pending", state
    # the node health check failed on it: the Slurm health play runs without it, nothing resumes it
    (scratch / "failing.yml").write_text(yaml.safe_dump([
        {"name": "Node health check", "hosts": "gpu_nodes", "gather_facts": False,
         "tasks": [{"name": "GPUs", "ansible.builtin.fail": {"msg": "1 of 8 GPUs"}}]},
        {"name": "Slurm health check", "hosts": "gpu_nodes", "gather_facts": False,
         "tasks": [{"name": "slurm", "ansible.builtin.include_role": {"name": "slurm", "tasks_from": "health.yml"},
                    "vars": joining}]}], sort_keys=False))
    failed = playbook(scratch, "-i", "local-inventory.yml", "failing.yml")
    assert failed.returncode != 0 and _node(env, name)[0].startswith("IDLE+DRAIN")
    passed = playbook(scratch, "-i", "local-inventory.yml", _play(scratch, "health2.yml", "health.yml", **joining))
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert _node(env, name) == ("IDLE", "")


@pytest.mark.parametrize("nvml", [True, False])
def test_gres_conf_follows_the_plugin_the_build_has(scratch, nvml):
    """Where the archive builds the NVML plugin, gres.conf autodetects; where not (Debian bookworm),
    it lists the device files. Both are possible on the supported images (catalog: uncertain)."""
    (scratch / "plugins").mkdir()
    if nvml:
        (scratch / "plugins" / "gpu_nvml.so").write_bytes(b"")
    v = _vars(scratch, slurm_gpus_per_node=4)
    proc = playbook(scratch, "-i", "local-inventory.yml", _play(scratch, "site.yml", **v))
    assert proc.returncode == 0, proc.stdout[-3000:]
    gres = (scratch / "etc" / "gres.conf").read_text()
    conf = (scratch / "etc" / "slurm.conf").read_text()
    assert " Gres=gpu:4 " in conf
    if nvml:
        assert "AutoDetect=nvml" in gres and "File=" not in gres
    else:
        assert "Name=gpu File=/dev/nvidia[0-3]" in gres and "AutoDetect" not in gres
