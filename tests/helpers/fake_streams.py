"""Streams and events of the fake accelerator, modelled (Note [modelled streams]); import it only in a process
of its own, after fake_gpu.install().

Note [modelled streams]: the fake accelerator's streams are all one C++ stream (a Python device guard has only
`type_`), so `install()` puts Python streams in torch's device-generic API (`torch.Stream`, `torch.Event`,
`torch.accelerator.current_stream` / `set_stream`, `Tensor.record_stream`) and a dispatch mode gives each op on
a device tensor a place in the current stream's queue. Every stream keeps a vector clock of what it knows to
be done on every other (its own queue; `wait_event` and `wait_stream` merge the clock an event recorded or the
other stream has; `synchronize` makes everything so far done for all). Freeing a storage (`resize_(0)`, how
the engine frees a unit's full values) from a stream that does not know that every op reading or writing it
on another stream is done, with no `record_stream` of that stream on it, is the hazard CUDA's caching
allocator would turn into another tensor's memory under a running kernel: `HAZARDS` names each. Host memory
a `non_blocking` copy reads or writes (pinned: the copy runs on the device's queue, the host goes on) is the
copy's until a `synchronize` makes that copy known done: a host op on it before then (the CPU optimizer
stepping gradient rows still being copied, rows overwritten while the device reads them) is a hazard too.
Every `synchronize` is a host wait for the device: counted with the step's syncs (fake_gpu.note_host_wait).
The engine's streams are the device API's where its group runs on the accelerator (engine/comm/context.py:
a MIXED world, fake_gpu.fake_world); on the plain fake world it has the host's order, and only code that uses
the device-generic API itself is checked.
"""

from __future__ import annotations

import itertools
import traceback

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.fake_gpu import DEVICE, is_pinned, note_host_wait, tensors_of

HAZARDS: list[str] = []
_ids = itertools.count()
_done: dict[int, int] = {}  # what a synchronize made known to be done, by stream id
_accesses: dict[int, dict[int, int]] = {}  # storage -> stream id -> the last queue position touching it
_recorded: dict[int, set[int]] = {}  # storage -> streams record_stream named
_host_pending: dict[int, tuple[int, int]] = {}  # host storage -> (stream, position) of a non_blocking copy of it
_streams: list = []


class ModelStream:
    """A stream: a queue position and what it knows to be done elsewhere (Note [modelled streams])."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.id = next(_ids)
        _streams.append(self)
        self.device = torch.device(DEVICE, 0)
        self.position = 0
        self.known: dict[int, int] = {}

    def wait_event(self, event):
        _merge(self.known, event.clock)

    def wait_stream(self, stream):
        _merge(self.known, {**stream.known, stream.id: stream.position})

    def record_event(self, event=None):
        event = event or ModelEvent()
        event.record(self)
        return event

    def synchronize(self):
        note_host_wait("stream.synchronize")
        _merge(_done, {self.id: self.position})

    def query(self):
        return True

    def __enter__(self):
        self._previous = _current[0]
        _current[0] = self

    def __exit__(self, *exc):
        _current[0] = self._previous

    def __eq__(self, other):
        return isinstance(other, ModelStream) and other.id == self.id

    def __hash__(self):
        return self.id


class ModelEvent:
    """An event: the clock of the stream it was recorded on, at the record."""

    def __init__(self, *args, **kwargs):
        self.clock: dict[int, int] = {}

    def record(self, stream=None):
        stream = stream or _current[0]
        self.clock = {**stream.known, stream.id: stream.position}

    def wait(self, stream=None):
        (stream or _current[0]).wait_event(self)

    def synchronize(self):
        note_host_wait("event.synchronize")
        _merge(_done, self.clock)

    def query(self):
        # the model's work is always done: a True answer tells the host so, as a real one does (what was recorded
        # before it is known done, e.g. a device form's tag, whose buffers go after its settle queried its copy)
        _merge(_done, self.clock)
        return True


def _merge(into: dict[int, int], clock: dict[int, int]) -> None:
    for stream, position in clock.items():
        into[stream] = max(into.get(stream, 0), position)


_current = [None]


def _key(tensor) -> int:
    return tensor.untyped_storage()._cdata


class StreamOrder(TorchDispatchMode):
    """Gives each op on a device tensor its place in the current stream and notes which storages it touched;
    checks each host op against the copies of host memory still in flight (Note [modelled streams])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_of(args, kwargs)
        host = [t for t in tensors if not isinstance(t, FakeTensor) and t.device.type == "cpu"]
        out = func(*args, **kwargs)
        touched = [t for t in tensors + tensors_of(out, {}) if isinstance(t, FakeTensor) and t.device.type == DEVICE]
        if touched:
            stream = _current[0]
            stream.position += 1
            for tensor in touched:
                _accesses.setdefault(_key(tensor), {})[stream.id] = stream.position
            if _copy_in_flight(func, args, kwargs):  # the host memory is the copy's: written by it, or read
                written = args[0].device.type == "cpu"
                for tensor in host:
                    _host_pending[_key(tensor)] = (stream.id, stream.position, written)
        elif not func.is_view and func not in _NO_DATA:
            written = {_key(t) for t in _written(func, args, kwargs)}
            for tensor in host:
                _check_host(func, _key(tensor), _key(tensor) in written)
        return out


_NO_DATA = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.lift_fresh.default,
            torch.ops.aten.is_pinned.default, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}


def _written(func, args, kwargs) -> list:
    """The tensors `func` writes (its schema's mutable arguments)."""
    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    out = []
    for argument in func._schema.arguments:
        if argument.alias_info is not None and argument.alias_info.is_write and argument.name in named:
            out += tensors_of(named[argument.name], {})
    return out


def _copy_in_flight(func, args, kwargs) -> bool:
    """A copy between the device and pinned host memory that the host does not wait for."""
    non_blocking = kwargs.get("non_blocking") or (len(args) > 2 and args[2])
    return func is torch.ops.aten.copy_.default and bool(non_blocking) and any(
        not isinstance(t, FakeTensor) and t.device.type == "cpu" and is_pinned(t) for t in args[:2])


def _check_host(func, key: int, writes: bool) -> None:
    """A host op on `key`: a hazard while a copy into it is in flight, or, writing it, one out of it."""
    if key not in _host_pending:
        return
    stream, position, written = _host_pending[key]
    if _done.get(stream, 0) >= position:
        del _host_pending[key]
    elif written or writes:
        del _host_pending[key]
        frames = [f for f in traceback.extract_stack() if "/src/shardwise/" in f.filename]
        HAZARDS.append(f"host op {func.__name__} on host memory that stream {stream}'s copy #{position} may still "
                       "read or write (no synchronize of its event):\n" + "".join(traceback.format_list(frames[-4:])))


def _resize(storage, size):
    if size == 0:  # a FakeTensor's storage is a meta one: known by its accesses
        _check_free(storage._cdata)
    return _real_resize(storage, size)


def _check_free(key: int) -> None:
    freeing = _current[0]
    for stream, position in _accesses.pop(key, {}).items():
        if stream == freeing.id or stream in _recorded.get(key, ()):
            continue
        if max(freeing.known.get(stream, 0), _done.get(stream, 0)) < position:
            frames = [f for f in traceback.extract_stack() if "/shardwise/" in f.filename or "/tests/" in f.filename]
            HAZARDS.append(f"a storage freed on stream {freeing.id} before stream {stream}'s op #{position} on it "
                           f"is known done (no wait_event/wait_stream, no record_stream):\n"
                           + "".join(traceback.format_list(frames[-4:])))
    _recorded.pop(key, None)


def _record_stream(tensor, stream):
    _recorded.setdefault(_key(tensor), set()).add(stream.id)


def _synchronize(device=None):
    note_host_wait("accelerator.synchronize")
    for stream in _streams:
        _merge(_done, {stream.id: stream.position})


def reset() -> None:
    """A new scenario: no hazard, no copy in flight, and no access of the last one's storages (keyed by address,
    which a new storage may reuse)."""
    HAZARDS.clear()
    _host_pending.clear()
    _accesses.clear()
    _recorded.clear()


_real_resize = torch.UntypedStorage.resize_


def install() -> None:
    """Put the modelled streams in torch's device-generic API (Note [modelled streams])."""
    _current[0] = ModelStream()
    torch.Stream, torch.Event = ModelStream, ModelEvent
    torch.accelerator.current_stream = lambda device=None: _current[0]
    torch.accelerator.set_stream = lambda stream: _current.__setitem__(0, stream)
    torch.accelerator.synchronize = _synchronize
    torch.Tensor.record_stream = _record_stream
    torch.UntypedStorage.resize_ = _resize
