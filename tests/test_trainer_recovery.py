"""A killed worker recovers in place: torchrun restarts the group, the trainer resumes from its
newest checkpoint and finishes with the losses of a run that was never interrupted.

One node, FSDP on 2 CPU/gloo processes, async checkpoints every 2 steps, GPUPROV_MAX_RESTARTS=1:
SIGKILL one worker after the first checkpoint. (Across nodes, the scheduler's requeue is the
primary path: slurm.sbatch; this is the in-trainer side.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from test_trainer import checkpoints, finish, free_port, losses, render_small, runs, save_tiny_base, start, wait_for

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("torch")
pytest.importorskip("transformers")

STEPS = 16


def workers(launcher_pid: int) -> list[int]:
    """The training processes torchrun started (its children)."""
    out = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def test_killed_worker_restarts_and_finishes_with_uninterrupted_losses(tmp_path):
    base = save_tiny_base(tmp_path / "base")
    args = ("--set", "data.synthetic=true", "--set", "data.synthetic_samples=64", "--set", "model.init=pretrained",
            "--set", f"model.pretrained_path={base}", "--set", "precision.param_dtype=float32",
            "--set", "export.at_end=false", "--set", "checkpoint.async=true")

    clean = render_small(tmp_path / "clean", nodes=1, gpus_per_node=2, sharding="fsdp", ac="none", steps=STEPS,
                         checkpoint_every=2)
    finish(start(clean, *args, port=free_port()))
    (ref,) = runs(clean)
    want = losses(ref)
    assert sorted(want) == list(range(1, STEPS + 1))

    launch = render_small(tmp_path / "killed", nodes=1, gpus_per_node=2, sharding="fsdp", ac="none", steps=STEPS,
                          checkpoint_every=2)
    proc = start(launch, *args, port=free_port(), GPUPROV_MAX_RESTARTS="1")
    wait_for(lambda: any((c / ".metadata").is_file() for c in checkpoints(launch)), [proc], every=0.05)
    deadline = time.monotonic() + 30
    while len(workers(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(workers(proc.pid)[-1], signal.SIGKILL)
    out = finish(proc, timeout=400)
    attempts = runs(launch)
    assert len(attempts) == 2, out[-3000:]  # the first launch, then torchrun's restart
    first, second = attempts
    resumed = second[0]["step"]
    assert 2 <= resumed < STEPS and f"at step {resumed}" in out
    got = losses(second)
    assert sorted(got) == list(range(resumed + 1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got, want)
    for step, loss in losses(first).items():
        assert loss == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
