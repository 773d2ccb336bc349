#!/usr/bin/env python3
"""Tokenize local data into the shards launch/train.py reads (data.path).

    python prepare_data.py --tokenizer /models/llama-3.1-8b --seq-len 4096 --out /shared/data/run1 corpus/*.jsonl
    python prepare_data.py --tokenizer DIR --seq-len 4096 --out DIR chat.jsonl        # {"messages": [...]} records
    python prepare_data.py --tokenizer DIR --prompt-field prompt --response-field response --out DIR pairs.jsonl
    python prepare_data.py --tokenizer DIR --hf-dataset wikitext:wikitext-2-raw-v1 --out DIR   # needs `datasets`

Inputs: JSONL (one object per line), Parquet (needs pyarrow), plain text (one document per file),
or a Hugging Face dataset. Three record formats (--format, detected from the first record):
  text             `--text-field` (default "text"), tokenized with the model's tokenizer, EOS appended,
                   every token trained on;
  prompt-response  `--prompt-field` + `--response-field`: the prompt without loss, the response and
                   its EOS with;
  chat             `--messages-field` (default "messages"): a list of {"role", "content"} turns (any
                   number), rendered by the model's own chat template (tokenizer.apply_chat_template,
                   from the tokenizer directory; --chat-template FILE overrides it); loss on the
                   assistant turns only, as TRL and torchtune train chat data: the other tokens
                   carry no loss.
Documents are shuffled (--seed), then packed per split:
  --pack stream (default for text): documents run on across window boundaries, as
      nanoGPT/torchtitan pack for pre-training, cut at a multiple of seq_len (+1 for the label);
  --pack whole (default for prompt-response and chat): every sample whole inside one window, the
      window padded with EOS (no loss), as torchtune packs SFT data; no window starts inside a sample.
Where each sample starts is written beside the tokens (`.starts`): the trainer restarts positions
and keeps attention inside each sample from it, never from EOS tokens (a chat template may put EOS
inside a sample).

Memory is bounded by the document count, not the token count: tokens are appended to a scratch
file as they are tokenized, then read back one document at a time in shuffled order into the
output shards through fixed buffers. What stays in memory is 8 bytes of offset and 4 of order per document (about 12 MB per
million documents: 1B tokens of 100-token samples take about 120 MB) plus one document's tokens.

Output: <out>/meta.json and per split (train/, val/) part-NNNNN.bin (little-endian uint16 when the
vocabulary fits, else uint32), part-NNNNN.starts (int64: the offset of every sample's first token,
a padding run counting as one; ascending from 0) and, where some token is not trained on,
part-NNNNN.mask (uint8, 1: a trained label). A shard holds at most --shard-windows windows of
seq_len tokens plus the last window's final label.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from array import array
from pathlib import Path

import numpy as np

BUFFER = 1 << 20  # tokens held before a write


def fail(msg: str) -> None:
    raise SystemExit(f"prepare_data.py: {msg}")


def read_records(paths: list[str], hf_dataset: str | None, split: str):
    """Yield dict records (JSONL/Parquet/HF) or {"text": ...} for plain-text files, one at a time."""
    if hf_dataset:
        try:
            import datasets
        except ImportError:
            fail("--hf-dataset needs the `datasets` package (pip install datasets)")
        name, _, config = hf_dataset.partition(":")
        # downloaded once into the datasets cache and memory-mapped (Arrow): read a record at a time
        yield from datasets.load_dataset(name, config or None, split=split)
    for path in map(Path, paths):
        if not path.is_file():
            fail(f"{path}: no such file")
        if path.suffix in (".jsonl", ".json"):
            with path.open() as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as exc:
                            fail(f"{path}:{n}: not JSON ({exc.msg})")
        elif path.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                fail(f"{path}: Parquet needs pyarrow (pip install pyarrow)")
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                yield from batch.to_pylist()
        else:
            yield {"text": path.read_text()}


# ---------------------------------------------------------------------------- one record -> tokens


def chat_tokens(tok, messages, n: int) -> tuple[list[int], list[int]]:
    """A conversation through the tokenizer's chat template; mask 1 on the assistant turns.

    Each assistant turn's text is what rendering the conversation up to and including it adds to
    the rendering up to it with the generation prompt (its content and its end-of-turn tokens); the
    full rendering is tokenized once and a token is trained on when its text lies inside such a span."""
    if not getattr(tok, "chat_template", None):
        fail("the tokenizer has no chat template for `messages` records (give --chat-template FILE)")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        fail(f"record {n}: messages must be a list of {{\"role\": ..., \"content\": ...}} turns")
    render = lambda msgs, gen=False: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    text = render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True) if i else "", render(messages[:i + 1])
        if not text.startswith(through) or not through.startswith(before):
            fail(f"record {n}: the chat template does not render a conversation's turns as prefixes of it "
                 "(it rewrites earlier turns); give --chat-template a template that does")
        spans.append((len(before), len(through)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return ids, mask


def record_tokens(rec: dict, n: int, tok, args) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one record in the chosen format."""
    eos = tok.eos_token_id
    if args.format == "chat":
        if args.messages_field not in rec:
            fail(f"record {n} has no field {args.messages_field!r} (use --messages-field)")
        return chat_tokens(tok, rec[args.messages_field], n)
    if args.format == "prompt-response":
        try:
            prompt, response = rec[args.prompt_field], rec[args.response_field]
        except KeyError as exc:
            fail(f"record {n} has no field {exc.args[0]!r}")
        p = tok(str(prompt), add_special_tokens=True)["input_ids"]
        r = tok(str(response), add_special_tokens=False)["input_ids"] + [eos]
        return p + r, [0] * len(p) + [1] * len(r)
    if args.text_field not in rec:
        fail(f"record {n} has no field {args.text_field!r} (use --text-field)")
    ids = tok(str(rec[args.text_field]), add_special_tokens=True)["input_ids"] + [eos]
    return ids, [1] * len(ids)


def detect_format(first: dict, args) -> str:
    if args.format:
        return args.format
    if args.prompt_field:
        return "prompt-response"
    return "chat" if args.messages_field in first else "text"


# ---------------------------------------------------------------------------- scratch store


class Scratch:
    """Every document's tokens and mask appended to two files as tokenized; offsets kept (8 B each)."""

    def __init__(self, root: Path, dtype):
        root.mkdir(parents=True, exist_ok=True)
        self.root, self.dtype = root, dtype
        self.tok_f, self.mask_f = open(root / "tokens", "wb"), open(root / "mask", "wb")
        self.offsets = array("q", [0])
        self.buf_t, self.buf_m = array("I"), array("B")
        self.any_masked = False

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.buf_t.extend(ids)
        self.buf_m.extend(mask)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.any_masked |= not all(mask)
        if len(self.buf_t) >= BUFFER:
            self.flush()

    def flush(self) -> None:
        np.frombuffer(self.buf_t, dtype=np.uint32).astype(self.dtype).tofile(self.tok_f)
        np.frombuffer(self.buf_m, dtype=np.uint8).tofile(self.mask_f)
        self.buf_t, self.buf_m = array("I"), array("B")

    def close(self) -> None:
        """Done writing: documents are read back one at a time (positioned reads, nothing mapped,
        so the process holds no page of the token files)."""
        self.flush()
        self.tok_f.close()
        self.mask_f.close()
        self.tok_r, self.mask_r = open(self.root / "tokens", "rb"), open(self.root / "mask", "rb")

    def length(self, i: int) -> int:
        return self.offsets[i + 1] - self.offsets[i]

    def doc(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, n, size = self.offsets[i], self.length(i), self.dtype.itemsize
        ids = np.frombuffer(os.pread(self.tok_r.fileno(), n * size, a * size), dtype=self.dtype)
        mask = np.frombuffer(os.pread(self.mask_r.fileno(), n, a), dtype=np.uint8).copy()
        return ids, mask

    def release(self) -> None:
        for f in (getattr(self, "tok_r", None), getattr(self, "mask_r", None), self.tok_f, self.mask_f):
            if f is not None:
                f.close()

    def __len__(self) -> int:
        return len(self.offsets) - 1


def tokenize_to_scratch(records, tok, args, scratch: Scratch) -> str:
    """Tokenize every record into the scratch store; returns the format used."""
    fmt = None
    for n, rec in enumerate(records, 1):
        if fmt is None:
            args.format = fmt = detect_format(rec, args)
        ids, mask = record_tokens(rec, n, tok, args)
        if ids:
            scratch.add(ids, mask)
    return fmt or "text"


# ---------------------------------------------------------------------------- shards


class ShardWriter:
    """One split's token stream written to shards of at most `shard_windows` windows (+1 token: the
    last window's final label, repeated as the next shard's first token), buffered."""

    def __init__(self, out: Path, seq_len: int, dtype, shard_windows: int, with_mask: bool):
        self.out, self.seq_len, self.dtype, self.with_mask = out, seq_len, dtype, with_mask
        self.limit = shard_windows * seq_len + 1
        self.shards: list[int] = []  # tokens per closed shard
        self.count, self.trained = 0, 0  # tokens in the open shard; trained labels in all
        self.bufs: tuple[list, list, list] = ([], [], [])
        self.last: tuple[int, int] | None = None  # the last token and its mask (a roll repeats it)
        self.files = None

    def _open(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"part-{len(self.shards):05d}"
        self.files = [open(self.out / f"{name}.{ext}", "wb") for ext in ("bin", "mask", "starts")]
        self.count, self.base = 0, 0

    def _roll(self) -> None:
        self.close_shard()
        self._open()
        tok, m = self.last
        self.append(np.asarray([tok]), np.asarray([m], np.uint8), start=True)

    def append(self, ids: np.ndarray, mask: np.ndarray, start: bool) -> None:
        """Tokens at the end of the stream; `start`: they begin a sample (or a padding run)."""
        while len(ids):
            if self.files is None:
                self._open()
            elif self.count == self.limit:
                self._roll()
            take = min(len(ids), self.limit - self.count)
            if start:
                self.bufs[2].append(np.asarray([self.count], dtype="<i8"))
                start = False
            self.bufs[0].append(np.asarray(ids[:take], dtype=self.dtype))
            self.bufs[1].append(np.asarray(mask[:take], dtype=np.uint8))
            self.trained += int(np.count_nonzero(mask[:take]))
            self.count += take
            self.last = (int(ids[take - 1]), int(mask[take - 1]))
            ids, mask = ids[take:], mask[take:]
            if sum(len(b) for b in self.bufs[0]) >= BUFFER:
                self._flush()

    def _flush(self) -> None:
        for f, parts in zip(self.files, self.bufs):
            if parts:
                np.concatenate(parts).tofile(f)
            parts.clear()

    def close_shard(self) -> None:
        if self.files is None:
            return
        self._flush()
        for f in self.files:
            f.close()
        name = self.out / f"part-{len(self.shards):05d}"
        if not self.with_mask:
            name.with_suffix(".mask").unlink()
        self.shards.append(self.count)
        self.files = None

    def windows(self) -> int:
        return sum((n - 1) // self.seq_len for n in self.shards)


def pack_stream(store, order, w: ShardWriter) -> dict:
    """Pre-training: documents run on across window boundaries (nanoGPT / torchtitan); whole
    windows only, the tail cut."""
    total = sum(store.length(int(i)) for i in order)
    keep = (total - 1) // w.seq_len * w.seq_len + 1 if total > w.seq_len else 0
    left = keep
    for i in order:
        if left <= 0:
            break
        ids, m = store.doc(int(i))
        w.append(ids[:left], m[:left], start=True)
        left -= len(ids)
    return {"packing": "stream"}


def pack_whole(store, order, w: ShardWriter, pad: int) -> dict:
    """Instruction tuning: every sample whole inside one window (greedy, in the shuffled order, as
    torchtune's PackedDataset), the rest of the window padded with `pad` (no loss).

    The trainer reads window i as tokens [i * seq_len, (i + 1) * seq_len] (seq_len + 1 tokens: the
    last is the next window's first, used only as the last label), so each window holds seq_len
    tokens of its own and the first token of every window carries no loss: no label ever crosses
    into another window's sample. A sample longer than seq_len is cut to seq_len (its prompt
    first, as torchtune truncates); one whose trained tokens all fall past the cut is dropped.
    """
    seq, used, truncated, dropped, written = w.seq_len, 0, 0, 0, 0

    def close() -> None:
        nonlocal used, written
        if used:
            w.append(np.full(seq - used, pad), np.zeros(seq - used, np.uint8), start=True)
            written, used = written + seq, 0

    for i in order:
        ids, m = store.doc(int(i))
        if len(ids) > seq:
            ids, m = ids[:seq], m[:seq]
            truncated += 1
            if not m[1:].any():
                dropped += 1
                continue
        if used + len(ids) > seq:
            close()
        if used == 0:
            m[0] = 0  # the window's first token: the previous window's last label
        w.append(ids, m, start=True)
        used += len(ids)
    close()
    if written:
        w.append(np.asarray([pad]), np.zeros(1, np.uint8), start=False)  # the last window's last label
    untrained = 1 - w.trained / max(1, written + 1) if written else 0.0
    return {"packing": "whole", "truncated_samples": truncated, "dropped_samples": dropped,
            "untrained_token_fraction": round(untrained, 4)}


def write_split(store, order, out: Path, args, dtype, with_mask: bool, pad: int) -> tuple[int, dict]:
    """Pack the split's documents into its shards; returns the window count and what packing did."""
    w = ShardWriter(out, args.seq_len, dtype, args.shard_windows, with_mask)
    info = pack_whole(store, order, w, pad) if args.pack == "whole" else pack_stream(store, order, w)
    w.close_shard()
    return w.windows(), info


# ---------------------------------------------------------------------------- command line


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("inputs", nargs="*", help="JSONL, Parquet or text files")
    ap.add_argument("--tokenizer", required=True, help="local directory with the model's tokenizer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, required=True, help="train.yaml batch.seq_len")
    ap.add_argument("--format", choices=("text", "prompt-response", "chat"),
                    help="record format (default: chat when the first record has --messages-field, "
                         "prompt-response with --prompt-field, else text)")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--prompt-field", help="instruction data: the prompt (no loss on it)")
    ap.add_argument("--response-field", help="instruction data: the response (trained on)")
    ap.add_argument("--messages-field", default="messages", help="chat data: the list of turns")
    ap.add_argument("--chat-template", help="a Jinja file replacing the tokenizer's chat template")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="documents held out for validation")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed")
    ap.add_argument("--hf-dataset", help="NAME[:CONFIG] of a Hugging Face dataset (needs datasets)")
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--pack", choices=("whole", "stream"),
                    help="whole: each sample inside one window, padded (default for prompt-response and chat); "
                         "stream: documents run across windows (default for text)")
    ap.add_argument("--shard-windows", type=int, default=1 << 18, help="windows per output shard at most")
    args = ap.parse_args(argv)
    if bool(args.prompt_field) != bool(args.response_field):
        fail("--prompt-field and --response-field go together")
    if args.format == "prompt-response" and not args.prompt_field:
        fail("--format prompt-response needs --prompt-field and --response-field")
    if not args.inputs and not args.hf_dataset:
        fail("no input files (or --hf-dataset)")
    if args.seq_len < 1 or not 0 <= args.val_fraction < 1 or args.shard_windows < 1:
        fail("--seq-len and --shard-windows must be >= 1 and --val-fraction in [0, 1)")
    return args


def load_tokenizer(args):
    from transformers import AutoTokenizer

    if not Path(args.tokenizer).is_dir():
        fail(f"--tokenizer {args.tokenizer}: not a directory (the model's local files: nothing is downloaded)")
    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as exc:
        fail(f"--tokenizer {args.tokenizer}: no tokenizer there ({str(exc).splitlines()[0][:200]})")
    if tok.eos_token_id is None:
        fail("the tokenizer has no eos_token_id: windows could not be padded")
    if args.chat_template:
        path = Path(args.chat_template)
        if not path.is_file() or path.stat().st_size > 1 << 20:
            fail(f"--chat-template {path}: not a readable file under 1 MiB")
        tok.chat_template = path.read_text()
    return tok


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tok = load_tokenizer(args)
    vocab = len(tok)
    dtype = np.dtype("<u2") if vocab <= 2**16 else np.dtype("<u4")
    out = Path(args.out)
    scratch = Scratch(out / ".scratch", dtype)
    try:
        fmt = tokenize_to_scratch(read_records(args.inputs, args.hf_dataset, args.hf_split), tok, args, scratch)
        scratch.close()
        n = len(scratch)
        if not n:
            fail("no documents in the inputs")
        order = np.random.default_rng(args.seed).permutation(n).astype(np.uint32)
        n_val = int(round(n * args.val_fraction)) if args.val_fraction else 0
        args.pack = args.pack or ("stream" if fmt == "text" else "whole")
        masked = scratch.any_masked or args.pack == "whole"
        store, eos = scratch, tok.eos_token_id
        for split in ("train", "val"):
            shutil.rmtree(out / split, ignore_errors=True)  # no shard of an earlier run left beside these
        train, info = write_split(store, order[n_val:], out / "train", args, dtype, masked, eos)
        val = write_split(store, order[:n_val], out / "val", args, dtype, masked, eos)[0] if n_val else 0
    finally:
        scratch.release()
        shutil.rmtree(out / ".scratch", ignore_errors=True)
    if train == 0:
        fail(f"fewer than seq_len + 1 = {args.seq_len + 1} training tokens")
    total = scratch.offsets[-1]
    meta = {"vocab_size": vocab, "dtype": dtype.name, "eos_token_id": eos, "seq_len": args.seq_len, "format": fmt,
            "documents": n, "document_tokens": total, "mean_document_tokens": round(total / n, 1),
            "validation_documents": n_val, "train_samples": train, "val_samples": val, "loss_mask": masked,
            "boundaries": "starts", "tokenizer": str(args.tokenizer), **info}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"prepare_data.py: {n} {fmt} documents -> {train} train + {val} validation samples of "
          f"{args.seq_len} tokens in {out} ({dtype.name})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit as exc:
        if isinstance(exc.code, str):  # fail(): bad input, one line and exit status 2
            print(exc.code, file=sys.stderr)
            sys.exit(2)
        raise
