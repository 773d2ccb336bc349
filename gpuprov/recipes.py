"""Training defaults by task: a published fine-tuning recipe, or pre-training from scratch.

catalog/data/recipes.yaml holds the numbers with their sources. The spec fills what the user left
out from here (`fill_budget`), and the Plan's learning-rate schedule comes from here
(`schedule`), so `plan`, `generate` and train.yaml agree on one recipe.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from functools import lru_cache
from typing import Any

from gpuprov.errors import GpuprovError

MAX_DATASET_BYTES = 1 << 40  # a text corpus larger than a TiB is not a fine-tuning set


def _data() -> dict:
    from gpuprov.catalog import load_data

    return load_data("recipes.yaml")


def recipe_names() -> tuple[str, ...]:
    return tuple(_data()["recipes"])


def default_recipe() -> str:
    return str(_data()["default_recipe"])


def recipe(name: str | None, task: str, params: int | None = None) -> dict[str, Any]:
    """One framework's published recipe for this task (`name` None: the default recipe), for the model
    size nearest `params` it publishes one at (None: the framework's main entries)."""
    import math

    recipes = _data()["recipes"]
    name = name or default_recipe()
    if name not in recipes:
        raise GpuprovError(f"unknown recipe {name!r}; one of {', '.join(recipes)}")
    framework = recipes[name]
    sizes = [framework, *framework.get("by_size", [])]
    entry = framework
    if params:
        with_task = [s for s in sizes if task in s and s.get("params")]
        if with_task:
            entry = min(with_task, key=lambda s: abs(math.log(float(s["params"]) / params)))
    return {"name": name, "params": entry.get("params"), "dataset_examples": entry.get("dataset_examples"),
            "dataset_source": entry.get("dataset_source"), **entry[task]}


@lru_cache(maxsize=64)
def model_params(model: str | None) -> int | None:
    """The parameter count of a spec's model (None when it does not load: its own validator says why)."""
    if not model:
        return None
    from gpuprov.catalog.models import get_model

    try:
        return int(get_model(model).params)
    except (GpuprovError, ValueError, OSError):
        return None


def pretrain() -> dict[str, Any]:
    return dict(_data()["pretrain"])


def assumed_finetune_tokens() -> int:
    return int(_data()["assumed_finetune_tokens"])


@dataclass(frozen=True)
class DatasetSize:
    """How many tokens the training data holds, and how that count was found."""
    tokens: int | None  # None: a remote source, counted only once it is prepared on the cluster
    # "given", "meta.json" (exact, from prepare_data.py), "measured" (every record tokenized with the
    # model's tokenizer), "estimated" (bytes / bytes_per_token), "remote"
    how: str
    sample: Any = None  # gpuprov/sample_length.py SampleLength of a JSONL file (None: unknown)


def dataset_tokens(value: str, base: Path, model: str | None = None) -> DatasetSize:
    """Tokens in one pass over the data: a count (`100M`), a prepared data directory or its meta.json
    (prepare_data.py: train_samples x seq_len, exact), or a raw text/JSONL file (estimated from its size)."""
    from gpuprov.specfile import parse_count

    from gpuprov.validators import dataset_scheme

    text = str(value).strip()
    try:
        return DatasetSize(parse_count(text, what="--dataset"), "given")
    except GpuprovError:
        pass  # not a count: a path
    if dataset_scheme(text) is not None:  # read by the nodes (the validator checks its shape)
        return DatasetSize(None, "remote")
    path = Path(text) if Path(text).is_absolute() else base / text
    if path.is_dir():
        path = path / "meta.json"
    if not path.exists():
        raise GpuprovError(f"--dataset {text!r}: neither a token count (100M) nor a file or data directory")
    if not path.is_file():
        raise GpuprovError(f"--dataset {text!r}: not a regular file")
    size = path.stat().st_size
    if size > MAX_DATASET_BYTES:
        raise GpuprovError(f"--dataset {text!r}: larger than 1 TiB; give its token count instead (--dataset 2B)")
    if path.name == "meta.json":
        return DatasetSize(_meta_tokens(path, text), "meta.json")
    per = int(_data()["bytes_per_token"])
    if size < per:
        raise GpuprovError(f"--dataset {text!r}: empty")
    from gpuprov.sample_length import sample_length

    sample = sample_length(path, model, per)
    if sample is not None and sample.how == "measured" and sample.whole_file:  # every record tokenized
        return DatasetSize(max(1, round(sample.mean_tokens * sample.records)), "measured", sample)
    return DatasetSize(size // per, "estimated", sample)


def _meta_tokens(path: Path, shown: str) -> int:
    from gpuprov.specfile import read_text

    try:
        meta = json.loads(read_text(path))
        tokens = int(meta["train_samples"]) * int(meta["seq_len"])
    except (ValueError, KeyError, TypeError):
        raise GpuprovError(f"--dataset {shown!r}: meta.json lacks train_samples and seq_len "
                           "(write it with launch/prepare_data.py)") from None
    if tokens <= 0:
        raise GpuprovError(f"--dataset {shown!r}: meta.json counts no training tokens")
    return tokens


def batch_sequences(name: str | None, task: str, dp: int, params: int | None = None) -> tuple[int, str]:
    """(global batch in sequences, its source) of the recipe run on `dp` data-parallel ranks.

    The recipes' batch is per device: batch_size x accumulation x devices. One rank takes the
    single-device recipe where one is published; up to the launch line's device count the recipe as
    launched on dp ranks; beyond it the launch line's global batch (the largest any recipe publishes
    at its learning rate), split over more ranks."""
    r = recipe(name, task, params)
    single = r.get("single_device")
    if dp == 1 and single:
        return int(single["batch_size"]) * int(single["gradient_accumulation_steps"]), str(single["source"])
    per_device = int(r["batch_size"]) * int(r["gradient_accumulation_steps"])
    return per_device * min(max(1, dp), int(r["devices"])), str(r["source"])


def global_batch_tokens(spec: Any, dp: int) -> int:
    """The spec's batch in tokens on `dp` data-parallel ranks: the one it states, else its recipe's."""
    stated = getattr(spec, "global_batch_tokens", None)
    if stated is not None:
        return int(stated)
    params = model_params(getattr(spec, "model", None))
    samples = batch_sequences(getattr(spec, "recipe", None), spec.task, dp, params)[0]
    mean = getattr(spec, "sample_tokens", None)
    if not mean:  # no sample length known: each of the recipe's samples taken as one packed window
        return samples * spec.seq_len
    # the recipe's samples x their mean length, in whole packed windows, one window per rank at least
    windows = max(1, round(samples * mean / spec.seq_len))
    return max(windows, dp) * spec.seq_len


def fill_budget(*, task: str, init: str, recipe_name: str | None, seq_len: int, tokens: int | None,
                global_batch_tokens: int | None, global_batch: int | None, dataset_tokens: int | None,
                epochs: float | None, params: int | None = None) -> tuple[int, int | None, list[str]]:
    """(tokens, global batch tokens, what was assumed) for a spec that may leave either out.

    Fine-tuning: the batch stays None unless stated (the recipe's depends on the data-parallel degree
    the plan picks: `global_batch_tokens`), its epochs over --dataset, or the assumed token count when
    no data size is given. From scratch: the pre-training defaults."""
    assumed: list[str] = []
    batch_default: int | None
    if init == "random":
        base = pretrain()
        batch_default, tokens_default, epochs_default = int(base["global_batch_tokens"]), int(base["tokens"]), 1.0
    else:
        r = recipe(recipe_name, task, params)
        batch_default = None
        tokens_default, epochs_default = assumed_finetune_tokens(), float(r["epochs"])
    if global_batch is not None:
        if global_batch_tokens is not None and global_batch_tokens != global_batch * seq_len:
            raise ValueError(f"global_batch {global_batch} sequences x seq_len {seq_len} = "
                             f"{global_batch * seq_len:,} tokens, not global_batch_tokens {global_batch_tokens:,}; "
                             "give one of them")
        global_batch_tokens = global_batch * seq_len
    if global_batch_tokens is None:
        global_batch_tokens = batch_default
    if dataset_tokens is not None:
        from_data = max(1, round(dataset_tokens * (epochs if epochs is not None else epochs_default)))
        if tokens is not None and tokens != from_data:
            raise ValueError(f"tokens {tokens:,} and dataset x epochs = {from_data:,} disagree; give --tokens "
                             "or --dataset (with --epochs), not both")
        tokens = from_data
    elif epochs is not None:
        raise ValueError("epochs needs a dataset size: --dataset FILE|TOKENS")
    if tokens is None:
        tokens = tokens_default
        if init != "random":
            assumed.append("tokens")
    return tokens, global_batch_tokens, assumed


def schedule(spec: Any, params: int, steps: int) -> dict[str, Any]:
    """learning_rate, warmup_steps, weight_decay for the Plan (the recipe's, or pre-training's)."""
    if getattr(spec, "init", "pretrained") == "random":
        base = pretrain()
        lr = float(base["learning_rate_large"] if params >= 30e9 else base["learning_rate"])
        warmup = max(1, min(int(base["warmup_steps"]), steps // 20))
        return dict(learning_rate=lr, warmup_steps=warmup, weight_decay=float(base["weight_decay"]))
    r = recipe(getattr(spec, "recipe", None), spec.task, params)
    fraction = warmup_fraction(r)
    # a count for a run of unrecorded length: the count, at most half of this run
    warmup = round(steps * fraction) if fraction is not None else min(int(r["warmup_steps"]), steps // 2)
    return dict(learning_rate=float(r["learning_rate"]), warmup_steps=warmup, weight_decay=float(r["weight_decay"]))


def warmup_fraction(r: dict[str, Any]) -> float | None:
    """The share of its own run a recipe warms up for: warmup_ratio as written, or warmup_steps over
    the recipe's optimizer steps (its dataset's rows x epochs / its launch line's global batch in
    samples). None: a step count for a dataset of unrecorded size."""
    if "warmup_ratio" in r:
        return float(r["warmup_ratio"])
    warmup = int(r["warmup_steps"])
    if not warmup:
        return 0.0
    if not r.get("dataset_examples"):
        return None
    samples = int(r["batch_size"]) * int(r["gradient_accumulation_steps"]) * int(r["devices"])
    return min(1.0, warmup / (float(r["dataset_examples"]) * float(r["epochs"]) / samples))


def tokens_assumed(spec: Any) -> bool:
    """Whether the run's token count is gpuprov's fine-tune default rather than the user's data.
    Decided from the spec's own values (a spec reloaded from a lock holds the number, not how it came)."""
    return (getattr(spec, "init", "pretrained") != "random" and getattr(spec, "dataset", None) is None
            and spec.tokens == assumed_finetune_tokens())


def notes(spec: Any, steps: int, batch_tokens: int, dp: int = 1) -> list[str]:
    """plan's Notes on the training budget: the recipe, and any size gpuprov assumed."""
    out = [describe(spec, steps, batch_tokens, dp)]
    if tokens_assumed(spec):
        out.append(f"{spec.tokens:,} training tokens is the size gpuprov assumes for a fine-tune without "
                   "--dataset or --tokens: give --dataset FILE|TOKENS [--epochs N] to size the run from your data")
    elif getattr(spec, "dataset_tokens", None):
        epochs = spec.tokens / spec.dataset_tokens
        # how generate counted it (the lock keeps it); a spec from before it was kept: counted again here
        how = getattr(spec, "dataset_tokens_how", None) or _dataset_how(spec.dataset, spec.model)
        if how == "estimated":  # never printed as if it were counted
            per = int(_data()["bytes_per_token"])
            out.append(f"Dataset: ~{spec.dataset_tokens:,} tokens per pass (an estimate: the file's bytes / {per}, "
                       f"not tokenized) x {epochs:g} epoch(s) = ~{spec.tokens:,} tokens in ~{steps:,} optimizer "
                       "steps; prepare_data.py's meta.json gives the exact count")
        else:
            out.append(f"Dataset: {spec.dataset_tokens:,} tokens per pass x {epochs:g} epoch(s) = {spec.tokens:,} "
                       f"tokens in {steps:,} optimizer steps")
    elif getattr(spec, "dataset", None) and getattr(spec, "init", "pretrained") != "random" \
            and getattr(spec, "dataset_tokens", None) is None and spec.tokens == assumed_finetune_tokens():
        out.append(f"{spec.tokens:,} training tokens is an assumption: {spec.dataset} is read on the cluster and "
                   "counted only once prepared; give --tokens to size the run")
    return out


def _dataset_how(value: str | None, model: str | None = None) -> str:
    """How --dataset was counted: given, meta.json, measured, estimated or remote ('given' when unreadable)."""
    if not value:
        return "given"
    try:
        return dataset_tokens(value, Path.cwd(), model).how
    except GpuprovError:
        return "given"


def describe(spec: Any, steps: int, batch_tokens: int, dp: int = 1) -> str:
    """One line: where the batch and schedule came from (for plan's Notes)."""
    if getattr(spec, "init", "pretrained") == "random":
        return (f"From scratch (init: random): pre-training defaults, {pretrain()['source']}")
    params = model_params(getattr(spec, "model", None))
    r = recipe(getattr(spec, "recipe", None), spec.task, params)
    seqs = batch_tokens // spec.seq_len
    if getattr(spec, "global_batch_tokens", None) is not None:
        how = "as stated"
    else:
        samples, source = batch_sequences(getattr(spec, "recipe", None), spec.task, dp, params)
        how = f"the recipe's for {dp} data-parallel rank{'s' if dp > 1 else ''}" + \
            (f", {source}" if source != r["source"] else "")
        mean = getattr(spec, "sample_tokens", None)
        seq_note = _data().get("sequences", {}).get(r["name"])
        if mean:
            how = f"{how}: {_tokens_words(spec, samples, mean, dp)}"
        elif seq_note:
            how += f"; {seq_note}; no sample length known (a local JSONL --dataset gives one)"
    return (f"Fine-tuning the pretrained weights with the {r['name']} {spec.task} recipe: global batch {seqs:,} "
            f"sequences of {spec.seq_len} tokens ({how}), learning rate {r['learning_rate']:g}, {steps:,} "
            f"optimizer steps{_warmup_words(r)} ({r['source']}, read {r['date']})")


def _tokens_words(spec: Any, samples: int, mean: float, dp: int) -> str:
    """The recipe's batch in tokens, and how the sample length behind it was found."""
    wanted = samples * mean
    windows = max(1, round(wanted / spec.seq_len))
    how = ("measured with the model's tokenizer" if spec.sample_tokens_how == "measured"
           else f"an estimate from the records' bytes at {_data()['bytes_per_token']} a token, no tokenizer here")
    out = (f"{samples} samples x {mean:,.1f} tokens a sample ({how}) = {wanted:,.0f} tokens, packed into "
           f"{windows} window{'s' if windows > 1 else ''}")
    if dp > windows:
        out += (f"; {dp} ranks take one window each at least, so a step carries {dp * spec.seq_len / wanted:.1f}x "
                "the recipe's tokens")
    return out


def _warmup_words(r: dict[str, Any]) -> str:
    fraction = warmup_fraction(r)
    if not fraction:
        return "" if fraction == 0.0 else f", warmup {r['warmup_steps']} steps (at most half the run)"
    if "warmup_ratio" in r:
        return f", warmup {fraction:.1%} of the steps (the recipe's warmup_ratio)"
    samples = int(r["batch_size"]) * int(r["gradient_accumulation_steps"]) * int(r["devices"])
    return (f", warmup {fraction:.1%} of the steps (the recipe's {r['warmup_steps']} of "
            f"{float(r['dataset_examples']) * float(r['epochs']) / samples:,.0f}: {r['dataset_examples']:,} rows "
            f"x {r['epochs']} epoch(s) / {samples} samples a step)")
