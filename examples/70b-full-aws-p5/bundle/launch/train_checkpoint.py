"""Checkpoints (torch.distributed.checkpoint, async where asked) and the Hugging Face export.

A checkpoint holds what a resume needs: model, optimizer, step, data position (samples consumed)
and the count of skipped steps. Rank 0 picks the newest complete one (its .metadata written) and
every rank loads that one.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from train_config import Config, ConfigError
from train_model import dtype_kwarg, hf_name, lora_config, unwrap
from train_runtime import DTYPES, Runtime, log

class TrainState(Stateful):
    """What a resume needs: model, optimizer, step and data position (samples consumed)."""

    def __init__(self, model, optimizer, frozen_ok: bool, flatten: bool = False):
        self.model, self.optimizer = model, optimizer
        self.step = 0
        self.samples_seen = 0
        self.skipped = 0  # steps whose loss or gradient norm was not finite
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # LoRA: the frozen base is not saved each time (it never changes); so loading must not
        # demand it (strict off), and load_state_dict checks that every trainable weight came back.
        # Pipeline stages: each rank's optimizer holds other parameters under the same group numbers,
        # so its groups are saved per parameter name (torchtitan flattens them for PP too).
        self.frozen_ok = frozen_ok
        self.options = StateDictOptions(ignore_frozen_params=frozen_ok, flatten_optimizer_state_dict=flatten)
        self.load_options = StateDictOptions(ignore_frozen_params=frozen_ok, strict=not frozen_ok,
                                             flatten_optimizer_state_dict=flatten)

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd,
                "train": {"step": self.step, "samples_seen": self.samples_seen, "skipped": self.skipped}}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        result = set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                                optim_state_dict=sd["optim"], options=self.load_options)
        lost = sorted(set(getattr(result, "missing_keys", []) or []) & trainable)
        if lost:
            raise RuntimeError(f"checkpoint lacks {len(lost)} trainable weights, e.g. {lost[0]}")
        self.step, self.samples_seen = int(sd["train"]["step"]), int(sd["train"]["samples_seen"])
        self.skipped = int(sd["train"].get("skipped", 0))


def checkpoint_dirs(root: Path) -> list[Path]:
    done = [p for p in root.glob("step-*") if (p / ".metadata").is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


def check_shared_dir(root: Path, rt: Runtime) -> None:
    """Several nodes: refuse a checkpoint directory they do not all see (each rank writes its own
    shard files, only rank 0 writes .metadata and prunes; a resume needs every shard in one place)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rt.world))
    if rt.world <= local_world:
        return
    token = [f".gpuprov-shared-{os.getpid()}-{time.time_ns()}" if rt.rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    probe = root / token[0]
    if rt.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe\n")
    dist.barrier()
    seen = torch.tensor([int(probe.is_file())], device=rt.device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    dist.barrier()
    if rt.rank == 0:
        probe.unlink(missing_ok=True)
    if not int(seen):
        raise ConfigError(f"checkpoint.dir {str(root)!r} is not shared by all {rt.world // local_world} nodes "
                          f"(a node cannot see rank 0's files there): point it at shared storage, "
                          f"e.g. /shared/checkpoints")


class Checkpointer:
    """DCP saves every N steps, asynchronous where asked (the step loop goes on while the shards
    are written; the next save, or the end, waits for the previous one), pruned to `keep`."""

    def __init__(self, cfg: Config, rt: Runtime):
        ck = cfg.checkpoint
        self.root, self.keep, self.rt = Path(ck.dir), ck.keep, rt
        self.use_async = ck.async_save and rt.world > 1
        self.pending = None
        # the background save runs its own collectives: on a group of its own, never the one the
        # training step is using at the same time
        self.group = dist.new_group(backend="gloo") if self.use_async else None

    def save(self, state: TrainState) -> Path:
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = self.root / f"step-{state.step:08d}"
        if self.use_async:
            self.pending = dcp.async_save({"app": state}, checkpoint_id=str(path), process_group=self.group)
        else:
            dcp.save({"app": state}, checkpoint_id=str(path))
            self.prune()
        return path

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            if self.rt.world > 1:
                dist.barrier()
            self.prune()

    def prune(self) -> None:
        if self.rt.rank == 0 and self.keep > 0:
            for old in checkpoint_dirs(self.root)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(root: Path, rt: Runtime) -> Path | None:
    """Rank 0 picks the newest complete checkpoint and tells the others, so all load the same one."""
    found = [str(checkpoint_dirs(root)[-1]) if root.is_dir() and checkpoint_dirs(root) else None]
    if rt.world > 1:
        dist.broadcast_object_list(found, src=0)
    return Path(found[0]) if found[0] else None


def resolve_checkpoint(name: str, root: Path, rt: Runtime) -> Path:
    """--export-from: 'latest', a step-N directory name under checkpoint.dir, or a path."""
    if name == "latest":
        path = latest_checkpoint(root, rt)
        if path is None:
            raise ConfigError(f"no complete checkpoint under {root}")
        return path
    path = Path(name) if Path(name).is_dir() else root / name
    if not path.is_dir() and name.startswith("step-") and name[5:].isdigit():
        path = root / f"step-{int(name[5:]):08d}"
    if not (path / ".metadata").is_file():
        raise ConfigError(f"--export-from {name}: no complete checkpoint at {path}")
    return path


def load_checkpoint(state: TrainState, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({"app": state}, checkpoint_id=str(path))


# --------------------------------------------------------------------------------------------
# export


def export_model(model: torch.nn.Module, cfg: Config, rt: Runtime, out: Path, merged: bool = False) -> Path:
    """Hugging Face format from the sharded model: safetensors shards + index + config.json for full
    training, a PEFT adapter (adapter_config.json + adapter_model.safetensors) for LoRA, plus a
    merged copy when asked; the base's tokenizer files and generation_config.json beside them."""
    if cfg.parallel.pp > 1:
        import train_pipeline

        train_pipeline.export_stages(model, cfg, rt, out)
        if rt.rank == 0:
            copy_tokenizer(cfg, out)
        log(f"exported model to {out} ({cfg.parallel.pp} pipeline stages)")
        dist.barrier()
        return out
    if cfg.task.kind != "full":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # the adapter alone is small: gathered whole on rank 0
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        sd = get_model_state_dict(model, options=opts)
        if rt.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            write_adapter(sd, cfg, out)
            copy_tokenizer(cfg, out)
            if merged:
                write_merged(cfg, out)
    else:
        write_hf_model(model, cfg, rt.rank == 0, out)
    if rt.rank == 0:
        log(f"exported {'model' if cfg.task.kind == 'full' else 'adapter'} to {out}")
    if rt.world > 1:
        dist.barrier()
    return out


class SafetensorsShards:
    """Tensors streamed into safetensors files of at most `max_bytes` each (one tensor more only
    when a single tensor is larger), as save_pretrained shards; only the open shard is held."""

    def __init__(self, out: Path, max_bytes: int, tag: str = "r0"):
        self.out, self.max_bytes, self.tag = out, max_bytes, tag
        self.tensors: dict[str, torch.Tensor] = {}
        self.done: list[tuple[str, list[str], int]] = []  # (temporary file name, keys, bytes)

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.tensors and self.size() + size > self.max_bytes:
            self.flush()
        self.tensors[name] = t

    def size(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def flush(self) -> None:
        from safetensors.torch import save_file

        name = f".{self.tag}-{len(self.done):05d}.safetensors.part"
        self.out.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, str(self.out / name), metadata={"format": "pt"})
        self.done.append((name, sorted(self.tensors), self.size()))
        self.tensors = {}

    def finish(self) -> list[tuple[str, list[str], int]]:
        if self.tensors:
            self.flush()
        return self.done


def name_shards(out: Path, parts: list[tuple[str, list[str], int]]) -> None:
    """The written parts under Hugging Face's names: model.safetensors when one, else
    model-0000i-of-0000N.safetensors and model.safetensors.index.json (what from_pretrained reads)."""
    import json

    if len(parts) == 1:
        os.replace(out / parts[0][0], out / "model.safetensors")
        return
    n, weight_map = len(parts), {}
    for i, (tmp, keys, _) in enumerate(parts, 1):
        final = f"model-{i:05d}-of-{n:05d}.safetensors"
        os.replace(out / tmp, out / final)
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": sum(p[2] for p in parts)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_hf_model(model: torch.nn.Module, cfg: Config, writer: bool, out: Path) -> None:
    """Every rank gathers one tensor at a time (the collective needs them all); the writer converts
    it to export.dtype on the host and streams it into shards of export.max_shard_gb: no full
    fp32 copy of the model is ever held on one rank, only one tensor and the open shard."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dtype, hf = DTYPES[cfg.export.dtype], unwrap(model)
    tied = getattr(hf.config, "tie_word_embeddings", False)
    shards = SafetensorsShards(out, int(cfg.export.max_shard_gb * 1e9)) if writer else None
    for k, v in get_model_state_dict(model).items():  # sharded values: nothing gathered yet
        name = hf_name(k.removeprefix("module."))
        if tied and name == "lm_head.weight":
            continue  # save_pretrained drops the tied copy too
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        if writer:
            shards.add(name, full.detach().to("cpu", dtype).contiguous())
        del full
    if writer:
        name_shards(out, shards.finish())
        write_hf_config(hf.config, cfg, out)
        copy_tokenizer(cfg, out)


# what a model directory holds besides weights and config.json: tokenizer and generation defaults
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def copy_tokenizer(cfg: Config, out: Path) -> list[str]:
    """The base model's tokenizer files and generation_config.json into the export (from
    model.pretrained_path, else the tokenizer data.path was prepared with), so it loads alone."""
    import json

    src = cfg.model.pretrained_path
    meta = Path(cfg.data.path or "", "meta.json") if cfg.data.path else None
    if not src and meta is not None and meta.is_file():
        src = json.loads(meta.read_text()).get("tokenizer")
    copied = []
    for name in TOKENIZER_FILES if src else ():
        f = Path(src, name)
        if f.is_file() and f.stat().st_size <= 1 << 30:  # a bounded regular file (a cache's link resolved)
            shutil.copyfile(f, out / name)
            copied.append(name)
    return copied


def write_hf_config(config, cfg: Config, out: Path) -> None:
    """config.json for the exported weights: their dtype, and the KV cache back on for inference."""
    import transformers

    setattr(config, "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype",
            cfg.export.dtype)
    config.use_cache = True
    config.save_pretrained(str(out))


def write_adapter(sd: dict, cfg: Config, out: Path) -> None:
    from safetensors.torch import save_file

    # PEFT's file keys: the module path without the adapter name ("default")
    tensors = {k.replace(".default.", "."): v.contiguous() for k, v in sd.items() if "lora_" in k}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    lora_config(cfg).save_pretrained(str(out))


def write_merged(cfg: Config, out: Path) -> None:
    """The base with the adapter folded in (rank 0, on CPU): a plain HF model for serving, sharded
    as the full export is, with the tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[cfg.export.dtype]
    base = AutoModelForCausalLM.from_pretrained(cfg.model.pretrained_path, **dtype_kwarg(dtype))
    merged = PeftModel.from_pretrained(base, str(out)).merge_and_unload()
    merged.save_pretrained(str(out / "merged"), max_shard_size=int(cfg.export.max_shard_gb * 1e9))
    copy_tokenizer(cfg, out / "merged")


def export_dir(cfg: Config, name: str) -> Path:
    return Path(cfg.export.dir or Path(cfg.checkpoint.dir) / "export") / name


