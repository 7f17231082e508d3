"""A device API (Note [one device path], engine/comm/streams.py) that records every stream and event call
instead of ordering a device: what a GPU would have been asked to wait for, read back by a test on CPU."""

from __future__ import annotations

import itertools


class RecordingStream:
    def __init__(self, api: RecordingApi, name: str) -> None:
        self.api, self.name = api, name

    def wait_stream(self, other: RecordingStream) -> None:
        self.api.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: RecordingEvent) -> None:
        self.api.log.append(("wait_event", self.name, event.id))

    def __enter__(self) -> RecordingStream:
        self.api.stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.api.stack.pop()


class RecordingEvent:
    def __init__(self, api: RecordingApi, number: int) -> None:
        self.api, self.id, self.stream = api, number, None

    def record(self, stream: RecordingStream) -> None:
        self.stream = stream.name
        self.api.log.append(("record", self.id, stream.name))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.api.log.append(("synchronize", self.id))


class RecordingApi:
    """Streams named "compute", "side1", "side2", ...; `current()` is the innermost entered stream, as torch's
    `with stream:` sets the current one."""

    name = "recording"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = RecordingStream(self, "compute")
        self.stack = [self.compute]
        self._streams = itertools.count(1)
        self._events = itertools.count(1)

    def new_stream(self) -> RecordingStream:
        return RecordingStream(self, f"side{next(self._streams)}")

    def new_event(self) -> RecordingEvent:
        return RecordingEvent(self, next(self._events))

    def current(self) -> RecordingStream:
        return self.stack[-1]

    def keep_for(self, tensor, stream) -> None:
        pass

    def waits_of(self, stream: str) -> list[tuple]:
        """The waits `stream` was asked for, in order."""
        return [entry for entry in self.log if entry[0] in ("wait_stream", "wait_event") and entry[1] == stream]
