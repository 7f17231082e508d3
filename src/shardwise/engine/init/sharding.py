"""Turning a model's parameters into units of shards, one unit at a time (zero strategies' set-up).
Uses: consistency, deferred, flat_unit, parallel_layout, offload, phase, residency, stage, units.

The peak during set-up is one unit's full values: each unit takes its rows and frees the
rest before the next is built. Eager models start from rank 0's values (as DDP does); a
model built under `sw.deferred_init()` replays its recorded init on every rank instead.
"""

from __future__ import annotations

from torch import nn

from shardwise.config import ShardConfig
from shardwise.engine.init.deferred import is_deferred, meta_buffers, record, replay, set_buffer, zeros_like_meta
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.memory.offload import DiskStore, register_offloaded
from shardwise.engine.phase import Clock
from shardwise.engine.schedule.consistency import broadcast_from_rank0
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.engine.unit.residency import Residents
from shardwise.engine.unit.stage import StagePolicy
from shardwise.engine.unit.units import UnitPlan


def shard_units(model: nn.Module, plans: list[UnitPlan], config: ShardConfig, group, mesh: ParallelLayout,
                store: DiskStore | None, init_fn=None, *, policy: StagePolicy, reduce_group=None,
                clock: Clock | None = None, residents: Residents | None = None, comm=None,
                host=None) -> list[FlatUnit]:
    """Every unit of `plans` holding only this rank's rows, in registration order (root first). `group`
    holds every rank of the mesh: eager values come from its rank 0. `policy`: the engine's stage policy
    (Note [stages]), shared by every unit; `comm`: the engine's CommContext (Note [comm context]); `host`: its
    HostCopies under offload="host" (Note [host offload])."""
    # Deferred: meta aliases of the parameters, by name, for the init replay below.
    # Host-shared frozen parameters (already mapped, Note [host copy]) are not replayed.
    deferred = {n: p.detach() for n, p in model.named_parameters() if p.device.type == "meta"} \
        if is_deferred(model) else None
    extra_log = record(lambda: init_fn(model)) if deferred is not None and init_fn is not None else None
    units = []
    for plan in plans:
        unit = FlatUnit(plan, mesh=mesh, policy=policy,
                        precision=config.precision, store=store, reduce_group=reduce_group, clock=clock,
                        residents=residents, comm=comm, host=host)
        if deferred is None:
            broadcast_from_rank0(unit, group)
        unit.take_shards()
        units.append(unit)
    if deferred is not None:
        # Every rank replays the same recorded init from the same RNG state, so the values
        # agree without a broadcast; each keeps its rows as each parameter is finished.
        # Buffers built on meta (Llama's rotary inv_freq) are replayed too: they stayed on meta.
        where = {layout.owned.name: (u, i) for u in units for i, layout in enumerate(u.layouts)}
        buffers = meta_buffers(model)

        def deliver(name, value):
            if name in where:
                if value is not None:  # None: nothing wrote it, its rows keep their zeros
                    where[name][0].set_value(where[name][1], value)
            else:
                set_buffer(model, name, value if value is not None else zeros_like_meta(buffers[name], units[0].device))

        replay({**deferred, **{n: b for n, b in buffers.items()}}, deliver, device=units[0].device,
               extra_log=extra_log)
    if store is not None:
        for unit in units:
            store.release(unit.shard_flat)  # written once; the step pages it back in
        register_offloaded(store, [unit.shard_params for unit in units])
    if config.precision.buffer_dtype is not None:
        for buffer in model.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(config.precision.buffer_dtype)
    return units
