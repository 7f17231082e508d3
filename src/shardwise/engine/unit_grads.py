"""One unit's gradient side: accumulate full gradients, pack them for the reduce-scatter, hand
each shard its averaged rows. Uses: collectives.

A unit's gradients have their own phase (`GradPhase`): IDLE until a backward hands the unit
gradients to keep (zero1, or any stage under no_sync: ACCUMULATING), back to IDLE once the
reduce has landed and its rows were handed out (`land`, `settle`).

Note [unused params]: a parameter no rank used this step must keep `grad=None`, as in a single
process (AdamW then leaves it alone: no decay, no moment update), while one used by some ranks
gets the average with zeros from the others. Which parameters a rank used is host knowledge (a
gradient is None or not), so the ranks agree on it with one small all-reduce of host values per
step over the host group (collectives.any_rank), after every reduce has landed: the hot path
reads no device value to decide it (a read per parameter, then per unit, stalled a GPU's stream
at every unit boundary).
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

import shardwise.engine.collectives as coll


class GradPhase(enum.Enum):
    """Whether a unit holds full gradients waiting for their reduce."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"  # full gradients summing in `full` (zero1; no_sync)


class UnitGrads:
    """The gradients of one unit (flat_unit.FlatUnit): read its layout, write only its own fields."""

    def __init__(self, unit) -> None:
        self.unit = unit
        self.full: Tensor | None = None  # accumulated full gradients, param-major (zero1; no_sync)
        self.phase = GradPhase.IDLE
        self.carried: dict[int, Tensor] = {}  # zero1: reduced grads the user did not zero
        self.used: set[int] = set()  # parameters that got a gradient in this accumulation window
        self.pending: coll.Pending | None = None  # the reduce-scatter in flight
        self.indices: list[int] = []  # the trainable parameters it reduces, in packing order
        self.used_here: list[bool] = []  # per reduced parameter: did this rank have a gradient
        self.waiting: dict[int, Tensor] = {}  # landed rows of parameters this rank did not use, by column
        self.summed_in_place = False  # the last reduce summed `full` itself (zero1 on gloo)

    # ---- accumulation (zero1, no_sync) --------------------------------------------------

    def _begin_accumulation(self) -> None:
        unit = self.unit
        if self.full is None:
            self.full = torch.zeros(unit.full_flat.shape, dtype=unit.reduce_dtype, device=unit.device)
            return
        # zero1 keeps `full` allocated across steps, and its shards' grads are views of their
        # own rows in it: set aside any the user kept (accumulating across steps), then start
        # the new window from zero.
        for i, shard in enumerate(unit.shard_params):
            if shard.grad is not None:
                self.carried[i] = shard.grad.clone()
                shard.grad = None
        self.full.zero_()

    def accumulate(self, grads: list[Tensor | None]) -> None:
        """Add this backward's full gradients into `full` (zero1, or under no_sync)."""
        if self.phase is GradPhase.IDLE:
            self._begin_accumulation()
            self.phase = GradPhase.ACCUMULATING
        with torch.no_grad():
            for index, (layout, grad) in enumerate(zip(self.unit.layouts, grads)):
                if grad is not None:
                    self.used.add(index)
                    start = self.unit.world_size * layout.offset
                    self.full[start : start + layout.rows * layout.row_numel].add_(grad.reshape(-1))

    def holds_full(self) -> bool:
        """Whether accumulated full gradients exist (zero1 always; zero2/zero3 after no_sync)."""
        return self.full is not None

    def full_list(self) -> list[Tensor | None]:
        """The accumulated full gradients per parameter (None: unused in the window)."""
        if self.full is None:
            return [None] * len(self.unit.layouts)
        out = []
        for index, layout in enumerate(self.unit.layouts):
            start = self.unit.world_size * layout.offset
            out.append(self.full[start : start + layout.rows * layout.row_numel] if index in self.used else None)
        return out

    # ---- the reduce ------------------------------------------------------------------------

    def start_reduce(self, grads: list[Tensor | None], async_op: bool) -> None:
        """Reduce-scatter (average) the full gradients of the trainable parameters; a None is
        zeros here and "unused" in `used_here` (Note [unused params])."""
        unit = self.unit
        self.indices = unit.trainable()
        self.used_here = [grads[i] is not None for i in self.indices]
        what = f"the gradient reduce of unit {unit.label} ({unit.where})"
        self.summed_in_place = self._sums_in_place()
        if self.summed_in_place:  # Note [kept gradients summed in place]
            if self.phase is GradPhase.IDLE:  # this rank added nothing in this window: it sends zeros
                self._begin_accumulation()  # (a buffer left from an earlier step would add its sums again)
            self.pending = coll.reduce_in_place(self.full, unit.reduce_group, async_op, what)
            return
        segments, offset = [], 0
        for i in self.indices:
            segments.append((offset, unit.layouts[i].shard_numel))
            offset += unit.layouts[i].shard_numel
        rows = [unit.layouts[i].rows for i in self.indices]
        packed = coll.pack([grads[i] for i in self.indices], rows, unit.world_size, segments, offset,
                           torch.empty(0, dtype=unit.reduce_dtype, device=unit.device))
        self.pending = coll.reduce_scatter_avg(packed, unit.world_size, unit.reduce_group, async_op, what)

    def _sums_in_place(self) -> bool:
        """Note [kept gradients summed in place]: zero1 keeps every full gradient until the step,
        param-major, in the shards' own dtype; where an all-reduce is the faster collective (gloo,
        collectives.sums_in_place) it sums that buffer in place, and each shard's gradient is a view
        of its own rows, divided by the world size: no rank-major copy, no separate reduced buffer.
        Decided from the stage, dtypes and sizes alone, so every rank issues the same collective."""
        unit = self.unit
        return (unit.stage.keeps_full_grads and unit.reduce_dtype == unit.dtype
                and coll.sums_in_place(unit.full_flat, unit.world_size, unit.reduce_group))

    def land(self) -> None:
        """Wait for the reduce, then hand out at once the rows of every parameter this rank used
        (some rank used it, so it gets its average); keep the others' rows for `settle`, which the
        agreement on which parameters any rank used decides (Note [unused params])."""
        unit, pending, self.pending = self.unit, self.pending, None
        reduced = pending.wait()
        offset = 0
        for column, i in enumerate(self.indices):
            layout = unit.layouts[i]
            if self.summed_in_place:  # Note [kept gradients summed in place]: the own rows of the sum
                rows = unit.own_rows(self.full, layout).view(layout.shard_shape).div_(unit.world_size)
            else:
                rows = reduced[offset : offset + layout.shard_numel].view(layout.shard_shape).to(unit.dtype)
                offset += layout.shard_numel
            if self.used_here[column]:
                self._give(i, rows)
            else:  # a copy: the reduced buffer is released now, as when every row is handed out
                self.waiting[column] = rows if self.summed_in_place else rows.clone()
        self.phase = GradPhase.IDLE
        self.used.clear()
        if not unit.stage.keeps_full_grads:
            self.full = None

    def settle(self, used_by_any: list[bool]) -> None:
        """The rows kept by `land`: a gradient where some rank used the parameter; where none did,
        the shard keeps the gradient it had (None, as in one process). `used_by_any[k]` is about
        the k-th reduced parameter."""
        for column, rows in self.waiting.items():
            i = self.indices[column]
            if used_by_any[column]:
                self._give(i, rows)
                continue
            carried = self.carried.pop(i, None)
            if carried is not None:
                self.unit.shard_params[i].grad = carried  # nobody added to it this time
        self.waiting = {}
        self.carried.clear()

    def _give(self, i: int, rows: Tensor) -> None:
        """Shard i's averaged rows: added to its gradient, or its gradient (plus what it carried)."""
        unit, shard = self.unit, self.unit.shard_params[i]
        carried = self.carried.pop(i, None)  # zero1: this shard's gradient from earlier backwards
        if shard.grad is not None:
            shard.grad.add_(rows)
        elif self.summed_in_place:  # `rows` is already the shard's own rows of the kept sums
            shard.grad = rows if carried is None else rows.add_(carried)
        elif unit.stage.keeps_full_grads and self.full is not None and self.full.dtype == unit.dtype:
            # zero1: the shard's grad is a view of its own rows of the kept full grads,
            # so the gradients are stored once, not twice.
            own = unit.own_rows(self.full, unit.layouts[i]).view(unit.layouts[i].shard_shape).copy_(rows)
            shard.grad = own if carried is None else own.add_(carried)
        else:
            shard.grad = rows if carried is None else rows + carried

    def end_accumulation(self) -> None:
        """After the synced reduce: zero2/zero3 drop the no_sync full grads; zero1 keeps its buffer."""
        self.phase = GradPhase.IDLE
        self.carried.clear()
        self.used.clear()
        if not self.unit.stage.keeps_full_grads:
            self.full = None

    def drop(self) -> None:
        """A backward that raised midway (Note [aborted backward]): forget this step's gradients."""
        self.waiting = {}
        self.end_accumulation()
        for shard in self.unit.shard_params:
            shard.grad = None
