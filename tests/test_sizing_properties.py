"""Property tests over the option space: no crash, and memory moves the right way."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprov.catalog.models import get_model, list_models
from gpuprov.errors import GpuprovError
from gpuprov.sizing.memory import estimate_memory
from gpuprov.sizing.types import AC_MODES, LORA_TARGET_PRESETS, OFFLOADS, OPTIMIZERS, PRECISIONS, SHARDINGS, TASKS, TrainSetup

MODELS = [m.name for m in list_models()]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def setups(draw):
    gpus_per_node = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, 16))
    gpus = gpus_per_node * nodes
    sharding = draw(st.sampled_from(SHARDINGS))
    if gpus == 1 and sharding != "none":
        sharding = draw(st.sampled_from(["none", "fsdp", "ddp"]))
    shard_group = None
    if sharding == "hsdp":
        divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
        shard_group = draw(st.sampled_from([None, *divisors]))
    targets = draw(st.sampled_from(list(LORA_TARGET_PRESETS.values())))
    return TrainSetup(
        task=draw(st.sampled_from(TASKS)),
        seq_len=draw(st.integers(1, 131072)),
        micro_batch=draw(st.integers(1, 64)),
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        sharding=sharding,
        shard_group=shard_group,
        activation_checkpointing=draw(st.sampled_from(AC_MODES)),
        precision=draw(st.sampled_from(PRECISIONS)),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        offload=draw(st.sampled_from(OFFLOADS)),
        lora_rank=draw(st.integers(1, 1024)),
        lora_targets=targets,
        compile=draw(st.booleans()),
        chunked_cross_entropy=draw(st.booleans()),
    )


@FAST
@given(model=st.sampled_from(MODELS), setup=setups())
def test_never_crashes(model: str, setup: TrainSetup) -> None:
    arch = get_model(model)
    try:
        e = estimate_memory(arch, setup)
    except GpuprovError as exc:  # only the documented bad inputs may refuse
        assert "\n" not in str(exc)
        assert "hidden size" in str(exc) or "does not divide" in str(exc)
        return
    assert e.per_gpu_bytes == sum(e.breakdown.values()) > 0
    assert all(v >= 0 for v in e.breakdown.values())
    assert 0 < e.trainable_params <= arch.params or setup.task != "full"


@FAST
@given(model=st.sampled_from(MODELS), setup=setups(), factor=st.integers(2, 8))
def test_monotone_in_seq_len_and_micro_batch(model: str, setup: TrainSetup, factor: int) -> None:
    arch = get_model(model)
    setup = replace(setup, lora_rank=min(setup.lora_rank, arch.hidden_size))
    try:
        base = estimate_memory(arch, setup).per_gpu_bytes
    except GpuprovError:
        return
    longer = estimate_memory(arch, replace(setup, seq_len=setup.seq_len * factor)).per_gpu_bytes
    bigger = estimate_memory(arch, replace(setup, micro_batch=setup.micro_batch * factor)).per_gpu_bytes
    assert longer >= base
    assert bigger >= base


@FAST
@given(model=st.sampled_from(MODELS), setup=setups(), more=st.integers(2, 16))
def test_fsdp_never_grows_with_more_gpus(model: str, setup: TrainSetup, more: int) -> None:
    arch = get_model(model)
    setup = replace(setup, sharding="fsdp", shard_group=None, lora_rank=min(setup.lora_rank, arch.hidden_size))
    small = estimate_memory(arch, setup).per_gpu_bytes
    large = estimate_memory(arch, replace(setup, gpus=setup.gpus * more)).per_gpu_bytes
    if setup.gpus == 1:
        # one GPU has no NCCL communicator; compare what the sharding changes
        large -= estimate_memory(arch, replace(setup, gpus=setup.gpus * more)).breakdown["nccl_buffers"]
    assert large <= small
