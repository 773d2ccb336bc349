"""Training data: fixed windows of seq_len + 1 tokens by global sample index, with labels and
per-document positions.

From files: raw little-endian uint16/uint32 token streams (`*.bin`, the nanoGPT/Megatron
layout), memory-mapped, cut into non-overlapping windows that never cross a file; read in order
(prepare_data.py shuffles documents before packing). A `<name>.mask` file beside a `.bin` (uint8,
one per token) marks which tokens are trained on as labels (0: an instruction prompt, padding).
A directory from prepare_data.py holds `train/` and `val/` (`split` picks one) and meta.json.

Documents: where meta.json names the EOS id and data.document_attention is on, position ids
restart after every EOS, and the model keeps attention inside each document (train_model's
token_loss_sum). prepare_data.py packs instruction samples whole, so no window starts inside a
response whose prompt it lacks.

Synthetic (data.synthetic: true): each sample is an arithmetic sequence mod the vocabulary with a
per-sample start and stride, so the loss can fall without real data; `data.synthetic_samples`
bounds the stream (one global batch = a fixed batch).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train_config import ConfigError, DataSection


@dataclass
class Batch:
    """One micro-batch: `inputs` [b, s] predict `labels` [b, s] (-100: no loss there)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None  # restart at each document; None: 0..s-1 in every row

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True).contiguous()  # noqa: E731
        return Batch(move(self.inputs), move(self.labels), move(self.positions))

    @property
    def labelled(self) -> torch.Tensor:
        """How many tokens carry a loss (the denominator's share of this micro-batch)."""
        return self.labels.ne(-100).sum()


def document_positions(inputs: np.ndarray, eos: int) -> np.ndarray:
    """Position ids that restart after every EOS: [a b EOS c d] -> [0 1 2 0 1]."""
    s = inputs.shape[-1]
    idx = np.broadcast_to(np.arange(s), inputs.shape)
    starts = np.zeros(inputs.shape, dtype=bool)
    starts[..., 0] = True
    starts[..., 1:] = inputs[..., :-1] == eos
    last = np.maximum.accumulate(np.where(starts, idx, 0), axis=-1)
    return idx - last


class TokenWindows:
    """Samples of seq_len + 1 tokens (inputs and shifted labels) and their loss mask, by global index."""

    def __init__(self, data: DataSection, seq_len: int, vocab: int, seed: int, split: str = "train"):
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.path, self.masks, self.eos = data.path, None, None
        if self.path:
            files = self._files(Path(self.path), split)
            meta_file = Path(self.path, "meta.json")
            meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
            dtype = np.dtype(meta.get("dtype", data.dtype)).newbyteorder("<")
            if data.document_attention and meta.get("eos_token_id") is not None:
                self.eos = int(meta["eos_token_id"])
            self.shards = [np.memmap(f, dtype=dtype, mode="r") for f in files]
            if all(f.with_suffix(".mask").is_file() for f in files):
                self.masks = [np.memmap(f.with_suffix(".mask"), dtype=np.uint8, mode="r") for f in files]
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
            self.starts = list(np.cumsum([0] + counts))
            self.size = int(self.starts[-1])
            if self.size == 0:
                raise ConfigError(f"data.path {self.path!r} holds fewer than seq_len + 1 = {seq_len + 1} tokens")
        elif not data.synthetic:
            raise ConfigError("data.path is null: point it at prepare_data.py's output (or token .bin files), "
                              "or set data.synthetic=true for a smoke test that learns nothing")
        else:
            self.size = int(data.synthetic_samples) if data.synthetic_samples else 2**62

    @staticmethod
    def _files(p: Path, split: str) -> list[Path]:
        if (p / "meta.json").is_file():
            p = p / split
        elif split != "train":
            return []
        files = sorted(p.glob("*.bin")) if p.is_dir() else [p]
        if not files or not all(f.is_file() for f in files):
            raise ConfigError(f"data.path {str(p)!r}: no .bin token files there")
        return files

    @classmethod
    def validation(cls, data: DataSection, seq_len: int, vocab: int, seed: int) -> TokenWindows | None:
        path = data.path
        if not path or not (Path(path) / "meta.json").is_file() or not (Path(path) / "val").is_dir():
            return None
        return cls(data, seq_len, vocab, seed, split="val")

    def __len__(self) -> int:
        return self.size

    def _where(self, index: int) -> tuple[int, int]:
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, (index - self.starts[shard]) * self.seq_len

    def sample(self, index: int) -> np.ndarray:
        index %= self.size  # wrap: another epoch
        if self.path:
            shard, off = self._where(index)
            return np.asarray(self.shards[shard][off: off + self.seq_len + 1], dtype=np.int64)
        rng = np.random.default_rng([self.seed, index])
        start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
        return (start + stride * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab

    def mask(self, index: int) -> np.ndarray | None:
        if self.masks is None:
            return None
        shard, off = self._where(index % self.size)
        return np.asarray(self.masks[shard][off: off + self.seq_len + 1], dtype=bool)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [count, seq_len + 1], labels [count, seq_len]: next tokens, -100 where masked)."""
        tokens = torch.from_numpy(np.stack([self.sample(first + i) for i in range(count)]))
        top = int(tokens.max())
        if top >= self.vocab:
            raise ConfigError(f"token id {top} in data.path {self.path!r} is outside the model's vocabulary "
                              f"of {self.vocab}: tokenized with another tokenizer?")
        labels = tokens[:, 1:].clone()
        if self.masks is not None:
            keep = torch.from_numpy(np.stack([self.mask(first + i) for i in range(count)]))[:, 1:]
            labels[~keep] = -100  # F.cross_entropy's ignore_index: no loss on prompt tokens
        return tokens, labels

    def micro_batch(self, first: int, count: int) -> Batch:
        """Samples first .. first + count - 1 as a Batch (with document positions where known)."""
        tokens, labels = self.batch(first, count)
        inputs = tokens[:, :-1]
        positions = None
        if self.eos is not None:
            positions = torch.from_numpy(document_positions(inputs.numpy(), self.eos))
        return Batch(inputs, labels, positions)
