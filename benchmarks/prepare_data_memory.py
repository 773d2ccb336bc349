#!/usr/bin/env python3
"""Peak memory of launch/prepare_data.py as the token count grows (it must not: it grows with the
document count only, 12 bytes a document, plus fixed buffers).

    python benchmarks/prepare_data_memory.py [--tokens 1e6,4e6,16e6] [--doc-words 200] [--json]

For each size: a JSONL corpus of documents of --doc-words words from a word-level tokenizer built
here (no download), tokenized by prepare_data.py in a fresh process; prints its peak resident set
(ru_maxrss of the child), the bytes per token of that peak above the 1st row's, and the design's
bound for the document count. A process that held every token in Python lists (about 100 bytes a
token with the mask) would add ~100 MB per million tokens; this one adds only its documents' 12 bytes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "templates" / "launch" / "prepare_data.py"

CHILD = """
import resource, runpy, sys
sys.argv = ["prepare_data.py", *sys.argv[1:]]
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exc:
    if exc.code not in (0, None):
        raise
print("MAXRSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def tokenizer(path: Path, vocab: int = 5000) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(f"w{i}" for i in range(vocab))],
                            trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


def corpus(path: Path, tokens: int, words: int, seed: int = 0) -> int:
    """Documents of `words` words (the tokenizer adds EOS: words + 1 tokens each), `tokens` in all."""
    import numpy as np

    rng = np.random.default_rng(seed)
    docs = max(1, tokens // (words + 1))
    with path.open("w") as f:
        for _ in range(docs):
            f.write(json.dumps({"text": " ".join(f"w{i}" for i in rng.integers(0, 5000, words))}) + "\n")
    return docs


def measure(tok: Path, data: Path, out: Path) -> int:
    """Peak RSS in bytes of prepare_data.py run in a fresh interpreter."""
    res = subprocess.run([sys.executable, "-c", CHILD.format(script=str(SCRIPT)), "--tokenizer", str(tok),
                          "--seq-len", "2048", "--val-fraction", "0.01", "--out", str(out), str(data)],
                         capture_output=True, text=True, check=True)
    kb = next(int(line.split()[1]) for line in res.stdout.splitlines() if line.startswith("MAXRSS_KB"))
    return kb * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1e6,4e6,16e6", help="comma-separated corpus sizes in tokens")
    ap.add_argument("--doc-words", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sizes = [int(float(x)) for x in args.tokens.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = tokenizer(tmp / "tok")
        for n in sizes:
            data = tmp / f"corpus-{n}.jsonl"
            docs = corpus(data, n, args.doc_words)
            peak = measure(tok, data, tmp / f"out-{n}")
            rows.append({"tokens": n, "documents": docs, "peak_rss_bytes": peak, "bound_doc_bytes": 12 * docs})
            data.unlink()
    base = rows[0]
    for r in rows:
        extra = r["peak_rss_bytes"] - base["peak_rss_bytes"]
        r["extra_bytes_per_token"] = round(extra / max(1, r["tokens"] - base["tokens"]), 3) if r is not base else 0.0
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'tokens':>12} {'documents':>10} {'peak RSS MiB':>13} {'+B/token vs 1st':>16} {'12 B/doc MiB':>13}")
    for r in rows:
        print(f"{r['tokens']:>12,} {r['documents']:>10,} {r['peak_rss_bytes'] / 2**20:>13.1f} "
              f"{r['extra_bytes_per_token']:>16.3f} {r['bound_doc_bytes'] / 2**20:>13.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
