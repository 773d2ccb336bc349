"""Exact parameter counts: presets vs published totals, vs transformers' own models, config.json parsing."""

from __future__ import annotations

import json

import pytest

from gpuprov.catalog import load_data
from gpuprov.catalog.models import get_model, list_models
from gpuprov.errors import GpuprovError
from gpuprov.sizing.arch import arch_from_hf_config, resolve_lora_targets

PRESETS = load_data("models.yaml")["models"]


def test_issue_reference_counts() -> None:
    assert get_model("llama-2-7b").params == 6_738_415_616
    assert get_model("llama-3.1-8b").params == 8_030_261_248


@pytest.mark.parametrize("slug", list(PRESETS))
def test_preset_count_equals_published(slug: str) -> None:
    """The page's exact total where recorded (less a multimodal model's vision tower and projector, plus
    what the publisher's own code counts as parameters and transformers as buffers); else the card's
    rounded figures, to the digits shown."""
    entry, arch = PRESETS[slug], get_model(slug)
    if "published_params" in entry:
        vision = entry.get("vision_params", 0)
        projector = 1152 * arch.hidden_size + 1152 if vision else 0  # SigLIP width into the text width, + norm
        if arch.model_type not in ("llama", "mistral", "mixtral", "qwen2", "gemma2"):  # where each total was read
            assert entry["published_source"], slug
        tied_copy = arch.embedding_params if entry.get("published_tied_copy") else 0  # the head stored beside it
        assert arch.params + vision + projector + entry.get("published_buffers", 0) + tied_copy \
            == entry["published_params"], slug
    else:
        assert "card_params" in entry, slug
    card = entry.get("card_params")
    if card:
        assert card["source"].startswith("https://huggingface.co/")
        non_embedding = arch.params - arch.embedding_params - arch.lm_head_params
        for key, ours in (("total", arch.params), ("active", arch.active_params), ("non_embedding", non_embedding)):
            if key in card:
                shown = card[key]
                digits = len(f"{shown / 1e9:g}".replace(".", "").lstrip("0"))  # 0.44e9 -> 2 digits, 6.95e9 -> 3
                unit = 10 ** (len(str(ours)) - digits)  # the last digit shown (cards round or truncate)
                assert shown - unit / 2 <= ours < shown + unit, (slug, key, ours, shown)
    assert entry["source"].startswith("https://huggingface.co/") and entry["source"].endswith("config.json")


def test_shorthands_name_real_models() -> None:
    aliases = load_data("models.yaml")["aliases"]
    for short in ("7b", "13b", "34b", "70b"):
        target = aliases[short]["model"]
        assert target in PRESETS and aliases[short]["why"]
        assert get_model(short).name == target
    assert get_model("70B").name == "llama-3.1-70b"  # case-insensitive


def test_architecture_features() -> None:
    qwen = get_model("qwen2.5-7b")
    assert qwen.qkv_bias and not qwen.tie_word_embeddings
    gemma = get_model("gemma-2-9b")
    assert gemma.tie_word_embeddings and gemma.head_dim == 256 and gemma.q_dim != gemma.hidden_size
    mixtral = get_model("mixtral-8x7b")
    assert mixtral.num_experts == 8 and mixtral.experts_per_token == 2
    assert 12.5e9 < mixtral.active_params < 13.5e9  # ~12.9B active per token (2 of 8 experts)
    small = get_model("llama-3.2-1b")
    assert small.tie_word_embeddings and small.lm_head_params == 0


def test_config_json_path(tmp_path) -> None:
    cfg = dict(PRESETS["llama-3.1-8b"]["config"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    arch = get_model(str(path))
    assert arch.params == 8_030_261_248
    assert get_model(str(tmp_path)).params == arch.params  # a folder holding config.json


def test_qkv_bias_and_tying_change_counts() -> None:
    base = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=2, vocab_size=100)
    llama = arch_from_hf_config(base, name="t").params
    qwen = arch_from_hf_config({**base, "model_type": "qwen2"}, name="t").params
    assert qwen - llama == 2 * (64 + 2 * 32)  # q, k, v biases per layer
    tied = arch_from_hf_config({**base, "tie_word_embeddings": True}, name="t").params
    assert llama - tied == 100 * 64


@pytest.mark.parametrize(
    "cfg, message",
    [
        ({"model_type": "gpt2", "hidden_size": 8}, "not supported"),
        ({"model_type": "llama", "hidden_size": 64}, "num_attention_heads"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 10, "num_key_value_heads": 3}, "divisor"),
        ({"model_type": "llama", "hidden_size": -64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 10}, "hidden_size"),
        ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 10}, "num_local_experts"),
        # sizes past any real model: the estimate printed yottabytes with exit 0
        ({"model_type": "llama", "hidden_size": 10**30, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 10}, "'hidden_size' = 10+ is beyond any real model"),
        ({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
          "intermediate_size": 128, "vocab_size": 10, "head_dim": 2**25}, "head_dim 33554432 is beyond"),
        ({"model_type": "llama", "hidden_size": 2**20, "num_attention_heads": 4, "num_hidden_layers": 2**20,
          "intermediate_size": 2**20, "vocab_size": 10}, "parameters is beyond any real model"),
    ],
)
def test_bad_configs(cfg: dict, message: str) -> None:
    with pytest.raises(GpuprovError, match=message):
        arch_from_hf_config(cfg, name="bad")


def test_malformed_and_missing_files(tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "llama",')
    with pytest.raises(GpuprovError, match="not a readable JSON"):
        get_model(str(bad))
    with pytest.raises(GpuprovError, match="not found"):
        get_model(str(tmp_path / "nope" / "config.json"))
    arr = tmp_path / "list.json"
    arr.write_text("[1, 2]")
    with pytest.raises(GpuprovError, match="JSON object"):
        get_model(str(arr))


def test_unknown_model_lists_close_matches() -> None:
    with pytest.raises(GpuprovError, match="llama-3.1-8b"):
        get_model("llama-3-8b")


def test_lora_counts_and_targets() -> None:
    arch = get_model("llama-2-7b")
    # q_proj + v_proj, rank 8: 32 layers * 2 modules * 8 * (4096 + 4096)
    assert arch.trainable_params("lora", 8, "qv") == 32 * 2 * 8 * 8192
    assert resolve_lora_targets("q_proj, v_proj") == ("q_proj", "v_proj")
    assert resolve_lora_targets(["w1", "w2", "w3"]) == ("gate_proj", "down_proj", "up_proj")
    with pytest.raises(GpuprovError, match="unknown LoRA target"):
        resolve_lora_targets("q_proj,lm_headx")
    with pytest.raises(GpuprovError, match="larger than the hidden size"):
        arch.trainable_params("lora", 5000, "qv")


def test_mixtral_lora_adapts_attention_never_its_experts() -> None:
    """Mixtral's experts are w1/w3/w2 Linears per expert under block_sparse_moe.experts (transformers 4.x) or
    fused tensors (5.x): no gate_proj/up_proj/down_proj for peft to match, and the trainer excludes experts.
    So its presets are attention, as every MoE family's, its expert names are refused with the reason,
    and the adapter count is the attention's alone."""
    moe = get_model("mixtral-8x7b")
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert resolve_lora_targets("all-linear", "mixtral") == attention == moe.lora_targets("all-linear")
    for name in ("w1", "gate_proj", "down_proj"):
        with pytest.raises(GpuprovError, match="routed experts are not adapted"):
            moe.trainable_params("lora", 8, name)
    # q: 4096 -> 4096, k and v: 4096 -> 1024, o: 4096 -> 4096; rank 8 on 32 blocks
    assert moe.trainable_params("lora", 8, "all-linear") == 32 * 8 * (2 * (4096 + 4096) + 2 * (4096 + 1024))
    dense = get_model("mistral-7b")  # the same attention and blocks: Mixtral adapts what Mistral's attention preset does
    assert moe.trainable_params("lora", 8, "all-linear") == dense.trainable_params("lora", 8, "attention")


@pytest.mark.torch
@pytest.mark.slow
def test_counts_match_transformers_models() -> None:
    """Build every preset on the meta device with transformers and count its parameters."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    for arch in list_models():
        cfg = transformers.AutoConfig.for_model(**arch.hf_config)
        if getattr(cfg, "vision_config", None) is not None:  # Gemma 3: the language model is what trains
            cfg = cfg.get_text_config()
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        assert sum(p.numel() for p in model.parameters()) == arch.params, arch.name


@pytest.mark.torch
def test_lora_count_matches_peft() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    arch = get_model("qwen2.5-7b")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**arch.hf_config))
        lora = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert trainable == arch.trainable_params("lora", 8, tuple(targets))


def test_a_caller_mutating_hf_config_does_not_change_the_next_lookup():
    arch = get_model("llama-3.1-8b")
    arch.hf_config["rope_scaling"]["rope_theta"] = 1.0  # what transformers 5 does to rope_scaling
    assert "rope_theta" not in get_model("llama-3.1-8b").hf_config["rope_scaling"]
