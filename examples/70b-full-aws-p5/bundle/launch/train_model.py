"""The model as it trains: built from train.yaml, adapted (LoRA), checkpointed, compiled,
parallelised (FSDP2 here, TP/CP in parallel.py), materialised shard by shard; and its loss.

The loss lives here too (`token_loss_sum`): change how a micro-batch is scored in one place.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import parallel
from train_config import Config, ConfigError
from train_runtime import DTYPES, Runtime, log

def build_model(cfg: Config, rt: Runtime) -> tuple[torch.nn.Module, bool]:
    """The HF causal LM, on the meta device unless it must hold real weights now.

    Returns (model, on_meta). Meta construction costs no memory: each rank later materialises only
    its shards, so a 70B model never exists whole on one host.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    mcfg, task = cfg.model, cfg.task.kind
    master = DTYPES[cfg.precision.master_dtype]
    check_attention(mcfg.attn_implementation)
    if task == "qlora":
        return build_qlora_model(cfg, rt), False
    path = pretrained_path(cfg)
    if path:
        config = language_config(AutoConfig.from_pretrained(path))
    else:
        hf = dict(mcfg.hf_config)
        config = language_config(AutoConfig.for_model(hf.pop("model_type"), **hf))
    config.use_cache = False  # no KV cache in training
    with torch.device("meta"):
        # The plan sizes attention that never stores the s x s scores: ask for it, never eager.
        model = AutoModelForCausalLM.from_config(config, attn_implementation=mcfg.attn_implementation)
    return model.to(master), True


def language_config(config):
    """The trainer trains causal LMs on text: a multimodal config (Gemma 3's `gemma3`: vision_config and
    text_config) gives its language model's config, as the plan sizes it; the vision tower is not built."""
    if getattr(config, "vision_config", None) is not None and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def pretrained_path(cfg: Config) -> str | None:
    """model.init says where the weights come from; a silent random base is never the default."""
    mcfg, task = cfg.model, cfg.task.kind
    init, path = mcfg.init, mcfg.pretrained_path
    if init == "pretrained":
        if not path:
            raise ConfigError("model.init is pretrained but model.pretrained_path is null: set it to a local "
                              "directory with config.json + *.safetensors (or model.init=random to train from scratch)")
        if not Path(path, "config.json").is_file():
            raise ConfigError(f"model.pretrained_path {path!r} has no config.json (a local directory is needed)")
        return path
    if init != "random":
        raise ConfigError(f"model.init must be pretrained or random, got {init!r}")
    if path:
        raise ConfigError(f"model.init is random but model.pretrained_path is {path!r}: set model.init=pretrained")
    if task == "qlora":
        raise ConfigError("task qlora quantises pretrained weights: "
                          "set model.init=pretrained and model.pretrained_path")
    return None


def check_attention(impl: str) -> None:
    if impl == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError as exc:
            raise ConfigError("model.attn_implementation flash_attention_2 needs flash-attn >= 2.6 "
                              "(pip install flash-attn --no-build-isolation)") from exc
    elif impl not in ("sdpa", "eager"):
        raise ConfigError(f"unknown model.attn_implementation {impl!r} (sdpa | flash_attention_2 | eager)")


def cast_frozen(model: torch.nn.Module, cfg: Config) -> None:
    """LoRA: the frozen base in task.frozen_dtype (bf16, as the plan sizes it), adapters in master_dtype."""
    frozen = cfg.task.frozen_dtype
    if cfg.task.kind != "lora" or not frozen:
        return
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(DTYPES[frozen])


def dtype_kwarg(dtype: torch.dtype) -> dict:
    """from_pretrained's dtype argument: `dtype` in transformers 5, `torch_dtype` before."""
    import transformers

    return {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}


def build_qlora_model(cfg: Config, rt: Runtime) -> torch.nn.Module:
    """QLoRA: the base in 4-bit NF4 (double quantisation) from local weights; bitsandbytes is CUDA-only."""
    if not rt.is_cuda:
        raise ConfigError("task qlora needs CUDA: bitsandbytes 4-bit kernels do not run on CPU "
                          "(use task.kind lora to test the adapter path on CPU)")
    path = pretrained_path(cfg)
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    found = AutoConfig.from_pretrained(path)
    if language_config(found) is not found:  # the plan refuses it too
        raise ConfigError("task qlora: a multimodal checkpoint's language model is not loaded by from_pretrained "
                          "into the text-only model; use task.kind lora")

    compute = DTYPES[cfg.precision.param_dtype]
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=compute)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb, device_map={"": rt.local_rank},
                                                 attn_implementation=cfg.model.attn_implementation,
                                                 **dtype_kwarg(compute))
    model.config.use_cache = False
    return model


def apply_lora(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    from peft import get_peft_model

    experts = any(name.endswith(".experts") for name, _ in model.named_modules())
    return get_peft_model(model, lora_config(cfg, exclude_experts=experts))


def lora_config(cfg: Config, exclude_experts: bool = False):
    from peft import LoraConfig

    lora = cfg.task.lora
    targets = lora.targets
    # routed experts are never adapted, as the plan sizes them (transformers 4.x builds one Linear per expert,
    # whose gate_proj/up_proj/down_proj names a dense MLP or a shared expert shares)
    return LoraConfig(r=int(lora.rank), lora_alpha=int(lora.alpha), lora_dropout=float(lora.dropout),
                      target_modules="all-linear" if targets == "all-linear" else list(targets),
                      exclude_modules=ROUTED_EXPERTS if exclude_experts else None, task_type="CAUSAL_LM",
                      base_model_name_or_path=cfg.model.pretrained_path)


ROUTED_EXPERTS = r".*\.experts(\..*)?"  # peft exclude_modules: a regex over module names (experts and within)


def transformer_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder-layer list (model.model.layers in Llama-style models, also under a peft wrapper; a
    pipeline stage keeps its blocks in a ModuleDict under their global index)."""
    lists = [m for name, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
             and name.split(".")[-1] in ("layers", "h", "blocks")]
    if not lists:
        raise ConfigError(f"cannot find the transformer blocks of {type(model).__name__}")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def selective_ac_context():
    """Op-level selective checkpointing, torchtitan's policy (and what gpuprov's estimate assumes).

    Inside each block: keep the block input, the attention kernel's output and every other
    matmul output; recompute the rest (norms, RoPE, activations, the other matmuls) in backward.
    Called once per block forward, so the matmul count restarts for each block.
    """
    from collections import defaultdict

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = ["mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    save = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    mm = aten.mm.default
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == mm:
            counts[key] += 1
        keep = func in save and not (func == mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def replace_blocks(blocks: torch.nn.Module, wrap) -> None:
    """Each block of a ModuleList or ModuleDict replaced by wrap(block), under the same name."""
    for name, block in list(blocks.named_children()):
        blocks.register_module(name, wrap(block))


def apply_activation_checkpointing(blocks: torch.nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import checkpoint

    if mode == "full":
        wrap = partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False)
    elif mode == "selective":
        wrap = partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False,
                       context_fn=selective_ac_context)
    else:
        raise ConfigError(f"unknown parallel.activation_checkpointing {mode!r}")
    replace_blocks(blocks, wrap)


def fsdp_kwargs(model: torch.nn.Module, cfg: Config, rt: Runtime) -> dict:
    """fully_shard's mesh, mixed-precision policy, offload policy and ignored parameters."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    prec, par = cfg.precision, cfg.parallel
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[prec.param_dtype], reduce_dtype=DTYPES[prec.reduce_dtype])
    offload: OffloadPolicy = OffloadPolicy()
    if par.offload != "none":
        if not rt.is_cuda:
            raise ConfigError("parallel.offload needs CUDA (it moves shards between GPU and host memory)")
        # FSDP2 offloads parameters, gradients and the optimizer step together; there is no
        # optimizer-only variant, so "optimizer" uses less GPU memory than planned, never more.
        offload = CPUOffloadPolicy(pin_memory=True)
    # QLoRA: the NF4 base stays whole on every GPU (the plan sizes it so); FSDP2 would turn
    # bitsandbytes' Params4bit into plain DTensors and lose their quant_state. Adapters are sharded.
    ignored = {p for p in model.parameters() if type(p).__name__ == "Params4bit"} or None
    return dict(mesh=rt.mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored)


def shard_model(model: torch.nn.Module, blocks: torch.nn.ModuleList, cfg: Config, rt: Runtime) -> torch.nn.Module:
    """FSDP2: fully_shard each transformer block, then the root (embeddings, final norm, LM head)."""
    from torch.distributed.fsdp import fully_shard

    kw = fsdp_kwargs(model, cfg, rt)
    # fsdp/hsdp free the gathered weights after forward (ZeRO-3); zero1/zero2 keep them until
    # backward (FSDP2 has no optimizer-only sharding: zero1 runs as zero2).
    reshard = cfg.parallel.sharding in ("fsdp", "hsdp")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if not tied:
        # torchtitan's units: embeddings alone, then each block, then final norm + head together
        # (needed first by backward: kept gathered); a tied head stays with the root.
        fully_shard(embed, reshard_after_forward=reshard, **kw)
    for i, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keep them gathered.
        fully_shard(block, reshard_after_forward=reshard and i < len(blocks) - 1, **kw)
    norm = final_norm(model)
    if not tied and head is not None:
        fully_shard([norm, head] if norm is not None else head, reshard_after_forward=False, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    return getattr(inner, "norm", None) if inner is not None else None


def apply_compile(blocks: torch.nn.Module, cfg: Config, rt: Runtime) -> None:
    """torch.compile each block (torchtitan's unit): fused norms and activations, fewer kernels."""
    if not cfg.efficiency.compile or not rt.is_cuda:
        return  # CPU runs (tests, smoke runs) stay eager: compile there only costs time
    replace_blocks(blocks, torch.compile)


def apply_float8(model: torch.nn.Module, cfg: Config, rt: Runtime) -> bool:
    """torchao float8 linears (dynamic scaling) with FSDP2 float8 all-gather, Hopper and later."""
    if not cfg.efficiency.float8:
        return False
    if not rt.is_cuda or torch.cuda.get_device_capability() < (8, 9):
        raise ConfigError("efficiency.float8 needs an sm_89+ GPU (Ada, Hopper, Blackwell)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError("efficiency.float8 needs torchao (pip install torchao)") from exc
    float8_linears(model)
    return True


def float8_linears(model: torch.nn.Module, emulate: bool = False) -> None:
    """Every linear but the head to torchao's tensorwise Float8Linear (before TP, whose float8 styles
    expect them: torchtitan converts at build time, then parallelises). `emulate`: torchao's
    emulation, for CPU tests only."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    head = model.get_output_embeddings()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: m is not head)  # the head stays bf16


def materialise(model: torch.nn.Module, on_meta: bool, cfg: Config, rt: Runtime, from_checkpoint: bool) -> None:
    """Allocate this rank's shards and fill them: fresh init, or pretrained weights file by file.

    `from_checkpoint`: a full-training resume, whose checkpoint holds every weight, so neither the
    pretrained files are read nor an init is spent (LoRA still needs its frozen base from them).
    """
    if not on_meta:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model.to_empty(device=rt.device)
    path = pretrained_path(cfg)
    skip = from_checkpoint and cfg.task.kind == "full"
    # DTensor random ops are exact on CUDA (offset-based RNG); on CPU each rank draws its local
    # shard from its own generator: seed by shard coordinate so HSDP replicas agree (LoRA's A too).
    torch.manual_seed(int(cfg.training.seed) + (0 if rt.is_cuda else rt.shard_rank))
    with torch.no_grad():
        if skip:
            log("resuming: every weight comes from the checkpoint (pretrained files not read)")
        elif path:
            load_pretrained(model, path, rt)
        else:
            if hasattr(base, "initialize_weights"):
                base.initialize_weights()
            else:
                base.apply(base._init_weights)
            if cfg.model.depth_init:
                depth_scale_residuals(model)
        reset_lora(model)
        reset_rotary_buffers(model, rt.device)
    if skip:
        return
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local).all():
            raise RuntimeError(f"parameter {name} is not finite after initialisation")


RESIDUAL_OUTPUTS = ("o_proj", "down_proj", "c_proj", "out_proj", "dense_4h_to_h")


@torch.no_grad()
def depth_scale_residuals(model: torch.nn.Module) -> int:
    """Residual-branch output projections drawn at std / sqrt(2 * layers), as torchtitan's Llama
    init (and GPT-2's): the sum of 2L residual branches then keeps the stream's variance at
    initialisation. Scaling an N(0, std) draw by c is an N(0, c * std) draw, shard by shard."""
    # the whole model's depth (a pipeline stage holds only some of its blocks)
    layers = getattr(model.config, "num_hidden_layers", None) or len(transformer_blocks(model))
    factor = 1.0 / math.sqrt(2.0 * layers)
    scaled = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in RESIDUAL_OUTPUTS and isinstance(getattr(module, "weight", None), torch.Tensor):
            w = module.weight
            (w.to_local() if hasattr(w, "to_local") else w).mul_(factor)
            scaled += 1
    return scaled


def hf_name(name: str) -> str:
    """A trainer parameter's name in the HF checkpoint: no wrapper prefixes (activation
    checkpointing, compile), and peft's base_model.model.<fqn> / <layer>.base_layer undone."""
    name = name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def load_pretrained(model: torch.nn.Module, path: str, rt: Runtime) -> None:
    """HF safetensors, one file at a time: every rank reads the file (memory-mapped) and copies
    only its own shard of each tensor into place, so no rank ever holds the whole model."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.pretrained_path {path!r} has no *.safetensors files (save_pretrained writes them)")
    params = {hf_name(n): p for n, p in model.named_parameters() if "lora_" not in n}
    # persistent buffers the checkpoint may hold (DeepSeek's router e_score_correction_bias)
    buffers = {hf_name(n): b for n, b in model.named_buffers() if "rotary" not in n and "inv_freq" not in n}
    loaded: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            names = set(sf.keys())
            for stored in names:
                key = language_model_name(stored)
                p = params.get(key, buffers.get(key))
                if p is None:
                    continue
                full = dequantised(sf, stored, names).to(p.dtype)
                if isinstance(p, DTensor):
                    # src_data_rank=None: slice locally, no communication (every rank has the file)
                    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    p.to_local().copy_(local)
                else:
                    p.copy_(full)
                loaded.add(key)
                del full
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in params if k not in loaded and not (tied and k == "lm_head.weight")]
    if missing:
        raise ConfigError(f"model.pretrained_path {path!r} lacks {len(missing)} weights, e.g. {missing[0]}")
    if tied and "lm_head.weight" in params and "lm_head.weight" not in loaded:
        _copy_tied_head(model)
    log(f"pretrained: {len(loaded)} tensors from {len(files)} safetensors file(s) in {path}")


def _copy_tied_head(model: torch.nn.Module) -> None:
    """save_pretrained leaves a tied head out of the files; when the built model holds the head as a
    tensor of its own (a multimodal config's language model is built untied), it would keep the
    uninitialised memory to_empty gave it: it gets the embedding, as tying would have given it."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embed is None or head.weight is embed.weight:
        return
    dst = head.weight.to_local() if hasattr(head.weight, "to_local") else head.weight
    src = embed.weight.to_local() if hasattr(embed.weight, "to_local") else embed.weight
    dst.copy_(src)  # same shape and placements: each rank copies its own shard


def language_model_name(key: str) -> str:
    """A multimodal checkpoint's language-model tensor under the text-only model's name (Gemma 3: saved as
    language_model.model.* before transformers 4.52, model.language_model.* since); others unchanged."""
    if key.startswith("language_model."):
        return key.removeprefix("language_model.")
    return "model." + key.removeprefix("model.language_model.") if key.startswith("model.language_model.") else key


FP8_BLOCK = 128  # DeepSeek-V3's quantization_config weight_block_size: [128, 128]


def dequantised(sf, key: str, names: set[str]) -> torch.Tensor:
    """A tensor as stored, or an FP8 weight times its blockwise `<key>_scale_inv` (DeepSeek-V3's checkpoint)."""
    t = sf.get_tensor(key)
    if t.dtype not in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)):
        return t
    if f"{key}_scale_inv" not in names:
        raise ConfigError(f"model.pretrained_path: {key} is FP8 without its {key}_scale_inv in the same file")
    scale = sf.get_tensor(f"{key}_scale_inv").float()
    rows, cols = t.shape
    full = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return t.float() * full


def reset_lora(model: torch.nn.Module) -> None:
    """LoRA's own init (A random, B zero: the adapted model starts equal to the base)."""
    for m in model.modules():
        if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A"):
            for adapter in m.lora_A:
                m.reset_lora_parameters(adapter, True)


def reset_rotary_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Rotary inv_freq buffers are not in any state dict: recompute them from the config."""
    for m in model.modules():
        if "Rotary" in type(m).__name__ and hasattr(m, "config") and hasattr(m, "inv_freq"):
            with torch.device("cpu"):
                fresh = type(m)(m.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(m, name).copy_(buf.to(device))


def count_params(model: torch.nn.Module) -> tuple[int, int, list[str]]:
    total = trainable = 0
    names = []
    for name, p in model.named_parameters():
        n = p.numel()  # the global (unsharded) size for DTensor parameters
        total += n
        if p.requires_grad:
            trainable += n
            names.append(name)
    return total, trainable, names


def verify_replicas(model: torch.nn.Module, rt: Runtime) -> None:
    """HSDP: every replica of a shard must hold the same numbers; catch a broken init at once."""
    if rt.mesh is None or rt.mesh.ndim != 2:
        return
    with torch.no_grad():
        s = torch.stack([p.to_local().float().sum() for p in model.parameters()]).to(rt.device)
    lo, hi = s.clone(), s.clone()
    group = rt.mesh.get_group("replicate")
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        names = [n for (n, _), a, b in zip(model.named_parameters(), lo, hi) if a != b]
        raise RuntimeError(f"HSDP replicas differ after initialisation: {', '.join(names[:3])}")


def prepare_model(cfg: Config, rt: Runtime, from_checkpoint: bool) -> tuple[torch.nn.Module, bool]:
    """The model as it trains: built, adapted, checkpointed, compiled, parallelised, materialised.

    Returns (model, float8). Tensor/context parallelism (launch/parallel.py) hooks in here.
    """
    if cfg.parallel.pp > 1:
        import train_pipeline

        return train_pipeline.prepare_stages(cfg, rt, from_checkpoint)
    model, on_meta = build_model(cfg, rt)
    if cfg.task.kind in ("lora", "qlora"):
        model = apply_lora(model, cfg)
        cast_frozen(model, cfg)
    install_chunked_loss(model, cfg)
    fp8 = apply_float8(model, cfg, rt)
    if cfg.model_parallel:
        model = parallel.parallelize(model, fp8)  # float8, then TP, AC, compile and FSDP, as torchtitan orders them
    blocks = transformer_blocks(model)
    apply_activation_checkpointing(blocks, cfg.parallel.activation_checkpointing)
    apply_compile(blocks, cfg, rt)
    if rt.mesh is not None:
        model = shard_model(model, blocks, cfg, rt)
        materialise(model, on_meta, cfg, rt, from_checkpoint)
    else:
        materialise(model, on_meta, cfg, rt, from_checkpoint)
        if rt.world > 1:
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rt.local_rank] if rt.is_cuda else None)
    return model, fp8


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under DDP's wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


# = catalog memory_constants.yaml cross_entropy.chunks: the plan sizes this many (torchtune's count)
LOSS_CHUNKS = 8


class ChunkedLossHead(torch.nn.Linear):
    """The LM head, computing the loss a sequence chunk at a time while `labels` is set.

    Each chunk's logits are upcast to fp32 and turned into a summed cross-entropy on their own, so
    the whole sequence's logits never exist at once: what stays for backward is each chunk's fp32
    log-softmax (the plan's chunked_cross_entropy, as torchtune's CEWithChunkedOutputLoss). It runs
    inside the head's own forward, so FSDP2 gathers the weight once per step. With `labels` unset
    it is the plain head (generation, export). Its class is swapped in; weights and names stay.
    """

    labels: torch.Tensor | None = None
    softcap: float | None = None  # Gemma-2's final_logit_softcapping, applied per chunk here

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:
            return super().forward(hidden)
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(hidden.tensor_split(LOSS_CHUNKS, dim=1), self.labels.tensor_split(LOSS_CHUNKS, dim=1)):
            logits = super().forward(h)
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            total = total + F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                                            reduction="sum")
        return total


def install_chunked_loss(model: torch.nn.Module, cfg: Config) -> None:
    """efficiency.chunked_cross_entropy: the head becomes a ChunkedLossHead (before TP/FSDP wrap it).
    Under tensor parallelism the loss already runs on vocab-sharded logits (loss_parallel), and the
    plan sizes it unchunked there too."""
    if not cfg.efficiency.chunked_cross_entropy or cfg.parallel.tp > 1:
        return
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise ConfigError(f"efficiency.chunked_cross_entropy: the output head is a {type(head).__name__}, "
                          "not a plain Linear; set it false and re-plan")
    head.__class__ = ChunkedLossHead
    head.softcap = getattr(model.config, "final_logit_softcapping", None)


def token_loss_sum(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                   positions: torch.Tensor | None = None, attention: dict | None = None) -> torch.Tensor:
    """Summed cross-entropy over the labelled tokens (`inputs` are the tokens before each label;
    -100 labels carry no loss). The caller divides by the step's global count of labelled tokens.

    `attention`: the model's position ids and per-document mask (train_attention.model_inputs, from
    the batch's recorded document boundaries), so attention never crosses packed documents;
    `positions` alone: position ids only. The logits are dropped before backward: only the loss's
    own fp32 log-softmax stays alive (the plan's loss_impl "native", as torchtitan). Under TP the
    logits and the loss are DTensors.
    """
    hf = unwrap(model)
    head = getattr(hf, "get_output_embeddings", lambda: None)()
    kw = dict(attention) if attention is not None else ({} if positions is None else {"position_ids": positions})
    if isinstance(head, ChunkedLossHead):
        cap = getattr(hf.config, "final_logit_softcapping", None)
        head.labels = labels
        try:
            if cap is not None:
                hf.config.final_logit_softcapping = None  # the head caps each chunk itself
            return model(input_ids=inputs, **kw).logits  # the head returned the summed loss
        finally:
            head.labels = None
            if cap is not None:
                hf.config.final_logit_softcapping = cap
    logits = model(input_ids=inputs, **kw).logits
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    del logits
    return loss


def batch_loss_sum(model: torch.nn.Module, batch) -> torch.Tensor:
    """token_loss_sum of a train_data.Batch: its documents masked as train_attention builds them."""
    from train_attention import model_inputs

    hf = unwrap(model)
    attention = model_inputs(hf.config._attn_implementation, batch.documents, batch.positions, batch.q_index,
                             batch.k_index)
    return token_loss_sum(model, batch.inputs, batch.labels, attention=attention)


def next_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor,
                    positions: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over this micro-batch's labelled tokens; all masked gives 0, not NaN."""
    return token_loss_sum(model, inputs, labels, positions) / labels.ne(-100).sum().clamp(min=1)


def param_dtypes(model: torch.nn.Module) -> dict[str, list[str]]:
    """Trainable and frozen parameter dtypes (what the plan sized: e.g. LoRA's bf16 base)."""
    out: dict[str, set] = {"trainable": set(), "frozen": set()}
    for p in model.parameters():
        out["trainable" if p.requires_grad else "frozen"].add(str(p.dtype).removeprefix("torch."))
    return {k: sorted(v) for k, v in out.items()}


