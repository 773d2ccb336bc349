"""Tensor, context and pipeline parallelism for gpuprov's trainer: torchtitan's device mesh and TP plan.

Shipped beside train.py; its mesh is built only when train.yaml asks for parallel.tp, parallel.cp
or parallel.pp above 1 (the pipeline stages themselves: train_pipeline.py). The layout follows torchtitan (torchtitan@9dec370
torchtitan/parallelisms/parallel_dims.py and parallelize_llama.py `apply_tp`), mapped onto
Hugging Face Llama-family module names:

  mesh      (pp, dp_replicate, dp_shard, cp, tp), row-major: tp ranks are consecutive (one node's
            NVLink domain), a pipeline stage's ranks too; FSDP2 shards over dp_shard x cp
            (torchtitan's "dp_shard_cp", named "shard" here as in train.py), HSDP replicates over
            dp_replicate ("replicate"); data-parallel ranks ("dp") are dp_replicate x dp_shard.
  TP plan   embed_tokens rowwise (output sequence-sharded), every RMSNorm SequenceParallel,
            attention / MLP inputs all-gathered (PrepareModuleInput), q/k/v and gate/up
            colwise, o/down rowwise back to sequence shards, lm_head colwise with vocab-sharded
            logits for loss_parallel.
  CP        inputs, labels and positions sharded along the sequence in load-balanced chunks.
            Packed documents (and CPU): attention all-gathers keys and values over the CP group
            under the document mask (train_attention.py). No documents on CUDA:
            torch.distributed.tensor.experimental.context_parallel's ring attention (it wraps the
            CUDA SDPA kernels only).

train.yaml's parallel.shard counts the GPUs of one replica of one pipeline stage (tp x cp x
dp_shard), so pp x replicate x shard = world size holds for every layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class LayoutError(SystemExit):
    """A train.yaml layout the world size or the model cannot take: one line, no traceback."""

    def __init__(self, message: str):
        super().__init__(f"train.py: {message}")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int = 1  # outermost, as torchtitan's mesh: a stage's ranks are consecutive

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)


def enabled(par: dict) -> bool:
    return int(par.get("tp", 1)) * int(par.get("cp", 1)) * int(par.get("pp", 1)) > 1


def layout_from(par: dict, world: int) -> Layout:
    """The 4-D mesh shape from train.yaml's parallel section, checked against the world size."""
    tp, cp, pp = int(par.get("tp", 1)), int(par.get("cp", 1)), int(par.get("pp", 1))
    replicate, shard, sharding = int(par["replicate"]), int(par["shard"]), par["sharding"]
    if tp < 1 or cp < 1 or pp < 1:
        raise LayoutError(f"parallel.tp {tp}, parallel.cp {cp} and parallel.pp {pp} must be positive")
    if sharding not in ("fsdp", "hsdp"):
        raise LayoutError(f"parallel.tp/cp/pp combine with sharding fsdp or hsdp, not {sharding}")
    if sharding == "fsdp" and replicate != 1:
        raise LayoutError(f"parallel.sharding fsdp needs parallel.replicate 1, got {replicate}")
    if shard % (tp * cp):
        raise LayoutError(f"parallel.shard {shard} (GPUs of one replica) is not a multiple of tp {tp} x cp {cp}")
    lay = Layout(replicate, shard // (tp * cp), cp, tp, pp)
    if lay.world != world:
        raise LayoutError(
            f"mesh pp {pp} x dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x cp {cp} x tp {tp} = {lay.world} GPUs, "
            f"but torchrun started {world} processes: fix train.yaml or the launch")
    return lay


def build_mesh(device_type: str, lay: Layout) -> DeviceMesh:
    """The world mesh, with FSDP's dimensions under the names train.py's 1-D/2-D meshes use:
    "shard" = dp_shard x cp (torchtitan's dp_shard_cp), "replicate" = dp_replicate."""
    mesh = init_device_mesh(device_type, lay.shape, mesh_dim_names=MESH_DIMS)
    mesh["dp_shard", "cp"]._flatten("shard")
    mesh["dp_replicate"]._flatten("replicate")
    mesh["dp_replicate", "dp_shard"]._flatten("dp")  # ranks that read different data
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")  # one stage's ranks whose loss partial sums add up
    mesh["pp", "dp_replicate", "dp_shard", "cp"]._flatten("loss")  # ... with the stages (only the last has a loss)
    return mesh


def fsdp_mesh(mesh: DeviceMesh, sharding: str) -> DeviceMesh:
    """FSDP2's mesh: ("shard",) for fsdp, ("replicate", "shard") for hsdp."""
    return mesh["replicate", "shard"] if sharding == "hsdp" else mesh["shard"]


@dataclass
class State:
    """The world mesh and layout of this process (one per trainer run)."""

    mesh: DeviceMesh
    layout: Layout
    positions: torch.Tensor | None = None  # this rank's CP share of the positions, during a step


_STATE: list[State] = []


def state() -> State:
    return _STATE[0]


def runtime(par: dict, runtime_cls: Any, rank: int, world: int, local_rank: int, device: torch.device) -> Any:
    """train.py's Runtime for a TP/CP layout: FSDP's mesh, data-parallel rank, size and groups."""
    lay = layout_from(par, world)
    mesh = build_mesh(device.type, lay)
    _STATE[:] = [State(mesh, lay)]
    dp = mesh["dp"]
    # CPU init draws each local shard from the rank's own generator: seed by (shard, tp) coordinate
    shard_rank = mesh["shard"].get_local_rank() * lay.tp + mesh["tp"].get_local_rank()
    pp = mesh["pp"]
    return runtime_cls(rank, world, local_rank, device, fsdp_mesh(mesh, par["sharding"]), dp.get_local_rank(),
                       dp.size(), shard_rank, dp_group=dp.get_group(), loss_group=mesh["loss"].get_group(),
                       pp_rank=pp.get_local_rank(), pp_group=pp.get_group() if lay.pp > 1 else None)


# ---------------------------------------------------------------------------- tensor parallel


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The HF base model holding embed_tokens / layers / norm (LlamaModel, MistralModel, ...)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens"):
        raise LayoutError(f"tensor parallelism needs a Llama-family model (model.layers, embed_tokens); got {type(model).__name__}")
    return inner


def check_divisible(config: Any, tp: int) -> None:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv),
                        ("intermediate_size", config.intermediate_size)):
        if value % tp:
            raise LayoutError(f"parallel.tp {tp} does not divide the model's {name} {value}")


def tp_plan(layers: list[str] | int, float8: bool = False, embed: bool = True, head: bool = True) -> dict[str, Any]:
    """torchtitan's apply_tp plan, in Hugging Face module names.

    float8 (torchao tensorwise float8 linears, converted before TP): the blocks' linears and their
    inputs take torchao's float8 TP styles, so the sequence-parallel all-gathers move float8, as
    torchtitan's apply_tp does with enable_float8_tensorwise_tp; embeddings, norms and the head stay
    plain (they are not float8 linears).

    `layers`: the blocks' names under model.layers (a count: 0 .. n-1); a pipeline stage passes its own
    blocks (their global indices) and whether it holds the embedding and the final norm + head.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare_input = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    plan: dict[str, Any] = {}
    if embed:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if head:
        plan["model.norm"] = SequenceParallel()
        # vocab-sharded logits as a DTensor: cross-entropy runs under loss_parallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    for i in (range(layers) if isinstance(layers, int) else layers):
        p = f"model.layers.{i}"
        plan.update({
            f"{p}.input_layernorm": SequenceParallel(),
            f"{p}.self_attn": prepare_input(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            f"{p}.self_attn.q_proj": colwise(),
            f"{p}.self_attn.k_proj": colwise(),
            f"{p}.self_attn.v_proj": colwise(),
            f"{p}.self_attn.o_proj": rowwise(output_layouts=Shard(1)),
            f"{p}.post_attention_layernorm": SequenceParallel(),
            f"{p}.mlp": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.mlp.gate_proj": colwise(),
            f"{p}.mlp.up_proj": colwise(),
            f"{p}.mlp.down_proj": rowwise(output_layouts=Shard(1)),
        })
    return plan


def _full_positions(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The embedding's output is sequence-sharded, so the HF model would count s/tp positions;
    rotary embeddings need the positions of the whole sequence (or of this rank's CP chunks)."""
    if kwargs.get("position_ids") is None:
        st = state()
        if st.positions is not None:
            kwargs["position_ids"] = st.positions
        else:
            ids = kwargs.get("input_ids", args[0] if args else None)
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    return args, kwargs


def parallelize(model: torch.nn.Module, float8: bool = False) -> torch.nn.Module:
    """Apply the TP plan (after the float8 conversion, before activation checkpointing and FSDP, as
    torchtitan does)."""
    from torch.distributed.tensor.parallel import parallelize_module

    st = state()
    decoder = _decoder(model)
    register_positions(model)
    if st.layout.cp > 1:
        import train_attention  # the trainer's sibling (imported late: parallel.py loads on its own in tests)

        train_attention.use_cp_attention(model)
    if st.layout.tp == 1:
        return model
    check_divisible(model.config, st.layout.tp)
    if getattr(model.config, "tie_word_embeddings", False):
        raise LayoutError("tensor parallelism here shards embed_tokens rowwise and lm_head colwise; tied embeddings need an untied model")
    layers = decoder.layers
    names = list(layers.keys()) if isinstance(layers, torch.nn.ModuleDict) else len(layers)
    plan = tp_plan(names, float8, embed=decoder.embed_tokens is not None, head=decoder.norm is not None)
    parallelize_module(model, st.mesh["tp"], plan)
    return model


def register_positions(model: torch.nn.Module) -> None:
    _decoder(model).register_forward_pre_hook(_full_positions, with_kwargs=True)


@contextlib.contextmanager
def step_context(batch):
    """Forward, cross-entropy and backward of one micro-batch under the layout; yields the batch this
    rank computes.

    TP: loss_parallel (cross-entropy on the vocab-sharded logits). CP: the window sharded along the
    sequence into load-balanced chunks. With documents (or on CPU) this rank's chunks are taken here
    and attention gathers the keys and values (train_attention.cp_attention) under the document mask;
    without documents on CUDA torch's context_parallel shards in place and runs ring attention, the
    model's positions coming from the sharded buffer.
    """
    if not _STATE:
        yield batch
        return
    import train_attention

    st = state()
    with contextlib.ExitStack() as stack:
        if st.layout.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if st.layout.cp > 1 and (batch.documents is not None or batch.inputs.device.type != "cuda"):
            batch = cp_shard(batch, st)
            train_attention._CP_GROUP[:] = [st.mesh["cp"].get_group()]
            stack.callback(train_attention._CP_GROUP.clear)
        elif st.layout.cp > 1:
            from torch.distributed.tensor.experimental import context_parallel

            inputs, labels = batch.inputs, batch.labels
            positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs).contiguous()
            stack.enter_context(context_parallel(st.mesh["cp"], buffers=[inputs, labels, positions],
                                                 buffer_seq_dims=[1, 1, 1],
                                                 no_restore_buffers={inputs, labels, positions}))
            st.positions = positions
            stack.callback(setattr, st, "positions", None)
        yield batch


def cp_shard(batch, st: State):
    """This CP rank's chunks of the window (inputs, labels, positions); the document ids stay whole
    (the mask scores this rank's queries against every gathered key)."""
    import train_attention

    seq, cp = batch.inputs.shape[1], st.layout.cp
    device = batch.inputs.device
    q = train_attention.cp_query_index(seq, cp, st.mesh["cp"].get_local_rank(), device)
    docs = batch.documents if batch.documents is not None else torch.zeros_like(batch.inputs)
    positions = batch.positions if batch.positions is not None else train_attention.document_positions(docs)
    return dataclasses.replace(batch, inputs=batch.inputs[:, q], labels=batch.labels[:, q],
                               positions=positions[:, q], documents=docs, q_index=q,
                               k_index=train_attention.cp_key_index(seq, cp, device))
