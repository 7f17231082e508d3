"""Streams and events through torch's device-generic API, so the CPU runs the code a GPU runs.
Uses: nothing of the engine.

Note [one device path]: the engine's collectives are ordered by streams and events, and every call goes
through one `DeviceApi` (torch 2.13's `torch.Stream`, `torch.Event`, `torch.accelerator.current_stream`;
nothing under `torch.cuda`). On this CPU-only torch `torch.Stream(device="cpu")` exists but
`torch.Event(...).record()` raises ("cpu backend doesn't support events") and `torch.accelerator` has no
current stream, so a device that is not the accelerator gets `HostApi`: one stream, the host's program
order, whose waits and records do nothing, because a collective's `wait()` on such a device returns on the
host only once its values are there. The engine's code is the same on both: it issues on a stream, records
an event, waits for that event; on CPU those calls are no-ops, on a GPU they order the queues. A test can
hand a context any object with the same methods (tests/test_streams.py records every call).

The branches that remain device-specific, all of them:
- `device_api` here: the accelerator's API where the device is the accelerator, the host's otherwise.
- `DeviceApi.keep_for`: a tensor allocated on a side stream and read on another is `record_stream`-ed for
  the caching allocator; host memory has no allocator streams.
- Which device an engine computes on, from its group's backend (NCCL: the current accelerator device):
  comm/context.py `CommContext.for_group`, unit/flat_unit.py, layout/groups.py, memory/precision.py,
  schedule/consistency.py, wire/messages.py (each through wire/backends.py, Note [group backends]); ddp.py's
  `device_ids`; dist.py's `sw.init` choosing each rank's device where NCCL serves it.
- Where a gather tag is checked (Note [gather tags], schedule/gather_tags.py): at once where the tags land
  on the host (gloo), later, off the critical path, where they land on a device (`TagsOnDevice`); likewise
  the agreement's headers (Note [headers on the device], schedule/agreement_device.py: `HeadersOnDevice`) and
  the used-parameter flags (Note [used flags on the device], schedule/used_flags.py: `UsedFlagsOnDevice`).
- The checkpoints' pinned copies and RNG states (checkpoint/): not the engine's streams.

Note [streams per collective]: as FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
`FSDPCommContext`), each kind of collective runs on a stream of its own, so one kind never queues behind
another: `GATHER` (the copy-in of this rank's rows and the all-gather, and the copy-out into the full
values; FSDP2 splits the copy-in onto a stream of its own so the next copy-in overlaps this all-gather;
ours is one `torch.cat` or none at all, Note [gathered in place], so it shares the gather's stream),
`REDUCE` (the pack's reduce-scatter and the average into rows; FSDP2's `reduce_scatter_stream`) and
`REPLICA` (a hybrid mesh's all-reduce over the replicas; FSDP2's `all_reduce_stream`). Then:
- Issue: the collective's stream first waits for the compute stream (it sends finished values), as
  FSDP2's copy-in waits for the current stream.
- Land: each `Pending` records its own event on its stream once its copy-out is queued, and the stream
  that consumes it (the current one) waits for that event only (FSDP2's `all_gather_event`,
  `reduce_scatter_event`, `all_reduce_event`), never for the whole side stream: a prefetched gather
  still in flight on the same stream does not hold up the unit whose gather landed.
- Reuse: a buffer the comm pool lent (Note [reused buffers]) goes back with the event after which every
  stream that read it is done: a collective's buffers with its own event, a zero3 unit's freed full values
  with an event recorded on the compute stream that read them. The next taker's stream waits for those
  events before it writes (FSDP2 keeps the all-gather result referenced until its copy-out event, and
  waits for `_reshard_after_forward_event` before the next all-gather reuses the memory).
- Prefetch depth: `sw.shard(prefetch=N)` (zero3; default 1, as FSDP2's implicit prefetch keeps one unit
  ahead in forward and backward): at most N gathers issued ahead of use (schedule/gather_schedule.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor

GATHER, REDUCE, REPLICA = "gather", "reduce", "replica"
KINDS = (GATHER, REDUCE, REPLICA)


class HostStream:
    """The host's program order: a CPU device's only stream (Note [one device path])."""

    def wait_stream(self, other) -> None:
        """Everything queued on `other` ran already: the host ran it."""

    def wait_event(self, event) -> None:
        """The event's work ran already: the host ran it."""

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc) -> None:
        return None


class HostEvent:
    """An event of the host's order: passed as soon as it is recorded."""

    def record(self, stream=None) -> None:
        """Nothing to mark: the host reached this point."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""


class HostApi:
    """The device-generic API of a device that is not the accelerator (CPU): Note [one device path]."""

    name = "host order"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._stream = HostStream()

    def new_stream(self) -> HostStream:
        return self._stream

    def new_event(self) -> HostEvent:
        return HostEvent()

    def current(self) -> HostStream:
        return self._stream

    def keep_for(self, tensor: Tensor, stream) -> None:
        """No allocator streams on the host."""


class DeviceApi:
    """torch's device-generic streams and events on the accelerator (`torch.Stream`, `torch.Event`)."""

    name = "streams per collective"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def new_stream(self) -> torch.Stream:
        return torch.Stream(device=self.device)

    def new_event(self) -> torch.Event:
        return torch.Event(device=self.device)

    def current(self) -> torch.Stream:
        return torch.accelerator.current_stream(self.device)

    def keep_for(self, tensor: Tensor, stream) -> None:
        """`tensor` may have been allocated on a side stream: the caching allocator keeps its memory until
        `stream`'s work queued so far is done (Note [one device path])."""
        if tensor.device.type == self.device.type:
            tensor.record_stream(stream)


def device_api(device: torch.device) -> HostApi | DeviceApi:
    """The API of `device`: torch's streams and events on the accelerator, the host's order elsewhere."""
    device = torch.device(device)
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and device.type == accelerator.type:
        return DeviceApi(device)
    return HostApi(device)


HOST_ORDER = HostApi(torch.device("cpu"))  # a Pending issued outside any context: a CPU group's, waited in order


class CommStreams:
    """One engine's streams, one per kind of collective (Note [streams per collective])."""

    def __init__(self, api) -> None:
        self.api = api
        self.by_kind = {kind: api.new_stream() for kind in KINDS}

    @contextmanager
    def issue(self, kind: str):
        """Run the enclosed issue on `kind`'s stream, after everything the compute stream queued so far."""
        stream = self.by_kind[kind]
        stream.wait_stream(self.api.current())
        with stream:
            yield stream
