"""One read per byte: a load checks its rows over a memory map of the file and applies from the same map.

Note [proved unchanged]: `sw.load` checks every chunk it will read before it writes anything (Note
[validate, then apply] in load.py), and it cannot hold the checked bytes in memory meanwhile (a zero3
load would then hold its shard twice). So the verify phase computes each chunk's crc over a read-only
`mmap` of the file, and the apply phase copies the rows from that same map into the model: the bytes
come from the disk into the page cache once, and reach the model without a second `read`. A page the
kernel dropped from the page cache in between is fetched again, but from the same file, which must not
have changed. That is what the file's stamp proves: (device, inode, size, mtime, ctime) taken before
the first byte is checked and compared before and after every copy. Every write, truncate, chmod or
link changes ctime, and no caller can set ctime back; the only write it would miss is one stamped with
the very ctime the file had already, which `settled_stamp` rules out by taking the stamp only once the
file's ctime lies SETTLE_NS (a second more on a filesystem with whole-second times) behind the clock:
the kernel stamps a write with its coarse clock (one tick, 1-10 ms, behind), rounded down to the
filesystem's granularity, so any later write is stamped later. A file too fresh to settle
within MAX_WAIT_S, or rows whose chunks were not all checked through the map, take the old way instead:
read again with `pread` and checked again (Note [validate, then apply]).

What this leaves to the filesystem: a network filesystem whose other clients' writes do not show in
`fstat` at once, and a clock stepped backwards between a save and a load, can defeat the stamp (the
re-read would not catch the first either); a file truncated while the map is read ends the process
with SIGBUS, as with every mmap reader (safetensors, `torch.load(mmap=True)`), rather than an error.
RSS stays bounded: each window's pages leave the map (`MADV_DONTNEED`) once checked or copied, so a
load never counts more than about two windows of the file as its own memory (small tensors' pages
are dropped together, a window's worth at a time).
"""

from __future__ import annotations

import mmap
import os
import time

from shardwise.checkpoint.format.crc import crc32
from shardwise.errors import ShardwiseError

WINDOW_BYTES = 4 * 2**20  # mapped and touched at a time; dropped from RSS after
SETTLE_NS = 20_000_000  # >= the coarse clock's tick (1-10 ms) + a sub-second timestamp granularity (<= 10 ms)
SECOND_NS = 1_000_000_000
MAX_WAIT_S = 0.05  # a fresher file is read twice rather than waited for


def stamp_of(fd: int) -> tuple[int, ...]:
    """What any change to the file's bytes changes (Note [proved unchanged])."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def settled_stamp(fd: int) -> tuple[int, ...] | None:
    """The file's stamp, taken once any later write must be stamped with a later ctime; None when
    the file is too fresh for that within MAX_WAIT_S (Note [proved unchanged])."""
    deadline = time.monotonic() + MAX_WAIT_S
    while True:
        now = time.time_ns()  # before the stamp: a write after it is stamped at least now - one tick
        stamp = stamp_of(fd)
        ctime = stamp[4]
        late = ctime + SETTLE_NS + (SECOND_NS if ctime % SECOND_NS == 0 else 0) - now
        if late < 0:
            return stamp
        if time.monotonic() + late / 1e9 > deadline:
            return None
        time.sleep(late / 1e9 + 0.001)


class MappedFile:
    """A read-only map of an open file, its stamp, and which (key, chunk) it has checked."""

    def __init__(self, fd: int, size: int, path) -> None:
        self.path, self.checked = path, set()
        self.stamp = settled_stamp(fd)
        self._fd = fd
        self._map = None
        self._proved = False  # the stamp compared since the first copy began (Note [proved unchanged])
        self._touched: tuple[int, int] | None = None  # bytes touched through the map, not yet dropped
        if self.stamp is not None and size:
            try:
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                pass  # a filesystem that cannot map files: read twice, as before (Note [proved unchanged])

    @property
    def usable(self) -> bool:
        return self._map is not None

    def covers(self, key: str, chunk: int, lo: int, hi: int) -> bool:
        """Whether every chunk holding rows lo:hi of `key` was checked through the map."""
        positions = range(lo // chunk, -(-hi // chunk))
        return self.usable and all((key, chunk, position) in self.checked for position in positions)

    def crc(self, start: int, size: int) -> int:
        """crc32 of bytes start:start+size, computed over the map a window at a time."""
        crc = 0
        for begin, end in self._windows(start, size):
            with memoryview(self._map) as whole, whole[begin:end] as piece:
                crc = crc32(piece, crc)
            self._drop(begin, end)
        return crc

    def copy_into(self, start: int, out: memoryview) -> None:
        """Copy bytes start:start+len(out) into `out`; refuses, before the first copy and after each, a
        file whose stamp changed since it was taken (Note [proved unchanged]): the check after one copy
        is the check before the next."""
        if not self._proved:
            self.check_unchanged()
            self._proved = True
        for begin, end in self._windows(start, len(out)):
            with memoryview(self._map) as whole, whole[begin:end] as piece:
                out[begin - start : end - start] = piece
            self._drop(begin, end)
        self.check_unchanged()

    def check_unchanged(self) -> None:
        if stamp_of(self._fd) != self.stamp:
            raise ShardwiseError(f"{self.path} was written to (its size, times or inode changed) after the load "
                                 "checked its bytes")

    def _windows(self, start: int, size: int):
        for begin in range(start, start + size, WINDOW_BYTES):
            yield begin, min(begin + WINDOW_BYTES, start + size)

    def _drop(self, begin: int, end: int) -> None:
        """Unmap the pages of bytes begin:end from this process (they stay in the page cache), so that RSS
        stays bounded: once a window's worth has been touched, so that the small tensors that follow one
        another in a file go with one madvise rather than one each."""
        if self._touched is not None and self._touched[0] <= begin <= self._touched[1]:
            begin, end = self._touched[0], max(end, self._touched[1])  # continues the span touched so far
        else:
            self._release()
        self._touched = (begin, end)
        if end - begin >= WINDOW_BYTES:
            self._release()

    def _release(self) -> None:
        if self._touched is not None:
            begin, end = self._touched
            page = begin - begin % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, page, end - page)
            self._touched = None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
