"""`gpuprov estimate`, `models`, `gpus`: the interface others call, its JSON, errors and start-up cost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120)


def test_json_interface() -> None:
    r = run(
        "estimate", "--model", "llama-3.1-8b", "--task", "full", "--seq-len", "8192", "--micro-batch", "2",
        "--gpu", "h100-80gb", "--gpus", "8", "--sharding", "fsdp", "--activation-checkpointing", "selective",
        "--precision", "bf16-mixed", "--optimizer", "adamw", "--offload", "none", "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert isinstance(d["per_gpu_bytes"], int) and d["per_gpu_bytes"] == sum(d["breakdown"].values())
    assert d["model"]["name"] == "llama-3.1-8b" and d["model"]["params"] == 8_030_261_248
    assert d["gpu_memory_bytes"] == 81559 * 2**20
    assert d["fits"] == (d["per_gpu_bytes"] <= d["gpu_memory_bytes"])
    assert d["assumptions"] and d["estimator"] == "analytic"


def test_lora_flags_and_hsdp() -> None:
    r = run(
        "estimate", "--model", "70b", "--task", "qlora", "--lora-rank", "64", "--lora-targets", "q_proj,k_proj,v_proj",
        "--gpus", "16", "--sharding", "hsdp", "--shard-group", "8", "--gpu", "a100-80gb", "--seq-len", "2048",
        "--activation-checkpointing", "full", "--json",
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["setup"]["lora_targets"] == ["q_proj", "k_proj", "v_proj"]
    assert 0 < d["model"]["trainable_params"] < d["model"]["params"] / 100


def test_extra_knobs() -> None:
    base = ["estimate", "--model", "llama-3.2-1b", "--gpus", "1", "--precision", "bf16", "--seq-len", "512", "--json"]
    plain = json.loads(run(*base).stdout)
    foreach = json.loads(run(*base, "--optimizer-impl", "foreach").stdout)
    accum = json.loads(run(*base, "--grad-accumulation", "4", "--seq-len", "16384").stdout)
    assert foreach["per_gpu_bytes"] > plain["per_gpu_bytes"]
    assert foreach["setup"]["optimizer_impl"] == "foreach" and accum["setup"]["grad_accumulation"] == 4
    assert run(*base, "--grad-accumulation", "0").returncode == 2


def test_loss_stack_and_lora_dropout_knobs() -> None:
    base = ["estimate", "--model", "llama-3.2-1b", "--gpus", "1", "--task", "lora", "--seq-len", "2048",
            "--activation-checkpointing", "none", "--json"]
    plain = json.loads(run(*base).stdout)
    legacy = json.loads(run(*base, "--loss-impl", "hf-legacy").stdout)
    native = json.loads(run(*base, "--loss-impl", "native").stdout)
    dropout = json.loads(run(*base, "--lora-dropout", "0.1").stdout)
    assert plain["setup"]["loss_impl"] == "hf" and legacy["setup"]["loss_impl"] == "hf-legacy"
    assert native["per_gpu_bytes"] <= plain["per_gpu_bytes"] < legacy["per_gpu_bytes"]
    assert dropout["setup"]["lora_dropout"] == 0.1 and dropout["per_gpu_bytes"] > plain["per_gpu_bytes"]
    assert plain["allocator"]["reserved"] <= plain["gpu_memory_bytes"]
    assert run(*base, "--lora-dropout", "1.5").returncode == 2
    assert run(*base, "--loss-impl", "megatron").returncode == 2


def test_human_table_shows_gib_and_fit() -> None:
    r = run("estimate", "--model", "llama-3.2-1b", "--gpus", "1", "--gpu", "rtx-4090-24gb", "--seq-len", "1024")
    assert r.returncode == 0, r.stderr
    assert "GiB" in r.stdout and "peak per GPU" in r.stdout and ("FITS" in r.stdout or "DOES NOT FIT" in r.stdout)
    assert "headroom" in r.stdout and "assumes:" in r.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "llama3-8b"], "did you mean"),
        (["--gpu", "h100x"], "h100-80gb"),  # (H100 itself is SkyPilot's name for h100-80gb, accepted)
        (["--seq-len", "0"], "--seq-len"),
        (["--micro-batch", "-3"], "--micro-batch"),
        (["--task", "lora", "--lora-rank", "100000"], "hidden size"),
        (["--sharding", "hsdp", "--gpus", "12"], "does not divide"),
        (["--task", "lora", "--lora-targets", "q_proj,nope"], "unknown LoRA target"),
        # the spec's sanity bounds hold for estimate too (it printed exabytes and exit 0)
        (["--seq-len", "99999999999999999999"], "--seq-len 99999999999999999999 is beyond any real run"),
        (["--gpus", "99999999999999999999"], "--gpus 99999999999999999999 is beyond"),
        (["--micro-batch", "9999999999999", "--seq-len", "16"], "--micro-batch x --seq-len"),
        (["--grad-accumulation", "0"], "--grad-accumulation"),
        (["--grad-accumulation", "99999999999999999999"], "--grad-accumulation 99999999999999999999 is beyond"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle) -> None:
    r = run("estimate", *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_malformed_config_json(tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama", "hidden_size": 4096,')
    r = run("estimate", "--model", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "JSON" in r.stderr
    unsupported = tmp_path / "gpt2.json"
    unsupported.write_text(json.dumps({"model_type": "gpt2", "n_embd": 768}))
    r = run("estimate", "--model", str(unsupported))
    assert r.returncode == 2 and "not supported" in r.stderr


def test_catalog_commands() -> None:
    r = run("models", "--json")
    assert r.returncode == 0
    d = json.loads(r.stdout)
    names = {m["name"] for m in d["models"]}
    assert {"llama-2-7b", "mixtral-8x7b", "gemma-2-9b", "qwen2.5-72b"} <= names
    assert d["aliases"]["70b"]["model"] in names
    r = run("gpus", "--json")
    slugs = {g["slug"]: g for g in json.loads(r.stdout)["gpus"]}
    for slug in ("h100-80gb", "h100-pcie-80gb", "h200-141gb", "a100-80gb", "a100-40gb", "l40s-48gb",
                 "rtx-6000-ada-48gb", "rtx-a6000-48gb", "rtx-4090-24gb", "rtx-3090-24gb", "a10g-24gb", "l4-24gb",
                 "b200-180gb"):
        assert slug in slugs and slugs[slug]["source"], slug
    assert slugs["h100-80gb"]["memory_bytes"] == 81559 * 2**20
    assert "rtx-3090-24gb" in run("gpus").stdout and "7b" in run("models").stdout


def test_estimate_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from gpuprov.cli import main\n"
        "try:\n"
        "    main(['estimate', '--model', '70b', '--json'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('TORCH' if 'torch' in sys.modules or 'transformers' in sys.modules else 'CLEAN', file=sys.stderr)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stderr.strip().endswith("CLEAN"), r.stderr


def test_precise_without_torch_says_how_to_install(tmp_path) -> None:
    # Hide torch/transformers behind import blockers: the message must name the extra, exit 2.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from gpuprov.cli import main\n"
        "main(['estimate', '--model', 'llama-3.2-1b', '--gpus', '1', '--precise'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "[precise] extra" in r.stderr and "pip install torch transformers peft" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.torch
def test_precise_prints_a_time_estimate_before_it_starts(tmp_path) -> None:
    """Issue 9: a time estimate up front (stderr, so --json stdout stays one object), then progress."""
    import re

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    }))
    r = run("estimate", "--model", str(config), "--gpus", "1", "--seq-len", "64", "--precise", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["estimator"] == "precise"
    lines = r.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if re.search(r"expect about \d+ (s|min)", line))
    started = next(i for i, line in enumerate(lines) if line.startswith("["))
    assert first < started and lines[-1].startswith("[100%]"), r.stderr
    # stderr a pipe: one plain line per update (a terminal gets one rewritten line: test_plan_readable)
    assert "\r" not in r.stderr and sum(line.startswith("[") for line in lines) > 3, r.stderr
    # a bad flag stays one error line: no time estimate for a run that never starts
    bad = run("estimate", "--model", str(config), "--gpus", "3", "--sharding", "hsdp", "--shard-group", "2",
              "--precise")
    assert bad.returncode == 2 and "expect about" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr


def test_qlora_base_replicated_costs_the_unsharded_nf4_base() -> None:
    base = ["--model", "llama-2-7b", "--task", "qlora", "--gpu", "rtx-3090-24gb", "--gpus", "8", "--json"]
    sharded = json.loads(run("estimate", *base).stdout)
    replicated = json.loads(run("estimate", *base, "--qlora-base", "replicated").stdout)
    grown = replicated["breakdown"]["parameters"] - sharded["breakdown"]["parameters"]
    # 7B of decoder linears in NF4 is ~3.4 GiB; replicating adds 7/8 of it on each GPU.
    assert 2.5 * 2**30 < grown < 3.5 * 2**30
    assert any("replicated" in a for a in replicated["assumptions"])


def test_framework_preset_names_what_it_set_and_flags_override_it() -> None:
    base = ["estimate", "--model", "llama-3.1-8b", "--gpus", "8", "--seq-len", "2048", "--framework", "torchtitan"]
    text = run(*base, "--activation-checkpointing", "full")
    assert text.returncode == 0, text.stderr
    assert "framework torchtitan:" in text.stdout and "sets --shard-embeddings" in text.stdout
    assert "sets --activation-checkpointing" not in text.stdout  # the explicit flag won
    d = json.loads(run(*base, "--no-shard-embeddings", "--json").stdout)
    assert d["setup"]["shard_embeddings"] is False and "shard_embeddings" not in d["framework"]["set"]
    assert d["setup"]["loss_impl"] == "native" and d["setup"]["activation_checkpointing"] == "selective"
    assert all("@" in v["source"] for v in d["framework"]["set"].values())
    plain = json.loads(run(*base[:-2], "--json").stdout)
    assert plain["framework"] is None and plain["setup"]["loss_impl"] == "hf"
    hint = "no --framework: the stack flags not given are generic defaults"
    assert hint not in text.stdout
    assert hint in run(*base[:-2]).stdout and "torchtune" in run(*base[:-2]).stdout.split(hint)[1]


def test_help_lists_every_stack_flag_and_preset() -> None:
    from gpuprov.commands.estimate import STACK_FLAGS
    from gpuprov.sizing.frameworks import STACK_FIELDS, names

    assert set(STACK_FLAGS) == set(STACK_FIELDS)  # every field a preset may set has its own flag
    out = run("estimate", "--help").stdout
    for flag, _ in STACK_FLAGS.values():
        assert flag in out, flag
    for name in names():
        assert name in out, name
    bad = run("estimate", "--framework", "megatron")
    assert bad.returncode == 2 and "megatron" in bad.stderr and "Traceback" not in bad.stderr


def test_does_not_fit_suggests_exact_commands_that_fit_and_exit_3() -> None:
    import shlex

    args = ["estimate", "--model", "llama-3.1-8b", "--gpu", "rtx-4090-24gb", "--gpus", "1", "--seq-len", "4096",
            "--micro-batch", "4", "--task", "lora", "--activation-checkpointing", "none"]
    r = run(*args, "--json", "--fail-if-not-fits")
    assert r.returncode == 3, r.stderr
    d = json.loads(r.stdout)
    assert not d["fits"] and 1 <= len(d["suggestions"]) <= 3
    costs = [s["gpu_seconds_per_token"] for s in d["suggestions"]]
    assert costs == sorted(costs)
    for s in d["suggestions"]:
        words = shlex.split(s["command"])
        assert words[:2] == ["gpuprov", "estimate"]
        again = json.loads(run(*words[1:], "--json").stdout)
        assert again["fits"] and again["per_gpu_bytes"] == s["per_gpu_bytes"], s
    text = run(*args)
    assert text.returncode == 0 and "would fit with" in text.stdout and "gpuprov estimate --model" in text.stdout
    fits = run("estimate", "--model", "llama-3.2-1b", "--gpus", "1", "--seq-len", "512", "--fail-if-not-fits", "--json")
    assert fits.returncode == 0 and "suggestions" not in json.loads(fits.stdout)
    asked = json.loads(run("estimate", "--model", "llama-3.2-1b", "--gpus", "1", "--seq-len", "512", "--suggest",
                           "--json").stdout)
    assert "suggestions" in asked


def test_qlora_text_says_which_base_it_sized() -> None:
    base = ["estimate", "--model", "llama-2-7b", "--task", "qlora", "--gpus", "8"]
    assert "QLoRA base: NF4 sharded by FSDP" in run(*base).stdout
    out = run(*base, "--framework", "gpuprov").stdout
    assert "QLoRA base: NF4 replicated on every GPU" in out and "gpuprov plan" in out


@pytest.mark.parametrize("args", [
    ["--model", "mistral-7b", "--gpu", "rtx-4090-24gb", "--gpus", "1", "--seq-len", "2048", "--micro-batch", "4",
     "--task", "lora", "--framework", "gpuprov"],
    ["--model", "llama-3.1-8b", "--gpu", "l4-24gb", "--gpus", "8", "--seq-len", "8192", "--task", "lora",
     "--framework", "litgpt"],
    ["--model", "llama-3.1-8b", "--gpu", "rtx-4090-24gb", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "4096",
     "--task", "lora", "--framework", "hf-trainer"],
])
def test_each_suggestion_sizes_what_its_command_sizes(args) -> None:
    """A change of --task or --sharding changes what a framework preset sets (its `when:` rules): the
    suggestion's bytes came from the old preset settings while its command re-resolved them."""
    import shlex

    d = json.loads(run("estimate", *args, "--suggest", "--json").stdout)
    assert d["suggestions"]
    for s in d["suggestions"]:
        again = json.loads(run(*shlex.split(s["command"])[1:], "--json").stdout)
        assert again["fits"] and again["per_gpu_bytes"] == s["per_gpu_bytes"], s


def test_kbit_fp32_casts_flag_reaches_the_setup_and_the_notes() -> None:
    base = ("estimate", "--model", "8b", "--task", "qlora", "--gpus", "1", "--gpu", "rtx-4090-24gb", "--precision",
            "bf16", "--json")
    plain, cast = run(*base), run(*base, "--kbit-fp32-casts")
    assert plain.returncode == 0 and cast.returncode == 0, cast.stderr
    p, c = json.loads(plain.stdout), json.loads(cast.stdout)
    assert c["setup"]["kbit_fp32_casts"] is True and p["setup"]["kbit_fp32_casts"] is False
    assert c["per_gpu_bytes"] > p["per_gpu_bytes"]
    assert any("prepare_model_for_kbit_training" in a for a in c["assumptions"])


def test_skypilot_gpu_count_is_the_gpu_count_and_a_conflict_is_one_line() -> None:
    named = run("estimate", "--model", "8b", "--gpu", "H100:4", "--json")
    assert named.returncode == 0, named.stderr
    setup = json.loads(named.stdout)["setup"]
    assert setup["gpus"] == 4 and json.loads(named.stdout)["gpu"]["slug"] == "h100-80gb"
    same = run("estimate", "--model", "8b", "--gpu", "H100:8", "--gpus", "8", "--json")
    assert same.returncode == 0 and json.loads(same.stdout)["setup"]["gpus"] == 8
    clash = run("estimate", "--model", "8b", "--gpu", "H100:4", "--gpus", "8")
    assert clash.returncode == 2 and len(clash.stderr.strip().splitlines()) == 1
    assert "--gpu H100:4" in clash.stderr and "--gpus 8" in clash.stderr
