"""Whether a unit's kept full values still equal every rank's rows, and which parameters the next
gather carries: zero1/zero2's `StepFreshness`; zero3 keeps no full values (`NoKeptValues`). The
stage policy (stage.py) picks one per unit. Uses: nothing of the engine.

Note [stepped parameters]: a zero1/zero2 unit re-gathers after a step only the parameters whose rows
an optimizer wrote: `mark_stepped` adds the ones it holds, and a whole-tensor owner's broadcast, which
writes the whole update into every rank's full view (Note [owner broadcast], owner_traffic.py), takes
its own out again (`mark_fresh`). A frozen parameter or a broadcast one is not re-gathered. Version
stamps cannot tell one parameter's rows from another's (the shards are views of one buffer), so the
set is trusted only while the stamp moved inside steps alone (`after_step` records it): a write outside
a step (a user's in-place write, `sw.load`) re-gathers every parameter and counts as a write in the
forward's header (`written`), which refuses a write only some ranks made. A gather clears the set.
"""

from __future__ import annotations

from typing import Callable


class StepFreshness:
    """zero1/zero2 (Note [stepped parameters]): `stamp()` moves whenever this rank's master rows are
    written in place (FlatUnit._master_stamp); `num_params` is the unit's parameter count."""

    def __init__(self, stamp: Callable[[], int], num_params: int) -> None:
        self.stamp, self.num_params = stamp, num_params
        self.gathered_stamp = -1  # stamp() right after the last gather
        self.stale = False  # an optimizer stepped these shards since the last gather (optim_hooks.py)
        self.current_at_step = False  # the full values matched every rank's rows when the last step began
        # The layout indices an optimizer wrote since the last gather, the stamp after the last step, and
        # whether rows were written outside a step since the last gather.
        self.stepped: set[int] = set()
        self.step_stamp = -1
        self.written_outside = False

    def gathered(self) -> None:
        """The kept full values were just written from the master rows (set-up, deferred init)."""
        self.gathered_stamp = self.stamp()

    def released(self) -> None:
        pass  # zero1/zero2 never free their full values

    def now_current(self) -> None:
        """Every rank's full values equal every rank's rows: nothing to re-gather until the rows change."""
        self.gathered_stamp, self.stale = self.stamp(), False
        self.stepped, self.written_outside = set(), False

    def to_gather(self) -> list[int]:
        """The layout indices the next gather carries: none while the full values are current, those an
        optimizer wrote after steps alone, all after any other write."""
        if not self.stale and self.stamp() == self.gathered_stamp:
            return []
        if not self.written():
            return sorted(self.stepped)
        return list(range(self.num_params))

    def needs_gather(self) -> bool:
        """The rows of a parameter changed since the last gather."""
        return bool(self.to_gather())

    def written(self) -> bool:
        """Rows changed by a write no optimizer step made (`p.data.mul_()`, `load_state_dict`, `sw.load`),
        which only the ranks that made it see (Note [agreement rides the traffic], agreement.py): since
        the last gather, or since the last step after one."""
        return self.written_outside or self.stamp() != (self.step_stamp if self.stale else self.gathered_stamp)

    def mark_stepped(self, indices: set[int]) -> None:
        """An optimizer is about to write the shards `indices`: re-gather them before the next use.
        Whether the kept full values still matched every rank's rows as this step began is kept for the
        owners (owner_traffic.can_copy_whole): the mark comes before the step, so `stale` no longer
        says it."""
        self.written_outside = self.written()  # since the last gather or step
        if not self.to_gather():
            self.now_current()  # so that the owners know the full values are current (can_copy_whole)
        self.current_at_step = not self.needs_gather()
        self.stepped |= indices
        self.stale, self.step_stamp = True, self.stamp()  # writes from here on are a step's

    def mark_fresh(self, index: int) -> None:
        """The owner's broadcast wrote parameter `index`'s whole update into every rank's full view: the
        next forward need not re-gather it."""
        self.stepped.discard(index)

    def after_step(self) -> None:
        """An optimizer's step over this unit ended (or was undone): its writes are accounted for."""
        self.step_stamp = self.stamp()

    def current_in_step(self) -> bool:
        """Inside an optimizer step: the full values were current when the step began (its pre-step mark
        has set `stale` since) and no rows were written since (an optimizer that stepped this unit earlier
        in the same step moved the stamp)."""
        return self.current_at_step and self.stamp() == self.gathered_stamp


class NoKeptValues:
    """zero3: no full values outlive a use, so every gather carries every parameter; residency says when
    to gather (stage.Zero3.needs_gather), and the values a unit holds while it stays gathered are
    tracked for writes alone.

    Note [kept while gathered]: some zero3 units do stay gathered between uses: the root for a whole
    window, and the last unit run, kept for backward, while a forward's loss is alive. A write to such a
    unit's rows then (`sw.load`, `load_state_dict`, a user's in-place write) must reach the next forward,
    as in one process and under zero1/zero2, so the stamp of the rows the held values were gathered from
    is kept (`now_current`) until the unit frees them (`released`): a unit gathered from other rows
    than its current ones is `written` and re-gathered, and the forward's header checks that every rank
    saw the same write (Note [agreement rides the traffic])."""

    def __init__(self, stamp: Callable[[], int], num_params: int) -> None:
        self.stamp, self.num_params = stamp, num_params
        self.held_stamp: int | None = None  # stamp() when the full values held now were gathered

    def gathered(self) -> None:
        pass  # set-up's full values are freed at once (FlatUnit.take_shards)

    def now_current(self) -> None:
        self.held_stamp = self.stamp()

    def released(self) -> None:
        self.held_stamp = None

    def to_gather(self) -> list[int]:
        return list(range(self.num_params))

    def written(self) -> bool:
        """The rows changed since the full values this unit still holds were gathered."""
        return self.held_stamp is not None and self.stamp() != self.held_stamp

    def mark_stepped(self, indices: set[int]) -> None:
        pass

    def mark_fresh(self, index: int) -> None:
        pass

    def after_step(self) -> None:
        pass

    def current_in_step(self) -> bool:
        return False
