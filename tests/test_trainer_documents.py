"""Packed instruction data trains the same objective in every layout.

Samples of different lengths packed whole into 32-token windows (prepare_data.py's layout: tokens,
loss mask and the recorded sample starts), one sample holding the EOS id inside it. One process,
TP 2, PP 2, CP 2 and TP 2 x CP 2 log the same losses over 6 steps, and step 1's loss is the token mean of the
base model scoring every sample on its own (plain transformers, no packing), which a window-long
causal sequence misses by far more than the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_trainer import finish, free_port, losses, runs, save_tiny_base, start
from test_trainer_layouts import render

pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("torch")
pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

GLOBAL_BATCH, SEQ, STEPS, EOS = 8, 32, 6, 2  # STEPS: what test_trainer_layouts.render plans


def packed_data(root: Path) -> tuple[Path, list[list[tuple[list[int], list[int]]]]]:
    """Windows of whole samples (prompt without loss, then response), padded with EOS; returns the
    directory and every window's samples (tokens, loss mask)."""
    rng = np.random.default_rng(11)
    tokens, mask, starts, windows = [], [], [], []
    for w in range(GLOBAL_BATCH * STEPS):
        used, samples = 0, []
        while True:
            n = int(rng.integers(4, 14))
            if used + n > SEQ:
                break
            ids = rng.integers(3, 512, n).tolist()
            if w == 0 and not samples:
                ids[n // 2] = EOS  # a chat template's EOS inside a sample: it must stay one document
            prompt = int(rng.integers(1, n - 1))
            m = [0] * prompt + [1] * (n - prompt)
            starts.append(len(tokens))
            tokens += ids
            mask += m
            samples.append((ids, m))
            used += n
        starts.append(len(tokens))  # the padding: a run of its own
        tokens += [EOS] * (SEQ - used)
        mask += [0] * (SEQ - used)
        mask[w * SEQ] = 0  # a window's first token is no label of the window before
        windows.append(samples)
    tokens.append(EOS)
    mask.append(0)
    (root / "train").mkdir(parents=True)
    np.asarray(tokens, dtype="<u2").tofile(root / "train" / "part-00000.bin")
    np.asarray(mask, dtype=np.uint8).tofile(root / "train" / "part-00000.mask")
    np.asarray(starts, dtype="<i8").tofile(root / "train" / "part-00000.starts")
    (root / "meta.json").write_text(json.dumps({"dtype": "uint16", "eos_token_id": EOS, "loss_mask": True}))
    return root, windows


LAYOUTS = {
    "1 process": dict(gpus=1, sharding="fsdp", micro=2, accum=4),
    "TP 2": dict(gpus=2, sharding="fsdp", micro=2, accum=4, tp=2),
    "PP 2": dict(gpus=2, sharding="fsdp", micro=2, accum=4, pp=2),
    "CP 2": dict(gpus=2, sharding="fsdp", micro=2, accum=4, cp=2),
    "TP 2 x CP 2": dict(gpus=4, sharding="fsdp", micro=2, accum=4, tp=2, cp=2),  # a mix: TP inside CP's chunks
}


def run_layout(root: Path, base: Path, data: Path, layout: dict) -> dict[int, float]:
    launch = render(root, **layout)
    args = ("--set", f"data.path={data}", "--set", "model.init=pretrained", "--set", f"model.pretrained_path={base}",
            "--set", "precision.param_dtype=float32", "--set", "precision.reduce_dtype=float32",
            "--set", "export.at_end=false")
    out = finish(start(launch, *args, port=free_port()))
    (run,) = runs(launch)
    assert run[0]["document_attention"] is True, out[-2000:]
    return losses(run)


def sample_losses(base: Path, windows) -> tuple[float, float]:
    """Step 1 by plain transformers: every sample of the first global batch scored on its own (token
    mean over the trained tokens), and the same windows as one causal sequence each."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for samples in windows[:GLOBAL_BATCH]:
            for ids, m in samples:
                logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
                labels = torch.tensor(ids[1:]).masked_fill(~torch.tensor(m[1:]).bool(), -100)
                total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
                count += sum(m[1:])
        crossed = 0.0
        for samples in windows[:GLOBAL_BATCH]:
            ids = [t for s in samples for t in s[0]]
            m = [x for s in samples for x in s[1]]
            m[0] = 0
            logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0]
            labels = torch.tensor(ids[1:]).masked_fill(~torch.tensor(m[1:]).bool(), -100)
            crossed += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
    return total / count, crossed / count


def test_packed_samples_train_the_same_objective_under_tp_pp_and_cp(tmp_path):
    base = save_tiny_base(tmp_path / "base")
    data, windows = packed_data(tmp_path / "data")
    results = {name: run_layout(tmp_path / f"l{i}", base, data, layout) for i, (name, layout) in enumerate(LAYOUTS.items())}
    ref = results["1 process"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    alone, crossed = sample_losses(base, windows)
    assert ref[1] == pytest.approx(alone, rel=1e-5)
    assert abs(crossed - alone) > 1e-4 * alone  # 10x the tolerance: document attention is what is tested
    wrong = {(name, step): (got.get(step), ref[step]) for name, got in results.items() for step in ref
             if got.get(step) != pytest.approx(ref[step], rel=1e-5, abs=1e-6)}
    assert not wrong, wrong
