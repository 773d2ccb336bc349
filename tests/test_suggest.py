"""What would make it fit (gpuprov.sizing.suggest): smallest changes, ranked by cost, each really fitting."""

from __future__ import annotations

from gpuprov.catalog.gpus import get_gpu
from gpuprov.catalog.models import get_model
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.suggest import candidate_changes, suggest
from gpuprov.sizing.types import TrainSetup

L8B = get_model("llama-3.1-8b")


def test_suggestions_fit_are_minimal_own_gpus_first_and_ranked_by_gpu_seconds_per_token() -> None:
    gpu = get_gpu("h100-80gb")
    s = TrainSetup(gpus=8, sharding="fsdp", seq_len=8192, micro_batch=4, activation_checkpointing="none")
    assert estimate_memory(L8B, s).per_gpu_bytes > gpu.memory_bytes
    found = suggest(L8B, gpu, s, estimate_memory, gpu.memory_bytes, limit=50)
    assert found
    # the list is shown "cheapest first": sorted by GPU-seconds per token
    costs = [x.gpu_seconds_per_token for x in found]
    assert costs == sorted(costs)
    # what is kept when the list is cut: what fits the user's 8 GPUs before what needs more GPUs
    for limit in (1, 2, 3):
        kept = suggest(L8B, gpu, s, estimate_memory, gpu.memory_bytes, limit=limit)
        own = [x for x in found if not any(c.kind == "gpus" for c in x.changes)]
        assert [x.gpu_seconds_per_token for x in kept] == sorted(x.gpu_seconds_per_token for x in kept)
        assert sorted(x.gpu_seconds_per_token for x in kept) == sorted(x.gpu_seconds_per_token for x in own[:limit]) \
            or len(own) < limit
    for x in found:
        assert estimate_memory(L8B, x.setup).per_gpu_bytes == x.per_gpu_bytes <= gpu.memory_bytes
        kinds = {c.kind: c.step for c in x.changes}
        for other in found:  # nothing listed is a larger version of another listed change
            o = {c.kind: c.step for c in other.changes}
            if other is not x and set(o) <= set(kinds):
                assert not all(o[k] <= kinds[k] for k in o), (x.summary, other.summary)
    # a smaller micro-batch keeps the global batch
    for x in found:
        if any(c.kind == "micro_batch" for c in x.changes):
            assert x.setup.micro_batch * x.setup.grad_accumulation_steps == 4


def test_offload_and_lora_changes_say_what_they_need() -> None:
    gpu = get_gpu("rtx-4090-24gb")
    s = TrainSetup(task="lora", gpus=1, sharding="none", seq_len=2048, activation_checkpointing="full")
    kinds = {c.kind for c in candidate_changes(s)}
    assert {"task", "offload", "optimizer", "gpus"} <= kinds and "micro_batch" not in kinds  # micro-batch 1
    found = suggest(L8B, gpu, s, estimate_memory, gpu.memory_bytes, limit=50)
    offloaded = [x for x in found if x.setup.offload != "none"]
    assert all(any("host RAM" in n for n in x.notes) and any("PCIe" in n for n in x.notes) for x in offloaded)
    assert any(x.setup.task == "qlora" for x in found)  # QLoRA instead of LoRA is among what fits
