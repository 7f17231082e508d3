"""What a save spends its time on, and getting its bytes to the disk while it still checksums.

Note [save phases]: a save's time splits into start (what can be refused checked on every rank,
rank 0's partial directory made and its id sent to every rank, the optimizer state's plan), gather
(each tensor made a contiguous host tensor: nothing for a CPU shard, a device-to-host copy on a
GPU), serialize (the rank file's header; the index's JSON counts in publish), checksum (crc32 of
every chunk), write (into the page cache), fsync (waiting for the disk to hold this rank's file) and
publish (the ranks' records gathered, the index written, the ranks' fsyncs reported, the directory
renamed and its parent fsynced: Note [one wait for the disk] in commit.py). `SavePhases` adds them
up for one save on one rank; bench/checkpoints/checkpoint.py prints them beside the disk's write+fsync ceiling.

Note [early writeback]: a durable save's last fsync waits for every byte the kernel has not yet
written, so a save that leaves all of it to that fsync pays crc + write + the whole disk time one
after the other. Every WRITEBACK_BYTES written, `start_writeback` asks the kernel to start writing
that range now (Linux's sync_file_range(SYNC_FILE_RANGE_WRITE): it does not wait), so the disk
works while the save checksums and writes the next chunks; the tail is started once the file is
written, so the disk writes it while the ranks gather their records, and the final fsync waits for
what is still in flight. Where the call does not exist it does nothing: the fsync still makes the file durable.
"""

from __future__ import annotations

import ctypes
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields

WRITEBACK_BYTES = 32 * 2**20
_SYNC_FILE_RANGE_WRITE = 2


@dataclass
class SavePhases:
    """Seconds one rank's save spent in each phase (Note [save phases])."""

    start: float = 0.0
    gather: float = 0.0
    serialize: float = 0.0
    checksum: float = 0.0
    write: float = 0.0
    fsync: float = 0.0
    publish: float = 0.0

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - start)

    def as_dict(self) -> dict[str, float]:
        return {field.name: getattr(self, field.name) for field in fields(self)}


def _sync_file_range():
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


_start = _sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes offset:offset+nbytes of `fd` to the disk, without waiting
    (Note [early writeback]); advisory: a failure changes nothing but the timing."""
    if _start is not None and nbytes > 0:
        _start(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)
