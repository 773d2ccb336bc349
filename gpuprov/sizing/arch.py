"""Model architecture from a Hugging Face config.json: exact parameter counts, module shapes.

Supported model_types (sizing/families.py): llama, mistral, mixtral (MoE), qwen2 (q/k/v biases), gemma2,
qwen3 and qwen3_moe (q/k head norms; routed experts), gemma3 / gemma3_text (local and global layers; the
multimodal config's language model), phi3 (fused qkv and gate/up), olmo2 (post-norms, full-width q/k
norms), deepseek_v3 (multi-head latent attention, shared and routed experts, dense first blocks). Counts
are exact: they equal what `AutoModelForCausalLM.from_config(cfg).num_parameters()` reports for the
language model (tests check both that and the published totals).
"""

from __future__ import annotations

import copy
import functools

from dataclasses import dataclass, field
from typing import Any

from gpuprov.errors import GpuprovError
from gpuprov.sizing import families
from gpuprov.sizing.families import SUPPORTED_MODEL_TYPES, family
from gpuprov.validators import MAX_CONFIG_COUNT, MAX_PARAMS

__all__ = ["SUPPORTED_MODEL_TYPES", "ModelArch", "arch_from_hf_config", "resolve_lora_targets", "check_lora_rank"]

# Mixtral (transformers 4.x) names its expert projections w1 (gate), w3 (up), w2 (down): read as the MLP names,
# which an MoE family refuses as LoRA targets (its experts are not adapted).
_MLP_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
LINEAR_NAMES: tuple[str, ...] = families.ALL_LINEAR_NAMES


def _per_arch(method):
    """A count of one block, computed once per arch and argument: the arch is frozen, and the planner asks for
    the same counts thousands of times while it searches."""
    name = method.__name__

    @functools.wraps(method)
    def counted(self, *args: Any, **kwargs: Any):
        memo = self.__dict__.setdefault("_counts", {})  # beside the fields: not compared, hashed or shown
        key = (name, args, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = method(self, *args, **kwargs)
        return memo[key]
    return counted


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer, enough of it to count parameters, FLOPs and activation bytes.

    For MoE models `intermediate_size` is one routed expert's width; `dense_layers` blocks (DeepSeek's
    first_k_dense_replace, Qwen3-MoE's mlp_only_layers) carry a dense MLP of `dense_intermediate_size`.
    """

    name: str
    display_name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 1  # 1 = dense MLP
    experts_per_token: int = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (llama attention_bias)
    qkv_bias: bool = False  # q/k/v biases only (qwen2)
    mlp_bias: bool = False
    max_position_embeddings: int | None = None
    dense_layers: int = 0  # MoE models: blocks with a dense MLP instead of experts
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # always-on shared experts, as one MLP of this width (DeepSeek)
    mla: tuple[int, int, int, int, int] | None = None  # (q_lora_rank or 0, kv_lora_rank, rope, nope, v_head_dim)
    sliding_window: int | None = None
    sliding_layers: int = 0  # blocks whose attention sees only the last sliding_window tokens
    excluded: str = ""  # what the config describes that is not sized (a vision tower, an MTP block)
    language_of: str = ""  # the multimodal model_type whose language model this is (Gemma 3's gemma3)
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    source: str = ""
    params: int = 0  # filled in __post_init__ (exact)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", self._count_params())

    # -- shapes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        """Width of the queries (MLA: heads x (nope + rope))."""
        if self.mla:
            return self.num_attention_heads * (self.mla[2] + self.mla[3])
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        if self.mla:  # K and V are decompressed per head from the latent before attention
            return self.num_attention_heads * (self.mla[2] + self.mla[3])
        return self.num_kv_heads * self.head_dim

    @property
    def v_dim(self) -> int:
        return self.num_attention_heads * self.mla[4] if self.mla else self.kv_dim

    @property
    def attn_out_dim(self) -> int:
        """Width of the attention output (o_proj's input)."""
        return self.num_attention_heads * self.mla[4] if self.mla else self.q_dim

    @property
    def attn_head_dim(self) -> int:
        """Mean per-head width of attention's two products (QK^T over q/k, PV over v): MLA's differ."""
        return (self.mla[2] + self.mla[3] + self.mla[4]) // 2 if self.mla else self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.dense_layers if self.is_moe else 0

    def _attention_shapes(self) -> dict[str, tuple[int, int, int]]:
        h = self.hidden_size
        if self.mla:
            qr, kvr, rope, nope, v = self.mla
            heads = self.num_attention_heads
            q = {"q_a_proj": (h, qr, 1), "q_b_proj": (qr, heads * (nope + rope), 1)} if qr else \
                {"q_proj": (h, heads * (nope + rope), 1)}
            return {**q, "kv_a_proj_with_mqa": (h, kvr + rope, 1), "kv_b_proj": (kvr, heads * (nope + v), 1),
                    "o_proj": (heads * v, h, 1)}
        if family(self.model_type).fused:
            return {"qkv_proj": (h, self.q_dim + 2 * self.kv_dim, 1), "o_proj": (self.q_dim, h, 1)}
        return {"q_proj": (h, self.q_dim, 1), "k_proj": (h, self.kv_dim, 1), "v_proj": (h, self.kv_dim, 1),
                "o_proj": (self.q_dim, h, 1)}

    def _mlp_shapes(self, width: int, copies: int, prefix: str = "") -> dict[str, tuple[int, int, int]]:
        h = self.hidden_size
        if family(self.model_type).fused:
            return {prefix + "gate_up_proj": (h, 2 * width, copies), prefix + "down_proj": (width, h, copies)}
        return {prefix + "gate_proj": (h, width, copies), prefix + "up_proj": (h, width, copies),
                prefix + "down_proj": (width, h, copies)}

    def linear_shapes(self, dense: bool = False) -> dict[str, tuple[int, int, int]]:
        """Per decoder block: module name -> (in_features, out_features, copies per block).

        `dense`: a dense block of an MoE model. Routed experts (Mixtral's w1/w3/w2 too) are named
        `experts.*`, one copy per expert: never LoRA targets (families.LORA_PRESETS)."""
        shapes = self._attention_shapes()
        if not self.is_moe or dense:
            width = self.dense_intermediate_size if (self.is_moe and self.dense_intermediate_size) else \
                self.intermediate_size
            return {**shapes, **self._mlp_shapes(width, 1)}
        shapes.update(self._mlp_shapes(self.intermediate_size, self.num_experts, "experts."))
        if self.shared_intermediate_size:
            shapes.update(self._mlp_shapes(self.shared_intermediate_size, 1))
        return shapes

    # -- counts -------------------------------------------------------------------------
    @_per_arch
    def layer_linear_params(self, dense: bool = False) -> int:
        """Weights of the big matmuls of one block (all experts), no biases: what NF4 quantizes."""
        return sum(i * o * n for i, o, n in self.linear_shapes(dense).values())

    @_per_arch
    def norm_params(self) -> int:
        """A block's norm weights (hidden-wide, q/k, MLA latent norms)."""
        fam, h = family(self.model_type), self.hidden_size
        total = fam.norms * h
        if fam.qk_norm == "head":
            total += 2 * self.head_dim
        elif fam.qk_norm == "full":
            total += self.q_dim + self.kv_dim
        if self.mla:
            total += self.mla[0] + self.mla[1]  # q_a_layernorm, kv_a_layernorm
        return total

    @_per_arch
    def layer_params(self, dense: bool = False) -> int:
        """Every parameter of one decoder block (all experts); the MoE block unless `dense`."""
        h = self.hidden_size
        total = self.layer_linear_params(dense)
        if self.attention_bias:
            total += self.q_dim + 2 * self.kv_dim + h
        elif self.qkv_bias:
            total += self.q_dim + 2 * self.kv_dim
        if self.mlp_bias:
            total += (2 * self.intermediate_size + h) * self.num_experts
        if self.is_moe and not dense:
            total += h * self.num_experts  # router, no bias
        return total + self.norm_params()

    @_per_arch
    def active_layer_params(self, dense: bool = False) -> int:
        """Parameters one token touches in a block (MoE: top-k experts), for FLOPs."""
        if not self.is_moe or dense:
            return self.layer_params(dense)
        per_expert = 3 * self.hidden_size * self.intermediate_size
        return self.layer_params() - per_expert * (self.num_experts - self.experts_per_token)

    @_per_arch
    def blocks_params(self) -> int:
        """Every decoder block's parameters together."""
        return self.moe_layers * self.layer_params() + (self.num_layers - self.moe_layers) * \
            self.layer_params(dense=self.is_moe)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def _count_params(self) -> int:
        final_norm = self.hidden_size
        return self.blocks_params() + self.embedding_params + self.lm_head_params + final_norm

    @property
    def active_params(self) -> int:
        return self.params - self.moe_layers * (self.layer_params() - self.active_layer_params())

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters (A: in x r, B: r x out) on every target module of every block."""
        def per_block(dense: bool) -> int:
            shapes = self.linear_shapes(dense)
            return sum(rank * (shapes[t][0] + shapes[t][1]) * shapes[t][2] for t in targets if t in shapes)
        return self.moe_layers * per_block(False) + (self.num_layers - self.moe_layers) * per_block(self.is_moe)

    def lora_targets(self, targets: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
        """A preset or module names, as this family's module names (unknown ones refused)."""
        return resolve_lora_targets(targets, self.model_type)

    def trainable_params(self, task: str, lora_rank: int = 16, lora_targets: tuple[str, ...] | str = "all-linear") -> int:
        if task == "full":
            return self.params
        if task not in ("lora", "qlora"):
            raise GpuprovError(f"unknown task {task!r}; expected full, lora or qlora")
        targets = self.lora_targets(lora_targets)
        check_lora_rank(self, lora_rank)
        return self.lora_params(lora_rank, targets)

    def summary(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "display_name": self.display_name,
            "model_type": self.model_type,
            "params": self.params,
            "active_params": self.active_params,
            "layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "heads": self.num_attention_heads,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "tie_word_embeddings": self.tie_word_embeddings,
            "source": self.source,
        }
        if self.excluded:
            out["excluded"] = self.excluded
        return out


def resolve_lora_targets(targets: tuple[str, ...] | list[str] | str, model_type: str | None = None) -> tuple[str, ...]:
    """'qv' / 'attention' / 'all-linear', or a comma list / sequence of module names.

    With `model_type`, presets are that family's modules and names must be its own; without, the
    Llama-style presets and any family's module names."""
    presets = families.lora_presets(model_type or "default")
    known = presets["all-linear"] if model_type else LINEAR_NAMES
    if isinstance(targets, str):
        if targets in presets:
            return presets[targets]
        names = [t.strip() for t in targets.split(",") if t.strip()]
    else:
        names = list(targets)
    if not names:
        raise GpuprovError("--lora-targets is empty; use qv, attention, all-linear or module names")
    out: list[str] = []
    for name in names:
        canon = _MLP_ALIASES.get(name, name)
        if canon not in known:
            where = f" of a {model_type} model" if model_type else ""
            experts = model_type in families.FAMILIES and family(model_type).moe and canon in families.MLP_NAMES
            why = " (its routed experts are not adapted: gpuprov plans LoRA on the attention of MoE models)" \
                if experts else ""
            raise GpuprovError(f"unknown LoRA target {name!r}{where}{why}; use qv, attention, all-linear or some of "
                               f"{', '.join(known)}")
        if canon not in out:
            out.append(canon)
    return tuple(out)


def check_lora_rank(arch: ModelArch, rank: int) -> None:
    if rank <= 0:
        raise GpuprovError(f"--lora-rank must be a positive integer, got {rank}")
    if rank > arch.hidden_size:
        raise GpuprovError(f"--lora-rank {rank} is larger than the hidden size {arch.hidden_size} of {arch.name}")


def _req(cfg: dict[str, Any], key: str, where: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GpuprovError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    if value > MAX_CONFIG_COUNT:  # past it the sizes are meaningless (a 10^30-wide layer printed yottabytes)
        raise GpuprovError(f"{where}: field {key!r} = {value} is beyond any real model (at most {MAX_CONFIG_COUNT:,})")
    return value


def _count(cfg: dict[str, Any], key: str, where: str, default: int) -> int:
    """A non-negative integer, `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > MAX_CONFIG_COUNT:
        raise GpuprovError(f"{where}: field {key!r} must be a non-negative integer, got {value!r}")
    return value


def _flag(cfg: dict[str, Any], key: str, default: bool, where: str) -> bool:
    """A JSON boolean (a string "false" would read as true)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GpuprovError(f"{where}: field {key!r} must be true or false, got {value!r}")
    return value


def _opt_count(cfg: dict[str, Any], key: str, where: str) -> int | None:
    return None if cfg.get(key) is None else _req(cfg, key, where)


# Gemma3TextConfig's defaults: a multimodal Gemma 3 config.json lists only what differs in text_config
# (transformers models/gemma3/configuration_gemma3.py Gemma3TextConfig.__init__)
_GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                         "head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 131072,
                         "sliding_window_pattern": 6}
_VISION_EXCLUDED = ("the vision tower and multimodal projector of Gemma3ForConditionalGeneration: the trainer "
                    "trains the language model (Gemma3ForCausalLM) on text")


def _language_config(cfg: dict[str, Any], where: str) -> tuple[dict[str, Any], str]:
    """(the language model's config, what is excluded): a Gemma 3 multimodal config's text_config."""
    if not family(cfg["model_type"]).text_config:
        return cfg, ""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise GpuprovError(f"{where}: a {cfg['model_type']} config needs a text_config object")
    merged = {**_GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    merged["model_type"] = "gemma3_text"
    merged.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    return merged, _VISION_EXCLUDED


def _sliding(cfg: dict[str, Any], layers: int, where: str) -> tuple[int | None, int]:
    """(window, how many blocks use it)."""
    mode = family(cfg["model_type"]).sliding
    window = _opt_count(cfg, "sliding_window", where)
    if not mode or window is None or cfg.get("use_sliding_window") is False:
        return None, 0
    if mode == "all":
        return window, layers
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return window, sum(1 for t in types if t == "sliding_attention")
    pattern = _count(cfg, "sliding_window_pattern", where, 6) or 1  # every pattern-th block is global
    return window, layers - layers // pattern


def _moe(cfg: dict[str, Any], layers: int, where: str) -> dict[str, Any]:
    """ModelArch's expert fields for the family's MoE config keys ({} for a dense model)."""
    kind = family(cfg["model_type"]).moe
    if not kind:
        return {}
    key = {"mixtral": "num_local_experts", "qwen3_moe": "num_experts", "deepseek": "n_routed_experts"}[kind]
    experts, topk = _req(cfg, key, where), _req(cfg, "num_experts_per_tok", where)
    if topk > experts:
        raise GpuprovError(f"{where}: num_experts_per_tok {topk} exceeds {key} {experts}")
    out: dict[str, Any] = {"num_experts": experts, "experts_per_token": topk}
    if kind == "qwen3_moe":
        step = _count(cfg, "decoder_sparse_step", where, 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
            raise GpuprovError(f"{where}: field 'mlp_only_layers' must be a list of block indices")
        out["dense_layers"] = sum(1 for i in range(layers) if i in only or not (step and (i + 1) % step == 0))
        out["intermediate_size"] = _req(cfg, "moe_intermediate_size", where)
    elif kind == "deepseek":
        out["dense_layers"] = min(_count(cfg, "first_k_dense_replace", where, 0), layers)
        out["intermediate_size"] = _req(cfg, "moe_intermediate_size", where)
        out["shared_intermediate_size"] = out["intermediate_size"] * _count(cfg, "n_shared_experts", where, 0)
    if out.get("dense_layers"):
        out["dense_intermediate_size"] = _req(cfg, "intermediate_size", where)
    return out


def _mla(cfg: dict[str, Any], where: str) -> dict[str, Any]:
    if not family(cfg["model_type"]).mla:
        return {}
    rope, nope = _req(cfg, "qk_rope_head_dim", where), _req(cfg, "qk_nope_head_dim", where)
    mla = (_count(cfg, "q_lora_rank", where, 0), _req(cfg, "kv_lora_rank", where), rope, nope,
           _req(cfg, "v_head_dim", where))
    mtp = _count(cfg, "num_nextn_predict_layers", where, 0)
    excluded = (f"the checkpoint's {mtp} multi-token-prediction block(s) (num_nextn_predict_layers): transformers' "
                "DeepseekV3ForCausalLM builds none, so the trainer trains none") if mtp else ""
    # head_dim: the query/key width per head (nope + rope), what attention's QK^T multiplies
    return {"mla": mla, "head_dim": rope + nope, "num_kv_heads": _req(cfg, "num_attention_heads", where),
            "excluded": excluded}


def _heads(cfg: dict[str, Any], hidden: int, heads: int, where: str) -> tuple[int, int]:
    kv = heads if cfg.get("num_key_value_heads") is None else cfg["num_key_value_heads"]
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or heads % kv:
        raise GpuprovError(f"{where}: field 'num_key_value_heads' must be a positive divisor of "
                           f"{heads} heads, got {kv!r}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise GpuprovError(f"{where}: hidden_size {hidden} is not a multiple of {heads} heads and no head_dim given")
        head_dim = hidden // heads
    elif isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise GpuprovError(f"{where}: head_dim must be a positive integer, got {head_dim!r}")
    if head_dim > MAX_CONFIG_COUNT:
        raise GpuprovError(f"{where}: head_dim {head_dim} is beyond any real model (at most {MAX_CONFIG_COUNT:,})")
    return kv, head_dim


def arch_from_hf_config(
    cfg: dict[str, Any], *, name: str, display_name: str | None = None, source: str = ""
) -> ModelArch:
    """Build a ModelArch from a parsed config.json (raises GpuprovError on what it cannot size)."""
    where = f"config for {name}"
    if not isinstance(cfg, dict):
        raise GpuprovError(f"{where}: expected a JSON object")
    if cfg.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise GpuprovError(f"{where}: model_type {cfg.get('model_type')!r} is not supported; supported: "
                           f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    original, outer = cfg, cfg["model_type"]
    cfg, excluded = _language_config(cfg, where)
    model_type = cfg["model_type"]
    fam = family(model_type)
    hidden = _req(cfg, "hidden_size", where)
    heads = _req(cfg, "num_attention_heads", where)
    layers = _req(cfg, "num_hidden_layers", where)
    kv, head_dim = _heads(cfg, hidden, heads, where)
    fields: dict[str, Any] = {"num_kv_heads": kv, "head_dim": head_dim,
                              "intermediate_size": _req(cfg, "intermediate_size", where)}
    fields.update(_moe(cfg, layers, where))
    mla = _mla(cfg, where)
    excluded = excluded or mla.pop("excluded", "")
    mla.pop("excluded", None)
    fields.update(mla)
    window, sliding_layers = _sliding(cfg, layers, where)
    arch = ModelArch(
        name=name,
        display_name=display_name or name,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        vocab_size=_req(cfg, "vocab_size", where),
        # HF defaults per model_type where config.json omits the key
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", fam.tied_default, where),
        attention_bias=_flag(cfg, "attention_bias", False, where) and fam.attention_bias_key,
        qkv_bias=fam.qkv_bias,
        mlp_bias=_flag(cfg, "mlp_bias", False, where) and fam.mlp_bias_key,
        max_position_embeddings=_opt_count(cfg, "max_position_embeddings", where),
        sliding_window=window,
        sliding_layers=sliding_layers,
        excluded=excluded,
        language_of=outer if outer != cfg["model_type"] else "",
        hf_config=copy.deepcopy(dict(original)),  # verbatim: the trainer takes a multimodal config's text_config
        source=source,
        **fields,
    )
    if arch.params > MAX_PARAMS:
        raise GpuprovError(f"{where}: {arch.params:.3g} parameters is beyond any real model (at most {MAX_PARAMS:.0e})")
    return arch
