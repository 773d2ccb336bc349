"""The model families end to end through the CLI: each plans and generates a bundle that validates, the
bundle's trainer gets the family's LoRA modules and config, instruct ids size offline, and what the trainer
cannot run is refused in one line (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from gpuprov.catalog import load_data
from gpuprov.catalog.models import get_model
from gpuprov.cli import cli as main
from gpuprov.sizing.memory_notes import family_notes
from gpuprov.errors import GpuprovError
from gpuprov.sizing.activations import sliding_mask_bytes
from gpuprov.sizing.arch import resolve_lora_targets
from gpuprov.sizing.families import lora_presets
from gpuprov.sizing.setup import make_setup
from gpuprov.sizing.throughput import flops_per_token

PRESETS = load_data("models.yaml")["models"]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No Hugging Face cache and no hub: whatever sizes here sizes offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def run(*args: str) -> subprocess.CompletedProcess:
    """The real process: exit codes and stderr as a user sees them."""
    return subprocess.run([sys.executable, "-m", "gpuprov", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3-30b-a3b", "gemma-3-4b", "phi-3-mini", "olmo-2-7b"])
def test_each_family_plans(model):
    r = cli("plan", "--model", model, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["model"]["params"] == get_model(model).params and d["cluster"]["total_gpus"] >= 1


def test_full_deepseek_v3_needs_more_than_fsdp_and_says_so():
    """Without expert parallelism each MoE block (11.3B parameters) is gathered whole on every GPU: full
    training fits no catalog node, and the refusal points at LoRA, which plans."""
    r = run("plan", "--model", "deepseek-v3")
    assert r.returncode == 2 and "--task lora" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert cli("plan", "--model", "deepseek-v3", "--task", "lora", "--json").exit_code == 0


@pytest.mark.slow  # 15-25 s each: a whole bundle rendered and validated
@pytest.mark.parametrize("model,task", [("qwen3-8b", "full"), ("qwen3-30b-a3b", "lora"), ("google/gemma-3-4b-it", "full"),
                                        ("phi-3-mini", "lora"), ("olmo-2-7b", "full"), ("deepseek-v3", "lora")])
def test_each_family_plans_generates_and_validates(tmp_path, model, task):
    out = tmp_path / "bundle"
    r = cli("generate", "--model", model, "--task", task, "-o", str(out))
    assert r.exit_code == 0, r.output
    arch = get_model(model)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["hf_model_type"] == arch.model_type and plan["model"]["params"] == arch.params
    train = yaml.safe_load((out / "launch" / "train.yaml").read_text())
    assert train["model"]["hf_config"] == arch.hf_config  # the config.json verbatim (Gemma 3's multimodal one)
    if task == "lora":
        assert train["task"]["lora"]["targets"] == list(lora_presets(arch.model_type)["all-linear"])
    r = cli("validate", "--offline", str(out))
    assert r.exit_code == 0, r.output
    r = cli("check", str(out))  # rebuilt from plan.json's config alone (no cache, no hub): the same bundle
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("slug", [s for s, e in PRESETS.items() if e.get("hf_ids")])
def test_instruct_and_chat_ids_size_offline_as_their_preset(slug):
    preset = get_model(slug)
    for repo in PRESETS[slug]["hf_ids"]:
        arch = get_model(repo)
        assert (arch.params, arch.hf_config) == (preset.params, preset.hf_config), repo
        assert arch.display_name == repo
        assert get_model(repo.upper()).params == preset.params  # ids are case-insensitive on the hub


def test_an_instruct_id_plans_with_its_own_weights():
    r = cli("plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--task", "lora", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["model"]["params"] == get_model("llama-3.1-8b").params
    assert d["training"]["base_weights"] == "meta-llama/Llama-3.1-8B-Instruct"


def test_an_unknown_id_is_refused_offline_in_one_line():
    r = run("plan", "--model", "someorg/NoSuchModel-7B-Instruct")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and not r.stdout, r.stderr


@pytest.mark.parametrize("args,words", [
    (("--model", "deepseek-v3", "--task", "qlora"), "--task qlora is not planned"),
    (("--model", "qwen3-30b-a3b", "--task", "qlora"), "--task qlora is not planned"),
    (("--model", "google/gemma-3-4b-it", "--task", "qlora"), "--task qlora is not planned"),
    (("--model", "phi-4", "--tp", "2"), "tensor-parallel plan does not cover phi3"),
    (("--model", "olmo-2-13b", "--pp", "2"), "pipeline stages are tested on"),
])
def test_what_the_trainer_cannot_run_is_refused(args, words):
    r = run("plan", *args)
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_tensor_parallel_where_the_trainer_shards_the_family():
    r = cli("plan", "--model", "qwen3-32b", "--gpu", "h100-80gb", "--tp", "2", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["cluster"]["tp"] == 2  # Qwen3's per-head q/k norms act on each rank's own heads


def test_lora_presets_name_each_familys_modules():
    assert resolve_lora_targets("all-linear", "phi3") == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert resolve_lora_targets("attention", "deepseek_v3") == ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                 "kv_b_proj", "o_proj")
    with pytest.raises(GpuprovError, match="of a deepseek_v3 model"):
        resolve_lora_targets("gate_proj", "deepseek_v3")  # named apart from the routed experts nowhere
    phi = get_model("phi-3-mini")
    # rank 8 on qkv_proj (3072 -> 9216) of every block
    assert phi.trainable_params("lora", 8, "qv") == 32 * 8 * (3072 + 9216)


def test_moe_flops_come_from_the_active_experts():
    arch = get_model("qwen3-30b-a3b")
    fl = flops_per_token(arch, 4096, "full", arch.params, "none")
    assert fl.matmul_params == arch.active_params - arch.embedding_params
    assert 3.2e9 < arch.active_params < 3.4e9 and arch.params > 30e9
    ds = get_model("deepseek-v3")
    assert 37e9 < ds.active_params < 38e9  # the card's 37B activated
    assert ds.attn_head_dim == (128 + 64 + 128) // 2  # QK^T over nope + rope, PV over v


def test_sliding_window_mask_only_past_the_window():
    arch = get_model("gemma-3-4b")
    assert arch.sliding_window == 1024 and arch.sliding_layers == 34 - 34 // 6

    def setup(seq):
        return make_setup(task="full", seq_len=seq, micro_batch=2, gpus=8, gpus_per_node=8, sharding="fsdp",
                          shard_group=None, activation_checkpointing="full", precision="bf16-mixed",
                          optimizer="adamw", offload="none", lora_rank=16, lora_targets=("q_proj",), grad_accum=1)
    assert sliding_mask_bytes(arch, setup(1024)) == 0
    assert sliding_mask_bytes(arch, setup(8192)) == 2 * 8192 * 8192
    assert sliding_mask_bytes(get_model("qwen3-8b"), setup(8192)) == 0


def test_the_bundles_transformers_pin_has_every_family():
    """software.yaml's pinned transformers (what the bundle installs) builds every family the planner sizes."""
    facts = load_data("trainer.yaml")["model_families"]
    software = load_data("software.yaml")
    pins = [r for r in yaml.safe_dump(software).split() if r.startswith("transformers==")]
    assert pins, "software.yaml pins no transformers"
    pinned = tuple(int(x) for x in pins[0].split("==")[1].split("."))
    for model_type, first in facts["min_transformers"].items():
        assert pinned >= tuple(int(x) for x in first.split(".")), model_type
    assert set(facts["blocks"]) >= set(facts["min_transformers"])


def test_a_multimodal_gemma3_config_json_lists_only_what_differs(tmp_path):
    """Gemma 3's config.json nests a text_config holding only what differs from Gemma3TextConfig's defaults
    (heads, kv heads, head_dim and vocabulary come from those): it sizes as the preset's language model."""
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = get_model(str(tmp_path / "config.json"))
    assert arch.params == get_model("gemma-3-4b").params and arch.model_type == "gemma3_text"
    assert arch.language_of == "gemma3" and "vision tower" in arch.excluded


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "deepseek-v3"])
def test_moe_plans_state_how_the_experts_are_held_and_counted(model):
    """The plan says what its MoE memory and FLOPs come from: every expert held and sharded by FSDP (no expert
    parallelism), the routed experts per token, DeepSeek's shared expert, dense blocks and latent attention."""
    arch = get_model(model)
    r = cli("plan", "--model", model, "--task", "lora", "--json")
    assert r.exit_code == 0, r.output
    notes = json.loads(r.output)["memory"]["assumptions"]
    (moe,) = [n for n in notes if n.startswith("MoE:")]
    assert f"all {arch.num_experts} experts" in moe and "sharded by FSDP" in moe and "no expert parallelism" in moe
    assert f"from the {arch.experts_per_token} routed experts per token" in moe
    # LoRA freezes the experts: the plan does not claim their gradients and optimizer states
    assert "frozen weights" in moe and "gradients and optimizer states are held" not in moe
    (full,) = [n for n in family_notes(arch, "full") if n.startswith("MoE:")]
    assert "weights, gradients and optimizer states are held" in full
    latent = [n for n in notes if n.startswith("multi-head latent attention")]
    if arch.mla:
        assert f"a shared expert of width {arch.shared_intermediate_size}" in moe
        assert f"{arch.dense_layers} of {arch.num_layers} blocks dense" in moe
        assert len(latent) == 1 and f"latents of {arch.mla[0]} (q)" in latent[0]
    else:
        assert "shared expert" not in moe and not latent
