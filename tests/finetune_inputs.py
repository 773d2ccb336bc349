"""What a fine-tuning user brings, made here, and how the tests read back what the trainer made.

Shared by tests/test_finetune_journey.py (the bundle's scripts on this machine) and the cluster
rehearsal (tests/rehearsal/: the same path through `gpuprov up` on stand-in nodes):
- `make_base`: a Hugging Face model folder as save_pretrained writes it (a local mirror of a named
  model; no download), with a word-level tokenizer and a chat template;
- `write_chat`: a chat JSONL (`messages` records) the model can learn in a few steps;
- `trainer_model`: the trainer's own final weights, loaded in one process from the last checkpoint
  of a run, to compare with what peft and transformers load from the export.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

# a ChatML-like template whose end-of-turn token is the tokenizer's EOS (as Qwen's <|im_end|>)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
WORDS = [f"w{i}" for i in range(24)]


def make_base(folder: Path) -> Path:
    """A 2-layer Llama (hidden 64) and its word-level tokenizer with a chat template, as
    save_pretrained writes them (safetensors)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(["system", "user", "assistant", "copy", *WORDS])],
                            trainers.WordLevelTrainer(special_tokens=special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)  # safetensors
    return folder


def write_chat(path: Path, count: int = 48) -> Path:
    """Conversations whose answer copies the question's words: learnable in a few steps."""
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(count):
            words = " ".join(rng.choice(WORDS) for _ in range(6))
            f.write(json.dumps({"messages": [{"role": "system", "content": "copy"},
                                             {"role": "user", "content": words},
                                             {"role": "assistant", "content": words}]}) + "\n")
    return path


def sample_tokens(base: Path, chat: Path):
    """The first conversation of `chat` through the base's own chat template, as a batch of one."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    first = json.loads(chat.read_text().splitlines()[0])["messages"]
    return torch.tensor([tok.apply_chat_template(first, tokenize=True, return_dict=True)["input_ids"]])


def trainer_model(launch: Path, where: Callable[[str], Path], staging: dict, cfg: dict):
    """The trainer's own final weights: one process loads the last checkpoint of a multi-rank run.
    `launch` is the bundle's launch/ folder; `where` maps a cluster path of the bundle to this machine.
    Returns (model in fp32, eval mode; the export folder of that last step)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("journey_train", launch / "train.py")
    train = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = train
    spec.loader.exec_module(train)
    ckpt_dir = where(cfg["checkpoint"]["dir"])
    overrides = ["parallel.sharding=none", "parallel.replicate=1", "parallel.shard=1", "runtime.device=cpu",
                 f"model.pretrained_path={where(staging['weights_dir'])}",
                 f"data.path={where(staging['data_dir'])}", f"checkpoint.dir={ckpt_dir}"]
    tcfg = train.load_config(str(launch / "train.yaml"), overrides)
    rt = train.init_runtime(tcfg)
    model, _ = train.prepare_model(tcfg, rt, from_checkpoint=True)
    last = sorted(ckpt_dir.glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    state = train.TrainState(model, train.build_optimizer(model, tcfg, rt), frozen_ok=tcfg.task.kind != "full")
    train.load_checkpoint(state, last)
    return model.float().eval(), ckpt_dir / "export" / last.name
