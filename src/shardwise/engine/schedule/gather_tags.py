"""zero3: which unit each rank's k-th all-gather carries, checked before its values are used.
Uses: agreement, collectives, flat_unit, groups, small.

Note [gather tags]: zero3's gathers follow each rank's own forward (Note [collective order], zero.py), so
ranks that run units in another order (rank 0 C(B(A(x))), rank 1 C(A(B(x)))) issue different
sequences: rank 1 drops A (gathered for the fixed queue), re-gathers it when it runs, and that gather
pairs with rank 0's gather of C. With the same size the collective completes, and rank 1 computes with
C's rows in A's place: a wrong loss, then a backward that waits for a collective no rank issues. The
agreement's header (agreement.py) only carries the last forward's order, learned after the fact.

So each zero3 gather sends a tag beside it, on a gloo channel of its own (pairing only with the other
ranks' tags, in issue order, as the gathers pair): [unit index, forwards so far, phase, units run so
far in this pass (the last ORDER_SLOTS of them)]. Before a gather's values are used (and before the
phase's header is confirmed: a rank refused here may never send its next header) the k-th tags of all
ranks are compared: a different unit or phase raises the same ShardwiseError on every rank, naming the
units each rank ran. A rank that waits for a header rather than a tag (rank 0 above, prefetching in its
backward while rank 1 still runs its forward) learns it from the refusing rank's last header
(Agreement.refuse), then reads its own tags in flight and raises the same words. A tag costs one small
async all-gather beside each gather, waited for with it (never a barrier of its own); zero1/zero2 need
none: their gathers follow one fixed queue on every rank. Nor does an engine of one unit (the root alone: a
small pipeline stage, Note [a stage as one unit] in pipeline/sharded.py): its gathers are all of that unit,
one order on every rank, and a forward or a phase only some ranks run differs in the header, which is
confirmed before a gather lands (Note [agreement rides the traffic]).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardwise.engine.comm.collectives import named_failure
from shardwise.engine.comm.small import start_all_gather_rows
from shardwise.engine.layout.groups import new_host_group
from shardwise.engine.schedule.agreement import DIFFERENT_FORWARDS, REFUSED, Agreement
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.errors import ShardwiseError

ORDER_SLOTS = 12  # the last units run, named in the error (earlier ones are elided)
_PHASES = {0: "forward", 1: "the backward of forward"}


class GatherTags:
    """The tags of one zero3 engine's gathers (Note [gather tags]). `where_now()` returns (forwards so far,
    phase 0 forward / 1 backward, unit ids run so far in this pass, in order)."""

    def __init__(self, units: list[FlatUnit], group, where_now: Callable[[], tuple[int, int, list[int]]],
                 agreement: Agreement):
        self.units = units
        self.index = {id(unit): i for i, unit in enumerate(units)}
        self.world = dist.get_world_size(group)
        self.group = new_host_group(group) if self.world > 1 else None
        self.where_now, self.agreement = where_now, agreement
        agreement.on_refused = self.explain  # a rank refused while this one waits for its header
        agreement.on_refusing = self.refuse  # this rank refuses at a header while others may wait on a tag
        self.refusal = None  # the refusing tag in flight (never waited for: this rank is raising)
        self.pending: dict[int, tuple] = {}  # id(unit) -> (work, received)

    def send(self, unit: FlatUnit) -> None:
        """Issue `unit`'s tag, right after issuing its gather."""
        if self.group is None:
            return
        forwards, phase, order = self.where_now()
        ran = [self.index[key] for key in order if key in self.index]
        recent = ran[-ORDER_SLOTS:]
        row = [self.index[id(unit)], forwards, phase, len(ran)] + recent + [-1] * (ORDER_SLOTS - len(recent))
        sent = torch.tensor(row, dtype=torch.int64)
        received = torch.empty(self.world * sent.numel(), dtype=torch.int64)
        with named_failure(f"the tag of the all-gather of unit {unit.label} ({unit.where})"):
            work = start_all_gather_rows(received, sent, self.group)
        self.pending[id(unit)] = (work, sent, received)

    def check(self, unit: FlatUnit) -> None:
        """Before `unit`'s gathered values are used: every rank's gather at this place carried this unit,
        in the same phase, or the same ShardwiseError on every rank."""
        entry = self.pending.pop(id(unit), None)
        if entry is None:
            return
        work, _sent, received = entry
        with named_failure(f"the tag of the all-gather of unit {unit.label} ({unit.where})"):
            work.wait()
        rows = received.view(self.world, -1).tolist()
        if all(row[:3] == rows[0][:3] for row in rows):
            return
        self.pending.clear()
        if any(row[2] == REFUSED for row in rows):  # refused at its header (Note [uneven work]): so is this one's
            self.agreement.confirm()
            raise ShardwiseError("another rank refused this step at its header (its own error says why)")
        self.agreement.refuse()  # the others may wait for this rank's next header, not on a tag
        for rank, row in enumerate(rows[1:], start=1):
            if row[1] != rows[0][1]:  # a forward only some ranks ran: the header's own words (agreement.py)
                raise ShardwiseError(f"ranks 0 and {rank} {DIFFERENT_FORWARDS}")
        lines = []
        for rank, (unit_at, forwards, phase, num_ran, *recent) in enumerate(rows):
            names = [self.units[i].label for i in recent if i >= 0]
            ran = ", ".join((["..."] if num_ran > len(names) else []) + names) or "no unit yet"
            lines.append(f"rank {rank} ran {ran} in {_PHASES.get(phase, 'a pass of forward')} {forwards}, then "
                         f"gathered {self.units[unit_at].label}")
        raise ShardwiseError(
            "ranks ran the units of a zero3 model in different orders (or different units): "
            + "; ".join(lines) + ". Under zero3 each unit's all-gather pairs with the other ranks' gather at the "
            "same place, so every rank must run the same units in the same order in each forward (branches "
            "inside a unit may differ). Run the same order on every rank, or use strategy='zero2', which "
            "keeps full parameters and takes any order (Note [gather tags], gather_tags.py).")

    def refuse(self) -> None:
        """This rank refuses at a header (Note [uneven work], agreement.py) while the others may wait on a tag:
        send them one that says so; they raise the header's words (their header pairs with this rank's)."""
        if self.group is None:
            return
        self.pending.clear()
        sent = torch.full((4 + ORDER_SLOTS,), REFUSED, dtype=torch.int64)
        received = torch.empty(self.world * sent.numel(), dtype=torch.int64)
        self.refusal = (start_all_gather_rows(received, sent, self.group), sent, received)

    def explain(self) -> None:
        """Another rank refused (its tag differed from this rank's at some gather still in flight here):
        check the tags in flight, in issue order, and raise the same words it did."""
        for key in list(self.pending):
            self.check(next(unit for unit in self.units if id(unit) == key))
