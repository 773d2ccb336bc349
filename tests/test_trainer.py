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
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gpuprov.render.launch import render_launch
from plan_fixtures import sample_plan
from ports import free_port

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(300)]
pytest.importorskip("torch")
pytest.importorskip("transformers")


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
    return write_launch(plan.model_copy(update=dict(cluster=cluster, training=training)), root)


def write_launch(plan, root: Path) -> Path:
    """The plan's launch/ under root, its scratch and shared mounts (checkpoints, logs) at root/scratch."""
    storage = plan.storage.model_copy(update=dict(mount_point=str(root / "scratch")))
    update = dict(storage=storage)
    if plan.shared_storage is not None:  # several "nodes" checkpoint to the shared mount: this test's own
        update["shared_storage"] = plan.shared_storage.model_copy(update=dict(mount_point=str(root / "scratch")))
    if plan.provisioning is not None:  # checkpoints where the target put them: this test's scratch
        update["provisioning"] = plan.provisioning.model_copy(update=dict(checkpoint_root=str(root / "scratch")))
    plan = plan.model_copy(update=update)
    launch = root / "launch"
    launch.mkdir(parents=True)
    files = render_launch(plan)
    assert yaml.safe_load(files["train.yaml"])["checkpoint"]["dir"].startswith(str(root)), \
        "a test run must never checkpoint outside its own directory"
    for name, text in files.items():
        (launch / name).write_text(text)
        if name.endswith((".sh", ".sbatch")):
            (launch / name).chmod(0o755)
    return launch


def start(launch: Path, *args: str, port: int, **env: str) -> subprocess.Popen:
    full_env = dict(os.environ, PYTHON=sys.executable, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", GPUPROV_MAX_RESTARTS="0",
                    GPUPROV_HEAD_PORT=str(port), GPUPROV_INVENTORY=str(launch / "no-inventory.yml"))
    full_env.update(env)
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
    args = ("--set", "data.synthetic=true", "--set", "data.synthetic_samples=8", "--set", "precision.param_dtype=float32")
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
    data = trainer.TokenWindows(trainer.DataSection(synthetic=True, synthetic_samples=samples), 32, 512,
                                cfg["training"]["seed"])
    tokens, _ = data.batch(0, samples)
    # the trainer keeps a LoRA base in bf16 (as the plan sizes it) and computes in fp32 here
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).float().eval()
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
                          steps=12, checkpoint_every=6)
    args = ("--set", "data.synthetic=true", "--set", "data.synthetic_samples=8", "--set", "optimizer.lr=0.01",
            "--set", f"model.pretrained_path={tmp_path / 'base'}", "--set", "precision.param_dtype=float32")
    out = finish(start(launch, *args, port=free_port()))
    assert "pretrained:" in out
    (run,) = runs(launch)
    start_rec = run[0]
    # the frozen base in bf16 as the plan sizes it (not the fp32 master dtype), adapters in fp32
    assert start_rec["dtypes"] == {"trainable": ["float32"], "frozen": ["bfloat16"]}
    assert start_rec["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in start_rec["trainable"])
    assert {n.split(".")[-4] for n in start_rec["trainable"]} == {"q_proj", "v_proj"}  # the plan's targets
    assert 0 < start_rec["trainable_params"] < start_rec["total_params"] / 10
    loss = losses(run)
    assert loss[1] == pytest.approx(base_loss_on_first_batch(tmp_path / "base", launch, 8), rel=1e-4)
    assert loss[12] < loss[1] - 0.1, loss

    ckpt = checkpoints(launch)[-1]
    keys = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("app.model.")]
    state_keys = [k for k in keys if k.startswith("app.optim.state.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert state_keys and all("lora_" in k for k in state_keys), state_keys

    # Resume from step 6: the checkpoint has no frozen base, and loading must not demand it.
    shutil.rmtree(ckpt)
    out = finish(start(launch, *args, port=free_port()))
    assert "at step 6" in out
    after = losses(runs(launch)[1])
    assert sorted(after) == list(range(7, 13))
    for step in after:
        assert after[step] == pytest.approx(loss[step], rel=1e-5, abs=1e-6), step
    # the adapter exported at the end loads into PEFT on the base
    from peft import PeftModel

    export = launch.parent / "scratch" / "checkpoints" / ckpt.parent.name / "export" / ckpt.name
    assert PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), export)


def test_ddp_two_processes_bf16_autocast(tmp_path):
    """The plan's ddp sharding: DDP with bf16 autocast and no_sync over the accumulation steps."""
    launch = render_small(tmp_path, nodes=1, gpus_per_node=2, sharding="ddp", ac="full", steps=12,
                          checkpoint_every=0)  # 0: no checkpoints
    traces = tmp_path / "traces"
    finish(start(launch, "--set", "data.synthetic=true", "--set", "data.synthetic_samples=8",
                 "--set", "runtime.profile_steps=[3, 4]", "--set", f"runtime.trace_dir={traces}", port=free_port()))
    (run,) = runs(launch)
    assert run[0]["mesh"] is None and run[0]["world"] == 2 and run[0]["sharding"] == "ddp"
    loss = losses(run)
    assert loss[12] < loss[1] - 0.5, loss
    # runtime.profile_steps: one chrome trace per rank of steps 3..4, with the step's matmuls in it
    for rank in (0, 1):
        trace = json.loads((traces / f"trace-rank{rank}-steps3-4.json").read_text())
        assert any("mm" in e.get("name", "") for e in trace["traceEvents"])


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
    assert cfg.batch.seq_len == 64 and cfg.data.path is None and cfg.task.lora.targets == ["q_proj"]
    # a wrong key or value: one line naming it
    with pytest.raises(SystemExit, match=r"^train.py: batch.seqlen: unknown key \(known: micro_batch"):
        train.load_config(str(yaml_path), ["batch.seqlen=64"])
    with pytest.raises(SystemExit, match=r"^train.py: batch.seq_len: expected an integer, got 'long'$"):
        train.load_config(str(yaml_path), ["batch.seq_len=long"])
    with pytest.raises(SystemExit, match=r"^train.py: parallel.sharding: 'zero3' is not one of fsdp"):
        train.load_config(str(yaml_path), ["parallel.sharding=zero3"])
    with pytest.raises(SystemExit, match=r"^train.py: optimiser: unknown key"):
        train.load_config(str(yaml_path), ["optimiser.lr=1"])
    with pytest.raises(SystemExit, match=r"^train.py: batch.micro_batch: must be at least 1, got 0$"):
        train.load_config(str(yaml_path), ["batch.micro_batch=0"])
    assert train.load_config(str(yaml_path), ["checkpoint.async=false"]).checkpoint.async_save is False
    assert train.load_config(str(yaml_path), ["optimizer.lr=1e-5"]).optimizer.lr == 1e-5  # YAML 1.1 reads a string
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
    assert lrs[3] == pytest.approx(3e-3)  # the first step after warmup is at the peak
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))  # decreasing after warmup
    assert lrs[99] == pytest.approx(3e-4)  # the last step (0-based 99) trains at lr x min_lr_ratio


def test_memmap_windows_stay_inside_each_file(trainer_module, tmp_path):
    import numpy as np

    train, _ = trainer_module
    (tmp_path / "a.bin").write_bytes(np.arange(0, 21, dtype=np.uint16).tobytes())  # 2 windows of 10+1
    (tmp_path / "b.bin").write_bytes(np.arange(100, 111, dtype=np.uint16).tobytes())  # 1 window
    data = train.TokenWindows(train.DataSection(path=str(tmp_path), dtype="uint16"), 10, 512, 0)
    assert len(data) == 3
    assert data.sample(0).tolist() == list(range(0, 11))
    assert data.sample(1).tolist() == list(range(10, 21))
    assert data.sample(2).tolist() == list(range(100, 111))
    # the next epoch visits the same windows in its own seeded order, the same on a resume
    first = sorted(tuple(data.sample(i).tolist()) for i in range(3))
    assert sorted(tuple(data.sample(i).tolist()) for i in range(3, 6)) == first
    again = train.TokenWindows(train.DataSection(path=str(tmp_path), dtype="uint16"), 10, 512, 0)
    assert [again.sample(i).tolist() for i in range(3, 6)] == [data.sample(i).tolist() for i in range(3, 6)]
    synthetic = train.TokenWindows(train.DataSection(synthetic=True), 10, 512, 0)
    assert synthetic.batch(5, 2)[0].shape == (2, 11) and synthetic.sample(5).tolist() == synthetic.sample(5).tolist()
    # ids the model has no embedding for: a clear error, not an index error deep in the forward
    with pytest.raises(SystemExit, match="outside the model's vocabulary of 50"):
        train.TokenWindows(train.DataSection(path=str(tmp_path), dtype="uint16"), 10, 50, 0).batch(2, 1)


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



def save_tiny_base(path: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from plan_fixtures import TINY_LLAMA_CONFIG

    hf = dict(TINY_LLAMA_CONFIG)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf)).save_pretrained(path)
    return path


def wait_for(predicate, procs, timeout: float = 200, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            pytest.fail("training ended or stalled before its first checkpoint:\n"
                        + "\n---\n".join((q.communicate()[0] or "")[-2000:] for q in procs))
        time.sleep(every)


@pytest.mark.parametrize("task", ["full", "lora"])
def test_two_nodes_killed_run_resumes_from_shared_checkpoints(tmp_path, task):
    """Two "nodes" (two torchrun launches, HSDP 2x1) from a pretrained base, checkpoints in the one
    directory both see; SIGKILL after the first checkpoint, then start again: the run resumes and
    finishes. Full training resumes without reading the pretrained weights again (they are gone)."""
    if task == "lora":
        pytest.importorskip("peft")
    base = save_tiny_base(tmp_path / "base")
    steps = 30  # enough that the kill after the first checkpoint lands mid-run on a fast machine
    launch = render_small(tmp_path, nodes=2, gpus_per_node=1, sharding="hsdp", task=task, ac="none", steps=steps,
                          checkpoint_every=2)
    args = ("--set", "data.synthetic=true", "--set", "model.init=pretrained", "--set", f"model.pretrained_path={base}",
            "--set", "export.at_end=false")

    def launch_nodes():
        port = free_port()
        return [start(launch, *args, port=port, GPUPROV_HEAD_ADDR="127.0.0.1", GPUPROV_NODE_RANK=str(r))
                for r in (0, 1)]

    nodes = launch_nodes()
    wait_for(lambda: any((c / ".metadata").is_file() for c in checkpoints(launch)), nodes, every=0.05)
    for p in nodes:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    done = [c for c in checkpoints(launch) if (c / ".metadata").is_file()]
    assert int(done[-1].name.split("-")[1]) < steps, "the first launch finished before the kill"
    if task == "full":
        for f in base.glob("*.safetensors"):
            f.unlink()  # a full-training resume must not need them: the checkpoint has every weight
    out = finish(*launch_nodes())
    assert f"resumed from {done[-1]}" in out
    assert ("pretrained files not read" in out) == (task == "full") and ("pretrained:" in out) == (task == "lora")
    last = runs(launch)[-1]
    assert last[0]["step"] == int(done[-1].name.split("-")[1]) and max(losses(last)) == steps


def test_two_nodes_refuse_node_local_checkpoints(tmp_path):
    """Each "node" writes checkpoints to its own directory: refused at start, one clear line."""
    launch = render_small(tmp_path, nodes=2, gpus_per_node=1, sharding="hsdp", steps=4, checkpoint_every=2)
    port = free_port()
    nodes = [start(launch, "--set", "data.synthetic=true", "--set", f"checkpoint.dir={tmp_path / f'local{r}'}",
                   port=port, GPUPROV_HEAD_ADDR="127.0.0.1", GPUPROV_NODE_RANK=str(r)) for r in (0, 1)]
    outs = [p.communicate(timeout=200)[0] for p in nodes]
    assert all(p.returncode != 0 for p in nodes)
    assert "is not shared by all 2 nodes" in "".join(outs) and "step      1" not in "".join(outs)


def tiny_tokenizer(path: Path, corpus: list[str]) -> Path:
    """A word-level tokenizer built here (no download), saved as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


def test_prepared_instruction_jsonl_trains_validates_and_exports(tmp_path):
    """JSONL instruction data -> prepare_data.py (tokenizer built here) -> FSDP on 2 processes with a
    loss mask and a validation split; the validation loss falls; the HF export loads in
    transformers and gives the trainer's own logits."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    words = [f"w{i}" for i in range(40)]
    rng = np.random.default_rng(0)
    records = []
    for _ in range(300):  # the response repeats the prompt: learnable, and only the response is trained on
        prompt = " ".join(rng.choice(words, 6))
        records.append({"prompt": "copy " + prompt, "response": prompt})
    corpus = [r["prompt"] + " " + r["response"] for r in records]
    tok_dir = tiny_tokenizer(tmp_path / "tok", corpus)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))

    launch = render_small(tmp_path, nodes=1, gpus_per_node=2, sharding="fsdp", ac="none", steps=30,
                          checkpoint_every=30)
    data = tmp_path / "data"
    prep = subprocess.run([sys.executable, str(launch / "prepare_data.py"), "--tokenizer", str(tok_dir), "--seq-len",
                           "32", "--prompt-field", "prompt", "--response-field", "response", "--val-fraction", "0.1",
                           "--out", str(data), str(jsonl)], capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr
    meta = json.loads((data / "meta.json").read_text())
    assert meta["loss_mask"] and meta["val_samples"] > 0 and meta["dtype"] == "uint16"
    ids = np.fromfile(data / "train" / "part-00000.bin", dtype="<u2")
    mask = np.fromfile(data / "train" / "part-00000.mask", dtype=np.uint8)
    eos = meta["eos_token_id"]
    # each sample's closing EOS is trained on; the EOS padding after whole samples is not
    assert len(ids) == len(mask) and mask[ids == eos].sum() > 100 and not mask[ids == eos].all() and not mask.all()
    assert meta["packing"] == "whole" and eos not in ids[:-1:32].tolist()  # every window opens on a prompt

    out = finish(start(launch, "--set", f"data.path={data}", "--set", "data.validation.every_steps=10",
                       "--set", "data.validation.batches=2", "--set", "precision.param_dtype=float32",
                       "--set", "export.dtype=float32", port=free_port()))
    (run,) = runs(launch)
    val = [r["val_loss"] for r in run if "val_loss" in r]
    assert len(val) == 3 and val[2] < val[0] - 0.3, (val, out[-2000:])

    # the trainer's own model (one process, loaded from the 2-rank checkpoint) vs the HF export
    trainer = load_trainer(launch)
    cfg = trainer.load_config(str(launch / "train.yaml"), [
        "parallel.sharding=none", "parallel.replicate=1", "parallel.shard=1", "precision.param_dtype=float32",
        "runtime.device=cpu", f"data.path={data}"])
    rt = trainer.init_runtime(cfg)
    model, _ = trainer.prepare_model(cfg, rt, from_checkpoint=True)
    ckpt = checkpoints(launch)[-1]
    trainer.load_checkpoint(trainer.TrainState(model, trainer.build_optimizer(model, cfg, rt), False), ckpt)
    tokens, labels = trainer.TokenWindows(cfg.data, 32, 512, 0, split="val").batch(0, 2)
    assert (labels == -100).any()  # the prompt tokens carry no loss
    exported = AutoModelForCausalLM.from_pretrained(ckpt.parent / "export" / ckpt.name, dtype=torch.float32).eval()
    model.eval()
    with torch.no_grad():
        ours, theirs = model(input_ids=tokens).logits, exported(input_ids=tokens).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def load_trainer(launch: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("generated_train_e2e", launch / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_refuses_synthetic_data_and_random_base_unless_asked(trainer_module):
    train, yaml_path = trainer_module
    cfg = train.load_config(str(yaml_path), [])
    assert cfg.data.path is None and cfg.data.synthetic is False
    with pytest.raises(SystemExit, match="data.synthetic=true"):
        train.TokenWindows(cfg.data, 32, 512, 0)
    lora = train.load_config(str(yaml_path), ["task.kind=lora"])
    assert lora.model.init == "pretrained"  # adapters need a real base
    with pytest.raises(SystemExit, match="pretrained_path is null"):
        train.pretrained_path(lora)
    assert train.pretrained_path(train.load_config(str(yaml_path), ["task.kind=lora", "model.init=random"])) is None


def test_lora_base_is_frozen_in_bf16_and_attention_is_requested(trainer_module):
    pytest.importorskip("peft")
    train, yaml_path = trainer_module
    cfg = train.load_config(str(yaml_path), ["task.kind=lora", "task.frozen_dtype=bfloat16", "model.init=random",
                                            "runtime.device=cpu"])
    rt = train.Runtime(0, 1, 0, train.torch.device("cpu"), None, 0, 1, 0)
    model, _ = train.build_model(cfg, rt)
    assert model.config._attn_implementation == cfg.model.attn_implementation == "sdpa"
    model = train.apply_lora(model, cfg)
    train.cast_frozen(model, cfg)
    assert train.param_dtypes(model) == {"trainable": ["float32"], "frozen": ["bfloat16"]}
    with pytest.raises(SystemExit, match="unknown model.attn_implementation"):
        train.check_attention("flash")
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit, match="flash-attn"):
            train.check_attention("flash_attention_2")


def test_tf32_torch_floor_and_record(trainer_module):
    train, yaml_path = trainer_module
    torch = train.torch
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        train.configure_backends(train.load_config(str(yaml_path), ["precision.tf32=true"]))
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(before)
        torch.backends.cuda.matmul.allow_tf32 = False
    cfg = train.load_config(str(yaml_path), [])
    assert cfg.runtime.min_torch == "2.7"
    with pytest.raises(SystemExit, match="older than runtime.min_torch 99.0"):
        train.check_torch("99.0")
    train.check_torch(cfg.runtime.min_torch)  # the torch these tests run passes
    assert hasattr(train.main, "__wrapped__")  # torchelastic @record


def test_tokens_per_s_leaves_out_checkpoints_and_mfu_follows_seq_len(trainer_module, tmp_path):
    train, yaml_path = trainer_module
    cfg = train.load_config(str(yaml_path), [f"logging.metrics_file={tmp_path / 'm.jsonl'}"])
    m = cfg.mfu
    plan_seq = m.plan_seq_len
    assert train.flops_per_token(m, plan_seq) == pytest.approx(m.flops_per_token)
    assert train.flops_per_token(m, 2 * plan_seq) == pytest.approx(m.flops_per_token + m.attention_flops_per_token)
    rt = train.Runtime(0, 1, 0, train.torch.device("cpu"), None, 0, 1, 0)
    metrics = train.Metrics(cfg, rt, tokens_per_step=1000, seq_len=plan_seq)
    with metrics.paused():
        time.sleep(0.5)  # a checkpoint
    metrics.step_done(1, 1.0, 1.0, 1e-3, every=1)
    rec = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert rec["tokens_per_s"] > 1000 / 0.25  # the 0.5 s pause is not counted


def test_readme_names_the_variables_train_sh_reads():
    import re

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    launch = render_launch(sample_plan("aws", 2, "hsdp", "full"))
    named = set(re.findall(r"`(GPUPROV_[A-Z_]+)`", readme))
    assert {"GPUPROV_HEAD_ADDR", "GPUPROV_NODE_RANK"} <= named
    assert all(v in launch["train.sh"] for v in named), named
    assert "set `HEAD`" not in readme


def test_compile_per_block_on_cuda_and_float8_refused_without_it(trainer_module):
    train, yaml_path = trainer_module
    torch = train.torch
    blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    cfg = train.load_config(str(yaml_path), ["efficiency.compile=true"])
    train.apply_compile(blocks, cfg, train.Runtime(0, 1, 0, torch.device("cpu"), None, 0, 1, 0))
    assert not any(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks)  # CPU: eager
    train.apply_compile(blocks, cfg, train.Runtime(0, 1, 0, torch.device("cuda"), None, 0, 1, 0))
    assert all(isinstance(b, torch._dynamo.eval_frame.OptimizedModule) for b in blocks)  # one unit per block
    cfg = train.load_config(str(yaml_path), ["efficiency.float8=true"])
    with pytest.raises(SystemExit, match="float8 needs an sm_89"):
        train.apply_float8(torch.nn.Linear(4, 4), cfg, train.Runtime(0, 1, 0, torch.device("cpu"), None, 0, 1, 0))


def test_loss_over_labelled_tokens_only(trainer_module):
    train, _ = trainer_module
    torch = train.torch

    class Fixed(torch.nn.Module):  # logits that put all mass on token 0
        def forward(self, input_ids):
            logits = torch.full((*input_ids.shape, 8), -30.0)
            logits[..., 0] = 30.0
            return type("Out", (), {"logits": logits})()

    tokens = torch.zeros(1, 5, dtype=torch.long)
    labels = torch.tensor([[0, 3, -100, -100]])  # one right, one wrong (-60 nats), two masked
    loss = train.next_token_loss(Fixed(), tokens[:, :-1], labels)
    assert float(loss) == pytest.approx(60.0 / 2, rel=1e-4)
    assert float(train.next_token_loss(Fixed(), tokens[:, :-1], torch.full((1, 4), -100))) == 0.0  # no NaN


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_chunked_loss_head_equals_the_whole_sequence_loss(trainer_module, model_type):
    """efficiency.chunked_cross_entropy (the plan's stack): same loss and gradients as the plain
    loss, over a length the chunks do not divide, with masked labels and Gemma-2's logit soft-cap."""
    import copy

    import transformers

    train, yaml_path = trainer_module
    torch = train.torch
    cfg = train.load_config(str(yaml_path), ["task.kind=full", "efficiency.chunked_cross_entropy=true"])
    small = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    if model_type == "gemma2":
        config = transformers.Gemma2Config(**small, final_logit_softcapping=5.0, attn_implementation="eager")
    else:
        config = transformers.LlamaConfig(**small)
    torch.manual_seed(0)
    plain = transformers.AutoModelForCausalLM.from_config(config).float()
    chunked = copy.deepcopy(plain)
    train.install_chunked_loss(chunked, cfg)
    assert type(chunked.get_output_embeddings()) is train.ChunkedLossHead
    from gpuprov.catalog import load_data

    assert train.LOSS_CHUNKS == load_data("memory_constants.yaml")["cross_entropy"]["chunks"]  # what the plan sizes
    tokens = torch.randint(0, 97, (2, 38))
    labels = tokens[:, 1:].clone()
    labels[0, :9] = -100  # a prompt: no loss there
    want = train.next_token_loss(plain, tokens[:, :-1], labels)
    got = train.next_token_loss(chunked, tokens[:, :-1], labels)
    want.backward()
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), chunked.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the head is the plain head again outside the loss, the soft-cap back in the config
    assert getattr(chunked.config, "final_logit_softcapping", None) == getattr(config, "final_logit_softcapping", None)
    torch.testing.assert_close(chunked(input_ids=tokens).logits, plain(input_ids=tokens).logits)
    # under TP the head stays plain (loss_parallel), as the plan sizes it
    tp = train.load_config(str(yaml_path), ["task.kind=full", "efficiency.chunked_cross_entropy=true", "parallel.tp=2"])
    again = copy.deepcopy(plain)
    train.install_chunked_loss(again, tp)
    assert type(again.get_output_embeddings()) is torch.nn.Linear


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_documents_do_not_attend_across(trainer_module, tmp_path, attn):
    """Sample starts recorded beside the tokens give each window's tokens a document id: positions
    restart at each document and attention stays inside it, so a document packed after another gets
    the logits it gets alone; an EOS inside a document splits nothing; without the starts file (or
    with document_attention off) a window is one causal sequence."""
    import numpy as np
    import transformers

    train, _ = trainer_module
    torch = train.torch
    eos = 2
    docs = torch.tensor([[4, 4, 4, 9, 9]])
    assert train.document_positions(docs).tolist() == [[0, 1, 2, 0, 1]]
    assert train.document_mask(docs)[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    (tmp_path / "train").mkdir()
    stream = np.array([5, 6, 7, eos, 9, 10, eos, 12, eos], dtype=np.uint16)  # the second document holds an EOS
    stream.tofile(tmp_path / "train" / "part-00000.bin")
    np.array([0, 4], dtype="<i8").tofile(tmp_path / "train" / "part-00000.starts")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "eos_token_id": eos}))
    data = train.TokenWindows(train.DataSection(path=str(tmp_path)), 8, 97, 0)
    batch = data.micro_batch(0, 1)
    assert data.documents and batch.positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch.documents.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    off = train.TokenWindows(train.DataSection(path=str(tmp_path), document_attention=False), 8, 97, 0)
    assert off.micro_batch(0, 1).documents is None and off.micro_batch(0, 1).positions is None
    (tmp_path / "train" / "part-00000.starts").unlink()
    assert train.TokenWindows(train.DataSection(path=str(tmp_path)), 8, 97, 0).micro_batch(0, 1).documents is None

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn,
                                      use_cache=False)  # as the trainer builds it: no KV cache
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    inputs = batch.inputs
    kw = train.model_inputs(attn, batch.documents)
    with torch.no_grad():
        packed = model(input_ids=inputs, **kw).logits
        alone = model(input_ids=inputs[:, 4:]).logits
        crossed = model(input_ids=inputs).logits
    torch.testing.assert_close(packed[:, 4:], alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(crossed[:, 4:], alone, atol=1e-3)
    # the trainer's loss takes the same positions and mask
    labels = torch.tensor([[6, 7, eos, 9, 10, eos, 12, eos]])
    with torch.no_grad():
        got = train.batch_loss_sum(model, train.Batch(inputs, labels, batch.positions, batch.documents))
        want = torch.nn.functional.cross_entropy(packed.flatten(0, 1), labels.flatten(), reduction="sum")
    assert float(got) == pytest.approx(float(want), rel=1e-6)


def test_non_finite_step_is_skipped_counted_and_shown(trainer_module, tmp_path, capsys):
    """A step whose loss or gradient norm is NaN/inf changes no weight and no optimizer state; the
    metrics line and metrics.jsonl count it; the next finite step trains as usual."""
    import transformers

    train, yaml_path = trainer_module
    torch = train.torch
    cfg = train.load_config(str(yaml_path), ["task.kind=full", "runtime.device=cpu", "precision.param_dtype=float32",
                                            f"logging.metrics_file={tmp_path / 'm.jsonl'}"])
    rt = train.Runtime(0, 1, 0, torch.device("cpu"), None, 0, 1, 0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    optimizer = train.build_optimizer(model, cfg, rt)
    tokens = torch.randint(0, 97, (2, 9))
    batches = [train.Batch(tokens[:, :-1], tokens[:, 1:].clone())]

    with torch.no_grad():
        model.model.embed_tokens.weight[tokens[0, 0]] = float("inf")  # a poisoned row: NaN loss
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = train.train_step(model, optimizer, batches, cfg, rt)
    import math

    assert result.skipped and not (math.isfinite(result.loss) and math.isfinite(result.grad_norm))
    assert result.tokens == 16 and not optimizer.state  # no AdamW step was taken
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())  # nothing carried into the next step

    with torch.no_grad():
        model.model.embed_tokens.weight[tokens[0, 0]] = 0.0
    ok = train.train_step(model, optimizer, batches, cfg, rt)
    assert not ok.skipped and ok.loss > 0 and optimizer.state
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])

    metrics = train.Metrics(cfg, rt, tokens_per_step=16, seq_len=8)
    metrics.step_done(2, ok.loss, ok.grad_norm, 1e-3, every=1, skipped=1)
    rec = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert rec["skipped_steps"] == 1 and rec["loss"] == pytest.approx(ok.loss)
    assert "| skipped 1" in capsys.readouterr().out


def test_residual_outputs_start_depth_scaled(trainer_module):
    """model.depth_init: o_proj and down_proj drawn at std / sqrt(2 * layers), as torchtitan's Llama
    init; the other weights keep the config's initializer_range."""
    import transformers

    train, _ = trainer_module
    torch = train.torch
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert train.depth_scale_residuals(model) == 2 * 8
    block = model.model.layers[3]
    want = 0.02 / (2 * 8) ** 0.5
    assert float(block.self_attn.o_proj.weight.std()) == pytest.approx(want, rel=0.05)
    assert float(block.mlp.down_proj.weight.std()) == pytest.approx(want, rel=0.05)
    assert float(block.self_attn.q_proj.weight.std()) == pytest.approx(0.02, rel=0.05)


def test_deterministic_mode_and_diagnostics_config(trainer_module, tmp_path):
    """runtime.deterministic turns on torch's deterministic algorithms (torchtitan's set_determinism);
    profile_steps / memory_snapshot_steps are checked and need a trace_dir."""
    train, yaml_path = trainer_module
    torch = train.torch
    was, env = torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        train.configure_backends(train.load_config(str(yaml_path), ["runtime.deterministic=true"]))
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == (env or ":4096:8")
    finally:
        torch.use_deterministic_algorithms(was)
        if env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    cfg = train.load_config(str(yaml_path), [])
    assert not cfg.runtime.deterministic and cfg.runtime.profile_steps is None and cfg.runtime.trace_dir
    for bad, match in ((["runtime.profile_steps=[4, 2]"], "1 <= first <= last"),
                       (["runtime.profile_steps=[3]"], "first, last"),
                       (["runtime.memory_snapshot_steps=-1"], "must not be negative"),
                       (["runtime.profile_steps=[1, 2]", "runtime.trace_dir=null"], "trace_dir: needed")):
        with pytest.raises(SystemExit, match=match):
            train.load_config(str(yaml_path), bad)


def _lora_losses(train, cfg, model, optimizer, step_fn, steps: int = 10) -> list[float]:
    torch = train.torch
    g = torch.Generator().manual_seed(2)
    out = []
    for s in range(steps):
        tokens = torch.randint(0, 97, (4, 33), generator=g)
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(s, cfg)
        out.append(step_fn(tokens))
    return out


def test_lora_matches_a_peft_loop_and_its_drift_is_the_bf16_base(trainer_module):
    """LoRA's drift from a peft reference is the frozen base's dtype: with task.frozen_dtype float32
    the trainer's LoRA steps equal a plain peft + AdamW loop exactly; in bfloat16 (as the plan sizes
    the base) the base layers round their weights and outputs, a small drift, not scaling or dropout."""
    import transformers
    from peft import LoraConfig, get_peft_model

    train, yaml_path = trainer_module
    torch = train.torch
    F = torch.nn.functional
    rt = train.Runtime(0, 1, 0, torch.device("cpu"), None, 0, 1, 0)
    hf = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, use_cache=False)

    def base():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hf).float()
        torch.manual_seed(1)  # the adapters' init
        return model

    def trainer_run(frozen: str) -> list[float]:
        cfg = train.load_config(str(yaml_path), [
            "task.kind=lora", "runtime.device=cpu", "precision.param_dtype=float32", "model.init=random",
            "task.lora.dropout=0.0", "task.lora.targets=[q_proj, v_proj]", "optimizer.grad_clip=1.0",
            f"task.frozen_dtype={frozen}"])
        model = train.apply_lora(base(), cfg)
        train.cast_frozen(model, cfg)
        opt = train.build_optimizer(model, cfg, rt)
        step = lambda t: train.train_step(model, opt, [train.Batch(t[:, :-1], t[:, 1:].clone())], cfg, rt).loss  # noqa: E731
        return _lora_losses(train, cfg, model, opt, step)

    cfg = train.load_config(str(yaml_path), ["task.kind=lora", "model.init=random", "optimizer.grad_clip=1.0"])
    peft = get_peft_model(base(), LoraConfig(r=cfg.task.lora.rank, lora_alpha=cfg.task.lora.alpha, lora_dropout=0.0,
                                             target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    params = [p for p in peft.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=tuple(o.betas), eps=o.eps)

    def peft_step(t):
        loss = F.cross_entropy(peft(input_ids=t[:, :-1]).logits.flatten(0, 1), t[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    ref = _lora_losses(train, cfg, peft, opt, peft_step)
    assert trainer_run("float32") == pytest.approx(ref, rel=1e-6, abs=0)
    bf16 = trainer_run("bfloat16")
    drift = max(abs(a - b) / b for a, b in zip(bf16, ref))
    assert 1e-6 < drift < 1e-3, drift


def test_epochs_reshuffle_and_validation_is_a_fixed_random_sample(trainer_module, tmp_path):
    """The first epoch reads prepare_data.py's (shuffled) order; every later epoch a permutation of
    the windows drawn from the seed and the epoch; validation reads one fixed random permutation."""
    import numpy as np

    train, _ = trainer_module
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        np.repeat(np.arange(20, dtype=np.uint16), 4).tofile(tmp_path / split / "part-00000.bin")  # window w: 4 x w
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    data = train.TokenWindows(train.DataSection(path=str(tmp_path)), 4, 97, seed=3)
    first = lambda d, i: int(d.sample(i)[0])  # noqa: E731
    n = len(data)
    epochs = [[first(data, e * n + i) for i in range(n)] for e in range(3)]
    assert epochs[0] == list(range(n))
    for e in (1, 2):
        assert sorted(epochs[e]) == epochs[0] and epochs[e] != epochs[0]
    assert epochs[1] != epochs[2]
    again = train.TokenWindows(train.DataSection(path=str(tmp_path)), 4, 97, seed=3)
    assert [first(again, n + i) for i in range(n)] == epochs[1]  # a resume reads the same order
    other = train.TokenWindows(train.DataSection(path=str(tmp_path)), 4, 97, seed=4)
    assert [first(other, n + i) for i in range(n)] != epochs[1]
    val = train.TokenWindows.validation(train.DataSection(path=str(tmp_path)), 4, 97, seed=3)
    picked = [first(val, i) for i in range(6)]
    assert picked == [first(val, i) for i in range(6)] and picked != sorted(picked)


def test_full_export_streams_sharded_safetensors_with_tokenizer(trainer_module, tmp_path):
    """The full export written one gathered tensor at a time into safetensors shards of at most
    export.max_shard_gb, named and indexed as save_pretrained does, with the base's tokenizer and
    generation_config.json: transformers loads it alone, weights equal, tokenizer the same."""
    import transformers

    train, yaml_path = trainer_module
    torch = train.torch
    base = tmp_path / "base"
    tiny_tokenizer(base, ["w1 w2 w3 w4"])
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(base)
    transformers.GenerationConfig(max_new_tokens=7, temperature=0.3, do_sample=True).save_pretrained(base)
    cfg = train.load_config(str(yaml_path), ["task.kind=full", "model.init=pretrained", f"model.pretrained_path={base}",
                                             "export.dtype=float32", "export.max_shard_gb=0.00002"])  # 20 kB shards
    out = tmp_path / "export"
    train.write_hf_model(model, cfg, True, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards) and not list(out.glob(".*part"))
    biggest = max(p.numel() * 4 for p in model.parameters())
    assert all((out / s).stat().st_size <= max(20_000, biggest) + 4096 for s in shards)  # + the header
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[k], v, rtol=0, atol=0, msg=k)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("w1 w3")["input_ids"] == transformers.AutoTokenizer.from_pretrained(base)("w1 w3")["input_ids"]
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 7
    with pytest.raises(train.ConfigError, match="export.max_shard_gb: must be above 0"):
        train.load_config(str(yaml_path), ["export.max_shard_gb=0"])
    # one shard: model.safetensors alone, as save_pretrained names it
    one = train.load_config(str(yaml_path), ["task.kind=full", f"model.pretrained_path={base}", "model.init=pretrained"])
    train.write_hf_model(model, one, True, tmp_path / "single")
    assert sorted(p.name for p in (tmp_path / "single").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "single" / "model.safetensors.index.json").exists()


def test_metrics_go_to_wandb_and_mlflow_only_when_named(trainer_module, monkeypatch):
    """logging.wandb_project / mlflow_tracking_uri: each tracker imported only then, given every
    logged step's scalars and finished at the end; unnamed, neither is imported; named but missing,
    one line."""
    import types

    train, yaml_path = trainer_module
    import train_metrics

    calls = []
    run = types.SimpleNamespace(log=lambda d, step: calls.append(("wandb", step, d["loss"])),
                                finish=lambda: calls.append(("wandb", "finish")))
    wandb = types.SimpleNamespace(init=lambda project, config: calls.append(("wandb", "init", project)) or run)
    mlflow = types.SimpleNamespace(set_tracking_uri=lambda u: calls.append(("mlflow", "uri", u)),
                                   start_run=lambda: None, log_params=lambda p: None,
                                   log_metrics=lambda d, step: calls.append(("mlflow", step, d["loss"])),
                                   end_run=lambda: calls.append(("mlflow", "finish")))
    cfg = train.load_config(str(yaml_path), [])
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: importing it fails
    assert train_metrics.trackers(cfg) == []  # unnamed: never imported
    named = train.load_config(str(yaml_path), ["logging.wandb_project=proj", "logging.mlflow_tracking_uri=file:/x"])
    with pytest.raises(train.ConfigError, match="needs wandb"):
        train_metrics.trackers(named)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    tracked = train_metrics.trackers(named)
    for log_fn, _ in tracked:
        log_fn({"loss": 1.5}, 3)
    for _, finish in tracked:
        finish()
    assert calls == [("wandb", "init", "proj"), ("mlflow", "uri", "file:/x"), ("wandb", 3, 1.5), ("mlflow", 3, 1.5),
                     ("wandb", "finish"), ("mlflow", "finish")]


def test_lora_exports_a_peft_adapter_and_a_merged_model_with_the_tokenizer(trainer_module, tmp_path):
    """A LoRA run's export: adapter_config.json + adapter_model.safetensors that peft loads onto the
    base with the trainer's logits, and with export.merged the base with the adapter folded in, as
    a plain transformers model giving the same logits; the tokenizer beside both."""
    import transformers
    from peft import PeftModel

    train, yaml_path = trainer_module
    torch = train.torch
    base = tmp_path / "base"
    tiny_tokenizer(base, ["w1 w2 w3 w4"])
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(base)
    cfg = train.load_config(str(yaml_path), ["task.kind=lora", "model.init=pretrained", f"model.pretrained_path={base}",
                                             "export.dtype=float32"])
    model = train.apply_lora(transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # a trained adapter (peft starts B at zero)
    out = tmp_path / "export"
    out.mkdir()
    sd = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    train.write_adapter(sd, cfg, out)
    train.copy_tokenizer(cfg, out)
    train.write_merged(cfg, out)
    tokens = torch.tensor([[5, 9, 2, 40, 7]])
    with torch.no_grad():
        want = model(input_ids=tokens).logits
        fresh = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        adapter = PeftModel.from_pretrained(fresh, out)(input_ids=tokens).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32)(input_ids=tokens).logits
    assert not torch.allclose(want, transformers.AutoModelForCausalLM.from_pretrained(base)(input_ids=tokens).logits)
    torch.testing.assert_close(adapter, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-4)
    for d in (out, out / "merged"):
        assert transformers.AutoTokenizer.from_pretrained(d)("w2 w4")["input_ids"] == \
            transformers.AutoTokenizer.from_pretrained(base)("w2 w4")["input_ids"]


def test_bad_sample_starts_are_one_line(trainer_module, tmp_path):
    import numpy as np

    train, _ = trainer_module
    (tmp_path / "train").mkdir()
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "train" / "part-00000.bin")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16"}))
    for content in (b"", np.array([3, 9], dtype="<i8").tobytes(), b"\0" * 5):
        (tmp_path / "train" / "part-00000.starts").write_bytes(content)
        with pytest.raises(train.ConfigError, match="part-00000.starts: not sample starts"):
            train.TokenWindows(train.DataSection(path=str(tmp_path)), 4, 97, 0)
