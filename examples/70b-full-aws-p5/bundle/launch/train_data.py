"""Training data: fixed windows of seq_len + 1 tokens by global sample index, with labels and
per-document positions.

From files: raw little-endian uint16/uint32 token streams (`*.bin`, the nanoGPT/Megatron
layout), memory-mapped, cut into non-overlapping windows that never cross a file; read in order
(prepare_data.py shuffles documents before packing). A `<name>.mask` file beside a `.bin` (uint8,
one per token) marks which tokens are trained on as labels (0: an instruction prompt, padding).
A directory from prepare_data.py holds `train/` and `val/` (`split` picks one) and meta.json.

Documents: prepare_data.py writes where every sample starts beside its tokens (`<name>.starts`,
little-endian int64 offsets into the `.bin`, ascending from 0; a padding run counts as its own).
With data.document_attention on, each window gets a document id per token from them, never from an
EOS token (a chat template may put EOS inside a sample), and train_attention.py turns the ids into
restarting positions and a per-document causal mask in every layout. Token files without
`.starts` train one causal sequence per window. prepare_data.py packs instruction samples whole,
so no window starts inside a response whose prompt it lacks.

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

from train_attention import document_positions
from train_config import ConfigError, DataSection


@dataclass
class Batch:
    """One micro-batch: `inputs` [b, s] predict `labels` [b, s] (-100: no loss there)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None  # restart at each document; None: 0..s-1 in every row
    documents: torch.Tensor | None = None  # [b, s] document id per input token; None: one per row
    # context parallelism (parallel.cp_shard): the window positions of this rank's tokens and of the
    # all-gathered keys; `documents` then stays whole
    q_index: torch.Tensor | None = None
    k_index: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True).contiguous()  # noqa: E731
        return Batch(move(self.inputs), move(self.labels), move(self.positions), move(self.documents),
                     move(self.q_index), move(self.k_index))

    @property
    def labelled(self) -> torch.Tensor:
        """How many tokens carry a loss (the denominator's share of this micro-batch)."""
        return self.labels.ne(-100).sum()


class TokenWindows:
    """Samples of seq_len + 1 tokens (inputs and shifted labels) and their loss mask, by global index."""

    def __init__(self, data: DataSection, seq_len: int, vocab: int, seed: int, split: str = "train"):
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.path, self.masks, self.starts_files = data.path, None, None
        self.validation_split = split != "train"
        self._order: tuple[int, np.ndarray | None] = (0, None)  # (epoch, its window order)
        if self.path:
            files = self._files(Path(self.path), split)
            meta_file = Path(self.path, "meta.json")
            meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
            dtype = np.dtype(meta.get("dtype", data.dtype)).newbyteorder("<")
            self.meta = meta
            self.shards = [np.memmap(f, dtype=dtype, mode="r") for f in files]
            if all(f.with_suffix(".mask").is_file() for f in files):
                self.masks = [np.memmap(f.with_suffix(".mask"), dtype=np.uint8, mode="r") for f in files]
            if data.document_attention and all(f.with_suffix(".starts").is_file() for f in files):
                self.starts_files = [self._starts(f.with_suffix(".starts")) for f in files]
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
            self.starts = list(np.cumsum([0] + counts))
            self.size = int(self.starts[-1])
            if self.size == 0:
                raise ConfigError(f"data.path {self.path!r} holds fewer than seq_len + 1 = {seq_len + 1} tokens")
        elif not data.synthetic:
            raise ConfigError("data.path is null: point it at prepare_data.py's output (or token .bin files), "
                              "or set data.synthetic=true for a smoke test that learns nothing")
        else:
            self.meta = {}
            self.size = int(data.synthetic_samples) if data.synthetic_samples else 2**62

    @property
    def documents(self) -> bool:
        """Whether windows carry document ids (recorded sample boundaries, document_attention on)."""
        return self.starts_files is not None

    @staticmethod
    def _starts(path: Path) -> np.ndarray:
        """A shard's sample starts (int64 offsets, the first 0), memory-mapped."""
        size = path.stat().st_size
        starts = np.memmap(path, dtype="<i8", mode="r") if size >= 8 and size % 8 == 0 else None
        if starts is None or starts[0] != 0:
            raise ConfigError(f"{path}: not sample starts (int64 offsets from 0, as prepare_data.py writes them)")
        return starts

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

    def window(self, index: int) -> int:
        """The stored window global sample `index` reads. Training: the first epoch in file order
        (prepare_data.py shuffled the documents with its seed), every later epoch a permutation
        drawn from (training.seed, epoch); a resume at any sample reads what the run would have.
        Validation: one fixed permutation, so its first batches are a fixed random sample."""
        epoch, pos = divmod(index, self.size)
        if not self.validation_split and epoch == 0:
            return pos
        key = -1 if self.validation_split else epoch
        if self._order[0] != key or self._order[1] is None:
            self._order = (key, np.random.default_rng([self.seed, key + 1]).permutation(self.size))
        return int(self._order[1][pos])

    def _where(self, index: int) -> tuple[int, int]:
        """(shard, token offset) of the window global sample `index` reads."""
        index = self.window(index)
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, (index - self.starts[shard]) * self.seq_len

    def sample(self, index: int) -> np.ndarray:
        if self.path:
            shard, off = self._where(index)
            return np.asarray(self.shards[shard][off: off + self.seq_len + 1], dtype=np.int64)
        rng = np.random.default_rng([self.seed, index % self.size])  # wrap: another epoch
        start, stride = rng.integers(0, self.vocab), rng.integers(1, 8)
        return (start + stride * np.arange(self.seq_len + 1, dtype=np.int64)) % self.vocab

    def mask(self, index: int) -> np.ndarray | None:
        if self.masks is None:
            return None
        shard, off = self._where(index)
        return np.asarray(self.masks[shard][off: off + self.seq_len + 1], dtype=bool)

    def document_ids(self, index: int) -> np.ndarray:
        """The document each of window `index`'s seq_len input tokens belongs to (ids local to the shard)."""
        shard, off = self._where(index)
        return np.searchsorted(self.starts_files[shard], off + np.arange(self.seq_len), side="right") - 1

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
        if not self.documents:
            return Batch(inputs, labels)
        docs = torch.from_numpy(np.stack([self.document_ids(first + i) for i in range(count)]))
        return Batch(inputs, labels, document_positions(docs), docs)
