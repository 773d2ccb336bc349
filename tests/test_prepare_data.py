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
    assert meta["document_tokens"] == 20 * 10 and meta["mean_document_tokens"] == 10.0  # 9 words + EOS
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A word-level tokenizer whose EOS is its end-of-turn token (as Qwen's <|im_end|>), with a
    ChatML-like chat template, saved as transformers loads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = [" ".join(["system", "user", "assistant"] + [f"w{i}" for i in range(30)])]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=special))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHATML
    path = tmp_path_factory.mktemp("chat-tok")
    fast.save_pretrained(path)
    return path


def conversation(turns: int, rng) -> list[dict]:
    words = lambda: " ".join(f"w{i}" for i in rng.integers(0, 30, rng.integers(1, 5)))  # noqa: E731
    msgs = [{"role": "system", "content": words()}]
    for _ in range(turns):
        msgs += [{"role": "user", "content": words()}, {"role": "assistant", "content": words()}]
    return msgs


def test_chat_records_train_on_assistant_turns_and_stay_whole(prep, chat_tokenizer, tmp_path):
    """Multi-turn `messages` through the tokenizer's own chat template: only the assistant turns
    (their words and end-of-turn token) carry a loss; each conversation, EOS tokens inside it, is one
    sample in the recorded starts, and the trainer gives it one document (positions run on past EOS)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_data
        from train_config import DataSection
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rng = np.random.default_rng(1)
    convs = [conversation(int(rng.integers(1, 4)), rng) for _ in range(30)]
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    out = tmp_path / "out"
    assert prep.main(["--tokenizer", str(chat_tokenizer), "--seq-len", "64", "--val-fraction", "0", "--out", str(out),
                      str(jsonl)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["format"] == "chat" and meta["packing"] == "whole" and meta["truncated_samples"] == 0
    tok = AutoTokenizer.from_pretrained(chat_tokenizer)
    ids, mask = read(out, "train", "bin", "<u2"), read(out, "train", "mask", np.uint8)
    starts = read(out, "train", "starts", "<i8")
    eos, im_start = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_start|>")
    samples = [ids[a:b] for a, b in zip(starts, list(starts[1:]) + [len(ids)]) if ids[a] == im_start]
    assert len(samples) == 30  # every conversation one sample, however many EOS it holds
    assert all((s == eos).sum() >= 3 for s in samples)
    # trained: assistant words and their end-of-turn; never a role word or a user/system word
    want = set()
    for c in convs:
        for m in c:
            if m["role"] == "assistant":
                want |= set(tok.convert_tokens_to_ids(m["content"].split()))
    trained = ids[mask == 1]
    assert set(trained.tolist()) <= want | {eos} and eos in trained
    role_ids = tok.convert_tokens_to_ids(["system", "user", "assistant", "<|im_start|>"])
    assert not np.isin(trained, role_ids).any()
    first = next(c for c in convs if c[0]["role"] == "system")
    text_ids = tok(tok.apply_chat_template(first, tokenize=False), add_special_tokens=False)["input_ids"]
    assert any(list(s) == text_ids for s in samples)  # the template's own rendering, unchanged
    # the trainer: one document per conversation (positions never restart at an inner EOS)
    windows = train_data.TokenWindows(DataSection(path=str(out)), 64, len(tok), 0)
    batch = windows.micro_batch(0, 1)
    docs, inputs = batch.documents[0], batch.inputs[0]
    inner_eos = [j for j in range(1, 64) if inputs[j - 1] == eos and inputs[j] != im_start and docs[j] == docs[j - 1]]
    assert inner_eos, "no EOS inside a conversation in this window"
    assert all(int(batch.positions[0, j]) > 0 for j in inner_eos)


def test_shards_roll_over_and_keep_the_windows(prep, tokenizer, tmp_path):
    """--shard-windows: several shards, each a whole number of windows plus the last label, holding
    the single shard's windows in order; sample starts recorded per shard from 0."""
    jsonl = tmp_path / "pairs.jsonl"
    rng = np.random.default_rng(2)
    jsonl.write_text("".join(json.dumps({"q": " ".join(f"w{i}" for i in rng.integers(0, 30, 3)),
                                         "a": " ".join(f"w{i}" for i in rng.integers(0, 30, 4))}) + "\n"
                             for _ in range(60)))
    common = ["--tokenizer", str(tokenizer), "--seq-len", "16", "--val-fraction", "0", "--prompt-field", "q",
              "--response-field", "a", str(jsonl)]
    prep.main([*common, "--out", str(tmp_path / "one")])
    prep.main([*common, "--out", str(tmp_path / "many"), "--shard-windows", "3"])
    one = read(tmp_path / "one", "train", "bin", "<u2")
    shards = sorted((tmp_path / "many" / "train").glob("*.bin"))
    assert len(shards) > 2
    windows = []
    for f in shards:
        t = np.fromfile(f, dtype="<u2")
        starts = np.fromfile(f.with_suffix(".starts"), dtype="<i8")
        assert (len(t) - 1) % 16 == 0 and (len(t) - 1) // 16 <= 3
        assert starts[0] == 0 and (np.diff(starts) > 0).all() and starts[-1] < len(t)
        assert len(np.fromfile(f.with_suffix(".mask"), dtype=np.uint8)) == len(t)
        windows += [t[i * 16:(i + 1) * 16 + 1] for i in range((len(t) - 1) // 16)]
    assert np.array_equal(np.concatenate([w[:-1] for w in windows] + [windows[-1][-1:]]), one)
    meta = json.loads((tmp_path / "many" / "meta.json").read_text())
    assert meta["train_samples"] == len(windows) == (len(one) - 1) // 16


def test_chat_needs_a_template_and_takes_one_from_a_file(prep, tokenizer, tmp_path):
    """`messages` records with a tokenizer that has no chat template: one line; --chat-template FILE
    gives it one (the tokenizer directory is left as it is)."""
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "w1 w2"},
                                                      {"role": "assistant", "content": "w3 w4"}]}) + "\n"
                             for _ in range(6)))
    args = ["--tokenizer", str(tokenizer), "--seq-len", "8", "--val-fraction", "0", str(jsonl)]
    with pytest.raises(SystemExit, match="no chat template"):
        prep.main([*args, "--out", str(tmp_path / "o")])
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% if m['role'] == 'assistant' %}</s> {% endif %}"
                        "{% endfor %}")
    assert prep.main([*args, "--chat-template", str(template), "--out", str(tmp_path / "o")]) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids, mask = read(tmp_path / "o", "train", "bin", "<u2"), read(tmp_path / "o", "train", "mask", np.uint8)
    assert set(ids[mask == 1].tolist()) == set(tok.convert_tokens_to_ids(["w3", "w4", "</s>"]))
    assert not getattr(tok, "chat_template", None)


@pytest.mark.slow
def test_command_line_bad_input_exits_2_with_one_line(tmp_path):
    import subprocess

    res = subprocess.run([sys.executable, str(SCRIPT), "--tokenizer", str(tmp_path / "none"), "--seq-len", "4",
                          "--out", str(tmp_path / "o"), str(tmp_path / "x.jsonl")], capture_output=True, text=True)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [f"prepare_data.py: --tokenizer {tmp_path / 'none'}: not a directory "
                                               "(the model's local files: nothing is downloaded)"]
