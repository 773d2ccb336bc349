"""gpuprov.sizing.allocator's rules and benchmarks/allocator_replay.py: the estimate's idle cache under them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from gpuprov.sizing.allocator import CachingAllocator

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20


def _replay():
    spec = importlib.util.spec_from_file_location("allocator_replay", REPO / "benchmarks" / "allocator_replay.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["allocator_replay"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_best_fit_split_and_merge_within_a_segment() -> None:
    A = CachingAllocator()
    big, small = A.malloc(400 * MiB), A.malloc(160 * MiB)
    A.free(big)
    A.free(small)
    assert A.reserved == 560 * MiB and A.idle == 560 * MiB
    x = A.malloc(150 * MiB)  # best fit: the 160 MiB block, not the 400
    assert A.reserved == 560 * MiB and x[0] == 150 * MiB  # a block is [size, free, segment index]
    assert [b[0] for b in A.segments[x[2]]] == [150 * MiB, 10 * MiB]  # split: 10 MiB left
    y = A.malloc(300 * MiB)  # carved from the 400 MiB segment
    assert [b[0] for b in A.segments[y[2]]] == [300 * MiB, 100 * MiB]
    A.free(y)
    assert [b[0] for b in A.segments[y[2]]] == [400 * MiB]  # the pieces merged back
    z = A.malloc(500 * MiB)  # two free segments of 400 and 10 MiB do not merge: a new one
    assert A.reserved == 1060 * MiB and z is not None
    assert A.malloc(MiB) is None  # small pool, left out


def test_the_estimate_reads_the_replayed_idle_cache_and_the_closed_form_stays_below_it() -> None:
    """For the traced stack (fsdp_qlora: transformers 4.38 Llama, peft LoRA, legacy loss) the estimator's
    allocator term at the start of backward is the replay's idle cache; the closed form used elsewhere is a floor."""
    mod = _replay()
    from gpuprov.catalog.models import get_model

    for name in ("7B LoRA bs6", "Yi-34B QLoRA bs4", "Mistral 7B QLoRA bs12"):
        shape = next(s for s in mod.SHAPES if s.name == name)
        arch = get_model(shape.model)
        live, reserved = mod.replay(arch, shape)
        assert 0 < live < reserved
        assert mod.floor_term(arch, shape) < reserved - live
        assert mod.analytic_term(arch, shape) == reserved - live
        # the loss' fp32 buffers and every saved input are live at that moment
        T, h, V = shape.batch * shape.seq, arch.hidden_size, arch.vocab_size
        assert live >= 4 * T * V * 4 + arch.num_layers * T * h * 2
