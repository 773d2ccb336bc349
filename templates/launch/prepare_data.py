#!/usr/bin/env python3
"""Tokenize local text data into the shards launch/train.py reads (data.path).

    python prepare_data.py --tokenizer /models/llama-3.1-8b --seq-len 4096 --out /shared/data/run1 corpus/*.jsonl
    python prepare_data.py --tokenizer DIR --prompt-field prompt --response-field response --out DIR chat.jsonl
    python prepare_data.py --tokenizer DIR --hf-dataset wikitext:wikitext-2-raw-v1 --out DIR   # needs `datasets`

Inputs: JSONL (one object per line, `--text-field`, default "text"), Parquet (same fields, needs
pyarrow), plain text (one document per file), or a Hugging Face dataset. Each document is
tokenized with the model's tokenizer (a local directory: no download), followed by EOS;
documents are shuffled, then packed per split:
  --pack stream (default for text): documents run on across window boundaries, as
      nanoGPT/torchtitan pack for pre-training, cut at a multiple of seq_len (+1 for the label);
  --pack whole (default for instruction data): every sample whole inside one window, windows
      padded with EOS (no loss), as torchtune packs SFT data; no window starts inside a sample.
The trainer restarts position ids after every EOS and keeps attention inside each document.

Instruction data (`--prompt-field` + `--response-field`): prompt tokens get mask 0 (no loss),
response tokens and the EOS mask 1; the mask is a uint8 file beside each token file.

Output: <out>/meta.json, <out>/train/part-00000.bin [+ .mask], <out>/val/part-00000.bin [+ .mask]
(little-endian uint16 when the vocabulary fits, else uint32).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np


def fail(msg: str) -> None:
    raise SystemExit(f"prepare_data.py: {msg}")


def read_records(paths: list[str], hf_dataset: str | None, split: str):
    """Yield dict records (JSONL/Parquet/HF) or {"text": ...} for plain-text files."""
    if hf_dataset:
        try:
            import datasets
        except ImportError:
            fail("--hf-dataset needs the `datasets` package (pip install datasets)")
        name, _, config = hf_dataset.partition(":")
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
            yield from pq.read_table(path).to_pylist()
        else:
            yield {"text": path.read_text()}


def tokenize(records, tok, args) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) per document, EOS appended."""
    eos = tok.eos_token_id
    if eos is None:
        fail("the tokenizer has no eos_token_id: documents could not be separated")
    docs = []
    for n, rec in enumerate(records, 1):
        if args.prompt_field:
            try:
                prompt, response = rec[args.prompt_field], rec[args.response_field]
            except KeyError as exc:
                fail(f"record {n} has no field {exc.args[0]!r}")
            p = tok(str(prompt), add_special_tokens=True)["input_ids"]
            r = tok(str(response), add_special_tokens=False)["input_ids"] + [eos]
            docs.append((p + r, [0] * len(p) + [1] * len(r)))
        else:
            if args.text_field not in rec:
                fail(f"record {n} has no field {args.text_field!r} (use --text-field)")
            ids = tok(str(rec[args.text_field]), add_special_tokens=True)["input_ids"] + [eos]
            docs.append((ids, [1] * len(ids)))
    return docs


def pack_stream(docs, seq_len: int) -> tuple[list[int], list[int], dict]:
    """Pre-training: documents run on across window boundaries (nanoGPT / torchtitan); whole
    windows only, the tail is cut."""
    ids = [t for d in docs for t in d[0]]
    mask = [m for d in docs for m in d[1]]
    samples = (len(ids) - 1) // seq_len if ids else 0
    keep = samples * seq_len + 1 if samples else 0
    return ids[:keep], mask[:keep], {"packing": "stream"}


def pack_whole(docs, seq_len: int, pad: int) -> tuple[list[int], list[int], dict]:
    """Instruction tuning: every sample whole inside one window (greedy, in the shuffled order, as
    torchtune's PackedDataset), the rest of the window padded with `pad` (no loss).

    The trainer reads window i as tokens [i * seq_len, (i + 1) * seq_len] (seq_len + 1 tokens: the
    last is the next window's first, used only as the last label), so each window holds seq_len
    tokens of its own and the first token of every window carries no loss: no label ever crosses
    into another window's sample. A sample longer than seq_len is cut to seq_len (its prompt
    first, as torchtune truncates); one whose prompt alone fills the window is dropped.
    """
    ids: list[int] = []
    mask: list[int] = []
    used, truncated, dropped, windows = 0, 0, 0, 0

    def close() -> None:
        nonlocal used, windows
        if used:
            ids.extend([pad] * (seq_len - used))
            mask.extend([0] * (seq_len - used))
            mask[windows * seq_len] = 0  # the window's first token: the previous window's last label
            windows += 1
            used = 0

    for toks, m in docs:
        if len(toks) > seq_len:
            toks, m = toks[:seq_len], m[:seq_len]
            truncated += 1
            if not any(m[1:]):
                dropped += 1
                continue
        if used + len(toks) > seq_len:
            close()
        ids.extend(toks)
        mask.extend(m)
        used += len(toks)
    close()
    if windows:
        ids.append(pad)  # the last window's last label
        mask.append(0)
    padding = sum(1 for x in mask if x == 0)
    return ids, mask, {"packing": "whole", "truncated_samples": truncated, "dropped_samples": dropped,
                       "untrained_token_fraction": round(padding / max(1, len(mask)), 4)}


def write_split(docs, out: Path, seq_len: int, dtype, with_mask: bool, pack: str, pad: int) -> tuple[int, dict]:
    """Pack the documents and write them; returns the window count and what packing did."""
    ids, mask, info = pack_whole(docs, seq_len, pad) if pack == "whole" else pack_stream(docs, seq_len)
    samples = (len(ids) - 1) // seq_len if ids else 0
    if samples < 1:
        return 0, info
    out.mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype=dtype).tofile(out / "part-00000.bin")
    if with_mask:
        np.asarray(mask, dtype=np.uint8).tofile(out / "part-00000.mask")
    return samples, info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("inputs", nargs="*", help="JSONL, Parquet or text files")
    ap.add_argument("--tokenizer", required=True, help="local directory with the model's tokenizer")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-len", type=int, required=True, help="train.yaml batch.seq_len")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--prompt-field", help="instruction data: the prompt (no loss on it)")
    ap.add_argument("--response-field", help="instruction data: the response (trained on)")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="documents held out for validation")
    ap.add_argument("--seed", type=int, default=0, help="shuffle seed")
    ap.add_argument("--hf-dataset", help="NAME[:CONFIG] of a Hugging Face dataset (needs datasets)")
    ap.add_argument("--hf-split", default="train")
    ap.add_argument("--pack", choices=("whole", "stream"),
                    help="whole: each sample inside one window, padded (default with --prompt-field); "
                         "stream: documents run across windows (default for text)")
    args = ap.parse_args(argv)
    if bool(args.prompt_field) != bool(args.response_field):
        fail("--prompt-field and --response-field go together")
    if not args.inputs and not args.hf_dataset:
        fail("no input files (or --hf-dataset)")
    if args.seq_len < 1 or not 0 <= args.val_fraction < 1:
        fail("--seq-len must be >= 1 and --val-fraction in [0, 1)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    docs = tokenize(read_records(args.inputs, args.hf_dataset, args.hf_split), tok, args)
    if not docs:
        fail("no documents in the inputs")
    random.Random(args.seed).shuffle(docs)
    n_val = int(round(len(docs) * args.val_fraction)) if args.val_fraction else 0
    vocab = len(tok)
    dtype = np.dtype("<u2") if vocab <= 2**16 else np.dtype("<u4")
    pack = args.pack or ("whole" if args.prompt_field else "stream")
    out, masked = Path(args.out), bool(args.prompt_field) or pack == "whole"
    eos = tok.eos_token_id
    train, info = write_split(docs[n_val:], out / "train", args.seq_len, dtype, masked, pack, eos)
    val = write_split(docs[:n_val], out / "val", args.seq_len, dtype, masked, pack, eos)[0] if n_val else 0
    if train == 0:
        fail(f"fewer than seq_len + 1 = {args.seq_len + 1} training tokens")
    meta = {"vocab_size": vocab, "dtype": dtype.name, "eos_token_id": tok.eos_token_id, "seq_len": args.seq_len,
            "documents": len(docs), "validation_documents": n_val, "train_samples": train, "val_samples": val,
            "loss_mask": masked, "tokenizer": str(args.tokenizer), **info}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"prepare_data.py: {len(docs)} documents -> {train} train + {val} validation samples of "
          f"{args.seq_len} tokens in {out} ({dtype.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
