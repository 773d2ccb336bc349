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
