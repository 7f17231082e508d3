"""Streams and events (Note [streams per collective], engine/comm/streams.py), read back on CPU through a device
API that records every call (tests/helpers/recording_streams.py): what a GPU's queues would be asked to wait for."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
import shardwise.engine.comm.context as context
from helpers.recording_streams import RecordingApi
from shardwise.engine.comm.context import CommContext
from shardwise.engine.comm.streams import HostApi, device_api


def test_this_cpu_build_gets_the_host_order():
    """Catches the engine asking torch's CPU streams for events (`torch.Event(device="cpu").record()` raises on
    this torch): a CPU device gets the host's order, whose waits do nothing (Note [one device path])."""
    api = device_api(torch.device("cpu"))
    assert isinstance(api, HostApi)
    event = api.new_event()
    event.record(api.current())
    api.current().wait_event(event)
    assert event.query()


def test_the_accelerator_gets_torchs_streams_and_the_cpu_the_host_order(monkeypatch):
    """Catches a device-specific branch beside `device_api` picking the streams (Note [one device path]): with an
    accelerator present its device gets torch's generic streams and events, the CPU still the host's order."""
    from shardwise.engine.comm.streams import DeviceApi

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert isinstance(device_api(torch.device("cuda", 0)), DeviceApi)
    assert isinstance(device_api(torch.device("cpu")), HostApi)


def test_pooled_memory_is_taken_only_after_its_last_readers_event():
    """Catches a buffer reused before the stream that read it passed its event (Note [streams per collective]):
    zero3's freed full values go to the pool with an event recorded on the compute stream that read them, a
    collective's buffer with the collective's own event; the next taker's stream waits for exactly that event
    before it writes."""
    from shardwise.engine.comm.buffers import BufferPool

    api = RecordingApi()
    pool = BufferPool(bound=1 << 20, smallest=0, api=api)
    freed = torch.empty(1000, dtype=torch.uint8).untyped_storage()
    pool.keep_memory(freed)  # a unit's full values, read on the compute stream
    ((_, freed_event, stream),) = [entry for entry in api.log if entry[0] == "record"]
    assert stream == "compute"
    refill = torch.UntypedStorage(0)
    start = len(api.log)
    pool.fill(refill, 1000)
    assert api.log[start:] == [("wait_event", "compute", freed_event)]
    lent = pool.lend(250, torch.float32, "cpu")
    collective = api.new_event()
    with api.new_stream() as side:
        collective.record(side)  # the collective that read `lent`, landed on its stream
    pool.give_back(lent, after=collective)
    start = len(api.log)
    pool.lend(250, torch.float32, "cpu")
    assert api.log[start:] == [("wait_event", "compute", collective.id)]


def _handles_and_events():
    """Two gathers, a reduce and a replica all-reduce issued through one context, landed out of their issue
    order; then a lend of the gathers' buffer size. Returns what each wait asked the streams."""
    api = RecordingApi()
    comm = CommContext(torch.device("cpu"), api=api)
    comm.bound_buffers(1 << 22)
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()

    def gather(value: float):
        # Two parameters of under 64 KiB a rank: packed into one lent buffer (Note [gathered in place])
        rows = [torch.full((10000,), value + rank), torch.full((9000,), value - rank)]
        regions = [torch.empty(world * 10000), torch.empty(world * 9000)]
        return comm.gather_into(rows, regions, world, group, f"gather {value}"), regions

    issued = len(api.log)
    handles = {}
    handles["a"], regions_a = gather(1.0)
    handles["b"], _ = gather(2.0)
    handles["r"] = comm.reduce_scatter_avg(torch.arange(world * 30000, dtype=torch.float32), world, group, "reduce")
    handles["c"] = comm.all_reduce_avg(torch.ones(10), group, "replica")
    issue_log = api.log[issued:]
    buffers = {name: [b.data_ptr() for b in pending.lent] for name, pending in handles.items()}
    waits = {}
    for name in ("b", "a", "r", "c"):  # out of issue order: b's wait must not stand for a's
        start = len(api.log)
        handles[name].wait()
        waits[name] = (handles[name].stream.name, handles[name].event.id, api.log[start:])
    start = len(api.log)
    again = comm.lend(world * 19000, torch.float32, torch.device("cpu"))
    reuse = (again.data_ptr(), api.log[start:])
    assert regions_a[0].view(world, -1)[:, 0].tolist() == [1.0 + r for r in range(world)]
    return issue_log, waits, buffers, reuse


def test_each_consumer_waits_for_its_own_collectives_event_only(ranks):
    """Catches a consumer that waits for the whole side stream, or another handle's event, instead of its own
    (a prefetched gather still in flight would hold up the unit whose gather landed; a wrong event lets it read
    values not yet landed), collectives of one kind queued behind another's, and a pooled buffer lent again
    before the stream that read it passed its event: each kind issues on a stream of its own after waiting for
    the compute stream, each wait records its handle's event on that stream and the compute stream waits for
    that one event, and the next taker of a buffer waits for the event of the collective that read it."""
    for issue_log, waits, buffers, (reused, reuse_log) in ranks.run(_handles_and_events, 2, timeout=60):
        streams = {name: stream for name, (stream, _, _) in waits.items()}
        assert streams["a"] == streams["b"], streams  # the gathers' stream
        assert len({streams["a"], streams["r"], streams["c"]}) == 3, streams
        for name in ("a", "r", "c"):  # issued after the compute stream's work, on its own stream
            assert ("wait_stream", streams[name], "compute") in issue_log, issue_log
        assert not any(entry[0] == "record" for entry in issue_log), issue_log  # events come at landing
        for name, (stream, event, log) in waits.items():
            assert ("record", event, stream) in log, (name, log)
            compute_waits = [entry for entry in log if entry[1] == "compute"]
            assert compute_waits == [("wait_event", "compute", event)], (name, log)
        owner = next(name for name, ptrs in buffers.items() if reused in ptrs)
        assert reuse_log == [("wait_event", "compute", waits[owner][1])], (owner, reuse_log)


class _Chain(nn.Module):
    def __init__(self, num_units: int = 3, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(width, width) for _ in range(num_units)])

    def forward(self, x):
        return self.blocks(x).pow(2).mean()


def _engine_stream_calls(strategy: str):
    """Two steps of a small model with the recording API in every context the engine builds."""
    apis = []

    def recording(device):
        apis.append(RecordingApi())
        return apis[-1]

    original, context.device_api = context.device_api, recording  # this rank process, this engine only
    try:
        torch.manual_seed(0)
        model = _Chain()
        sw.shard(model, strategy=strategy, units=nn.Linear)
    finally:
        context.device_api = original  # the pool's rank processes run later tests
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(4, 64)).backward()
        optim.step()
        optim.zero_grad()
    (api,) = apis
    recorded = {entry[1]: entry[2] for entry in api.log if entry[0] == "record"}
    return api.waits_of("compute"), recorded


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_engine_waits_for_events_never_for_a_stream(ranks, strategy):
    """Catches an engine path that lands a collective by waiting for a whole side stream (today's CUDA code
    did: `compute.wait_stream(side)`) or on the host alone: in a training step every wait of the compute
    stream is for an event: one a collective recorded on its own side stream as it landed, or (zero3) one the
    compute stream recorded when it freed a unit's memory into the pool, which it takes back."""
    for compute_waits, recorded in ranks.run(_engine_stream_calls, 2, strategy, timeout=60):
        assert compute_waits, "no collective landed through the context"
        assert all(kind == "wait_event" and event in recorded for kind, _, event in compute_waits), compute_waits
        landed = [event for _, _, event in compute_waits if recorded[event] != "compute"]
        assert landed and all(recorded[event].startswith("side") for event in landed), (compute_waits, recorded)


def _deep() -> nn.Module:
    return _Chain(num_units=6, width=16)


def _in_flight(prefetch):
    """Losses of three zero3 steps at `prefetch`, and the most gathers ever issued ahead of use."""
    from shardwise.engine import engine_of

    torch.manual_seed(0)
    model = _deep()
    sw.shard(model, strategy="zero3", units=nn.Linear, prefetch=prefetch)
    gathers = engine_of(model).driver.gathers
    most, issue = [0], gathers.issue

    def counting(queue, up_to=None):
        issue(queue, up_to)
        most[0] = max(most[0], len(gathers.prefetching))

    gathers.issue = counting
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = model(torch.full((4, 16), 0.1 * (step + 1 + dist.get_rank())))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, most[0]


def test_prefetch_sets_the_gathers_in_flight_and_changes_no_value(ranks):
    """Catches `prefetch=` not reaching the gather schedule (the depth fixed at the stage's), or a depth that
    changes what is computed: zero3 keeps at most `prefetch` gathers issued ahead of use, reaches that many
    on a model of six units, and its losses are bitwise the default's."""
    default = ranks.run(_in_flight, 2, None, timeout=60)
    assert {most for _, most in default} == {1}  # Note [prefetch depth]: PREFETCH, FSDP2's one unit ahead
    for prefetch in (2, 4):
        for (losses, most), (reference, _) in zip(ranks.run(_in_flight, 2, prefetch, timeout=60), default):
            assert most == prefetch
            assert losses == reference


def test_the_estimate_counts_each_prefetched_unit():
    """Catches an estimate (and a comm pool bound) that ignores `prefetch`: each gather more in flight holds one
    more unit's full values."""
    model = _deep()
    peaks = [sw.estimate(model, strategy="zero3", world_size=2, prefetch=p, runtime=0).gather_buffers
             for p in (1, 2, 3)]
    unit = 16 * 16 * 4 + 16 * 4  # one Linear's full values, fp32 (padding: none at 2 ranks)
    assert peaks[1] - peaks[0] == peaks[2] - peaks[1] >= unit, peaks
