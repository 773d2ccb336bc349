"""Each model family the planner sizes, trained by the generated trainer on CPU (one process, tiny configs).

A tiny config.json per family goes through the same path a plan's does: gpuprov sizes it
(arch_from_hf_config), the trainer builds it from the sized hf_config on the meta device, wraps and
checkpoints its blocks, materialises and trains it; LoRA adapts exactly the modules (and parameter
count) the plan sized, never a routed expert.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest

from gpuprov.catalog import load_data
from gpuprov.render.launch import render_launch
from gpuprov.sizing.arch import arch_from_hf_config, resolve_lora_targets
from plan_fixtures import sample_plan

pytestmark = [pytest.mark.torch]
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

_BASE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             vocab_size=128, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY = {
    "qwen3": dict(_BASE, model_type="qwen3"),
    "mixtral": dict(_BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[0]),
    "gemma3_text": dict(_BASE, model_type="gemma3_text", sliding_window=8, sliding_window_pattern=3,
                        tie_word_embeddings=True, query_pre_attn_scalar=16),
    "gemma3": dict(model_type="gemma3", tie_word_embeddings=True,
                   text_config=dict(_BASE, model_type="gemma3_text", sliding_window=8, tie_word_embeddings=True)),
    "phi3": dict(_BASE, model_type="phi3", sliding_window=8),
    "olmo2": dict(_BASE, model_type="olmo2"),
    "deepseek_v3": dict({k: v for k, v in _BASE.items() if k != "head_dim"}, model_type="deepseek_v3", q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                        topk_group=1, num_key_value_heads=4, num_nextn_predict_layers=1),
}


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    """The generated train.py imported in-process, with its rendered train.yaml."""
    root = tmp_path_factory.mktemp("families")
    plan = sample_plan("aws", 1, "fsdp", "full")
    files = render_launch(plan.model_copy(update=dict(
        storage=plan.storage.model_copy(update=dict(mount_point=str(root / "scratch"))))))
    for name, text in files.items():
        (root / name).write_text(text)
    spec = importlib.util.spec_from_file_location("generated_train_families", root / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    import types

    merged = types.SimpleNamespace(**vars(sys.modules["train_model"]))  # the model code train.py imports
    merged.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    yield merged, root / "train.yaml"
    del sys.modules[spec.name]


def _setup(train, yaml_path, family: str, *overrides: str):
    arch = arch_from_hf_config(copy.deepcopy(TINY[family]), name=family)
    cfg = train.load_config(str(yaml_path), ["runtime.device=cpu", "precision.param_dtype=float32",
                                             "model.init=random", "task.frozen_dtype=float32", *overrides])
    cfg.model.hf_config = copy.deepcopy(arch.hf_config)  # what the plan carries into train.yaml
    rt = train.Runtime(0, 1, 0, train.torch.device("cpu"), None, 0, 1, 0)
    return arch, cfg, rt


def _steps(train, model, cfg, rt, n: int = 4) -> list[float]:
    torch = train.torch
    opt = train.build_optimizer(model, cfg, rt)
    torch.manual_seed(3)
    tokens = torch.randint(3, 128, (1, 13))
    return [train.train_step(model, opt, [train.Batch(tokens[:, :-1], tokens[:, 1:].clone())], cfg, rt).loss
            for _ in range(n)]


@pytest.mark.slow  # 10-30 s a family on two shared cores
@pytest.mark.parametrize("family", list(TINY))
def test_full_training_of_each_family(train, family):
    """Built from the sized config on meta, one block class per FSDP/AC unit (the catalog's), every
    parameter the plan counted, selective checkpointing per block, and the loss falls."""
    train, yaml_path = train
    arch, cfg, rt = _setup(train, yaml_path, family, "task.kind=full", "parallel.activation_checkpointing=selective",
                           "optimizer.lr=0.01")
    train.torch.manual_seed(0)
    model, on_meta = train.build_model(cfg, rt)
    assert on_meta
    blocks = train.transformer_blocks(model)
    want = load_data("trainer.yaml")["model_families"]["blocks"][arch.model_type]
    assert {type(b).__name__ for b in blocks} == {want} and len(blocks) == arch.num_layers
    assert sum(p.numel() for p in model.parameters()) == arch.params  # the language model only (Gemma 3)
    train.apply_activation_checkpointing(blocks, "selective")
    train.materialise(model, on_meta, cfg, rt, from_checkpoint=False)
    assert all(train.torch.isfinite(b).all() for b in model.buffers() if b.is_floating_point())
    loss = _steps(train, model, cfg, rt)
    assert all(x == x for x in loss) and loss[-1] < loss[0] - 0.1, loss


@pytest.mark.slow
@pytest.mark.parametrize("family", list(TINY))
def test_lora_adapts_what_the_plan_sized(train, family):
    """The family's all-linear preset: peft adapts exactly those modules, no routed expert, and the adapter
    parameters equal the plan's count; the adapted model trains."""
    train, yaml_path = train
    arch = arch_from_hf_config(copy.deepcopy(TINY[family]), name=family)
    targets = resolve_lora_targets("all-linear", arch.model_type)
    arch, cfg, rt = _setup(train, yaml_path, family, "task.kind=lora", "task.lora.dropout=0.0", "optimizer.lr=0.01",
                           "task.lora.rank=4", "task.lora.alpha=8",
                           f"task.lora.targets=[{', '.join(targets)}]")
    model, on_meta = train.build_model(cfg, rt)
    model = train.apply_lora(model, cfg)
    train.materialise(model, on_meta, cfg, rt, from_checkpoint=False)
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted and not any(".experts." in n for n in adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} == set(targets)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == arch.trainable_params("lora", cfg.task.lora.rank, targets)
    loss = _steps(train, model, cfg, rt, n=4)
    assert loss[-1] < loss[0], loss


def test_multimodal_checkpoint_trains_its_language_model(train, tmp_path):
    """A Gemma 3 multimodal checkpoint (vision tower, projector, language model) loads into the text-only
    model the plan sized: its language-model tensors by name, the vision tower left out."""
    import transformers

    train, yaml_path = train
    torch = train.torch
    hf = copy.deepcopy(TINY["gemma3"])
    hf["vision_config"] = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14)
    hf["mm_tokens_per_image"] = 4
    torch.manual_seed(0)
    full = transformers.AutoModelForImageTextToText.from_config(
        transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)).float()
    full.save_pretrained(tmp_path / "base")
    arch, cfg, rt = _setup(train, yaml_path, "gemma3", "task.kind=full", "model.init=pretrained",
                           f"model.pretrained_path={tmp_path / 'base'}")
    model, on_meta = train.build_model(cfg, rt)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    train.materialise(model, on_meta, cfg, rt, from_checkpoint=False)
    ref = {k.split("language_model.", 1)[-1]: v for k, v in full.state_dict().items() if "language_model" in k}
    got = dict(model.model.state_dict())
    assert ref and all(torch.equal(got[k], v) for k, v in ref.items() if k in got)
    assert set(got) <= set(ref) | {k for k in got if "rotary" in k}
    # the tied head, which the checkpoint leaves out: the embedding, never the memory to_empty gave it
    assert torch.equal(model.lm_head.weight, full.lm_head.weight)


def test_fp8_blockwise_weights_are_dequantised(train, tmp_path):
    """DeepSeek-V3's checkpoint: FP8 weights with a 128 x 128 block scale_inv each, loaded as weight x scale."""
    train, _ = train
    torch = train.torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.randn(200, 300)
    scale = torch.rand(2, 3) + 0.5
    save_file({"w.weight": w.to(torch.float8_e4m3fn), "w.weight_scale_inv": scale}, str(tmp_path / "a.safetensors"))
    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as sf:
        got = train.dequantised(sf, "w.weight", set(sf.keys()))
    want = w.to(torch.float8_e4m3fn).float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    torch.testing.assert_close(got, want)
    assert got[0, 0] == w.to(torch.float8_e4m3fn).float()[0, 0] * scale[0, 0]
    assert got[199, 299] == w.to(torch.float8_e4m3fn).float()[199, 299] * scale[1, 2]
