"""Run the GENERATED launch scripts for real: CPU PyTorch, gloo, a tiny Llama built from its config.

Each test renders a small plan into a temporary bundle, then starts launch/train.sh (torchrun,
c10d rendezvous on 127.0.0.1) with environment overrides only: the trainer code and the shell
scripts are exactly what a cluster gets. Kept to six short torchrun launches in all.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuprov.render.launch import render_launch
from plan_fixtures import sample_plan

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]
pytest.importorskip("torch")
pytest.importorskip("transformers")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_small(root: Path, *, nodes: int, gpus_per_node: int, sharding: str, task: str = "full",
                 ac: str = "selective", steps: int = 20, checkpoint_every: int = 10) -> Path:
    """A sample plan shrunk to CPU size (seq 32, micro-batch 2, accum 2), rendered to root/launch."""
    plan = sample_plan("aws", nodes, sharding, task)
    total = nodes * gpus_per_node
    shard = gpus_per_node if sharding == "hsdp" else total
    cluster = plan.cluster.model_copy(update=dict(
        gpus_per_node=gpus_per_node, total_gpus=total, shard_group=shard, replicate=total // shard,
        activation_checkpointing=ac, micro_batch=2, grad_accum=2, seq_len=32, global_batch_tokens=2 * 2 * 32 * total))
    training = plan.training.model_copy(update=dict(
        steps=steps, warmup_steps=3, learning_rate=3e-3, checkpoint_every_steps=checkpoint_every, log_every_steps=1))
    storage = plan.storage.model_copy(update=dict(mount_point=str(root / "scratch")))
    plan = plan.model_copy(update=dict(cluster=cluster, training=training, storage=storage))
    launch = root / "launch"
    launch.mkdir(parents=True)
    for name, text in render_launch(plan).items():
        (launch / name).write_text(text)
        if name.endswith((".sh", ".sbatch")):
            (launch / name).chmod(0o755)
    return launch


def start(launch: Path, *args: str, port: int, **env: str) -> subprocess.Popen:
    full_env = dict(os.environ, PYTHON=sys.executable, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", GPUPROV_MAX_RESTARTS="0",
                    GPUPROV_HEAD_PORT=str(port), GPUPROV_INVENTORY=str(launch / "no-inventory.yml"), **env)
    full_env.pop("TORCHRUN", None)
    # own session: a run that hangs is killed with its torchrun workers (see finish)
    return subprocess.Popen(["bash", str(launch / "train.sh"), *args], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(*procs: subprocess.Popen, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            # Kill every launch with its workers (nothing left holding ports for later tests) and
            # fail with what each printed, so a hang says where it stopped.
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            tails = "\n---\n".join((q.communicate()[0] or "")[-3000:] for q in procs)
            pytest.fail(f"training did not finish within {timeout:.0f} s; output:\n{tails}")
    text = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), text[-4000:]
    return text


def runs(launch: Path) -> list[list[dict]]:
    """metrics.jsonl split per launch: [start record, step records..., end record]."""
    metrics = next((launch.parent / "scratch" / "logs").glob("*/metrics.jsonl"))
    out: list[list[dict]] = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "start":
            out.append([])
        out[-1].append(rec)
    return out


def losses(run: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run if "loss" in r}


def checkpoints(launch: Path) -> list[Path]:
    return sorted((launch.parent / "scratch" / "checkpoints").glob("*/step-*"))


def test_fsdp_two_processes_memmap_data_resumes_to_same_losses(tmp_path):
    """1-D FSDP on 2 processes, bf16 params (the plan's policy), selective AC, data from uint16
    memmap shards; a resume from the step-6 checkpoint logs the same losses for steps 7-12."""
    import numpy as np

    launch = render_small(tmp_path, nodes=1, gpus_per_node=2, sharding="fsdp", steps=12, checkpoint_every=6)
    data = tmp_path / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):  # 2 shards; 12 steps x 8 samples x 32 tokens wraps around them (an epoch)
        rng.integers(0, 512, 1500, dtype=np.uint16).tofile(data / f"part-{i}.bin")
    args = ("--set", f"data.path={data}")

    finish(start(launch, *args, port=free_port()))
    first = runs(launch)
    assert first[0][0]["mesh"] == [2] and first[0][0]["world"] == 2 and first[0][0]["data"] == str(data)
    assert sorted(losses(first[0])) == list(range(1, 13))
    assert [c.name for c in checkpoints(launch)] == ["step-00000006", "step-00000012"]

    shutil.rmtree(checkpoints(launch)[-1])  # as if the job died after step 6's checkpoint
    out = finish(start(launch, *args, port=free_port()))
    assert "resumed from" in out and "at step 6" in out
    second = runs(launch)[1]
    assert second[0]["step"] == 6
    before, after = losses(first[0]), losses(second)
    assert sorted(after) == list(range(7, 13))
    for step in after:
        assert after[step] == pytest.approx(before[step], rel=1e-5, abs=1e-6), step


def test_two_nodes_hsdp_fixed_batch_loss_falls(tmp_path):
    """Two torchrun launches (two "nodes") rendezvous on 127.0.0.1; HSDP on a 2x1 (replicate x
    shard) mesh, full AC, fp32 via the config; on a fixed batch the loss must fall. The trainer
    itself checks that the replicas hold identical shards after initialisation."""
    launch = render_small(tmp_path, nodes=2, gpus_per_node=1, sharding="hsdp", ac="full", steps=20,
                          checkpoint_every=20)
    port = free_port()
    # one global batch: 2 micro-batches x 2 samples x 2 data-parallel ranks
    args = ("--set", "data.synthetic_samples=8", "--set", "precision.param_dtype=float32")
    nodes = [start(launch, *args, port=port, GPUPROV_HEAD_ADDR="127.0.0.1", GPUPROV_NODE_RANK=str(rank))
             for rank in (0, 1)]
    out = finish(*nodes)
    (run,) = runs(launch)
    assert run[0]["mesh"] == [2, 1] and run[0]["sharding"] == "hsdp" and run[0]["world"] == 2
    loss = losses(run)
    assert len(loss) == 20
    assert sum(loss[s] for s in (18, 19, 20)) / 3 < loss[1] - 1.0, loss
    assert all(r["tokens_per_s"] > 0 and r["mfu"] > 0 for r in run if "loss" in r)
    # a 2-D (HSDP) checkpoint, in a directory both "nodes" see
    assert [c.name for c in checkpoints(launch)] == ["step-00000020"] and "not shared" not in out


def base_loss_on_first_batch(model_dir: Path, launch: Path, samples: int) -> float:
    """The saved model's mean next-token loss on the trainer's first global batch (its own data code)."""
    import importlib.util

    import torch
    import torch.nn.functional as F
    import yaml
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location("generated_train", launch / "train.py")
    trainer = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = trainer  # its dataclasses look their module up
    try:
        spec.loader.exec_module(trainer)
    finally:
        del sys.modules[spec.name]
    cfg = yaml.safe_load((launch / "train.yaml").read_text())
    data = trainer.TokenWindows({"data": {"path": None, "synthetic_samples": samples}}, 32, 512,
                                cfg["training"]["seed"])
    tokens = data.batch(0, samples)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1]).logits
    return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))


def test_lora_from_pretrained_trains_only_the_adapters(tmp_path):
    """LoRA under FSDP2 on a local pretrained model (from_pretrained on rank 0, broadcast to the
    shards): the first loss is the base model's (B = 0), only lora_A/lora_B require grad, the
    checkpoint holds only adapter weights and their optimizer state, and the loss falls."""
    pytest.importorskip("peft")
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForCausalLM

    from plan_fixtures import TINY_LLAMA_CONFIG

    hf = dict(TINY_LLAMA_CONFIG)
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    base.to(torch.float32).save_pretrained(tmp_path / "base")

    launch = render_small(tmp_path, nodes=1, gpus_per_node=2, sharding="fsdp", task="lora", ac="none",
                          steps=12, checkpoint_every=12)
    out = finish(start(launch, "--set", "data.synthetic_samples=8", "--set", "optimizer.lr=0.01",
                       "--set", f"model.pretrained_path={tmp_path / 'base'}",
                       "--set", "precision.param_dtype=float32", port=free_port()))
    assert "pretrained:" in out
    (run,) = runs(launch)
    start_rec = run[0]
    assert start_rec["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in start_rec["trainable"])
    assert {n.split(".")[-4] for n in start_rec["trainable"]} == {"q_proj", "v_proj"}  # the plan's targets
    assert 0 < start_rec["trainable_params"] < start_rec["total_params"] / 10
    loss = losses(run)
    assert loss[1] == pytest.approx(base_loss_on_first_batch(tmp_path / "base", launch, 8), rel=1e-4)
    assert loss[12] < loss[1] - 0.1, loss

    (ckpt,) = checkpoints(launch)
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("app.model.")]
    state_keys = [k for k in keys if k.startswith("app.optim.state.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert state_keys and all("lora_" in k for k in state_keys), state_keys


def test_ddp_two_processes_bf16_autocast(tmp_path):
    """The plan's ddp sharding: DDP with bf16 autocast and no_sync over the accumulation steps."""
    launch = render_small(tmp_path, nodes=1, gpus_per_node=2, sharding="ddp", ac="full", steps=12,
                          checkpoint_every=0)  # 0: no checkpoints
    finish(start(launch, "--set", "data.synthetic_samples=8", port=free_port()))
    (run,) = runs(launch)
    assert run[0]["mesh"] is None and run[0]["world"] == 2 and run[0]["sharding"] == "ddp"
    loss = losses(run)
    assert loss[12] < loss[1] - 0.5, loss


@pytest.fixture(scope="module")
def trainer_module(tmp_path_factory):
    """The generated train.py imported in-process, with its rendered train.yaml path."""
    import importlib.util

    launch = render_small(tmp_path_factory.mktemp("unit"), nodes=1, gpus_per_node=1, sharding="fsdp",
                          task="qlora", steps=100)
    spec = importlib.util.spec_from_file_location("generated_train_unit", launch / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module, launch / "train.yaml"
    del sys.modules[spec.name]


def test_config_overrides_and_clear_errors(trainer_module):
    train, yaml_path = trainer_module
    cfg = train.load_config(str(yaml_path), ["batch.seq_len=64", "data.path=null", "task.lora.targets=[q_proj]"])
    assert cfg["batch"]["seq_len"] == 64 and cfg["data"]["path"] is None and cfg["task"]["lora"]["targets"] == ["q_proj"]
    with pytest.raises(SystemExit, match="unknown key 'seqlen'"):
        train.load_config(str(yaml_path), ["batch.seqlen=64"])
    with pytest.raises(SystemExit, match="section.key=value"):
        train.load_config(str(yaml_path), ["batch.seq_len"])
    # QLoRA's 4-bit kernels are CUDA-only: on CPU a one-line reason, not a bitsandbytes traceback
    cfg = train.load_config(str(yaml_path), ["runtime.device=cpu"])
    rt = train.Runtime(0, 1, 0, train.torch.device("cpu"), None, 0, 1, 0)
    with pytest.raises(SystemExit, match="qlora needs CUDA"):
        train.build_model(cfg, rt)


def test_lr_schedule_warmup_then_cosine(trainer_module):
    train, yaml_path = trainer_module
    cfg = train.load_config(str(yaml_path), [])  # lr 3e-3, warmup 3, 100 steps, floor 0.1
    lrs = [train.lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[2] == pytest.approx(3e-3)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # non-increasing after warmup
    assert train.lr_at(100, cfg) == pytest.approx(3e-4)  # lr x min_lr_ratio at the end


def test_memmap_windows_stay_inside_each_file(trainer_module, tmp_path):
    import numpy as np

    train, _ = trainer_module
    (tmp_path / "a.bin").write_bytes(np.arange(0, 21, dtype=np.uint16).tobytes())  # 2 windows of 10+1
    (tmp_path / "b.bin").write_bytes(np.arange(100, 111, dtype=np.uint16).tobytes())  # 1 window
    data = train.TokenWindows({"data": {"path": str(tmp_path), "dtype": "uint16"}}, 10, 512, 0)
    assert len(data) == 3
    assert data.sample(0).tolist() == list(range(0, 11))
    assert data.sample(1).tolist() == list(range(10, 21))
    assert data.sample(2).tolist() == list(range(100, 111))
    assert data.sample(3).tolist() == data.sample(0).tolist()  # next epoch
    synthetic = train.TokenWindows({"data": {"path": None, "synthetic_samples": None}}, 10, 512, 0)
    assert synthetic.batch(5, 2).shape == (2, 11) and synthetic.sample(5).tolist() == synthetic.sample(5).tolist()


def test_adamw_is_fused_on_cuda_only(trainer_module, monkeypatch):
    """The plan's memory estimate assumes a fused AdamW step (no state-sized foreach temporary)."""
    train, yaml_path = trainer_module
    seen: list[dict] = []

    class Recorder:
        def __init__(self, groups, **kw):
            seen.append(kw)

    monkeypatch.setattr(train.torch.optim, "AdamW", Recorder)
    model = train.torch.nn.Linear(4, 4)
    for device, offload, fused in (("cuda", "none", True), ("cpu", "none", False), ("cuda", "optimizer", False)):
        cfg = train.load_config(str(yaml_path), [f"parallel.offload={offload}"])
        rt = train.Runtime(0, 1, 0, train.torch.device(device), None, 0, 1, 0)  # no CUDA needed to say "cuda"
        train.build_optimizer(model, cfg, rt)
        assert seen[-1].get("fused", False) is fused, (device, offload, seen[-1])

