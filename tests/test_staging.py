"""`up` stages what the job reads: the base weights, the dataset, the prepared data (gpuprov/staging.py,
ansible/stage.yml, launch/fetch_weights.sh, launch/stage_data.sh).

The scripts and the playbook run for real here: ansible-playbook against this machine over the local
connection (the transport is the only thing swapped), the fetch script against a stand-in
huggingface_hub that raises the library's own error classes and records what it was given."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from bundle_fixtures import standin_renderers
from gpuprov import bundle
from gpuprov.bringup import staging_steps
from gpuprov.staging import staging_for
from plan_fixtures import sample_plan

TOKEN = "hf_StagingTestToken0123456789abcdefXYZ"
REPO = "test-org/tiny-llama"
GPUPROV = [sys.executable, "-m", "gpuprov"]
ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))


def _staged_plan(root: Path, dataset: str | None, task: str = "lora", nodes: int = 1):
    """sample_plan fine-tuning a Hub model, its checkpoint root under `root` (so the scripts write here)."""
    plan = sample_plan("aws", nodes=nodes, sharding="fsdp", task=task)
    plan = plan.model_copy(update={
        "spec": plan.spec.model_copy(update={"dataset": dataset}),
        "training": plan.training.model_copy(update={"init": "pretrained", "base_weights": REPO}),
        "provisioning": plan.provisioning.model_copy(update={"checkpoint_root": str(root / "fs")})})
    return plan.model_copy(update={"staging": staging_for(plan)})


def _write_bundle(tmp_path: Path, plan) -> Path:
    """The real Ansible and launch files (Terraform's stand-in: these tests start after it)."""
    from gpuprov.render.ansible import render_ansible
    from gpuprov.render.launch import render_launch

    renderers = [(d, render_ansible if d == "ansible" else render_launch if d == "launch" else f)
                 for d, f in standin_renderers()]
    out = tmp_path / "bundle"
    bundle.write_bundle(out, bundle.build_bundle(plan, renderers), force=True)
    return out


def _safetensors(path: Path, tensors: dict[str, int], truncate: int = 0) -> None:
    """A real safetensors file: 8-byte header length, JSON header, the tensors' bytes (uint8)."""
    header, offset = {}, 0
    for name, size in tensors.items():
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset - truncate))


def _whole_copy(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text("{}")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _safetensors(dest / weight_map["a"], {"a": 64})
    _safetensors(dest / weight_map["b"], {"b": 32})


# A stand-in huggingface_hub: the library's error classes (same names, same hierarchy as 2.x, checked
# below), a snapshot_download that records whether it got the token (as a hash) and its process
# command lines, then writes a whole copy or raises.
FAKE_HUB = textwrap.dedent('''\
    import hashlib, json, os
    from pathlib import Path
    from . import errors

    def snapshot_download(repo_id, revision, local_dir, allow_patterns):
        token = os.environ.get("HF_TOKEN", "")
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                    for pid in ("self", str(os.getppid()))]
        Path(os.environ["FAKE_HUB_LOG"]).write_text(json.dumps(
            {"repo": repo_id, "token_sha": hashlib.sha256(token.encode()).hexdigest() if token else None,
             "cmdlines": cmdlines}))
        mode = os.environ.get("FAKE_HUB", "ok")
        if mode == "gated":
            raise errors.GatedRepoError("403 Client Error: access to model " + repo_id + " is restricted")
        exec(os.environ["FAKE_HUB_WRITE"], {"dest": Path(local_dir)})
    ''')
FAKE_ERRORS = textwrap.dedent('''\
    class HfHubHTTPError(Exception): pass
    class RepositoryNotFoundError(HfHubHTTPError): pass
    class GatedRepoError(RepositoryNotFoundError): pass
    class RevisionNotFoundError(HfHubHTTPError): pass
    ''')
WRITE_WHOLE = textwrap.dedent('''\
    import json, struct
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text("{}")
    raw = json.dumps({"w": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}}).encode()
    (dest / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(16))
    ''')


def test_stand_in_hub_errors_match_the_library():
    errors = pytest.importorskip("huggingface_hub.errors")
    assert issubclass(errors.GatedRepoError, errors.RepositoryNotFoundError)
    assert {"GatedRepoError", "RepositoryNotFoundError", "RevisionNotFoundError"} <= set(dir(errors))


@pytest.fixture
def hub(tmp_path: Path) -> dict:
    pkg = tmp_path / "fakehub" / "huggingface_hub"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_HUB)
    (pkg / "errors.py").write_text(FAKE_ERRORS)
    log = tmp_path / "hub.json"
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(pkg.parent), FAKE_HUB_LOG=str(log), FAKE_HUB_WRITE=WRITE_WHOLE)
    return {"env": env, "log": log}


def _files_holding(root: Path, needle: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle.encode() in p.read_bytes()]


# ---------------------------------------------------------------- the plan and the dry run


def _generate(tmp_path: Path, dataset: str, *extra: str) -> Path:
    out = tmp_path / "b"
    proc = subprocess.run([*GPUPROV, "generate", "--model", "meta-llama/Llama-3.1-8B", "--task", "lora",
                           "--dataset", dataset, "-o", str(out), *extra], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


def _dry_run(root: Path) -> list[list[str]]:
    proc = subprocess.run([*GPUPROV, "up", str(root), "--dry-run"], env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    steps = []
    for line in proc.stdout.splitlines():
        head, _, rest = line.partition(". ")
        if head.isdigit():
            words = shlex.split(rest.split("  # ")[0].split("  > ")[0].strip("()").replace(" && ", " ; "))
            steps.append(words)
    return steps


def test_generate_then_dry_run_stages_weights_and_local_data_before_the_job(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "hi", "response": "there"}\n' * 50)
    root = _generate(tmp_path, "./train.jsonl")
    plan = json.loads((root / "plan.json").read_text())
    st = plan["staging"]
    assert st["weights_repo"] == "meta-llama/Llama-3.1-8B"
    assert st["dataset_kind"] == "local" and st["dataset_source"] == str(tmp_path / "train.jsonl")
    steps = _dry_run(root)
    tags = [s[-1] for s in steps if "stage.yml" in s]
    assert tags == ["weights", "data", "prepare"]
    names = [" ".join(s) for s in steps]
    first_stage = next(i for i, s in enumerate(names) if "stage.yml" in s)
    health = next(i for i, s in enumerate(names) if "health" in s)
    assert health < first_stage and first_stage + 3 == len(steps) - 1  # then the job, last
    train = yaml.safe_load((root / "launch" / "train.yaml").read_text())
    assert train["data"]["path"] == st["data_dir"] and train["data"]["path"].endswith("/prepared")
    assert train["model"]["pretrained_path"] == st["weights_dir"]
    stage = yaml.safe_load((root / "ansible" / "stage.yml").read_text())[0]["vars"]
    assert stage["stage_inputs_dataset_local"] == st["dataset_source"] and stage["stage_inputs_data_dir"] == st["data_dir"]


@pytest.mark.parametrize("source,tags,tool", [
    ("s3://my-bucket/sft/train.jsonl", ["weights", "data", "prepare"], "aws"),
    ("gs://my-bucket/sft/", ["weights", "data", "prepare"], "gcloud"),
    ("az://myacct/sft-data/train.jsonl", ["weights", "data", "prepare"], "azcopy"),
    ("hf:tatsu-lab/alpaca", ["weights", "prepare"], None),
    ("20M", ["weights"], None),
])
def test_remote_sources_are_read_by_the_nodes(tmp_path, source, tags, tool):
    root = _generate(tmp_path, source)
    assert [s[-1] for s in _dry_run(root) if "stage.yml" in s] == tags
    st = json.loads((root / "plan.json").read_text())["staging"]
    script = (root / "launch" / "stage_data.sh").read_text()
    subprocess.run(["bash", "-n", str(root / "launch" / "stage_data.sh")], check=True)
    if tool:
        assert st["download_argv"][0] == tool and st["download_argv"][-2 if source.endswith("/") else -1] \
            == st["dataset_raw"].rstrip("/") + ".part" + ("/" if source.endswith("/") else "")
        assert shlex.join(st["download_argv"]) in script
    if tool == "azcopy":
        assert "https://myacct.blob.core.windows.net/sft-data/train.jsonl" in st["download_argv"]
    data_path = yaml.safe_load((root / "launch" / "train.yaml").read_text())["data"]["path"]
    assert data_path == (None if source == "20M" else st["data_dir"])


@pytest.mark.parametrize("bad", ["s3://Bad_Bucket/x", "s3://ok-bucket/a b", "s3://ok-bucket/$(id)", "ftp://h/x",
                                 "hf:only-a-name", "gs://bkt/../../etc/passwd", "s3://ok-bucket/x\n"])
def test_a_bad_source_is_one_line_at_parse_time(tmp_path, bad):
    proc = subprocess.run([*GPUPROV, "plan", "--model", "meta-llama/Llama-3.1-8B", "--task", "lora",
                           "--dataset", bad], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_up_refuses_a_local_dataset_gone_before_anything_runs(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "hello world"}\n' * 50)
    root = _generate(tmp_path, "./train.jsonl")
    (tmp_path / "train.jsonl").unlink()
    proc = subprocess.run([*GPUPROV, "up", str(root)], env=dict(ENV, PATH="/nonexistent"),
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "is not on this machine" in proc.stderr
    assert not (root / ".gpuprov-up.json").exists()


# ---------------------------------------------------------------- fetch_weights.sh


def test_fetch_keeps_a_whole_copy_and_refetches_a_truncated_shard(tmp_path, hub):
    plan = _staged_plan(tmp_path, None)
    root = _write_bundle(tmp_path, plan)
    dest = Path(plan.staging.weights_dir)
    _whole_copy(dest)
    script = [str(root / "launch" / "fetch_weights.sh")]
    proc = subprocess.run(script, env=hub["env"], capture_output=True, text=True)
    assert proc.returncode == 0 and "already complete" in proc.stdout
    assert not hub["log"].exists()  # nothing downloaded
    _safetensors(dest / "model-00002-of-00002.safetensors", {"b": 32}, truncate=5)  # a cut-off download
    proc = subprocess.run(script, env=hub["env"], capture_output=True, text=True)
    assert json.loads(hub["log"].read_text())["repo"] == REPO
    # the stand-in wrote model.safetensors, but the index still names the cut shard: not whole
    assert proc.returncode == 1 and "model-00002-of-00002.safetensors is" in proc.stderr


def test_gated_model_fails_in_one_line_naming_the_licence(tmp_path, hub):
    plan = _staged_plan(tmp_path, None)
    root = _write_bundle(tmp_path, plan)
    proc = subprocess.run([str(root / "launch" / "fetch_weights.sh")], env=dict(hub["env"], FAKE_HUB="gated"),
                          capture_output=True, text=True)
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"https://huggingface.co/{REPO}" in lines[0] and "no HF_TOKEN" in lines[0]


def test_token_on_stdin_reaches_the_download_and_nothing_else(tmp_path, hub):
    plan = _staged_plan(tmp_path, None)
    root = _write_bundle(tmp_path, plan)
    proc = subprocess.run([str(root / "launch" / "fetch_weights.sh"), "--token-stdin"], env=hub["env"],
                          input=TOKEN + "\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(hub["log"].read_text())
    assert record["token_sha"] == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert not any(TOKEN in line for line in record["cmdlines"])
    assert TOKEN not in proc.stdout + proc.stderr
    assert _files_holding(tmp_path, TOKEN) == []


# ---------------------------------------------------------------- the playbook, for real


def _local_inventory(root: Path) -> None:
    inventory = {"all": {"children": {"gpu_nodes": {"hosts": {"node-0": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "ansible_become": False}}}}}}  # this machine: the transport, swapped; no sudo here
    (root / "ansible" / "inventory.yml").write_text(yaml.safe_dump(inventory))


def _stage_job_dir(root: Path, plan) -> None:
    """What site.yml (tag job) puts on the first node: launch/ at the job directory."""
    from gpuprov.render.launch import run_paths

    job = Path(run_paths(plan)["job_dir"])
    job.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(root / "launch"), str(job / "launch")], check=True)


def _ansible_env(tmp_path: Path, hub: dict) -> dict:
    bin_dir = Path(sys.executable).parent
    return dict(hub["env"], PATH=f"{bin_dir}:/usr/bin:/bin", ANSIBLE_LOCAL_TEMP=str(tmp_path / "ans-local"),
                ANSIBLE_REMOTE_TMP=str(tmp_path / "ans-remote"), ANSIBLE_LOG_PATH=str(tmp_path / "ansible.log"),
                ANSIBLE_NOCOLOR="1", HOME=str(tmp_path / "home"))


@pytest.mark.slow
def test_playbook_fetches_with_the_token_from_the_environment_and_leaks_it_nowhere(tmp_path, hub):
    plan = _staged_plan(tmp_path, str(tmp_path / "train.jsonl"))
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    root = _write_bundle(tmp_path, plan)
    _local_inventory(root)
    _stage_job_dir(root, plan)
    env = dict(_ansible_env(tmp_path, hub), HF_TOKEN=TOKEN)
    steps = staging_steps(root, plan)
    assert [s.name for s in steps] == ["fetch-weights", "stage-data", "prepare-data"]
    for step in steps[:2]:
        assert TOKEN not in " ".join(step.argv)
        proc = subprocess.run([*step.argv, "-vvv"], cwd=step.cwd, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert TOKEN not in proc.stdout + proc.stderr
    assert json.loads(hub["log"].read_text())["token_sha"] == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert (Path(plan.staging.dataset_raw)).read_text() == '{"text": "hello"}\n'
    assert _files_holding(tmp_path, TOKEN) == []
    # run again: the whole copy is kept (no download), the copy is unchanged
    hub["log"].unlink()
    proc = subprocess.run([*steps[0].argv], cwd=steps[0].cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "changed=0" in proc.stdout and not hub["log"].exists()


@pytest.mark.slow
def test_up_stops_on_a_gated_model_with_the_licence_line(tmp_path, hub):
    from gpuprov.bringup import build_steps, lock_digest, write_state

    plan = _staged_plan(tmp_path, None)
    root = _write_bundle(tmp_path, plan)
    _local_inventory(root)
    _stage_job_dir(root, plan)
    # the cluster is up (its steps done in an earlier run): `up` continues at fetch-weights
    write_state(root, {"lock_sha256": lock_digest(root), "completed": [s.name for s in build_steps(root, "aws")]})
    env = dict(_ansible_env(tmp_path, hub), FAKE_HUB="gated", PYTHONPATH=hub["env"]["PYTHONPATH"] + os.pathsep
               + ENV["PYTHONPATH"])
    proc = subprocess.run([*GPUPROV, "up", str(root)], env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "'fetch-weights'" in last and f"accept its licence at https://huggingface.co/{REPO}" in last
    assert json.loads((root / ".gpuprov-up.json").read_text())["failed"] == "fetch-weights"


def test_a_files_token_count_is_labelled_an_estimate_and_a_prepared_count_is_not(tmp_path):
    (tmp_path / "train.jsonl").write_bytes(b'{"text": "' + b"x" * 3988 + b'"}\n')  # 4,001 bytes
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "meta.json").write_text(json.dumps({"train_samples": 10, "seq_len": 4096}))

    def dataset_note(dataset: str) -> str:
        proc = subprocess.run([*GPUPROV, "plan", "--model", "meta-llama/Llama-3.1-8B", "--task", "lora", "--json",
                               "--dataset", dataset], cwd=tmp_path, env=ENV, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return next(n for n in json.loads(proc.stdout)["notes"] if n.startswith("Dataset:"))

    assert dataset_note("./train.jsonl").startswith("Dataset: ~1,000 tokens per pass (an estimate")
    assert dataset_note("./prepared").startswith("Dataset: 40,960 tokens per pass x")


# ---------------------------------------------------------------- the recipe's batch in tokens


def _word_tokenizer(folder: Path) -> None:
    """A real tokenizers.Tokenizer (word level, whitespace split): one token per word, so the lengths are known."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["ask", "answer", "why", "because"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


def _plan_json(tmp_path: Path, *args: str) -> dict:
    proc = subprocess.run([*GPUPROV, "plan", "--json", *args], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_recipes_batch_is_its_samples_times_the_measured_sample_length(tmp_path):
    from plan_fixtures import TINY_LLAMA_CONFIG

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(TINY_LLAMA_CONFIG, max_position_embeddings=4096)))
    _word_tokenizer(model)
    # 300 records of 10 + 90 words: 100 tokens a sample with this tokenizer; 3x4 = 12 bytes a word,
    # so the bytes estimate (4 a token) would say about 300
    records = [{"prompt": " ".join(["ask"] * 10), "response": " ".join(["because"] * 90)}] * 300
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    p = _plan_json(tmp_path, "--model", str(model / "config.json"), "--task", "lora", "--dataset", "sft.jsonl",
                   "--seq-len", "512", "--gpus", "1", "--cloud", "aws")
    spec = p["spec"]
    assert spec["sample_tokens_how"] == "measured" and abs(spec["sample_tokens"] - 100) < 1.5  # + a newline join
    assert spec["dataset_tokens"] == round(spec["sample_tokens"] * 300)  # every record tokenized: a count
    samples = 2 * 8  # 8B_lora_single_device: batch 2 x accumulation 8 on one rank
    assert p["cluster"]["global_batch_tokens"] == round(samples * spec["sample_tokens"] / 512) * 512
    dataset_note = next(n for n in p["notes"] if n.startswith("Dataset:"))
    assert not dataset_note.startswith("Dataset: ~")  # measured, so printed as a count
    assert "measured with the model's tokenizer" in next(n for n in p["notes"] if n.startswith("Fine-tuning"))


def test_without_a_tokenizer_the_sample_length_is_an_estimate_and_says_so(tmp_path):
    records = [{"text": "x" * 400}] * 50  # 400 bytes: about 100 tokens at 4 bytes a token
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env_no_cache = dict(ENV, HF_HUB_CACHE=str(tmp_path / "empty-cache"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([*GPUPROV, "plan", "--json", "--model", "8b", "--task", "lora", "--dataset", "d.jsonl",
                           "--gpus", "1"], cwd=tmp_path, env=env_no_cache, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    p = json.loads(proc.stdout)
    assert p["spec"]["sample_tokens_how"] == "estimated" and p["spec"]["sample_tokens"] == 100.0
    assert p["cluster"]["global_batch_tokens"] == 4096  # 16 x 100 = 1,600 tokens: one packed window
    assert "an estimate from the records' bytes" in next(n for n in p["notes"] if n.startswith("Fine-tuning"))
    assert next(n for n in p["notes"] if n.startswith("Dataset:")).startswith("Dataset: ~")


def test_a_hostile_local_file_name_stays_data_in_every_rendered_file(tmp_path):
    name = "a'$(touch PWNED)`touch PWNED2`{{ lookup('pipe','id') }}\".jsonl"
    (tmp_path / name).write_text('{"text": "hello world"}\n' * 50)
    root = _generate(tmp_path, name)
    st = json.loads((root / "plan.json").read_text())["staging"]
    assert st["dataset_source"] == str(tmp_path / name)
    stage = (root / "ansible" / "stage.yml").read_text()
    assert "!unsafe" in stage  # Ansible never templates it
    assert yaml.safe_load(stage.replace("!unsafe ", ""))[0]["vars"]["stage_inputs_dataset_local"] == str(tmp_path / name)
    script = root / "launch" / "stage_data.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    proc = subprocess.run(["bash", str(script), "download"], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0 and "nothing to download" in proc.stdout
    assert not list(tmp_path.rglob("PWNED*"))


# ---------------------------------------------------------------- a base folder on this machine


def _local_base_plan(tmp_path: Path, folder: Path):
    """_staged_plan with the base weights a folder on the machine running `up` (generate --model DIR)."""
    plan = _staged_plan(tmp_path, None)
    plan = plan.model_copy(update={"training": plan.training.model_copy(update={"base_weights": str(folder)})})
    return plan.model_copy(update={"staging": staging_for(plan)})


def test_generate_from_a_local_folder_copies_it_and_prepares_with_its_tokenizer(tmp_path):
    base = tmp_path / "models" / "my-llama"
    base.mkdir(parents=True)
    hf = json.loads(json.dumps(sample_plan("aws", 1, "fsdp", "lora").model.hf_config))
    (base / "config.json").write_text(json.dumps(hf))
    (tmp_path / "train.jsonl").write_text('{"prompt": "hi", "response": "there"}\n' * 50)
    out = tmp_path / "b"
    proc = subprocess.run([*GPUPROV, "generate", "--model", str(base), "--task", "lora", "--dataset", "train.jsonl",
                           "-o", str(out)], cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    st = json.loads((out / "plan.json").read_text())["staging"]
    # the folder as plan.json's model names it: relative to the bundle, no path of this machine
    assert st["weights_repo"] is None and st["weights_local"] == "../models/my-llama"
    assert st["weights_dir"].endswith("/models/local/my-llama") and st["data_dir"].endswith("/prepared")
    train = yaml.safe_load((out / "launch" / "train.yaml").read_text())
    assert train["model"]["pretrained_path"] == st["weights_dir"] and train["data"]["path"] == st["data_dir"]
    assert "/gpuprov-my-llama-lora/" in train["checkpoint"]["dir"] + "/"  # named by the folder, not config.json
    stage = yaml.safe_load((out / "ansible" / "stage.yml").read_text())[0]["vars"]
    assert stage["stage_inputs_weights_local"] == st["weights_local"]
    assert [s[-1] for s in _dry_run(out) if "stage.yml" in s] == ["weights", "data", "prepare"]
    # no weights in the folder: `up` says so before it starts anything
    proc = subprocess.run([*GPUPROV, "up", str(out)], env=dict(ENV, PATH="/nonexistent"), capture_output=True,
                          text=True)
    assert proc.returncode == 1 and "has no config.json and *.safetensors on this machine" in proc.stderr
    assert not (out / ".gpuprov-up.json").exists()


def test_fetch_checks_a_copied_folder_whole_and_downloads_nothing(tmp_path, hub):
    plan = _local_base_plan(tmp_path, tmp_path / "base")
    assert plan.staging.weights_repo is None and plan.staging.weights_local == str(tmp_path / "base")
    root = _write_bundle(tmp_path, plan)
    dest = Path(plan.staging.weights_dir)
    _whole_copy(dest)
    script = [str(root / "launch" / "fetch_weights.sh")]
    proc = subprocess.run(script, env=hub["env"], capture_output=True, text=True)
    assert proc.returncode == 0 and "already complete" in proc.stdout
    _safetensors(dest / "model-00002-of-00002.safetensors", {"b": 32}, truncate=5)  # a cut-off copy
    proc = subprocess.run(script, env=hub["env"], capture_output=True, text=True)
    assert proc.returncode == 2 and "is not whole (model-00002-of-00002.safetensors is" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not hub["log"].exists()  # never a download


@pytest.mark.slow
def test_playbook_copies_the_local_folder_then_keeps_it(tmp_path, hub):
    _whole_copy(tmp_path / "base")
    plan = _local_base_plan(tmp_path, tmp_path / "base")
    root = _write_bundle(tmp_path, plan)
    _local_inventory(root)
    _stage_job_dir(root, plan)
    step = staging_steps(root, plan)[0]
    assert step.name == "fetch-weights"
    proc = subprocess.run(step.argv, cwd=step.cwd, env=_ansible_env(tmp_path, hub), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    dest = Path(plan.staging.weights_dir)
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in (tmp_path / "base").iterdir())
    assert (dest / "model-00001-of-00002.safetensors").read_bytes() == \
        (tmp_path / "base" / "model-00001-of-00002.safetensors").read_bytes()
    proc = subprocess.run(step.argv, cwd=step.cwd, env=_ansible_env(tmp_path, hub), capture_output=True, text=True)
    assert proc.returncode == 0 and "changed=0" in proc.stdout, proc.stdout[-2000:]
    assert not hub["log"].exists()


def test_a_hostile_model_folder_name_stays_data_in_every_rendered_file(tmp_path):
    name = "a'$(touch PWNED)`touch PWNED2`{{ lookup('pipe','id') }}\"b"
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(sample_plan("aws", 1, "fsdp", "lora").model.hf_config))
    out = tmp_path / "b"
    proc = subprocess.run([*GPUPROV, "generate", "--model", str(folder), "--task", "lora", "-o", str(out)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    st = json.loads((out / "plan.json").read_text())["staging"]
    assert st["weights_local"] == "../" + name and "$" not in st["weights_dir"] and "'" not in st["weights_dir"]
    stage = (out / "ansible" / "stage.yml").read_text()
    assert f"stage_inputs_weights_local: !unsafe {json.dumps(st['weights_local'])}" in stage
    script = out / "launch" / "fetch_weights.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    line = next(ln for ln in script.read_text().splitlines() if ln.startswith("LOCAL="))
    echoed = subprocess.run(["bash", "-c", f'{line}; printf %s "$LOCAL"'], cwd=tmp_path, capture_output=True, text=True)
    assert echoed.stdout == "../" + name
    assert not list(tmp_path.rglob("PWNED*"))


# ---------------------------------------------------------------- a dataset prepare_data.py already wrote


def _prepared(folder: Path, samples: int = 8, seq_len: int = 128) -> Path:
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "part-00000.bin").write_bytes(bytes(2 * (samples * seq_len + 1)))
    (folder / "meta.json").write_text(json.dumps({"vocab_size": 512, "dtype": "uint16", "seq_len": seq_len,
                                                  "train_samples": samples, "val_samples": 0}))
    return folder


@pytest.mark.parametrize("given", ["./prepared", "./prepared/meta.json"])
@pytest.mark.slow
def test_a_prepared_dataset_is_copied_to_data_path_even_from_scratch(tmp_path, given):
    """A from-scratch run has no tokenizer on the cluster, so a prepared directory is the only data it
    can be given: `up` copies it to where train.yaml's data.path points, and tokenizes nothing."""
    _prepared(tmp_path / "prepared")
    out = tmp_path / "b"
    proc = subprocess.run([*GPUPROV, "generate", "--model", "llama-3.1-8b", "--from-scratch", "--cloud", "aws",
                           "--gpus", "16", "--seq-len", "128", "--dataset", given, "-o", str(out)],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    st = json.loads((out / "plan.json").read_text())["staging"]
    assert st["dataset_prepared"] and st["dataset_source"] == str(tmp_path / "prepared") + "/"
    assert [s[-1] for s in _dry_run(out) if "stage.yml" in s] == ["data"]
    train = yaml.safe_load((out / "launch" / "train.yaml").read_text())
    assert train["data"]["path"] == st["data_dir"] and st["dataset_raw"] == st["data_dir"] + "/"
    stage = yaml.safe_load((out / "ansible" / "stage.yml").read_text())[0]["vars"]
    assert stage["stage_inputs_data_dir"] == ""  # nothing to tokenize


@pytest.mark.slow
def test_playbook_copies_a_prepared_dataset_as_it_is(tmp_path, hub):
    plan = _staged_plan(tmp_path, str(_prepared(tmp_path / "prepared")))
    plan = plan.model_copy(update={"training": plan.training.model_copy(update={"init": "random", "base_weights": None})})
    plan = plan.model_copy(update={"staging": staging_for(plan)})
    root = _write_bundle(tmp_path, plan)
    _local_inventory(root)
    _stage_job_dir(root, plan)
    steps = staging_steps(root, plan)
    assert [s.name for s in steps] == ["stage-data"]
    proc = subprocess.run(steps[0].argv, cwd=steps[0].cwd, env=_ansible_env(tmp_path, hub), capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    data = Path(plan.staging.data_dir)
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == ["meta.json", "train", "train/part-00000.bin"]
    assert (data / "train" / "part-00000.bin").read_bytes() == (tmp_path / "prepared/train/part-00000.bin").read_bytes()
