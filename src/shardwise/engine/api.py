"""`shard(model, strategy=...)`: the one entry point that applies a strategy in place.
Uses: compat, consistency, ddp, deferred, grads, guards, host_copy, parallel_layout, protocol, units, zero.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.config import (
    Compression,
    DiskOffload,
    HostFrozen,
    HostOffload,
    MixedPrecision,
    ShardConfig,
    resolve_compression,
    resolve_frozen,
    resolve_offload,
    resolve_precision,
)
from shardwise.engine.compat import DDP_IGNORE_ATTRIBUTE
from shardwise.engine.ddp import apply_ddp
from shardwise.engine.guards import RefuseDataParallel
from shardwise.engine.init.deferred import is_deferred, materialize
from shardwise.engine.layout.parallel_layout import check_mesh, data_mesh
from shardwise.engine.memory.host_copy import place_frozen_on_host
from shardwise.engine.optim.grads import no_sync
from shardwise.engine.protocol import attach_engine, engine_of, slicing_of
from shardwise.engine.schedule.consistency import check_same_options, layout_words
from shardwise.engine.unit.units import UnitSpec
from shardwise.engine.zero import apply_zero
from shardwise.errors import ShardwiseError


def shard(
    model: nn.Module,
    *,
    strategy: str,
    units: UnitSpec = "auto",
    precision: str | MixedPrecision | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    checkpoint_activations: bool = False,
    offload: str | DiskOffload | HostOffload | None = None,
    process_group: dist.ProcessGroup | None = None,
    find_unused_parameters: bool = False,
    frozen: str | HostFrozen | None = None,
    mesh=None,
    reshard_after_forward: bool | int = True,
    compression: Compression | dict | None = None,
    prefetch: int | None = None,
    keep_comm_buffers: bool = False,
) -> nn.Module:
    """Apply `strategy` to `model` in place and return the same model object.

    `strategy` is one of "ddp", "zero1", "zero2", "zero3"; changing it changes memory,
    never the result. `units` (zero strategies) sets the grain of communication: "auto"
    (the default: the model's declared blocks, HF's `_no_split_modules`, else its most
    repeated block class; Note [auto units]), a module class or tuple of classes, a module
    instance or a list of them (an `nn.ModuleList`: each child), a list of module names,
    or a callable `module -> bool`; the root is always a unit (`sw.describe(model)` shows
    the plan). After it,
    `model.named_parameters()` yields this rank's shards under the original names, so
    any torch optimizer with ordinary param groups steps only shards.
    `precision` (zero strategies): "fp32" (default), "bf16", "fp16" or a
    `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`; shards stay fp32 masters.
    A model built under `sw.deferred_init()` is materialized here, one parameter at a
    time, each rank keeping its rows; its values equal eager init with the same seed.
    `init_fn(model)`, if given, initializes it further (recorded and replayed the same way).
    `checkpoint_activations` (zero strategies) recomputes each non-root unit's forward in
    backward instead of keeping its activations; results are unchanged.
    `offload="host"` (or `sw.HostOffload(pin_memory=True)`; zero1/zero2/zero3: FSDP2's `CPUOffloadPolicy`) keeps
    the fp32 master rows, their gradients and the optimizer state in host memory (pinned on a GPU) and steps the
    user's optimizer there, on the CPU; each gather copies this rank's rows to the device on a stream of its own,
    each reduce's rows come back as they land; the result is unchanged. Note [host offload] in
    engine/memory/host_offload.py. `offload="disk:PATH"` (zero3) keeps the fp32 master shards and the optimizer
    state in memory-mapped files under PATH and steps the optimizer one unit at a time.
    `process_group` defaults to the group `sw.init()` formed.
    `find_unused_parameters` (ddp only) must be True when some trainable parameter
    gets no gradient in some step (an unused branch); shardwise raises a clear error
    at the next step when it was needed and not given.
    `frozen="host"` (or `sw.HostFrozen(source=..., directory=...)`) keeps the parameters
    frozen now (`requires_grad=False`) as one read-only copy per host that every local rank
    maps, instead of one copy per rank; the strategy then applies to the trainable ones only.
    Writing a host-shared weight raises; unfreeze it (`requires_grad_(True)` copies it out)
    before `shard()`. Note [host copy] in host_copy.py.
    `mesh` (zero strategies) is a 2-D `DeviceMesh` named ("replicate", "shard") for hybrid sharding
    (FSDP2's HSDP): each parameter is sharded over the shard dimension only, whose ranks run the
    gathers and reduce-scatters, and the gradients are then averaged across the replicas; the
    result is still one process's. Note [mesh info] in parallel_layout.py. A model sliced first with
    `sw.slice(model, group=mesh)` over a 3-D mesh named ("replicate", "shard", "tensor") takes the
    same mesh here: each tensor rank's slices are sharded over the other two (Note [sliced mesh]).
    `reshard_after_forward` (zero3): True (the default) frees each unit's full parameters after its
    forward, so backward gathers them again over the shard group; an int N (hpZ: DeepSpeed's
    `zero_hpz_partition_size`, FSDP2's `reshard_after_forward=int`) keeps a secondary shard of each unit
    over the N ranks of this rank's node (ranks numbered node by node, as torchrun does), so backward's
    re-gather stays inside the node; the result is unchanged. Note [secondary shards] in unit/secondary.py.
    `compression` (zero strategies; opt-in, not exact) is a `sw.Compression(gather="int8", reduce="int8" or
    "int4", block=256)`: zero3's parameter all-gathers travel block-quantized (qwZ) and the gradient
    reduce-scatters quantized over an all-to-all, summed in fp32 (qgZ); the fp32 master shards are never
    quantized. `sw.describe` and the checkpoint index record it. An optimizer stepped on whole tensors
    (Muon, Adafactor, ...) is refused with it. Note [quantized collectives] in engine/comm/quantize.py.
    `prefetch` (zero3): how many units' all-gathers are kept issued ahead of use, each on the gathers' own
    stream (default 1, FSDP2's one unit ahead: the next issued once this one landed); each more holds one
    more unit's full parameters and buys overlap where a unit computes faster than the next one gathers. The
    result is unchanged. Note [prefetch depth] in engine/unit/stage.py.
    `keep_comm_buffers` (zero3): False (the default) releases the comm pool's buffers once backward has issued
    its last gather, so backward's tail holds none idle (the smaller peak: 132 blocks at 2 GiB where kept fit
    129); True keeps them between steps, so the next forward's gathers reuse them: faster where released memory
    faults its pages in again (a CPU: about 3% of the bench GPT's step); on a GPU the caching allocator keeps
    released memory, so False costs nothing there. The result is unchanged. Note [lean tail] in
    engine/comm/buffers.py.
    The option rules live in `shardwise.config.ShardConfig`; every rank passes the same options (compared
    at once: Note [options by construction]). The model gains `model.no_sync()`, `sw.no_sync(model)` as DDP's
    and FSDP1's habit spells it.
    """
    arguments = {name: value for name, value in locals().items() if name != "model"}  # every one: Note [options
    config, refusal = None, None  # by construction]; a rank's refusal is raised once the ranks compared options
    try:
        config = ShardConfig.of(strategy, precision=precision, offload=offload,
                                checkpoint_activations=checkpoint_activations,
                                find_unused_parameters=find_unused_parameters, frozen=frozen,
                                reshard_after_forward=reshard_after_forward, compression=compression,
                                prefetch=prefetch, keep_comm_buffers=keep_comm_buffers)
    except ShardwiseError as error:
        refusal = error
    if engine_of(model) is not None:
        raise ShardwiseError(
            f"this model is already sharded with strategy={engine_of(model).strategy!r}: "
            + ("call sw.shard() once per model; drop the second call" if engine_of(model).strategy == strategy else
               "build a fresh model (or load a checkpoint into one) to change strategy")
        )
    if not dist.is_initialized():
        raise refusal or ShardwiseError("no process group: call `sw.init()` before `sw.shard(...)`")
    group = process_group or dist.group.WORLD
    slicing = slicing_of(model)  # sw.slice ran first: Note [slice then shard] (parallel/slicing)
    if mesh is not None:  # Note [sliced mesh]: a 3-D mesh's data part, and the group of its ranks
        mesh, group = data_mesh(mesh, slicing.group if slicing is not None else None, process_group)
    check_same_options("sw.shard options", _options(arguments, config, refusal, group), group, _FIXES,
                       {id(module): name for name, module in model.named_modules()})
    if refusal is not None:
        raise refusal
    if mesh is not None:
        check_mesh(mesh, config.strategy, group)
    _refuse_sparse_gradients(model, config.strategy)
    if slicing is not None:
        slicing.check_data_group(group)
    if config.frozen is not None:
        place_frozen_on_host(model, config.frozen, group)  # before any strategy sees the parameters
    if config.strategy == "ddp":
        if is_deferred(model):
            materialize(model, init_fn)  # ddp holds the full model anyway
        engine = apply_ddp(model, group, config)
    else:
        engine = apply_zero(model, config, units, group, init_fn, mesh)
    attach_engine(model, engine)  # Note [engine protocol]
    setattr(model, DDP_IGNORE_ATTRIBUTE, RefuseDataParallel(config.strategy))  # Note [no second wrapper]
    if not hasattr(type(model), "no_sync"):  # a class with a no_sync of its own keeps it
        # `with model.no_sync():`, the DDP / FSDP1 / Accelerate habit, is sw.no_sync(model): the same accumulation
        object.__setattr__(model, "no_sync", partial(no_sync, model))
    return model


def _options(arguments: dict, config: ShardConfig | None, refusal: ShardwiseError | None, group) -> dict:
    """What the ranks compare (Note [options by construction]): every argument of `shard()`, its string
    shortcuts resolved ("bf16" and MixedPrecision(torch.bfloat16) alike), every `ShardConfig` field no argument
    names, the layout in words, the group's ranks, and a rank's refusal of its own options."""
    options = {name: _resolved(name, value) for name, value in arguments.items()}
    for name in (f.name for f in dataclasses.fields(ShardConfig) if f.name not in arguments):
        options[name] = None if config is None else getattr(config, name)
    mesh = arguments["mesh"]
    options["mesh"] = layout_words(mesh) if mesh is None or isinstance(mesh, DeviceMesh) else mesh
    options["process_group"] = f"ranks {dist.get_process_group_ranks(group)}"
    options["refused"] = None if refusal is None else str(refusal)
    return options


_RESOLVERS = {"precision": resolve_precision, "offload": resolve_offload, "frozen": resolve_frozen,
              "compression": resolve_compression}


def _resolved(name: str, value):
    """An argument as `ShardConfig.of` reads it, or as given where it does not resolve (its rank refuses it)."""
    try:
        return _RESOLVERS[name](value) if name in _RESOLVERS else value
    except ShardwiseError:
        return value


_FIXES = {"mesh": "Pass the same mesh= to sw.shard on every rank (built by the same init_device_mesh call from the "
                  "same sizes), or none on any: ranks given different layouts create other groups",
          "refused": "Pass the same options on every rank; one rank refused its own (its words above)"}


def _refuse_sparse_gradients(model: nn.Module, strategy: str) -> None:
    """A sparse gradient (nn.Embedding(sparse=True)) cannot be packed into the flat reduce."""
    if strategy == "ddp":
        return  # torch DDP reduces sparse gradients itself
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ShardwiseError(
                f"{name or 'the model'} is an {type(module).__name__} with sparse=True: its sparse gradient cannot "
                f"be sharded by strategy={strategy!r}. Build it with sparse=False (AdamW, Adam and the other "
                "dense optimizers then apply), or use strategy='ddp', which reduces sparse gradients."
            )
