"""Low-bit optimizer state in `sw.estimate` (torchao's AdamW8bit, AdamW4bit): each tensor's state by torchao's
rules, on the rank the engine steps it (Note [low-bit estimate]). Uses: whole_step (the engine's owner cost).

Note [low-bit estimate]: shardwise steps these optimizers on whole tensors, one owner rank per parameter (Note
[low-bit state] in engine/optim/lowbit.py, Note [whole-tensor step] in engine/optim/whole_step.py), so:

- **State per tensor**, by torchao's rule (`_AdamBase._new_buffer`): a tensor of at least 4096 elements that the
  block size divides (256 for 8-bit, 128 for 4-bit) keeps each of its two moments as codes (8-bit: 1 byte an
  element; 4-bit: half a byte), one fp32 scale per block and a code map (256 fp32 entries for 8-bit, 16 for
  4-bit); any other tensor keeps them as the parameter's dtype (the fp32 master), as AdamW does; plus the
  fp32 `step` counter. A model's own shapes decide which; a bare parameter count is taken as quantized.
- **Where it lives**: zero1/2/3 put each parameter's whole state on its owner, owners assigned greedily in the
  optimizer's parameter order to the rank least loaded by `step_cost` (elements, for these classes), as the
  engine's `_owners` does for an optimizer built on `model.parameters()` (frozen parameters take an owner, hold
  no state). Under optimizer_in_backward the owners are assigned unit by unit as backward steps them (Note
  [whole step per unit]), the load kept across units: the units in reverse order, the root last (its reduce is
  backward's last), each unit's parameters in the optimizer's order. The estimate is the busiest rank's; a
  matrix is not split, so the largest one is the grain. ddp: every rank holds the whole state. At world size 1
  the one rank holds it all.
- **The step's transient** (`step_buffers`): `WholeStep.begin` gathers each parameter's rows and gradient rows
  to its owner (`gather_to_owners`, Note [owner memory]: a tensor whose whole is ALONE_BYTES or more is received
  straight into its padded whole, its rows sent without a copy; the smaller ones packed into transfers of at most
  ALONE_BYTES, WINDOW of them in flight), the optimizer steps them, and the updated rows are scattered back from
  the same buffers. Per rank: its padded wholes, plus as the last of them are cut one packed transfer received
  and the next one's rows in flight; or the wholes and the step's own buffers after; zero1/zero2 at the master
  dtype copy the values from their kept full buffers and gather the gradients only (Note [owner traffic]); a
  parameter with no gradient (frozen) moves not at all (Note [no gradient, no traffic]). After the gather,
  torchao's compiled step holds buffers of its own for the tensor it steps, one at a time: measured on one
  process for a 4 MiB fp32 tensor (VmHWM over the RSS before the step, steady steps) 7.9 MiB for 8-bit, 26.0
  MiB for 4-bit, so 2 and 6.5 times the largest stepped tensor's fp32 bytes are counted (ddp and world size 1:
  these alone). Measured at 2 ranks on 4 blocks of 256 x 1024 (each rank's VmHWM over its RSS before
  `optimizer.step()`, steady steps, MALLOC_MMAP_THRESHOLD_ fixed): zero3 14.0-14.9 MiB since the bounded
  gather (23.8-23.9 before it, when every send, receive and whole buffer was alive at once), zero2 and zero1
  8-bit 12.0 against 12.1 (the gather's), zero2 4-bit 14.3 against 14.6 (the step's own buffers).
  It comes after backward, when activations are gone: the peak counts the larger phase (Note [peak] in
  core.py). With `optimizer_in_backward=True` each unit's owned parameters are gathered, stepped and
  scattered inside backward, one unit at a time: the largest unit's share counts with the backward's
  buffers (`gather_buffers`) instead.
- **No offload**: sw.shard's offload="host" refuses a whole-tensor step over ranks at the first step
  (host_offload.py's `refuse_whole_step`), and disk offload refuses quantized state at any world size
  (whole_step.py's `refuse_disk_offload`, Note [what a chunk can step] in offload.py). So `sw.estimate`
  refuses the pair, `sw.plan` marks those rows and `sw.max_model` leaves them out.
- **torchao's runtime**, its own line (`optimizer_runtime`): importing torchao.optim and its compiled step on top of
  a rank's runtime. The step compiles `single_param_adam` with dynamic=False, one graph per distinct shape a rank
  steps. In one process that had imported nothing else (torch 2.13 CPU, torchao 0.18, MALLOC_MMAP_THRESHOLD_ fixed)
  the import alone costs 83 MiB, and the first step's peak 202-238 MiB over the RSS before the import (2 to 16
  shapes: the 2.55 MiB per shape counted). But a shardwise rank has paid most of that import already: sw.shard
  imports torch._dynamo and torch._inductor (225 MiB after sw.init(), 367 after sw.shard of 4 blocks, 380 after
  torchao.optim), and RUNTIME_BYTES, fitted on ranks, holds them. Counted: what a rank adds, fitted on
  bench/memory/max_model.py's 8-bit row (zero3 + bf16 + optimizer in backward + 8-bit AdamW + checkpointing,
  d_model 512, 4 ranks; bench/memory/estimate_gap.py, results/estimate_gap.md): 29 MiB + 2.55 MiB per distinct
  shape of the busiest rank's stepped tensors (its owned trainable ones; ddp: all) with inductor's cache warm (732
  MiB estimated at 40 blocks against 731.6 measured, 2039 at 311 against 2044), and 35 MiB more for compiling the
  step from nothing (TORCHAO_COLD_COMPILE_BYTES): the same probe with a fresh TORCHINDUCTOR_CACHE_DIR peaked 34.6
  MiB higher (766.2), one process 40 MiB (the state left out: cold 261 MiB over its RSS before the import, warm
  221). The cold figure is counted: a machine's first run compiles (and any run whose cache was cleared: the
  cache lives under /tmp/torchinductor_$USER), and the estimate is what a user plans with, so it is the upper of
  the two; a later run holds about 35 MiB less (the estimate's notes say so). bench/memory/max_model.py gives every
  probe a fresh cache, so its rows measure that first run (Note [first run] there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from shardwise.engine.comm.owner_traffic import ALONE_BYTES
from shardwise.engine.layout.rows import shard_numel
from shardwise.engine.optim.whole_step import step_cost
from shardwise.engine.unit.units import build_units

MIB = 2**20
MIN_QUANTIZED = 4096  # torchao quantizes no smaller tensor (`_new_buffer`, following bitsandbytes)
STEP_COUNTER_BYTES = 4  # torchao's `step`: a 0-d fp32 tensor per parameter with state
TORCHAO_RUNTIME_BYTES = 29 * MIB  # Note [low-bit estimate]: on top of a rank's runtime, fitted, cache warm
TORCHAO_SHAPE_BYTES = int(2.55 * MIB)  # and per distinct shape compiled (one graph each)
TORCHAO_COLD_COMPILE_BYTES = 35 * MIB  # and compiling it with inductor's cache cold (a machine's first run)


@dataclass(frozen=True)
class LowBit:
    """One low-bit optimizer's state format."""

    bits: int  # per element of a quantized moment
    block: int  # elements per fp32 scale (the optimizer's default block_size)
    qmap: int  # fp32 entries of each quantized state's code map
    temporaries: float  # the compiled step's own buffers for the tensor it steps, in its fp32 sizes (measured)


OFFLOAD_NOT_MODELLED = ("offload with a low-bit optimizer is not modelled (Note [low-bit estimate]): the engine "
                        "refuses offload='host' for whole-tensor steps and cannot spill quantized state to disk")
LOW_BIT = {"adamw8bit": LowBit(8, 256, 256, 2.0), "adamw4bit": LowBit(4, 128, 16, 6.5)}
_MOMENTS = 2  # exp_avg, exp_avg_sq (amsgrad=False)


@dataclass(frozen=True)
class Tensor_:
    """One parameter as the low-bit estimate sees it."""

    shape: tuple[int, ...]
    numel: int
    shard: int  # one rank's padded rows (elements) at the layout's world size
    trainable: bool
    unit: int  # index of its unit in build_units' order


@dataclass(frozen=True)
class LowBitTerms:
    """What a low-bit optimizer adds to an estimate (Note [low-bit estimate])."""

    state_by_rank: tuple[int, ...]  # optimizer state bytes of each rank
    step_buffers: int  # the whole-tensor step's transient after backward (busiest rank)
    in_backward_buffers: int  # the same, one unit at a time, under optimizer_in_backward
    runtime: int
    notes: tuple[str, ...]


def quantized(numel: int, kind: LowBit) -> bool:
    """torchao's rule: whether a tensor of `numel` elements gets quantized state."""
    return numel >= MIN_QUANTIZED and numel % kind.block == 0


def tensor_state_bytes(numel: int, kind: LowBit, master: int = 4, assume_quantized: bool = False) -> int:
    """One parameter's state bytes: two moments (quantized, or the master dtype) and the step counter."""
    if assume_quantized or quantized(numel, kind):
        moment = numel * kind.bits // 8 + 4 * math.ceil(numel / kind.block) + 4 * kind.qmap
    else:
        moment = master * numel
    return _MOMENTS * moment + STEP_COUNTER_BYTES


def tensors_of_model(model: nn.Module, units, layout_size: int) -> list[Tensor_]:
    """The model's parameters in `model.parameters()` order (an optimizer's built on it), with their units."""
    unit_of = {id(owned.param): i for i, plan in enumerate(build_units(model, units)) for owned in plan.params}
    return [Tensor_(tuple(p.shape), p.numel(), shard_numel(p.shape, layout_size), p.requires_grad,
                    unit_of.get(id(p), 0)) for p in model.parameters()]


def tensors_of_count(plan_units) -> list[Tensor_]:
    """A bare count's units (zero_bytes.units_of_count), one tensor each."""
    return [Tensor_((u.largest,), u.largest, u.shard, True, i) for i, u in enumerate(plan_units) if u.largest]


def owners_of(tensors: list[Tensor_], world_size: int) -> list[int]:
    """Each tensor's owner: the least loaded rank so far by the engine's `step_cost`, lowest rank on a tie
    (whole_step._owners for a fresh optimizer, whose rule takes parameter objects, not shapes)."""
    load, owners = [0] * world_size, []
    for t in tensors:
        owner = min(range(world_size), key=lambda r: (load[r], r))
        load[owner] += step_cost(object, t.shape)  # the optimizer's class: no Muon
        owners.append(owner)
    return owners


def backward_order(tensors: list[Tensor_]) -> list[Tensor_]:
    """`tensors` in the order sw.optimizer_in_backward's unit steps meet them (Note [low-bit estimate]): the units
    in reverse, the root (unit 0) last, each unit's own in the optimizer's order."""
    return sorted(tensors, key=lambda t: -t.unit if t.unit else 1)


def lowbit_terms(tensors: list[Tensor_], strategy: str, world_size: int, optimizer: str, master: int,
                 copies_values: bool, assume_quantized: bool = False, in_backward: bool = False) -> LowBitTerms:
    """Note [low-bit estimate]: the state on each rank, the step's transient, torchao's runtime.
    `copies_values`: zero1/zero2 at the master dtype (the owner copies its kept full values); `in_backward`:
    owners assigned in backward's unit order (sw.optimizer_in_backward)."""
    tensors = backward_order(tensors) if in_backward else tensors
    kind = LOW_BIT[optimizer]
    state = [tensor_state_bytes(t.numel, kind, master, assume_quantized) if t.trainable else 0 for t in tensors]
    whole = strategy == "ddp" or world_size == 1  # not stepped by owners: every rank its whole state
    if whole:  # the step's own buffers, one tensor at a time: the largest's
        by_rank, shapes = (sum(state),) * world_size, len({t.shape for t in tensors if t.trainable})
        step = per_unit = int(kind.temporaries * master * max((t.numel for t in tensors if t.trainable), default=0))
    else:
        owners = owners_of(tensors, world_size)
        shapes = max(len({t.shape for t, o in zip(tensors, owners) if o == r and t.trainable})
                     for r in range(world_size))
        by_rank = tuple(sum(s for s, o in zip(state, owners) if o == r) for r in range(world_size))
        step = _gather_peak(tensors, owners, world_size, master, copies_values, kind)
        per_unit = max(_gather_peak([t for t in tensors if t.unit == u], [o for t, o in zip(tensors, owners)
                                                                          if t.unit == u], world_size, master,
                                    copies_values, kind) for u in {t.unit for t in tensors})
    quantized_elems = sum(t.numel for t in tensors if t.trainable and (assume_quantized or quantized(t.numel, kind)))
    trainable = sum(t.numel for t in tensors if t.trainable) or 1
    notes = [f"{optimizer}: {100 * quantized_elems / trainable:.0f}% of trainable elements in quantized state "
             + ("(a bare count is taken as quantized)" if assume_quantized else
                f"(tensors of >= {MIN_QUANTIZED} elements that {kind.block} divides; the others fp32)")]
    if not whole:
        notes.append(f"{optimizer}: each parameter's whole state on its owner rank (ranks hold "
                     f"{min(by_rank) / MIB:,.1f}-{max(by_rank) / MIB:,.1f} MiB; the busiest counted)")
    runtime = TORCHAO_RUNTIME_BYTES + TORCHAO_COLD_COMPILE_BYTES + TORCHAO_SHAPE_BYTES * shapes
    notes.append(f"{optimizer}: torchao's step counted as a first run compiles it (inductor's cache cold); a run with "
                 f"the cache warm holds about {TORCHAO_COLD_COMPILE_BYTES / MIB:.0f} MiB less")
    return LowBitTerms(by_rank, step, per_unit, runtime, tuple(notes))


def _gather_peak(tensors: list[Tensor_], owners: list[int], world_size: int, master: int, copies: bool,
                 kind: LowBit) -> int:
    """The busiest rank's bytes in `WholeStep.begin` and the step (Note [low-bit estimate]): the padded whole
    tensors it owns, with, as the last of them are cut, the received parts of one packed transfer and the rows
    of the next one in flight (Note [owner memory]: a tensor of ALONE_BYTES or more is received straight into
    its whole); after it the wholes and the step's own buffers for the largest tensor it steps."""
    parts = 1 if copies else 2  # values (unless copied) and gradient, each gathered
    moved = [(t, o) for t, o in zip(tensors, owners) if t.trainable]  # Note [no gradient, no traffic]
    packed = [world_size * t.shard * master for t, _ in moved if world_size * t.shard * master < ALONE_BYTES]
    in_flight = min(ALONE_BYTES, sum(packed) * parts) // world_size  # the rows of the next packed transfer
    peak = 0
    for rank in range(world_size):
        owned = [t for t, o in moved if o == rank]
        wholes = master * sum(world_size * t.shard * parts for t in owned)
        mine = sum(b for b in (world_size * t.shard * master for t in owned) if b < ALONE_BYTES) * parts
        largest = max((t.numel for t in owned), default=0)
        after = master * (sum(t.numel * 2 for t in owned) + kind.temporaries * largest)
        peak = max(peak, wholes + min(ALONE_BYTES, mine) + in_flight, after)
    return int(peak)
