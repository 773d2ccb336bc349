"""launch/prepare_data.py on small local files with a tokenizer built here (no download)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

SCRIPT = Path(__file__).resolve().parent.parent / "templates" / "launch" / "prepare_data.py"


@pytest.fixture(scope="module")
def prep():
    spec = importlib.util.spec_from_file_location("prepare_data_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from test_trainer import tiny_tokenizer

    words = [f"w{i}" for i in range(30)]
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"), [" ".join(words)] * 3)


def read(out: Path, split: str, name: str, dtype) -> np.ndarray:
    return np.fromfile(out / split / f"part-00000.{name}", dtype=dtype)


def test_text_files_are_documents_separated_by_eos_and_packed(prep, tokenizer, tmp_path):
    docs = []
    for i in range(20):
        (tmp_path / f"doc{i}.txt").write_text(" ".join(f"w{(i + j) % 30}" for j in range(9)))
        docs.append(tmp_path / f"doc{i}.txt")
    out = tmp_path / "out"
    assert prep.main(["--tokenizer", str(tokenizer), "--seq-len", "16", "--val-fraction", "0.2", "--out", str(out),
                      *map(str, docs)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["documents"] == 20 and meta["validation_documents"] == 4 and not meta["loss_mask"]
    train = read(out, "train", "bin", "<u2")
    assert (len(train) - 1) % 16 == 0 and meta["train_samples"] == (len(train) - 1) // 16
    eos = meta["eos_token_id"]
    # 16 documents of 9 words + EOS each, packed; whole windows only (the tail is cut)
    assert len(train) <= 16 * 10 and (train == eos).sum() >= (len(train) // 10) - 1
    assert not (out / "train" / "part-00000.mask").exists()
    # shuffled: another shuffle seed packs the documents in another order
    again = tmp_path / "again"
    prep.main(["--tokenizer", str(tokenizer), "--seq-len", "16", "--seed", "1", "--out", str(again), *map(str, docs)])
    assert not np.array_equal(read(again, "train", "bin", "<u2")[:30], train[:30])


def test_instruction_jsonl_masks_prompts(prep, tokenizer, tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"q": "w1 w2 w3", "a": "w4 w5"}) + "\n" for _ in range(10)))
    out = tmp_path / "out"
    prep.main(["--tokenizer", str(tokenizer), "--seq-len", "8", "--val-fraction", "0", "--prompt-field", "q",
               "--response-field", "a", "--out", str(out), str(jsonl)])
    ids, mask = read(out, "train", "bin", "<u2"), read(out, "train", "mask", np.uint8)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    w4, w5 = tok.convert_tokens_to_ids(["w4", "w5"])
    assert set(ids[mask == 1].tolist()) == {w4, w5, tok.eos_token_id}  # only responses and EOS are trained on
    assert not (out / "val").exists()


def test_bad_input_is_one_line(prep, tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w1"}\nnot json\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2: not JSON"):
        prep.main(["--tokenizer", str(tokenizer), "--seq-len", "4", "--out", str(tmp_path / "o"), str(bad)])
    with pytest.raises(SystemExit, match="no field 'body'"):
        prep.main(["--tokenizer", str(tokenizer), "--seq-len", "4", "--text-field", "body", "--out",
                   str(tmp_path / "o"), str(bad)])
    with pytest.raises(SystemExit, match="go together"):
        prep.main(["--tokenizer", str(tokenizer), "--seq-len", "4", "--prompt-field", "q", "--out", "x", str(bad)])


def windows_lacking_their_prompt(ids, mask, seq_len: int, prompt_start: int, eos: int) -> int:
    """Windows as the trainer reads them (seq_len + 1 tokens, labels = tokens[1:]) in which some
    trained label has no prompt start before it inside its own document in that window."""
    bad = 0
    for w in range((len(ids) - 1) // seq_len):
        toks, keep = ids[w * seq_len: w * seq_len + seq_len + 1], mask[w * seq_len: w * seq_len + seq_len + 1]
        has_prompt = False
        for j in range(seq_len):  # input j predicts label j + 1
            has_prompt = (toks[j] == prompt_start) or (has_prompt and toks[j] != eos)
            if keep[j + 1] and not has_prompt:
                bad += 1
                break
    return bad


def test_instruction_samples_stay_whole_in_their_windows(prep, tokenizer, tmp_path):
    """Samples of many lengths (some longer than a window): packed whole, no window starts inside a
    response whose prompt it lacks; stream packing of the same data does (the check can fail)."""
    from transformers import AutoTokenizer

    rng = np.random.default_rng(0)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"q": "w0 " + " ".join(f"w{i}" for i in rng.integers(1, 29, rng.integers(1, 9))),
                                         "a": " ".join(f"w{i}" for i in rng.integers(1, 29, rng.integers(1, 12)))}) + "\n"
                             for _ in range(200)))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    start, eos = tok.convert_tokens_to_ids("w0"), tok.eos_token_id
    found = {}
    for pack in ("whole", "stream"):
        out = tmp_path / pack
        assert prep.main(["--tokenizer", str(tokenizer), "--seq-len", "16", "--val-fraction", "0", "--prompt-field", "q",
                          "--response-field", "a", "--pack", pack, "--out", str(out), str(jsonl)]) == 0
        ids, mask = read(out, "train", "bin", "<u2"), read(out, "train", "mask", np.uint8)
        assert len(ids) == len(mask) and (len(ids) - 1) % 16 == 0
        found[pack] = windows_lacking_their_prompt(ids.tolist(), mask.tolist(), 16, start, eos)
        meta = json.loads((out / "meta.json").read_text())
        assert meta["packing"] == pack
    assert found["whole"] == 0 and found["stream"] > 10, found
    whole = json.loads((tmp_path / "whole" / "meta.json").read_text())
    assert whole["truncated_samples"] > 0 and 0 < whole["untrained_token_fraction"] < 1
    ids, mask = read(tmp_path / "whole", "train", "bin", "<u2"), read(tmp_path / "whole", "train", "mask", np.uint8)
    # every window's first token is a prompt start or padding, and carries no loss
    firsts = ids[:-1:16]
    assert set(firsts.tolist()) <= {start, eos} and not mask[:-1:16].any()
    # every response token is still trained on (none lost to the packing), bar truncated ones
    assert mask.sum() > 0.5 * sum(1 for line in jsonl.read_text().splitlines()
                                  for _ in json.loads(line)["a"].split())
