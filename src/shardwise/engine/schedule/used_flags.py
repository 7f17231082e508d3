"""Which parameters any rank used this backward (Note [unused params], unit_grads.py), agreed for the reducer
(reducer.py): on the host group where the engine's collectives run on the host (gloo), on the device where they
run on a device (NCCL). Uses: collectives, flat_unit, groups, small, streams.

Note [used flags on the device]: on gloo the flags are one all-reduce of host values on the host group once the
backward's reduces landed, where the host waits for those reduces anyway (`UsedFlags`, as before). On NCCL that
all-reduce ran on a gloo group beside NCCL: the one rendezvous of the ranks' CPUs a step left once the headers
and tags went to the device (Note [headers on the device], agreement_device.py). So where the engine's
collectives run on a device, `UsedFlagsOnDevice`:

- sends this rank's flags as a small all-reduce (MAX) of a device tensor on a group of their own with the
  engine's backend (a channel of their own: flags pair only with the other ranks' flags, whatever else is in
  flight, as the headers do), on a stream of its own, and copies the result to host memory on that stream
  right behind it (a non-blocking copy and an event: nothing blocks the host);
- issues it at the same place on every rank whatever the rank's flags (every rank reduces the same units in the
  same order, Note [collective order]): right after the backward's last reduce is issued, one exchange for
  every unit reduced (it then travels beside the last reduces instead of after them); under
  sw.optimizer_in_backward right after each unit's reduce, that unit's flags alone (the unit is stepped as its
  reduce lands, Note [optimizer in backward]: one small collective a unit, never a host rendezvous a unit);
- reads the result only on a rank that did not use some parameter it reduces: where this rank used every one,
  the OR over the ranks is all True whatever the others sent, so it hands out every row and never waits.

So a step whose ranks use every parameter (the steady state of a training run) makes no host rendezvous and no
device sync for its flags. A rank that skipped a parameter waits for the copy of the result (one host wait a
backward, one per such unit under optimizer_in_backward): the stated allowance, counted in `host_waits`
(tests/test_agreement_fake_gpu.py counts 0 on the fake accelerator where every parameter is used;
tests/test_used_flags_device.py runs this form forced onto gloo, an unused parameter included). An exchange no
rank reads is dropped unread: the device keeps its tensors as long as its collective and copy need them (they
were allocated on the flags' stream, and the work keeps what it sends), the host copy's pinned memory is kept
by its allocator until the copy ran.

The flags span the engine's whole group: on a hybrid mesh every replica (a parameter used on one replica gets
its gradient on every one), as the host form's group does (zero.py). A rank whose units or order differ from
the others' pairs its flags with theirs wrongly, as its reduces pair wrongly: the headers compared before the
step refuse that step on every rank (Note [headers on the device]) before any value it computed is applied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.engine.comm.collectives import any_rank, named_failure
from shardwise.engine.comm.small import host_values_to, start_all_reduce_max, wait_for_copy
from shardwise.engine.comm.streams import device_api
from shardwise.engine.layout.groups import make_group
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.wire.backends import on_device

WHAT = "the agreement on which parameters have gradients"


class UsedFlags:
    """The host form: `send` keeps this rank's flags, `agree` OR-s them over the host group (a host rendezvous,
    where the host has waited for the reduces already: gloo)."""

    def __init__(self, host_group) -> None:
        self.host_group = host_group
        self.host_waits = 0  # the device form's count; here every agreement is on the host

    def send(self, flags: list[bool]) -> list[bool]:
        """Nothing sent ahead: the flags travel at `agree`."""
        return flags

    def agree(self, sent: list[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks."""
        return any_rank(sent, self.host_group)


class _Exchange:
    """One exchange of flags on the device: this rank's flags, the collective's handle and tensor until it is
    queued behind, then the host copy of the result and the event after that copy."""

    def __init__(self, flags: list[bool]) -> None:
        self.flags = flags
        self.work, self.values, self.host, self.passed = None, None, None, None


class UsedFlagsOnDevice:
    """The flags where the engine's collectives run on `device` (Note [used flags on the device])."""

    def __init__(self, group, device: torch.device) -> None:
        self.group = make_group(dist.get_process_group_ranks(group), like=group, backend=dist.get_backend(group),
                                local=True, what="a used-flags group")
        self.device, self.api = torch.device(device), device_api(device)
        self.stream = self.api.new_stream()
        self.host_waits = 0  # reads of a result: one per exchange this rank did not use every parameter of

    def send(self, flags: list[bool]) -> _Exchange:
        """Issue the OR of `flags` over the ranks, whatever they are (every rank issues the same exchanges)."""
        exchange = _Exchange(flags)
        if not flags:  # no parameter reduced: on every rank alike
            return exchange
        with self.stream:  # behind nothing of the compute stream's: the flags are the host's values
            exchange.values = host_values_to(flags, torch.int32, self.device)
            with named_failure(WHAT):
                exchange.work = start_all_reduce_max(exchange.values, self.group)
        if self.device.type != "cpu":  # on a host group (forced onto gloo) the host would wait here: at `agree`
            self._land(exchange)
        return exchange

    def agree(self, exchange: _Exchange) -> list[bool]:
        """Each flag OR-ed over the ranks: this rank's own where it used every parameter (nothing read), else the
        exchange's result, read on the host once its copy passed (the allowance, counted)."""
        if all(exchange.flags):
            return exchange.flags
        self.host_waits += 1
        if exchange.passed is None:
            self._land(exchange)
        wait_for_copy(exchange.passed)
        return self.result_of(exchange)

    def _land(self, exchange: _Exchange) -> None:
        """The result copied to the host on the flags' stream, behind its collective: a stream wait on a device,
        the host's wait on a host group."""
        with self.stream:
            with named_failure(WHAT):
                exchange.work.wait()
            exchange.host = exchange.values.to("cpu", non_blocking=True)
            exchange.passed = self.api.new_event()
            exchange.passed.record(self.stream)
        exchange.work = exchange.values = None

    def result_of(self, exchange: _Exchange) -> list[bool]:
        """The OR over the ranks, from the result's host copy (the copy has passed)."""
        return [bool(value) for value in exchange.host.tolist()]


def make_used_flags(units: list[FlatUnit], group, host_group) -> UsedFlags | UsedFlagsOnDevice:
    """The used flags of an engine whose collectives run on `group`: OR-ed on `host_group` when asked (gloo), sent
    on the device as the reduces are and read only where needed (Note [used flags on the device])."""
    if dist.get_world_size(group) > 1 and on_device(group):
        return UsedFlagsOnDevice(group, units[0].full_flat.device)
    return UsedFlags(host_group)
