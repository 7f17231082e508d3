"""The agreement's headers where the engine's collectives run on a device (NCCL): sent on a device group of their
own and compared before the next optimizer step, never waited for by the host at a phase. Uses: agreement,
collectives, flat_unit, groups, small, streams.

Note [headers on the device]: on gloo a header (Note [agreement rides the traffic], agreement.py) is confirmed
where the host waits for the phase's collectives anyway, so it costs no rendezvous the payload did not already
cost. On NCCL the engine's own waits are stream waits, and each `confirm` was a wait of the ranks' CPUs for each
other's header on a gloo group: about three a step (the forward's, the backward's, the step's), on the critical
path of a GPU that the hosts are meant to run ahead of. So where the gathers run on a device, as zero3's tags do
(Note [tags on the device], gather_tags.py), `HeadersOnDevice`:

- sends each header as a small all-gather on a group of its own with the engine's backend (a channel of its own:
  a header pairs only with the other ranks' next header, whatever their phase, as on gloo), issued on a stream
  of its own (never queued behind a gather or a reduce that may never pair), its rows copied to host memory on
  that stream right behind it (a non-blocking copy and an event: nothing blocks the host);
- compares them, in issue order, at `settle()`: before every optimizer step over the engine's parameters
  (`agree_on_step` and StepWatch.before_step: in-backward and whole-tensor steps go through the same hook),
  before zero3's tags (gather_tags.py), so no step applies values computed in a phase the ranks disagree on,
  and every rank raises the same words (each reads the same rows, and the first that differ say why);
- sends the step's own header (STEP, Note [uneven work]) after that comparison and compares it at the next
  settle, with the next step's forward and backward;
- compares without a step once SETTLE_HEADERS headers are in flight (evaluation, generate()): all but the
  newest, which may still be on its way.

So a training step (forward, backward, clipping, the optimizer step) makes no host rendezvous for its headers:
at its settle the forward's and backward's headers went out a phase or more earlier on every rank whose host
keeps pace, so their copies have passed; the host blocks there only where another rank's host is a whole phase
behind, and counts it. (The used-parameter flags, which met the hosts at the backward's end before, ride the
device too, and are read only by a rank that did not use every parameter: Note [used flags on the device],
used_flags.py.) `host_waits` counts the times the
host thread blocked for a header: one per settle where a header had not landed on a host group (this class forced
onto gloo: tests, bench/overhead/tag_cost.py) or its copy had not passed on a device (the event's query, before
the wait), one per settle without a step, one per write below; a training step on a device expects none
(tests/test_agreement_fake_gpu.py counts them on the fake accelerator).

The host waits a step on a device may make, all of them (each counted): the write below, and a rank's read of
the used flags in a backward where it did not use some parameter (Note [used flags on the device]).

Kept on the host's path, as set-up, the one thing that must be decided before collectives are issued: a write
of the user's (`p.data.mul_()`, `load_state_dict`, `sw.load`) is seen only by the ranks that made it, and it
decides zero1/zero2's re-gathers (Note [agreement rides the traffic] (a)), so a forward whose header flags a
write waits for that header here before any re-gather is issued (one host wait: the allowance). Its header
still rides the device channel, so it pairs with whatever header the other ranks send next.

What it gives up against confirming each phase on the host (no GPU has run it yet):
- a forward, backward or step whose header differs is refused at the next settle instead of at its phase: a
  loss computed from another phase's pairing may reach the user first (no parameter changes: the step is
  refused), and the process group is spent after the error, as after any mismatched collective. A save between
  steps settles every header first, the last STEP header included (`settle_all`, through the engine's
  `settle_agreement`), so it refuses before anything is written;
- uneven work (Note [uneven work]): the step's header is compared at the next settle, so the ranks that reached
  their step first apply that one step before every rank refuses at the next one (their rows are then one step
  ahead of the others'; the run cannot go on: end it and restart from the last checkpoint). On gloo the step
  still waits for its header and refuses before it runs;
- a rank whose collectives stop pairing at all leaves the device waiting, not the host: the headers run on a
  channel and a stream of their own, so the host still reaches the settle that names the difference (or, where
  the other ranks stopped sending headers, the group's timeout);
- which words are raised when a header and a tag differ in the same settle: the header's, on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.engine.comm.collectives import named_failure
from shardwise.engine.comm.small import host_values_to, start_all_gather_rows, wait_for_copy
from shardwise.engine.comm.streams import device_api
from shardwise.engine.layout.groups import make_group
from shardwise.engine.schedule.agreement import REFUSED, STEP, Agreement
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.errors import ShardwiseError
from shardwise.wire.backends import on_device

# Headers in flight without a step before the older ones are compared: evaluation loops, generate(); a step of up to
# 7 micro-batches (a STEP header and two a micro-batch) stays under it.
SETTLE_HEADERS = 16


def new_header_group(group) -> dist.ProcessGroup:
    """A group of `group`'s ranks with its backend, for the headers alone (a channel of their own)."""
    return make_group(dist.get_process_group_ranks(group), like=group, backend=dist.get_backend(group), local=True,
                      what="a header group")


class _Header:
    """One header sent on the device: this rank's row, the order it reported, its handle until it lands on the
    device, then its rows' host copy and the event after that copy."""

    def __init__(self, row: list[int], order: list[int], work, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.row, self.order, self.work, self.received, self.sent = row, order, work, received, sent
        self.host_rows, self.passed = None, None


class HeadersOnDevice(Agreement):
    """The agreement's headers where the engine's collectives run on `device` (Note [headers on the device])."""

    def __init__(self, units: list[FlatUnit], group, device: torch.device) -> None:
        super().__init__(units, group, channel=new_header_group)
        self.device, self.api = torch.device(device), device_api(device)
        self.stream = self.api.new_stream()
        self.in_flight: list[_Header] = []  # in issue order

    def announce(self, phase: int, num_forwards: int, order: list[int], regather: list[FlatUnit]) -> None:
        """Send this phase's header; compared at the next settle. A write of the user's among the re-gathers is
        agreed on now, before they are issued (the set-up allowance)."""
        row = self.header(phase, num_forwards, order, regather)
        self.in_flight.append(self._send(row, list(order)))
        if any(flag == 2 for flag in row[4:]):
            self._compare(len(self.in_flight), counted=True)
        elif len(self.in_flight) > SETTLE_HEADERS:
            self._compare(len(self.in_flight) - 1, counted=True)

    def confirm(self) -> None:
        """Nothing at a phase: the headers are compared at `settle` (Note [headers on the device])."""

    def settle(self) -> None:
        """Before an optimizer step: every header in flight compared, in issue order, but a STEP header just
        sent (compared at the next settle, with the next step's)."""
        count = len(self.in_flight)
        if count and self.in_flight[-1].row[2] == STEP:
            count -= 1
        self._compare(count)

    def settle_all(self) -> None:
        """Before values leave the engine (`sw.save`, `save_async`): every header in flight compared, the last
        STEP header included, so a checkpoint never holds rows of ranks whose last step differed (a host wait
        where any is in flight: a save waits for the disk anyway)."""
        self._compare(len(self.in_flight), counted=bool(self.in_flight))

    def agree_on_step(self, num_forwards: int, order: list[int]) -> None:
        """Before an optimizer step: this step's headers compared, then its own STEP header sent, compared at the
        next settle (Note [headers on the device]: what that gives up)."""
        self.settle()
        self.announce(STEP, num_forwards, order, [])

    def refuse(self) -> None:
        """This rank is about to raise: a header that says so, for ranks that wait for its next one."""
        self.in_flight.clear()
        self.refusal = self._send([REFUSED] * (4 + len(self.units)), [])

    def _send(self, row: list[int], order: list[int]) -> _Header:
        where = self.units[0].where
        with self.stream:  # behind nothing of the compute stream's: the header's values are the host's
            sent = host_values_to(row, torch.int64, self.device)
            received = torch.empty(self.world * sent.numel(), dtype=torch.int64, device=self.device)
            with named_failure(f"the agreement of a phase ({where})"):
                work = start_all_gather_rows(received, sent, self.group)
        header = _Header(row, order, work, received, sent)
        if self.device.type != "cpu":  # on a host group (forced onto gloo) the host would wait here: at settle
            self._land(header)
        return header

    def _land(self, header: _Header) -> None:
        """The header's rows copied to the host on the headers' stream, behind its collective: a stream wait on a
        device, the host's wait on a host group."""
        with self.stream:
            with named_failure(f"the agreement of a phase ({self.units[0].where})"):
                header.work.wait()
            header.host_rows = header.received.to("cpu", non_blocking=True)
            header.passed = self.api.new_event()
            header.passed.record(self.stream)
        header.work = header.sent = None

    def _compare(self, count: int, counted: bool = False) -> None:
        """Compare the first `count` headers in flight on the host, in issue order; the first that differs raises
        the same words on every rank. `counted`: a wait outside a step's settle (a host rendezvous)."""
        headers, self.in_flight = self.in_flight[:count], self.in_flight[count:]
        if not headers:
            return
        # the host blocks where a header has not landed (a host group) or its copy has not passed (a device)
        self.host_waits += int(counted or any(header.passed is None or not header.passed.query() for header in headers))
        try:
            for header in headers:
                if header.passed is None:
                    self._land(header)
                wait_for_copy(header.passed)
                self.check(self.rows_of(header), header.order)
        except ShardwiseError:
            self.refuse()
            raise

    def rows_of(self, header: _Header) -> list[list[int]]:
        """Every rank's row of `header`, from its host copy (the copy has passed)."""
        return header.host_rows.view(self.world, -1).tolist()


def make_agreement(units: list[FlatUnit], group) -> Agreement:
    """The agreement of an engine whose collectives run on `group`: confirmed at each phase on the host (gloo),
    before the step on a device (Note [headers on the device])."""
    if dist.get_world_size(group) > 1 and on_device(group):
        return HeadersOnDevice(units, group, units[0].full_flat.device)
    return Agreement(units, group)
