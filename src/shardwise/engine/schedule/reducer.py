"""The gradient side of a step: reduce-scatters issued in one fixed unit order, one in flight.
Uses: flat_unit.

Note [collective order] (zero.py): every rank must issue the same sequence of reduce-scatters,
so a unit whose gradients are ready waits for every unit before it in `order` (the reverse of
registration: roughly the order backward finishes them); `finish` reduces the units no rank
reached this step (their gradients are zeros, or zero1's kept ones) in the same order. A landed
reduce hands out the rows of the parameters this rank used; `finish` agrees once which parameters
any rank used (Note [unused params], unit_grads.py) and settles the rest. Under
sw.optimizer_in_backward each unit is settled, and stepped, as soon as its reduce lands. The flags
travel as used_flags.py says: on the host group at the settle (gloo), or on the device, sent right
after the last reduce (each unit's reduce in backward steps) and read only by a rank that did not use
every parameter (Note [used flags on the device]).
"""

from __future__ import annotations

import collections

from shardwise.engine.unit.flat_unit import FlatUnit

# Reduce-scatters allowed in flight during backward. One overlaps the previous unit's
# reduce with this unit's backward compute, as FSDP2 does; a second kept one more packed
# unit-sized gradient buffer alive at the backward peak (bench/memory/max_model.py: zero3's peak
# 815-825 MiB with 2, 805 with 1, FSDP2 803) for no step-time gain we could measure. Measured again
# at 2 ranks on the bench GPT, 2 against 1 in interleaved rounds: zero2 0.95 (0.84-1.06, 12 rounds),
# zero1 1.03 (0.93-1.13, 6 rounds); the per-round spread is larger than any gain.
MAX_PENDING_REDUCES = 1
# Replica averages (a hybrid mesh) in flight past their unit's reduce-scatter (Note [async replica reduce],
# unit_grads.py): each holds its unit's averaged rows, and where the shards already have gradients (a later
# micro-batch, or gradients kept across steps) those rows are a buffer beside them until handed out; so two
# overlap the next units' backward without holding every unit's rows to the end of backward.
MAX_PENDING_REPLICAS = 2


class Reducer:
    """Issues each unit's reduce in `order`, at most MAX_PENDING_REDUCES in flight; `reset()` per backward."""

    def __init__(self, order: list[FlatUnit], flags):
        """`flags`: how the ranks agree on which parameters any used (used_flags.make_used_flags)."""
        self.order, self.flags = order, flags
        self.stepper = None  # Note [optimizer in backward] (step_in_backward.py): steps each reduced unit
        self.reset()

    def step_units_with(self, stepper) -> None:
        """Step each unit with `stepper` as its reduce lands (Note [optimizer in backward]); a
        stepper given before is no longer run (a new optimizer replaces the old one)."""
        if self.stepper is not None:
            self.stepper.hook.remove()
        self.stepper = stepper

    def reset(self) -> None:
        self.reduced: set[int] = set()  # units whose reduce was issued in this backward
        self.ready: dict[int, list] = {}  # units whose gradients wait for their turn
        self.next = 0  # position in `order`
        self.pending: collections.deque = collections.deque()  # units whose reduce is in flight
        self.landed: list[FlatUnit] = []  # units whose reduce landed, rows handed out, used flags not agreed yet
        self.replicating: collections.deque = collections.deque()  # hybrid: replica averages in flight
        self.flags_sent: dict[int, object] = {}  # optimizer in backward: each unit's flags, sent with its reduce

    def add(self, unit: FlatUnit, grads: list) -> None:
        """`unit`'s gradients for this backward are complete: reduce them in their turn."""
        self.ready[id(unit)] = grads
        while self.next < len(self.order) and id(self.order[self.next]) in self.ready:
            unit = self.order[self.next]
            self._launch(unit, self.ready.pop(id(unit)))
            self.next += 1

    def finish(self) -> None:
        """Reduce every unit not reduced yet, in order, wait for all reduces to land, and hand
        every unit its rows after one agreement on which parameters were used."""
        for unit in self.order[self.next :]:
            self._launch(unit, self.ready.pop(id(unit), None))  # None: the kept gradients, or zeros
        self.next = len(self.order)
        # Note [used flags on the device]: every unit's flags, in the order their reduces went, sent right after
        # the last one (units move pending -> replicating -> landed in that order); stepped units sent theirs
        sent = self.flags.send(self._flags_of([*self.landed, *self.replicating, *self.pending])) \
            if self.stepper is None else None
        while self.pending:
            self._land_oldest()
        while self.replicating:  # Note [async replica reduce]: the last replica averages waited here, in order
            self._hand_out_oldest()
        if sent is not None:
            self._settle(self.landed, sent)
        self.landed = []
        for unit in self.order:  # offload="host": the rows' copies to the host done (Note [host offload])
            unit.storage.synchronize()
        if self.stepper is not None:
            self.stepper.after_backward()

    def abandon(self) -> None:
        """A backward that raised midway: wait for its reduces (every rank issued the same ones),
        drop the step's gradients (what it reduced, and every unit's accumulation), start over."""
        while self.pending:
            unit = self.pending.popleft()
            unit.grads.land()
            self.replicating.append(unit)
        while self.replicating:
            self._hand_out_oldest()
        for unit in self.order:
            unit.grads.drop()
        self.reset()
        if self.stepper is not None:
            self.stepper.after_abandon()

    def _launch(self, unit: FlatUnit, grads: list) -> None:
        self.reduced.add(id(unit))
        if not unit.trainable():
            return
        while len(self.pending) >= MAX_PENDING_REDUCES:
            self._land_oldest()
        unit.grads.start_reduce(grads, async_op=True)
        self.pending.append(unit)
        if self.stepper is not None:  # stepped as its reduce lands: its flags go now (Note [used flags on the device])
            self.flags_sent[id(unit)] = self.flags.send(self._flags_of([unit]))

    def _land_oldest(self) -> None:
        unit = self.pending.popleft()
        unit.grads.land()  # hybrid: the replica average now in flight (Note [async replica reduce])
        if self.stepper is None:
            self.replicating.append(unit)
            while len(self.replicating) > (MAX_PENDING_REPLICAS if unit.mesh.hybrid else 0):
                self._hand_out_oldest()
            return
        unit.grads.hand_out()  # stepped now: its rows must be averaged everywhere first
        self._settle([unit], self.flags_sent.pop(id(unit)))  # Note [optimizer in backward]: step it now
        unit.storage.synchronize()  # offload="host": its rows on the host first (Note [host offload])
        self.stepper.after_reduce(unit)

    def _hand_out_oldest(self) -> None:
        unit = self.replicating.popleft()
        unit.grads.hand_out()
        self.landed.append(unit)

    @staticmethod
    def _flags_of(units: list[FlatUnit]) -> list[bool]:
        return [flag for unit in units for flag in unit.grads.used_here]

    def _settle(self, units: list[FlatUnit], sent) -> None:
        """One agreement on which parameters any rank used (`sent`: this rank's flags of `units`, as the flags'
        `send` returned them), then the rows of those this rank did not use (unit_grads.py, Note [unused params])."""
        used = self.flags.agree(sent)
        start = 0
        for unit in units:
            count = len(unit.grads.used_here)
            unit.grads.settle(used[start : start + count])
            start += count
