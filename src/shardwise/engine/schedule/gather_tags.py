"""zero3: which unit each rank's k-th all-gather carries, checked before its values are used (gloo) or
before any optimizer step applies them (a device). Uses: agreement, collectives, context, flat_unit,
groups, small, streams.

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

`host_waits` counts the times the host thread blocked on tags (tests and bench/overhead/tag_cost.py read it): here one
per tagged gather. On gloo that is cheap, since the host waits for the gather itself there anyway; on a
device it is a host rendezvous per unit on the GPU's critical path, which Note [tags on the device] removes.

Note [tags on the device]: where the engine's gathers run on a device (NCCL), `TagsOnDevice` sends each tag as a
small all-gather on the gathers' own group and stream (comm.gather_rows), issued right after the unit's gather,
so it pairs in issue order exactly as the gathers do and never blocks the host: no host group, no wait per unit.
As a unit's gather lands, its tag's rows are copied to host memory on the gathers' stream, right behind the tag
(a non-blocking copy and an event: the host queues them and goes on). The host reads them at `settle()`: before
every optimizer step over the engine's parameters (optim_hooks.StepWatch: in-backward and whole-tensor steps go
through the same hook), and after SETTLE_STEPS steps' worth of tags without a step (evaluation, generate()); by
then the copies have long passed (the gathers' stream is as far as the step's last gather, not the backward's
end), so a step applies nothing computed from a mismatched gather, and every rank raises the same words, as
every rank reads the same tags in the same order. Ranks whose gathers stop pairing at all (one rank re-gathers a
unit the others do not: a backward waiting for a collective no rank issues) leave the device waiting, not the
host: the host reaches the step, whose tags before the stuck gather already name the order that differs (as
designed: no GPU has run it yet). What it gives up against the per-unit check: a loss computed from another
unit's rows may reach the user before the error (the step is refused, the parameters stay as they were), and the
process group is spent after such an error, as after any mismatched collective. FSDP2 has no such check at all.
On gloo the per-unit check stays: the host waits for each gather there anyway, and a tag costs no rendezvous the
gather did not already cost (tests/test_gather_tags.py counts both; forced onto gloo, the device form waits once
a step, at the step, and its backward can wait for a gather no rank issued, where the host form refuses first).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from shardwise.engine.comm.collectives import named_failure
from shardwise.engine.comm.context import CommContext
from shardwise.engine.comm.small import host_values_to, start_all_gather_rows, wait_for_copy
from shardwise.engine.comm.streams import GATHER
from shardwise.engine.layout.groups import new_host_group
from shardwise.engine.schedule.agreement import DIFFERENT_FORWARDS, REFUSED, Agreement
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.errors import ShardwiseError
from shardwise.wire.backends import on_device

ORDER_SLOTS = 12  # the last units run, named in the error (earlier ones are elided)
# Tags on the device compared without an optimizer step at least every SETTLE_STEPS steps' worth (a step tags
# at most two gathers a unit): evaluation and generate() loops, never in the middle of a training step.
SETTLE_STEPS = 2
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
        self.host_waits = 0  # times the host blocked on tags (module docstring)

    def _row(self, unit: FlatUnit) -> list[int]:
        """`unit`'s tag: [unit index, forwards so far, phase, units run so far, the last ORDER_SLOTS of them]."""
        forwards, phase, order = self.where_now()
        ran = [self.index[key] for key in order if key in self.index]
        recent = ran[-ORDER_SLOTS:]
        return [self.index[id(unit)], forwards, phase, len(ran)] + recent + [-1] * (ORDER_SLOTS - len(recent))

    def settle(self) -> None:
        """Before an optimizer step: nothing left to check here, every tag was checked as its gather landed."""

    def send(self, unit: FlatUnit) -> None:
        """Issue `unit`'s tag, right after issuing its gather."""
        if self.group is None:
            return
        sent = torch.tensor(self._row(unit), dtype=torch.int64)
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
        self.host_waits += 1
        rows = received.view(self.world, -1).tolist()
        if all(row[:3] == rows[0][:3] for row in rows):
            return
        self.pending.clear()
        if any(row[2] == REFUSED for row in rows):  # refused at its header (Note [uneven work]): so is this one's
            self.agreement.confirm()
            raise ShardwiseError("another rank refused this step at its header (its own error says why)")
        self.agreement.refuse()  # the others may wait for this rank's next header, not on a tag
        self._raise_for(rows)

    def _raise_for(self, rows: list[list[int]]) -> None:
        """The error of tags `rows` (one per rank) that differ, the same words on every rank."""
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


class _TagInFlight:
    """One tag sent on the device: its handle, then (once landed) its rows' host copy and the event after it."""

    def __init__(self, pending) -> None:
        self.pending, self.host_rows, self.passed = pending, None, None


class TagsOnDevice(GatherTags):
    """zero3's tags where the gathers run on a device: sent on the gathers' own group and stream, compared
    before the next optimizer step (Note [tags on the device])."""

    def __init__(self, units: list[FlatUnit], group, where_now: Callable[[], tuple[int, int, list[int]]],
                 agreement: Agreement, comm: CommContext):
        self.units, self.comm = units, comm
        self.device = units[0].full_flat.device  # where the gathers land (NCCL: the comm context's device)
        self.index = {id(unit): i for i, unit in enumerate(units)}
        self.world, self.group = dist.get_world_size(group), group
        self.where_now, self.agreement = where_now, agreement
        agreement.on_refused = self.settle
        self.in_flight: list[_TagInFlight] = []  # in issue order
        self.of_unit: dict[int, _TagInFlight] = {}  # id(unit) -> its last tag, until that lands
        self.host_waits = 0
        self.settle_every = SETTLE_STEPS * 2 * len(units)

    def send(self, unit: FlatUnit) -> None:
        sent = host_values_to(self._row(unit), torch.int64, self.device)
        tag = _TagInFlight(self.comm.gather_rows(
            sent, self.world, self.group, f"the tag of the all-gather of unit {unit.label} ({unit.where})"))
        self.in_flight.append(tag)
        self.of_unit[id(unit)] = tag
        if len(self.in_flight) >= self.settle_every:
            self.settle()

    def check(self, unit: FlatUnit) -> None:
        """As `unit`'s gather lands: its tag's rows (and those of every tag before it) are copied to the host on
        the gathers' stream, right behind the tag, so a later hang of the device cannot hold back the copy that
        names it; nothing blocks the host. Rows on a host group (this class forced onto gloo) wait for `settle`."""
        tag = self.of_unit.pop(id(unit), None)
        if tag is None or tag.pending.output.device.type == "cpu":
            return
        for earlier in self.in_flight[: self.in_flight.index(tag) + 1]:
            if earlier.passed is None:
                self._land(earlier)

    def _land(self, tag: _TagInFlight) -> None:
        api = self.comm.api
        with self.comm.streams.by_kind[GATHER]:  # behind the tag's own collective, not the compute stream's work
            tag.host_rows = tag.pending.wait().to("cpu", non_blocking=True)
            tag.passed = api.new_event()
            tag.passed.record(api.current())

    def explain(self) -> None:
        self.settle()

    def settle(self) -> None:
        """Compare every tag in flight, in issue order, on the host once its copy passed; the first that
        differs raises the same words on every rank (Note [tags on the device])."""
        in_flight, self.in_flight = self.in_flight, []
        self.of_unit.clear()
        # A host rendezvous only where the tags ran on a host group (this class forced onto gloo: tests, bench):
        # one for the step's tags together.
        self.host_waits += int(any(tag.passed is None for tag in in_flight))
        for tag in in_flight:
            if tag.passed is None:
                self._land(tag)
            wait_for_copy(tag.passed)
            rows = self.rows_of(tag)
            if any(row[:3] != rows[0][:3] for row in rows):
                self._raise_for(rows)

    def rows_of(self, tag: _TagInFlight) -> list[list[int]]:
        """Every rank's row of `tag`, from its host copy (the copy has passed)."""
        return tag.host_rows.view(self.world, -1).tolist()


def make_tags(units: list[FlatUnit], group, where_now: Callable[[], tuple[int, int, list[int]]],
              agreement: Agreement) -> GatherTags:
    """The tags of a zero3 engine whose gathers run on `group`: checked per unit on the host (gloo), before the
    step on a device (Note [tags on the device])."""
    if dist.get_world_size(group) > 1 and on_device(group):
        return TagsOnDevice(units, group, where_now, agreement, units[0].comm)
    return GatherTags(units, group, where_now, agreement)
