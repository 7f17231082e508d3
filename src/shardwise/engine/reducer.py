"""The gradient side of a step: reduce-scatters issued in one fixed unit order, one in flight.

Note [collective order] (zero.py): every rank must issue the same sequence of reduce-scatters,
so a unit whose gradients are ready waits for every unit before it in `order` (the reverse of
registration: roughly the order backward finishes them); `finish` reduces the units no rank
reached this step (their gradients are zeros, or zero1's kept ones) in the same order.
"""

from __future__ import annotations

import collections

from shardwise.engine.flat_unit import FlatUnit

# Reduce-scatters allowed in flight during backward. One overlaps the previous unit's
# reduce with this unit's backward compute, as FSDP2 does; a second kept one more packed
# unit-sized gradient buffer alive at the backward peak (bench/max_model.py: zero3's peak
# 815-825 MiB with 2, 805 with 1, FSDP2 803) for no step-time gain we could measure.
MAX_PENDING_REDUCES = 1


class Reducer:
    """Issues each unit's reduce in `order`, at most MAX_PENDING_REDUCES in flight; `reset()` per backward."""

    def __init__(self, order: list[FlatUnit]):
        self.order = order
        self.stepper = None  # Note [optimizer in backward] (step_in_backward.py): steps each reduced unit
        self.reset()

    def reset(self) -> None:
        self.reduced: set[int] = set()  # units whose reduce was issued in this backward
        self.ready: dict[int, list] = {}  # units whose gradients wait for their turn
        self.next = 0  # position in `order`
        self.pending: collections.deque = collections.deque()

    def add(self, unit: FlatUnit, grads: list) -> None:
        """`unit`'s gradients for this backward are complete: reduce them in their turn."""
        self.ready[id(unit)] = grads
        while self.next < len(self.order) and id(self.order[self.next]) in self.ready:
            unit = self.order[self.next]
            self._launch(unit, self.ready.pop(id(unit)))
            self.next += 1

    def finish(self) -> None:
        """Reduce every unit not reduced yet, in order, and wait for all reduces to land."""
        for unit in self.order[self.next :]:
            grads = self.ready.pop(id(unit), None)
            self._launch(unit, unit.full_grad_list() if grads is None else grads)
        self.next = len(self.order)
        while self.pending:
            self._finish_oldest()
        if self.stepper is not None:
            self.stepper.after_backward()

    def abandon(self) -> None:
        """A backward that raised midway: wait for its reduces (every rank issued the same ones),
        drop the step's gradients (what it reduced, and every unit's accumulation), start over."""
        while self.pending:
            unit, pending, _ = self.pending.popleft()
            pending.wait()
        for unit in self.order:
            unit.end_accumulation()
            for shard in unit.shard_params:
                shard.grad = None
        self.reset()
        if self.stepper is not None:
            self.stepper.after_abandon()

    def _launch(self, unit: FlatUnit, grads: list) -> None:
        self.reduced.add(id(unit))
        if not unit.trainable():
            return
        while len(self.pending) >= MAX_PENDING_REDUCES:
            self._finish_oldest()
        pending, indices = unit.start_reduce(grads, async_op=True)
        self.pending.append((unit, pending, indices))

    def _finish_oldest(self) -> None:
        unit, pending, indices = self.pending.popleft()
        unit.finish_reduce(pending, indices)
        unit.end_accumulation()
        if self.stepper is not None:
            self.stepper.after_reduce(unit)
