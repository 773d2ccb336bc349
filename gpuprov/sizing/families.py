"""What a Hugging Face model_type builds, block by block: the facts arch.py counts from.

Each entry is read off the family's transformers modeling file (the module tree
`AutoModelForCausalLM.from_config(cfg)` builds); tests compare every count with that tree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """What one Hugging Face model_type builds in each block, beyond the Llama layout arch.py counts by default."""
    norms: int = 2  # hidden-wide RMSNorm weights per block (input/post-attention, Gemma's pre/post-feedforward)
    qk_norm: str = ""  # "head": q_norm/k_norm over head_dim (Qwen3, Gemma 3); "full": over q/kv width (OLMo 2)
    fused: bool = False  # qkv_proj and gate_up_proj as single linears (Phi-3)
    moe: str = ""  # "mixtral" (num_local_experts), "qwen3_moe" (num_experts), "deepseek" (n_routed_experts)
    mla: bool = False  # multi-head latent attention (DeepSeek-V2/V3)
    tied_default: bool = False  # tie_word_embeddings when config.json omits it
    qkv_bias: bool = False  # q/k/v biases always on (Qwen2)
    attention_bias_key: bool = False  # config's attention_bias adds q/k/v/o biases
    mlp_bias_key: bool = False  # config's mlp_bias adds gate/up/down biases
    sliding: str = ""  # "all": every layer (Mistral, Phi-3 when set); "pattern": Gemma 3's local/global layers
    text_config: bool = False  # a multimodal config nesting the language model's config (Gemma 3)
    source: str = ""


FAMILIES: dict[str, Family] = {
    "llama": Family(attention_bias_key=True, mlp_bias_key=True,
                    source="transformers models/llama/modeling_llama.py"),
    "mistral": Family(sliding="all", source="transformers models/mistral/modeling_mistral.py"),
    "mixtral": Family(moe="mixtral", source="transformers models/mixtral/modeling_mixtral.py"),
    "qwen2": Family(qkv_bias=True, source="transformers models/qwen2/modeling_qwen2.py"),
    "gemma2": Family(norms=4, tied_default=True, attention_bias_key=True,
                     source="transformers models/gemma2/modeling_gemma2.py"),
    # Qwen3: Qwen2's block without q/k/v biases, RMSNorm on each head's q and k (Qwen3Attention q_norm/k_norm)
    "qwen3": Family(qk_norm="head", attention_bias_key=True, source="transformers models/qwen3/modeling_qwen3.py"),
    # Qwen3-MoE: routed experts only (no shared expert), router `gate` without bias; mlp_only_layers and
    # decoder_sparse_step make some blocks dense
    "qwen3_moe": Family(qk_norm="head", moe="qwen3_moe", attention_bias_key=True,
                        source="transformers models/qwen3_moe/modeling_qwen3_moe.py"),
    # Gemma 3: Gemma 2's four norms per block plus q/k head norms, local (sliding) and global layers
    "gemma3_text": Family(norms=4, qk_norm="head", tied_default=True, attention_bias_key=True, sliding="pattern",
                          source="transformers models/gemma3/modeling_gemma3.py (Gemma3DecoderLayer)"),
    "gemma3": Family(norms=4, qk_norm="head", tied_default=True, attention_bias_key=True, sliding="pattern",
                     text_config=True,
                     source="transformers models/gemma3/modeling_gemma3.py (Gemma3ForConditionalGeneration: "
                            "vision_tower, multi_modal_projector, language_model)"),
    # Phi-3 (and Phi-4): fused qkv_proj and gate_up_proj; sliding_window set on Phi-3-mini
    "phi3": Family(fused=True, sliding="all", source="transformers models/phi3/modeling_phi3.py"),
    # OLMo 2: post-norms only (post_attention_layernorm, post_feedforward_layernorm) and q/k norms over
    # the whole q and k projections (Olmo2Attention q_norm(num_heads*head_dim), k_norm(num_kv_heads*head_dim))
    "olmo2": Family(qk_norm="full", attention_bias_key=True, source="transformers models/olmo2/modeling_olmo2.py"),
    # DeepSeek-V3: MLA (q_a/q_b, kv_a_proj_with_mqa/kv_b with their latent norms), first_k_dense_replace
    # dense blocks, then routed experts plus n_shared_experts always-on experts; the router's
    # e_score_correction_bias is a buffer, not a parameter
    "deepseek_v3": Family(moe="deepseek", mla=True, attention_bias_key=True,
                          source="transformers models/deepseek_v3/modeling_deepseek_v3.py"),
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)

# LoRA target presets per family: the linear modules peft adapts in every block. MoE families adapt their
# attention only: routed experts are never adapted (transformers 5 keeps them as 3-D tensors, and peft >= 0.18
# maps the names gate_proj/up_proj/down_proj onto those tensors, so DeepSeek's dense and shared-expert MLPs
# cannot be named apart from the experts; 4.x builds one Linear per expert, which the trainer excludes).
# Mixtral is no exception: 4.x names each expert's projections w1/w3/w2 (block_sparse_moe.experts.N.w1), 5.x
# fuses them (mlp.experts.gate_up_proj), and neither has a gate_proj/up_proj/down_proj for peft to match.
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
_MLA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
LORA_PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    "default": {"qv": ("q_proj", "v_proj"), "attention": _ATTN, "all-linear": _ATTN + _MLP},
    "phi3": {"qv": ("qkv_proj",), "attention": ("qkv_proj", "o_proj"),
             "all-linear": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")},
    "mixtral": {"qv": ("q_proj", "v_proj"), "attention": _ATTN, "all-linear": _ATTN},
    "qwen3_moe": {"qv": ("q_proj", "v_proj"), "attention": _ATTN, "all-linear": _ATTN},
    "deepseek_v3": {"qv": ("q_b_proj", "kv_b_proj"), "attention": _MLA, "all-linear": _MLA},
}


def family(model_type: str) -> Family:
    return FAMILIES[model_type]


def lora_presets(model_type: str) -> dict[str, tuple[str, ...]]:
    return LORA_PRESETS.get(model_type, LORA_PRESETS["default"])


ALL_LINEAR_NAMES: tuple[str, ...] = tuple(dict.fromkeys(
    n for p in LORA_PRESETS.values() for n in p["all-linear"]))
