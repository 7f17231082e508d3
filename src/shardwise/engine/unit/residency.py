"""Where a unit's full values are: its residency state machine, the gather in flight, the pin, and
the count of an engine's units holding full values. Uses: collectives.

Note [unit lifecycle]: a unit's full values are in one of three states, changed only by
`Residence.move`, which refuses any other transition (a use-after-free becomes an error, not a
wrong number):

    SHARDED --start_gather--> GATHERING --finish_gather--> GATHERED --free (zero3)--> SHARDED
                                   ^-----------start_gather (rows changed, zero1/2)----'

zero1/zero2 start GATHERED and stay there (their full values are kept); zero3 starts
SHARDED. Gradients have their own phase (unit_grads.GradPhase).
"""

from __future__ import annotations

import enum

import shardwise.engine.comm.collectives as coll


class Residency(enum.Enum):
    """Where a unit's full values are (Note [unit lifecycle])."""

    SHARDED = "sharded"  # only this rank's rows exist; full_flat has no storage
    GATHERING = "gathering"  # an all-gather into full_flat is in flight
    GATHERED = "gathered"  # full_flat holds every rank's rows


_TRANSITIONS = {
    Residency.SHARDED: {Residency.GATHERING},
    Residency.GATHERING: {Residency.GATHERED},
    Residency.GATHERED: {Residency.SHARDED, Residency.GATHERING},
}


class Residents:
    """How many of one engine's zero3 units, the root aside, hold their full values now, and the most
    at once (the memory check): counted where residency changes (`Residence.move`), so no unit's
    entry scans the others. Every transition counts, set-up's too (each unit is built GATHERED and
    zero3's `take_shards` frees it: the peak is 1 right after `shard()`)."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, change: int) -> None:
        self.now += change
        self.peak = max(self.peak, self.now)


class Residence:
    """One unit's residency (Note [unit lifecycle]): its state, the all-gather in flight (GATHERING) and
    whether an input-gradient graph pinned its full values until the window closes (Note [gradients of
    inputs], window.py). Built GATHERED: the unit allocates its full buffer first."""

    def __init__(self, label: str, residents: Residents) -> None:
        self.label, self.residents = label, residents
        self.state = Residency.GATHERED
        self.residents.add(1)
        self.pending: coll.Pending | None = None  # the all-gather in flight (GATHERING)
        self.pinned = False  # read by an input-gradient graph (create_graph): kept until the window closes

    def move(self, to: Residency) -> None:
        """The one place a unit's residency changes (Note [unit lifecycle])."""
        if to not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"shardwise engine bug: unit {self.label} cannot go from "
                               f"{self.state.value} to {to.value}")
        self.residents.add((to is Residency.GATHERED) - (self.state is Residency.GATHERED))
        self.state = to

    @property
    def resident(self) -> bool:
        """Whether the full values are usable now."""
        return self.state is Residency.GATHERED

    @property
    def sharded(self) -> bool:
        """Whether only this rank's rows exist (no gather in flight either)."""
        return self.state is Residency.SHARDED
