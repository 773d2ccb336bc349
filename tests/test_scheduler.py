"""Plan.scheduler: one rule for every target (gpuprov/scheduler.py), carried by the plan and
rendered as it says: the slurm role and its health check in site.yml/health.yml, the job script,
and `up --dry-run` ending with the job submission on every cloud and on-prem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpuprov import bundle, job, job_status
from gpuprov.render.ansible import render_ansible
from gpuprov.render.launch import render_launch
from gpuprov.scheduler import decide
from gpuprov.spec import TrainingSpec
from plan_fixtures import sample_plan

CLOUDS = ["aws", "gcp", "azure", "oci", "onprem"]


@pytest.mark.parametrize("cloud", CLOUDS)
def test_multi_node_plans_install_slurm_with_the_controller_on_the_first_node(cloud):
    plan = sample_plan(cloud, nodes=2)
    s = plan.scheduler
    assert s.kind == "slurm" and s.controller == "first-node" and s.partition == "gpu" and s.max_requeues > 0
    assert "head node" in s.reason and s.source
    assert s.controller_host == ("gpu0" if cloud == "onprem" else None)  # on clouds: terraform's first node
    for build in s.builds.values():
        assert any("slurmctld" in n for n in build.packages["controller"])
        assert any("slurmd" in n for n in build.packages["compute"])
    # the plan's images: one OS on a cloud (its image profile), each supported one on-prem
    assert list(s.builds) == (["ubuntu-22.04", "ubuntu-24.04"] if cloud == "onprem" else ["ubuntu-22.04"])
    assert s.set_hostname == (cloud != "onprem") and (s.node_cpus is None) == (cloud == "onprem")


@pytest.mark.parametrize("profile", ["azure-ubuntu-hpc-2204", "azure-ubuntu-hpc-2404"])
def test_azure_hpc_images_get_microsofts_slurm_smd_packages(profile):
    """The image's apt pin makes Ubuntu's slurm* uninstallable (priority -1) and prefers
    packages.microsoft.com's slurm-smd*: the plan's packages are all slurm-smd ones (or munge)."""
    from gpuprov.catalog import images
    from gpuprov.scheduler import builds, profile_build

    entry = images.profile(profile)
    assert "Pin-Priority: -1" in entry["slurm"]["source"] and "slurm-u.pin" in entry["slurm"]["source"]
    _, build = profile_build(profile)
    for names in build.packages.values():
        assert all(n.startswith("slurm-smd") or not n.startswith("slurm") for n in names), names
    assert build.cgroup_plugin == "cgroup/v2" and entry["slurm"]["pmix"]["prefix"] == "/opt/pmix"
    if profile == images.profile_for("azure", "Standard_ND96isr_H100_v5"):  # the default plan's
        assert builds("azure", "Standard_ND96isr_H100_v5") == {entry["os"]: build}


def test_ubuntu_2204_images_get_no_cgroup_plugin_their_slurm_lacks():
    """slurm-wlm 21.08 (Ubuntu 22.04) has a cgroup/v1 plugin only; 22.04 boots cgroup v2: every
    22.04 profile whose Slurm is older than 22.05 tracks by process tree, with no cgroup plugin."""
    from gpuprov.catalog import images
    from gpuprov.scheduler import catalog

    table = catalog()["slurm"]["builds"]
    for name, profile in images.profiles().items():
        build = table[profile["slurm"]["build"]]
        major_minor = tuple(int(x) for x in str(build["version"]).split(".")[:2])
        if major_minor < (22, 5):
            assert build["cgroup_plugin"] is None and build["proctrack"] == "proctrack/linuxproc", name
            assert "cgroup" not in build["task_plugin"], name
        else:
            assert build["cgroup_plugin"] == "cgroup/v2", name


def test_single_node_runs_torchrun_directly_unless_asked():
    spec = TrainingSpec(model="7b", cloud="aws")
    assert decide(spec, "aws", 1).kind == "none"
    assert decide(spec.model_copy(update={"slurm": "install"}), "aws", 1).kind == "slurm"
    assert decide(spec.model_copy(update={"slurm": "none"}), "aws", 4).kind == "none"


def test_existing_slurm_is_on_prem_only_and_renders_jobs_only():
    with pytest.raises(ValueError, match="slurm: existing needs cloud: onprem"):
        TrainingSpec(model="7b", cloud="aws", slurm="existing")
    plan = sample_plan("onprem", nodes=2)
    spec = plan.spec.model_copy(update={"slurm": "existing"})
    plan = plan.model_copy(update={"spec": spec, "scheduler": decide(spec, "onprem", 2, plan.hosts)})
    assert plan.scheduler.kind == "existing" and plan.scheduler.partition is None
    files = render_ansible(plan)
    plays = yaml.safe_load(files["site.yml"])
    assert not any(r.get("role") == "slurm" for p in plays for r in p.get("roles", []))
    assert "slurm_controller" not in files["group_vars/all.yml"] and "tasks_from: health.yml" not in files["health.yml"]
    sbatch = render_launch(plan)["slurm.sbatch"]
    assert "#SBATCH --requeue" in sbatch and "--partition" not in sbatch
    assert job.job_kind(plan) == "slurm"  # the job is still submitted, to the site's Slurm


@pytest.mark.parametrize("cloud", CLOUDS)
def test_rendered_glue_runs_the_slurm_role_and_checks_it(cloud):
    plan = sample_plan(cloud, nodes=2)
    files = render_ansible(plan)
    plays = yaml.safe_load(files["site.yml"])
    slurm = [p for p in plays if any(r.get("role") == "slurm" for r in p.get("roles", []))]
    assert len(slurm) == 1 and slurm[0]["hosts"] == "gpu_nodes"
    staging = next(p for p in plays if p.get("tags") == ["job"])
    assert staging["hosts"] == "gpu_nodes[0]"
    gv = yaml.safe_load(files["group_vars/all.yml"])
    assert gv["slurm_gpus_per_node"] == plan.cluster.gpus_per_node and gv["slurm_partition"] == "gpu"
    train = yaml.safe_load(render_launch(plan)["train.yaml"])
    # the job folders the role stages are the ones the trainer writes to
    assert gv["slurm_checkpoint_dir"] == train["checkpoint"]["dir"]
    assert gv["slurm_log_dir"] == str(Path(train["logging"]["metrics_file"]).parent)
    health = yaml.safe_load(files["health.yml"])
    assert any(t.get("ansible.builtin.include_role", {}).get("tasks_from") == "health.yml"
               for p in health for t in p.get("tasks", []))


def test_sbatch_asks_for_whole_gpu_nodes_requeues_and_logs_on_the_shared_filesystem():
    plan = sample_plan("aws", nodes=4)
    text = render_launch(plan)["slurm.sbatch"]
    directives = dict(ln[len("#SBATCH "):].split("=", 1) for ln in text.splitlines()
                      if ln.startswith("#SBATCH ") and "=" in ln)
    assert directives["--nodes"] == "4" and directives["--gpus-per-node"] == "8"
    assert directives["--output"].startswith(plan.shared_storage.mount_point + "/logs/")
    assert {"#SBATCH --exclusive", "#SBATCH --requeue"} <= set(text.splitlines())
    assert "--rdzv-backend c10d" in render_launch(plan)["train.sh"] and '"$LAUNCH_DIR/train.sh"' in text
    proc = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert proc.returncode == 0, proc.stderr


def _sbatch_starts(tmp_path, progress: bool, starts: int) -> list[tuple[int, bool]]:
    """Run the rendered slurm.sbatch `starts` times as Slurm would after each requeue, with srun and
    scontrol stood in for: training fails each time, writing a new complete checkpoint first when
    `progress`. Returns (exit code, requeued) per start."""
    from gpuprov.render.launch import run_paths

    plan = sample_plan("aws", nodes=2)
    paths = run_paths(plan)
    ckpt, logs = tmp_path / "ckpt", tmp_path / "logs"
    text = render_launch(plan)["slurm.sbatch"].replace(paths["checkpoint_dir"], str(ckpt)).replace(
        paths["log_dir"], str(logs))
    launch, bindir = tmp_path / "launch", tmp_path / "bin"
    for d in (launch, bindir, ckpt, logs):
        d.mkdir(parents=True, exist_ok=True)
    (launch / "slurm.sbatch").write_text(text)
    (launch / "train.sh").write_text("#!/bin/sh\nexit 1\n")
    (launch / "env.sh").write_text(":\n")
    (bindir / "scontrol").write_text('#!/bin/sh\n[ "$1" = requeue ] && touch "$REQUEUED"; [ "$1" = show ] && echo n1\nexit 0\n')
    write_step = f'n=$(ls {ckpt} | wc -l); mkdir -p {ckpt}/step-$((n + 1)); touch {ckpt}/step-$((n + 1))/.metadata; '
    (bindir / "srun").write_text("#!/bin/sh\n" + 'case "$*" in *hostname*) echo 10.0.0.5; exit 0;; esac\n'
                                 + (write_step if progress else "") + "exit 1\n")
    for tool in ("scontrol", "srun", "train.sh"):
        (bindir / tool if tool != "train.sh" else launch / tool).chmod(0o755)
    out = []
    for restart in range(starts):
        flag = tmp_path / f"requeued-{restart}"
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restart),
               "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "GPUPROV_LAUNCH_DIR": str(launch),
               "REQUEUED": str(flag)}
        proc = subprocess.run(["bash", str(launch / "slurm.sbatch")], env=env, capture_output=True, text=True)
        out.append((proc.returncode, flag.exists()))
    return out


def test_a_failure_without_progress_is_not_requeued_ten_times(tmp_path):
    """A run that fails before writing any new checkpoint, start after start, is deterministic: it is
    requeued at most max_requeues_without_progress times in a row, then ends failed; a run that
    checkpoints between failures (lost nodes, spot) keeps being requeued."""
    limit = sample_plan("aws", nodes=2).scheduler.max_requeues_without_progress
    assert 0 < limit < sample_plan("aws", nodes=2).scheduler.max_requeues
    stuck = _sbatch_starts(tmp_path / "stuck", progress=False, starts=limit + 1)
    assert stuck == [(0, True)] * limit + [(1, False)]
    moving = _sbatch_starts(tmp_path / "moving", progress=True, starts=limit + 2)
    assert moving == [(0, True)] * (limit + 2)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_up_dry_run_ends_with_the_job_submission(tmp_path, cloud):
    plan = sample_plan(cloud, nodes=2)
    root = tmp_path / "b"
    bundle.write_bundle(root, bundle.build_bundle(plan))
    proc = subprocess.run([sys.executable, "-m", "gpuprov", "up", str(root), "--dry-run"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    steps = [ln for ln in proc.stdout.splitlines() if ln[:1].isdigit()]
    assert "ansible 'gpu_nodes[0]'" in steps[-1] and "sbatch --parsable slurm.sbatch chdir=/shared/jobs/" in steps[-1]
    assert "start training" not in proc.stdout and "watch: gpuprov status" in proc.stdout


def test_single_node_up_starts_train_sh_in_the_background():
    plan = sample_plan("aws", nodes=1, sharding="fsdp")
    assert plan.scheduler.kind == "none" and job.job_kind(plan) == "direct"
    argv = job.submit_argv(plan)
    assert argv[-1].startswith("cd ") and "setsid nohup ./train.sh" in argv[-1] and argv[-1].endswith("& echo $!")


def test_submission_output_and_status_parsing():
    assert job.parse_submission("node-0 | CHANGED | rc=0 >>\n4242\n") == "4242"
    assert job.parse_submission("node-0 | CHANGED | rc=0 >>\n4243;cluster\n") == "4243"
    assert job.parse_submission("node-0 | FAILED | rc=1 >>\nsbatch: error: x\n") is None
    running = job_status.job_summary("slurm", "JobId=7 JobName=x JobState=RUNNING Reason=None Restarts=2 "
                                              "RunTime=00:01:02 NodeList=n[1-2]")
    assert running == {"state": "RUNNING", "restarts": 2, "nodes": "n[1-2]", "run_time": "00:01:02", "reason": None}
    assert job_status.job_summary("slurm", "slurm_load_jobs error: Invalid job id specified")["state"] == "GONE"
    text = "\n".join(['{"event": "start", "step": 0}', '{"step": 1, "loss": 9.0, "tokens_per_s": 5.0, "mfu": 0.1}',
                      '{"event": "start", "step": 1}', '{"step": 2, "loss": 8.0, "tokens_per_s": 6.0, "mfu": 0.2}',
                      '{"step": 3, "lo'])  # a torn last line while the trainer writes
    m = job_status.parse_metrics(text)
    assert m["starts"] == 2 and m["step"]["step"] == 2 and m["end"] is None
    plan = sample_plan("aws", nodes=2)
    r = job_status.report(plan, "7", "slurm", running, m)
    assert r["resumed_at"] == 1 and r["loss"] == 8.0 and r["plan"]["mfu"] == plan.throughput.mfu
    shown = job_status.lines(r)
    assert shown[0].startswith("job 7 (Slurm): RUNNING") and "requeued 2x" in shown[0]
    assert shown[1].startswith("step 2 of ") and "resumed at step 1" in shown[1]


def test_status_reads_the_job_completion_record_once_slurmctld_forgot_the_job(tmp_path, monkeypatch):
    """slurmctld forgets an ended job after MinJobAge; its jobcomp/filetxt record (slurm.conf
    JobCompLoc, the plan's jobcomp_loc) stays: status reports how it ended, not GONE. scontrol is
    stood in for; the record has jobcomp/filetxt's line format (test_slurm_role.py checks it against
    a real slurmctld's)."""
    from gpuprov.commands import status as status_cmd

    plan = sample_plan("aws", nodes=2)
    assert plan.scheduler.jobcomp_loc.startswith(plan.scheduler.state_save_location)
    comp = tmp_path / "jobcomp.log"
    comp.write_text("JobId=420 UserId=u(1000) GroupId=u(1000) Name=x JobState=COMPLETED Partition=gpu ExitCode=0:0\n"
                    "JobId=42 UserId=u(1000) GroupId=u(1000) Name=x JobState=NODE_FAIL Partition=gpu "
                    "NodeList=n-[00-01] EndTime=2026-12-06T01:00:00 ExitCode=0:0\n"
                    "JobId=42 UserId=u(1000) GroupId=u(1000) Name=x JobState=FAILED Partition=gpu "
                    "NodeList=n-[00-01] EndTime=2026-12-06T02:00:00 ExitCode=1:0\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified'\n")
    (bindir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    text, _ = status_cmd._local("slurm", "42", tmp_path / "metrics.jsonl", str(comp))
    summary = job_status.job_summary("slurm", text)
    assert summary["state"] == "FAILED" and "exit code 1:0" in summary["reason"] and summary["nodes"] == "n-[00-01]"
    assert job_status.job_summary("slurm", status_cmd._local("slurm", "42", tmp_path / "m", "")[0])["state"] == "GONE"


def test_status_without_a_job_is_a_one_line_error(tmp_path):
    root = tmp_path / "b"
    bundle.write_bundle(root, bundle.build_bundle(sample_plan("aws", nodes=2)))
    proc = subprocess.run([sys.executable, "-m", "gpuprov", "status", str(root)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "no training job recorded" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "gpuprov", "status", str(root), "--job", "1;rm"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "expected a number" in proc.stderr
