"""Which units' all-gathers are in flight and which come next, in one fixed order on every rank
(Note [collective order], zero.py). Uses: flat_unit, gather_tags.

The forward queue holds the units to gather before this forward (zero3: all of them; zero1/2:
those whose rows changed), the backward queue zero3's re-gathers in the reverse order. A unit is
gathered by issuing every queued unit before it (a unit this rank skips is still gathered, and
dropped, so every rank issues the same sequence); at most `policy.gathers_in_flight` are issued
ahead of use (zero3 prefetches the next unit while this one computes). `before_landing` runs before
any gather is waited for: the engine confirms its phase's header there (Note [agreement rides the
traffic], agreement.py). zero3's gathers carry tags checked before that (Note [gather tags], gather_tags.py).
"""

from __future__ import annotations

from typing import Callable

from shardwise.engine.schedule.gather_tags import GatherTags
from shardwise.engine.unit.flat_unit import FlatUnit


class GatherScheduler:
    """The gathers of one window (Note [unit window]); `reset()` when it closes."""

    def __init__(self, units: list[FlatUnit], in_flight: int, before_landing: Callable[[], None],
                 tags: GatherTags | None = None) -> None:
        self.units, self.in_flight, self.before_landing, self.tags = units, in_flight, before_landing, tags
        self.reset()

    def _start(self, unit: FlatUnit) -> None:
        unit.start_gather(async_op=True)
        if self.tags is not None:
            self.tags.send(unit)

    def _land(self, landing: list[FlatUnit]) -> None:
        """Check the tags of the gathers about to land (Note [gather tags]: before the phase's header, which
        a refused rank may never send), then confirm the header."""
        if self.tags is not None:
            for unit in landing:
                self.tags.check(unit)
        self.before_landing()

    def settle_tags(self) -> None:
        """Before an optimizer step: every tag still unchecked compared (Note [tags on the device])."""
        if self.tags is not None:
            self.tags.settle()

    def reset(self) -> None:
        self.prefetching: dict[int, FlatUnit] = {}  # gathers in flight, in issue order
        self.forward_queue: list[FlatUnit] = []  # units to gather in this forward, fixed order
        self.backward_queue: list[FlatUnit] = []  # zero3 backward: the same, reversed

    def issue(self, queue: list[FlatUnit], up_to: FlatUnit | None = None) -> None:
        """Issue queued gathers in their fixed order, through `up_to` if given, else just
        enough to keep the stage's number in flight."""
        while queue:
            if up_to is None and len(self.prefetching) >= self.in_flight:
                return
            unit = queue.pop(0)
            self._start(unit)
            self.prefetching[id(unit)] = unit
            if unit is up_to:
                return

    def ensure_gathered(self, unit: FlatUnit, queue: list[FlatUnit], running: list[FlatUnit]) -> None:
        """`unit`'s full values usable now; `running`: units whose forward is open (kept)."""
        if unit in queue:
            self.issue(queue, up_to=unit)
        if id(unit) in self.prefetching:
            landing = list(self.prefetching.values())
            self._land(landing[:landing.index(unit) + 1])
            # Gathers land in issue order: those queued before this unit first. A zero3 unit
            # among them that is not running is one this rank skipped: drop it again.
            for other in list(self.prefetching.values()):
                del self.prefetching[id(other)]
                other.finish_gather()
                if other is unit:
                    break
                if not any(other is u for u in running):
                    other.free()  # zero3 (zero1/zero2 keep their full values: StagePolicy.free)
        elif unit.policy.gathers_on_use(unit):
            # zero3: a unit freed since its last use (A, B, A; a later forward or backward).
            self._start(unit)
            self._land([unit])
            unit.finish_gather()

    def drain(self, queue: list[FlatUnit]) -> None:
        """Issue and land every queued gather (units this rank did not run take theirs too)."""
        while queue or self.prefetching:
            self.issue(queue)
            self.land_all()

    def land_all(self) -> None:
        """Wait for every gather in flight (freed or kept by the caller, the same on every rank)."""
        if self.prefetching:
            self._land(list(self.prefetching.values()))
        for unit in list(self.prefetching.values()):
            del self.prefetching[id(unit)]
            unit.finish_gather()

    def free_idle(self, keep: set[int], running: list[FlatUnit]) -> None:
        """Free (zero3) every unit not in `keep`, not running and not in flight."""
        busy = keep | {id(u) for u in running} | set(self.prefetching)
        for unit in self.units:
            if id(unit) not in busy:
                unit.free()
