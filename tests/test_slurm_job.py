"""The generated slurm.sbatch under a real Slurm (slurmctld + two slurmd, Debian's slurm-wlm):
two nodes train the tiny model on CPU through to a checkpoint; one node is killed as a machine
dies; the job is requeued, waits for its nodes, resumes from the newest checkpoint and logs the
losses of an uninterrupted run. `gpuprov status` then reads the job and the metrics file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import slurm_cluster
from ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(600)]
pytest.importorskip("torch")
pytest.importorskip("transformers")
if slurm_cluster.missing():
    pytest.skip(slurm_cluster.missing(), allow_module_level=True)

from plan_fixtures import sample_plan  # noqa: E402

STEPS, EVERY = 30, 5
ARGS = ("--set", "data.synthetic=true", "--set", "export.at_end=false")


def small_bundle(root: Path) -> Path:
    """A whole bundle (plan.json, lock, launch/) for a sample two-node plan shrunk to CPU size, its
    shared mount (checkpoints, logs) inside root: what `gpuprov generate` writes, at test scale."""
    from gpuprov.bundle import build_bundle, write_bundle
    from gpuprov.targets.decide import decided

    plan = sample_plan("aws", 2, "hsdp", "full")
    cluster = plan.cluster.model_copy(update=dict(
        gpus_per_node=1, total_gpus=2, shard_group=1, replicate=2, activation_checkpointing="none", micro_batch=2,
        grad_accum=2, seq_len=32, global_batch_tokens=2 * 2 * 32 * 2))
    training = plan.training.model_copy(update=dict(steps=STEPS, warmup_steps=3, learning_rate=3e-3,
                                                    checkpoint_every_steps=EVERY, log_every_steps=1))
    shared = str(root / "shared")
    plan = decided(plan.model_copy(update=dict(
        cluster=cluster, training=training, storage=plan.storage.model_copy(update=dict(mount_point=str(root / "scratch"))),
        shared_storage=plan.shared_storage.model_copy(update=dict(mount_point=shared)))))
    assert plan.scheduler.kind == "slurm" and plan.provisioning.checkpoint_root == shared
    write_bundle(root / "bundle", build_bundle(plan))
    return root / "bundle"


def _status(cluster, bundle: Path, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "gpuprov", "status", str(bundle), *flags, "--json"],
                          env=dict(cluster.env, PYTHONPATH=os.pathsep.join(sys.path)), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _metrics(path: Path) -> list[list[dict]]:
    runs: list[list[dict]] = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start":
            runs.append([])
        runs[-1].append(rec)
    return runs


def _losses(run: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run if "loss" in r}


def _wait(predicate, what: str, timeout: float = 150, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def _submit(cluster, launch: Path, nodes: str, *args: str) -> str:
    """sbatch slurm.sbatch on these nodes (a requeued job waits for the same ones), train.py's *args."""
    # Four slurmd and two jobs' processes on one loaded 2-core machine: a restarted start can time out
    # or lose a peer before its first checkpoint more often than on a cluster: the job is allowed more
    # starts without progress than the plan's 2 (raised as an operator would, through the
    # environment); every start must still resume to the reference losses.
    env = dict(cluster.env, PYTHON=sys.executable, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               GPUPROV_HEAD_PORT=str(free_port()), GPUPROV_INVENTORY=str(launch / "no-inventory.yml"),
               GPUPROV_MAX_REQUEUES_WITHOUT_PROGRESS="6")
    env.pop("TORCHRUN", None)
    proc = subprocess.run(["sbatch", "--parsable", f"--nodelist={nodes}", "slurm.sbatch", *ARGS, *args], cwd=launch,
                          env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _finished(cluster, job_id: str) -> dict:
    # A requeued job waits out Slurm's own hold before it starts again (slurm.conf(5): cred_expire
    # "also controls how long a requeued job must wait"; 31 s in the test cluster). Released at once
    # (this test once did), a start found one node where the batch step was told two.
    job = cluster.job(job_id)
    return job if job["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else {}


def test_sbatch_two_nodes_killed_node_requeues_and_resumes(tmp_path_factory):
    # n1, n2 run the job that loses a node; n3, n4 the same job uninterrupted, at the same time
    with slurm_cluster.slurm_cluster(nodes=4, gpus=1) as cluster:
        bundle = small_bundle(cluster.root)
        launch = bundle / "launch"
        cfg = yaml.safe_load((launch / "train.yaml").read_text())
        ckpt, metrics = Path(cfg["checkpoint"]["dir"]), Path(cfg["logging"]["metrics_file"])
        log_dir = metrics.parent
        log_dir.mkdir(parents=True)  # `gpuprov up`'s submit step makes it; sbatch needs it for --output

        job = _submit(cluster, launch, "n1,n2")
        # The same job uninterrupted, into its own checkpoints and metrics: the reference losses.
        ref_metrics = log_dir / "reference.jsonl"
        ref = _submit(cluster, launch, "n3,n4", "--set", f"checkpoint.dir={ckpt.parent / 'reference'}",
                      "--set", f"logging.metrics_file={ref_metrics}")
        first = _wait(lambda: sorted(p for p in ckpt.glob("step-*") if (p / ".metadata").is_file()),
                      "the first checkpoint")
        killed = cluster.kill_node("n2")
        assert killed, "nothing of node n2 was running"
        done_at = int(first[-1].name.split("-")[1])

        # The survivors' collectives fail; slurmctld marks n2 DOWN (SlurmdTimeout) and requeues the
        # job, or the script requeues it first: either way it waits for two nodes again.
        _wait(lambda: cluster.job(job)["JobState"] == "PENDING" and cluster.job(job)["Restarts"] == "1",
              "the requeue", timeout=90)
        cluster.start_node("n2")  # the node comes back (a replaced VM registers the same way)
        _wait(lambda: cluster.node_states().get("n2") in ("idle", "mix", "alloc"), "n2 to register", timeout=120)
        state = _wait(lambda: _finished(cluster, job), "the requeued job", timeout=330, every=0.5)
        out = (log_dir / f"{cfg_name(launch)}-{job}.out").read_text()
        assert state["JobState"] == "COMPLETED", out[-4000:]
        # one requeue for the killed node; on a loaded machine a requeued start can fail again
        # (a node not yet answering) and be requeued once more: every start must resume correctly
        restarts = int(state["Restarts"])
        assert restarts >= 1
        assert "requeueing job" in out or "DUE TO NODE FAILURE" in out

        runs = _metrics(metrics)
        assert len(runs) >= 2, out[-3000:]
        # the start that trained to the end; a start after it (requeued once the last checkpoint was
        # written, seen once on a loaded machine, cause not seen) resumes at the last step and trains nothing
        resumed = [run for run in runs if _losses(run)][-1]
        for late in runs[runs.index(resumed) + 1:]:
            assert late[0]["step"] == STEPS and late[0]["world"] == 2 and not _losses(late), out[-3000:]
        assert resumed[0]["step"] >= done_at and resumed[0]["world"] == 2
        assert f"resumed from {ckpt}/step-" in out
        assert max(_losses(resumed)) == STEPS

        # what `up` records after its submit step; status reads it back with the metrics file
        (bundle / ".gpuprov-up.json").write_text(json.dumps({"job": {"id": job, "kind": "submit"}}))
        report = _status(cluster, bundle, "--local")
        assert report["job"]["id"] == job and report["job"]["state"] == "COMPLETED"
        assert report["job"]["restarts"] == restarts and report["starts"] == len(runs) and report["finished"]
        assert report["step"] == STEPS and report["loss"] == _losses(resumed)[STEPS]
        assert report["tokens_per_s"] > 0 and 0 < report["mfu"] < 1
        assert report["resumed_at"] == runs[-1][0]["step"] and report["plan"]["tokens_per_s"] > 0
        assert Path(report["log"]).is_file()
        # from the operator's machine: the same queries on the first node over Ansible
        (bundle / "ansible" / "inventory.yml").write_text(json.dumps({"all": {"children": {"gpu_nodes": {"hosts": {
            "node0": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}}}))
        assert _status(cluster, bundle) == report

        assert _wait(lambda: _finished(cluster, ref), "the reference job", timeout=200, every=0.5)["JobState"] == "COMPLETED"
        reference = _losses(_metrics(ref_metrics)[0])
        assert sorted(reference) == list(range(1, STEPS + 1))
        after = _losses(resumed)
        assert sorted(after) == list(range(resumed[0]["step"] + 1, STEPS + 1))
        for step, loss in after.items():
            assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step
        for run in runs[:runs.index(resumed)]:  # the killed start (and any failed restart) agrees as far as it got
            for step, loss in _losses(run).items():
                assert loss == pytest.approx(reference[step], rel=1e-5, abs=1e-6), step


def cfg_name(launch: Path) -> str:
    for line in (launch / "slurm.sbatch").read_text().splitlines():
        if line.startswith("#SBATCH --job-name="):
            return line.split("=", 1)[1]
    raise AssertionError("no job name")
