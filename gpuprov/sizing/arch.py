"""Model architecture from a Hugging Face config.json: exact parameter counts, module shapes.

Supported model_types: llama, mistral, mixtral (MoE), qwen2 (q/k/v biases), gemma2 (tied
embeddings, explicit head_dim, four norms per layer). Counts are exact: they equal what
`AutoModelForCausalLM.from_config(cfg).num_parameters()` reports (tests check both that and the
published totals).
"""

from __future__ import annotations

import copy

from dataclasses import dataclass, field
from typing import Any

from gpuprov.errors import GpuprovError
from gpuprov.sizing.types import LORA_TARGET_PRESETS
from gpuprov.validators import MAX_CONFIG_COUNT, MAX_PARAMS

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "mistral", "mixtral", "qwen2", "gemma2")

# Norms per decoder layer (RMSNorm weight of size hidden): gemma2 adds pre/post-feedforward norms.
_NORMS_PER_LAYER = {"llama": 2, "mistral": 2, "mixtral": 2, "qwen2": 2, "gemma2": 4}

# Mixtral names its expert projections w1 (gate), w3 (up), w2 (down); accept either spelling.
_MLP_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
LINEAR_NAMES: tuple[str, ...] = LORA_TARGET_PRESETS["all-linear"]


@dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer, enough of it to count parameters, FLOPs and activation bytes."""

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
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    source: str = ""
    params: int = 0  # filled in __post_init__ (exact)

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", self._count_params())

    # -- shapes -------------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    def linear_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Per decoder layer: module name -> (in_features, out_features, copies per layer)."""
        h, f, e = self.hidden_size, self.intermediate_size, self.num_experts
        return {
            "q_proj": (h, self.q_dim, 1),
            "k_proj": (h, self.kv_dim, 1),
            "v_proj": (h, self.kv_dim, 1),
            "o_proj": (self.q_dim, h, 1),
            "gate_proj": (h, f, e),
            "up_proj": (h, f, e),
            "down_proj": (f, h, e),
        }

    # -- counts -------------------------------------------------------------------------
    def layer_linear_params(self) -> int:
        """Weights of the big matmuls of one layer (all experts), no biases: what NF4 quantizes."""
        return sum(i * o * n for i, o, n in self.linear_shapes().values())

    def layer_params(self) -> int:
        """Every parameter of one decoder layer (all experts)."""
        h = self.hidden_size
        total = self.layer_linear_params()
        if self.attention_bias:
            total += self.q_dim + 2 * self.kv_dim + h
        elif self.qkv_bias:
            total += self.q_dim + 2 * self.kv_dim
        if self.mlp_bias:
            total += (2 * self.intermediate_size + h) * self.num_experts
        if self.is_moe:
            total += h * self.num_experts  # router, no bias
        total += _NORMS_PER_LAYER[self.model_type] * h
        return total

    def active_layer_params(self) -> int:
        """Parameters one token touches in a layer (MoE: top-k experts), for FLOPs."""
        if not self.is_moe:
            return self.layer_params()
        per_expert = 3 * self.hidden_size * self.intermediate_size
        return self.layer_params() - per_expert * (self.num_experts - self.experts_per_token)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def _count_params(self) -> int:
        final_norm = self.hidden_size
        return self.num_layers * self.layer_params() + self.embedding_params + self.lm_head_params + final_norm

    @property
    def active_params(self) -> int:
        return self.params - self.num_layers * (self.layer_params() - self.active_layer_params())

    def lora_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """Adapter parameters (A: in x r, B: r x out) on every target module of every layer."""
        shapes = self.linear_shapes()
        return self.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) * shapes[t][2] for t in targets)

    def trainable_params(self, task: str, lora_rank: int = 16, lora_targets: tuple[str, ...] | str = "all-linear") -> int:
        if task == "full":
            return self.params
        if task not in ("lora", "qlora"):
            raise GpuprovError(f"unknown task {task!r}; expected full, lora or qlora")
        targets = resolve_lora_targets(lora_targets)
        check_lora_rank(self, lora_rank)
        return self.lora_params(lora_rank, targets)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "display_name": self.display_name,
            "model_type": self.model_type,
            "params": self.params,
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


def resolve_lora_targets(targets: tuple[str, ...] | list[str] | str) -> tuple[str, ...]:
    """'qv' / 'attention' / 'all-linear', or a comma list / sequence of module names."""
    if isinstance(targets, str):
        if targets in LORA_TARGET_PRESETS:
            return LORA_TARGET_PRESETS[targets]
        names = [t.strip() for t in targets.split(",") if t.strip()]
    else:
        names = list(targets)
    if not names:
        raise GpuprovError("--lora-targets is empty; use qv, attention, all-linear or module names")
    out: list[str] = []
    for name in names:
        canon = _MLP_ALIASES.get(name, name)
        if canon not in LINEAR_NAMES:
            raise GpuprovError(
                f"unknown LoRA target {name!r}; use qv, attention, all-linear or some of {', '.join(LINEAR_NAMES)}"
            )
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


def arch_from_hf_config(
    cfg: dict[str, Any], *, name: str, display_name: str | None = None, source: str = ""
) -> ModelArch:
    """Build a ModelArch from a parsed config.json (raises GpuprovError on what it cannot size)."""
    where = f"config for {name}"
    if not isinstance(cfg, dict):
        raise GpuprovError(f"{where}: expected a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise GpuprovError(
            f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden = _req(cfg, "hidden_size", where)
    heads = _req(cfg, "num_attention_heads", where)
    layers = _req(cfg, "num_hidden_layers", where)
    inter = _req(cfg, "intermediate_size", where)
    vocab = _req(cfg, "vocab_size", where)
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
    experts, topk = 1, 1
    if model_type == "mixtral":
        experts = _req(cfg, "num_local_experts", where)
        topk = _req(cfg, "num_experts_per_tok", where)
        if topk > experts:
            raise GpuprovError(f"{where}: num_experts_per_tok {topk} exceeds num_local_experts {experts}")
    # HF defaults per model_type where config.json omits the key.
    tie_default = model_type == "gemma2"
    tie = _flag(cfg, "tie_word_embeddings", tie_default, where)
    if head_dim > MAX_CONFIG_COUNT:
        raise GpuprovError(f"{where}: head_dim {head_dim} is beyond any real model (at most {MAX_CONFIG_COUNT:,})")
    arch = ModelArch(
        name=name,
        display_name=display_name or name,
        model_type=model_type,
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=vocab,
        num_experts=experts,
        experts_per_token=topk,
        tie_word_embeddings=tie,
        attention_bias=_flag(cfg, "attention_bias", False, where) and model_type in ("llama", "gemma2"),
        qkv_bias=model_type == "qwen2",
        mlp_bias=_flag(cfg, "mlp_bias", False, where) and model_type == "llama",
        max_position_embeddings=_opt_count(cfg, "max_position_embeddings", where),
        hf_config=copy.deepcopy(dict(cfg)),
        source=source,
    )
    if arch.params > MAX_PARAMS:
        raise GpuprovError(f"{where}: {arch.params:.3g} parameters is beyond any real model (at most {MAX_PARAMS:.0e})")
    return arch
