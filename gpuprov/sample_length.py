"""The mean length in tokens of one sample of a local dataset: what a recipe's batch of samples is
in tokens (gpuprov/recipes.py global_batch_tokens).

Measured with the model's own tokenizer (its tokenizer.json, from the model's folder or the local
Hugging Face cache; nothing is downloaded) on the first records of the file; without a tokenizer
here, estimated from the records' text bytes at the catalog's bytes per token, and labelled so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SAMPLE_RECORDS = 1000  # records read for the mean
SAMPLE_BYTES = 64 << 20  # and at most this much of the file
_TEXT_FIELDS = ("text", "prompt", "response", "completion", "instruction", "input", "output")


@dataclass(frozen=True)
class SampleLength:
    mean_tokens: float
    how: str  # "measured" (the model's tokenizer) or "estimated" (bytes / bytes_per_token)
    records: int  # records it was taken over
    whole_file: bool  # every record of the file was read


def _record_text(record: object) -> str:
    """The text a record trains on: its text fields, or its chat messages' contents."""
    if not isinstance(record, dict):
        return ""
    if isinstance(record.get("messages"), list):
        return "\n".join(str(m.get("content", "")) for m in record["messages"] if isinstance(m, dict))
    return "\n".join(str(record[k]) for k in _TEXT_FIELDS if isinstance(record.get(k), str))


def _records(path: Path) -> tuple[list[str], bool]:
    """(texts of the first records, whether the file ended within the sample)."""
    texts: list[str] = []
    read = 0
    with path.open("rb") as f:
        for line in f:
            read += len(line)
            if read > SAMPLE_BYTES or len(texts) >= SAMPLE_RECORDS:
                return texts, False
            if line.strip():
                try:
                    text = _record_text(json.loads(line))
                except ValueError:
                    continue
                if text:
                    texts.append(text)
    return texts, True


def tokenizer_file(model: str | None) -> Path | None:
    """The model's tokenizer.json on this machine: beside its config.json, or in the local Hugging Face cache."""
    if not model:
        return None
    from gpuprov.catalog.models import HF_ID, weights_source

    try:
        source = weights_source(model)
    except Exception:  # noqa: BLE001 - an unknown model: its own validator reports it
        return None
    local = Path(source) / "tokenizer.json"
    if local.is_file():
        return local
    if not HF_ID.fullmatch(source):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(source, "tokenizer.json")
    return Path(found) if isinstance(found, str) and Path(found).is_file() else None


def sample_length(path: Path, model: str | None, bytes_per_token: int) -> SampleLength | None:
    """The mean tokens per record of a JSONL file (None: not JSONL, or no record with text)."""
    if path.suffix not in (".jsonl", ".json"):
        return None
    texts, whole = _records(path)
    if not texts:
        return None
    found = tokenizer_file(model)
    if found is not None:
        try:
            from tokenizers import Tokenizer

            lengths = [len(e.ids) for e in Tokenizer.from_file(str(found)).encode_batch(texts)]
            return SampleLength(sum(lengths) / len(lengths), "measured", len(texts), whole)
        except Exception:  # noqa: BLE001 - a tokenizer that does not load: fall back to the estimate
            pass
    mean_bytes = sum(len(t.encode("utf-8")) for t in texts) / len(texts)
    return SampleLength(max(1.0, mean_bytes / bytes_per_token), "estimated", len(texts), whole)
