"""The zero strategies' bytes per rank, unit by unit (estimate/core.py's table, Note [transient buffers]), and
where offload puts them: disk offload's files (`offloaded`), offload="host"'s host memory (`host`, Note [host
offload] in engine/memory/host_offload.py); the units a model or a bare count is cut into (`units_of_model`,
`units_of_count`). Uses: buffers, quantize, rows, stage, units.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.config import DiskOffload, HostOffload, ShardConfig
from shardwise.engine.comm.buffers import comm_buffer_bytes
from shardwise.engine.comm.quantize import wire_buffer_bytes
from shardwise.engine.layout.rows import shard_numel
from shardwise.engine.unit.stage import policy_of
from shardwise.engine.unit.units import UnitSpec, build_units


@dataclass(frozen=True)
class Unit:
    """One unit's sizes at a world size (elements; `shard` = S is one rank's padded rows)."""

    shard: int
    full: int  # N·S
    trainable_shard: int
    trainable_full: int
    num_trainable: int  # trainable tensors
    largest: int  # largest single tensor (elements)
    num_tensors: int = 1  # parameter tensors, frozen ones too (Note [per-tensor objects], objects.py)


def zero_state(plan_units, config: ShardConfig, m, c, r, state_per_elem, state_per_tensor):
    """(parameters, gradients, optimizer state, offloaded, host) for zero1/2/3 (estimate/core.py's table): the
    first three on the compute device, `offloaded` in disk offload's files, `host` in offload="host"'s memory."""
    if isinstance(config.offload, HostOffload):
        return _host_state(plan_units, config, m, c, r, state_per_elem, state_per_tensor)
    stage, offload = policy_of(config.strategy, config.prefetch), isinstance(config.offload, DiskOffload)
    parameters = gradients = optimizer_state = offloaded = 0
    for u in plan_units:
        # zero1/2 at c == m: the shards are views of the kept full buffer (shard_storage.AliasedShards).
        kept, masters = stage.parameter_bytes(u.full, u.shard, c, m)
        parameters += kept
        if offload:
            offloaded += masters
        else:
            parameters += masters
        # Param-sized state goes to the files; Adam's `step` counters stay in memory.
        state = state_per_elem * m * u.trainable_shard
        optimizer_state += state_per_tensor * u.num_trainable
        if offload:
            offloaded += state
        else:
            optimizer_state += state
        if not u.num_trainable:
            continue
        # The reduce-scatter output: this rank's rows plus one "used" flag per tensor. The shard
        # grads are views of it when r == m, else fp32 copies and the output is freed.
        reduced = r * (u.trainable_shard + u.num_trainable) if r == m else m * u.trainable_shard
        gradients += stage.gradient_bytes(u.full, reduced, r, m)  # zero1: its kept full grads
    return parameters, gradients, optimizer_state, offloaded, 0


def stepped_gradient_bytes(plan_units, config: ShardConfig, m, r) -> int:
    """Note [gradients stepped in backward] (estimate/core.py): zero2/zero3 under sw.optimizer_in_backward hold
    one unit's reduced gradient at a time, the largest one's at most."""
    stage = policy_of(config.strategy, config.prefetch)
    return max((stage.gradient_bytes(u.full, r * (u.trainable_shard + u.num_trainable) if r == m
                                     else m * u.trainable_shard, r, m)
                for u in plan_units if u.num_trainable), default=0)


def _host_state(plan_units, config: ShardConfig, m, c, r, state_per_elem, state_per_tensor):
    """offload="host" (Note [host offload]): the master rows (m·S, apart from any kept full values), their
    gradients (m·S_t, copied from the reduce) and all optimizer state in host memory; the device keeps zero1/
    zero2's full values (c·F) and zero1's full gradients (r·F)."""
    stage = policy_of(config.strategy, config.prefetch)
    parameters = gradients = host = 0
    for u in plan_units:
        parameters += stage.parameter_bytes(u.full, u.shard, c, m)[0]
        host += m * u.shard + (state_per_elem + 1) * m * u.trainable_shard + state_per_tensor * u.num_trainable
        if u.num_trainable:
            gradients += stage.gradient_bytes(u.full, 0, r, m)  # the reduce's output goes: zero1's kept gradients
    return parameters, gradients, 0, 0, host


def zero_transient(plan_units, config: ShardConfig, c, r, world_size: int, with_backward: bool = True) -> int:
    """Note [transient buffers]; of it, `comm_pool_bytes` is the comm pool's bound."""
    root, others = plan_units[0], plan_units[1:] or plan_units[:1]
    biggest = max(u.full for u in others)
    stage = policy_of(config.strategy, config.prefetch)
    # The comm pool (Note [reused buffers]): the reduce in flight over the largest unit, the root included (input
    # and receive buffer; zero1: receive only) and zero3's gathered units, all lent at zero3's backward peak (Note
    # [lean tail]), so counted with the probe too; compression's wire buffers, over the largest unit too.
    comm = comm_pool_bytes(plan_units, config, c, r, world_size)
    regathers = stage.transient_gathered_bytes(c, root.full, biggest)  # zero1/2: 2 in flight
    backward = c * biggest + c * root.full if with_backward else 0  # one unit's full gradients and the root's
    return comm + regathers + backward + kept_tail_bytes(config, c, root.full)  # Note [kept tail]


# Note [kept tail]: zero3 with keep_comm_buffers=True holds its pool at its bound through backward's tail (Note
# [lean tail], comm/buffers.py), where the root's backward and reduce then come on top of it: measured over the
# released tail's peak (bench/memory/max_model.py's GPT, 4 ranks, peak RSS of the busiest rank), 31.8 and 32.4 MiB
# at d_model 512 (40 and 100 blocks: a constant in depth) and 18.4 MiB at d_model 256 (60 blocks), where the root's
# full values are 16.8 and 8.4 MiB: about two of them, counted so (33.6 and 16.8).
KEPT_TAIL_ROOTS = 2


def kept_tail_bytes(config: ShardConfig, c: int, root_full: int) -> int:
    """What zero3's kept pool adds at backward's tail (Note [kept tail]); 0 where the tail releases it."""
    return KEPT_TAIL_ROOTS * c * root_full if config.strategy == "zero3" and config.keep_comm_buffers else 0


def comm_pool_bytes(plan_units, config: ShardConfig, c, r, world_size: int) -> int:
    """The comm pool's bound (Note [reused buffers]), as the engine sets it (ZeroEngine._comm_bound): the reduce in
    flight over the largest unit, the root included (input and receive buffer; zero1: receive only), zero3's gathered
    units, and compression's wire buffers over the largest unit too (Note [comm option bytes])."""
    root, others = plan_units[0], plan_units[1:] or plan_units[:1]
    biggest = max(u.full for u in others)
    stage = policy_of(config.strategy, config.prefetch)
    wire = wire_buffer_bytes(config.compression, world_size, max(biggest, root.full))
    return comm_buffer_bytes(stage, c, r, root.full, biggest, wire)


def units_of_model(model: nn.Module, units: UnitSpec, world_size: int) -> list[Unit]:
    """The model's units as shard() cuts them, sized with dim-0 padding (flat_unit._layout)."""
    out = []
    for plan in build_units(model, units):
        shard = full = t_shard = t_full = num_trainable = largest = 0
        for owned in plan.params:
            s = shard_numel(owned.param.shape, world_size)
            shard, full = shard + s, full + world_size * s
            largest = max(largest, owned.param.numel())
            if owned.param.requires_grad:
                t_shard, t_full, num_trainable = t_shard + s, t_full + world_size * s, num_trainable + 1
        out.append(Unit(shard, full, t_shard, t_full, num_trainable, largest, len(plan.params)))
    return out


def units_of_count(num_params: int, world_size: int, unit_params: int | None, num_layers: int | None,
                    notes: list[str]) -> list[Unit]:
    """Equal units for a bare parameter count (no padding: shapes are unknown)."""
    if unit_params is None and num_layers:
        unit_params = num_params // num_layers
    if unit_params is None or unit_params >= num_params:
        notes.append("a bare parameter count is one unit: pass unit_params= or num_layers= for zero3's "
                     "gather buffers")
        sizes = [num_params]
    else:
        sizes = [num_params - unit_params * (num_params // unit_params)] + [unit_params] * (num_params // unit_params)

    def unit(n: int) -> Unit:
        s = shard_numel((n,), world_size)
        # One tensor per unit: the `step` counters and flags are per tensor and are small.
        return Unit(s, world_size * s, s, world_size * s, 1 if n else 0, n, 1 if n else 0)

    return [unit(n) for n in sizes]
