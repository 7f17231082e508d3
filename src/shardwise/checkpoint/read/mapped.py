"""One read per byte: a load checks its rows over a memory map of the file, then reads each row once into
the model and checks the bytes it read.

Note [checked where applied]: `sw.load` checks every chunk it will read before it writes anything (Note
[validate, then apply] in load.py), and it cannot hold the checked bytes in memory meanwhile (a zero3 load
would then hold its shard twice). So the bytes the verify phase checked are not the bytes the model gets:
the file can change between the two phases, and nothing about the file proves it did not. (Its stamp does
not: a rewrite through another process's shared writable map of pages already dirty changes neither mtime
nor ctime; issue 60 loaded 3.4e38 so, through a stamp that "proved" the file unchanged.) Hence:

- verify (`MappedFile.crc`): each chunk's crc32 over a read-only `mmap` of the file, a window at a time,
  the window's pages dropped from the map once checked (`MADV_DONTNEED`), so RSS stays bounded. This reads
  the file from the disk into the page cache, without a read syscall.
- apply (`FileReader._read_checked`): the rows are read with `pread` from the page cache, a window of whole
  chunks at a time, straight into the model's memory when it is a contiguous CPU tensor (else into one
  buffer for the tensor), and the crc32 of exactly the bytes read is compared with the index's before the
  next window is read. A chunk only partly in the rows (a shard's first and last) is read whole into a
  small staging buffer, checked there, and only its rows copied on. A mismatch zeroes the window it read
  (no byte that failed its crc stays in the model) and raises: the rows before it were checked, and the
  error says that the model holds part of the load. So every byte a load leaves in the model passed its
  crc after it was read, whatever happened to the file after the verify phase.
- early refusal (`MappedFile.check_unchanged`): before the apply reads its first row of a file, the
  file's stamp (inode, size, mtime, ctime) is compared with the one taken when its checks began, so an
  ordinary rewrite (`cp` over it, a truncation) is refused before any of its rows is applied. The stamp
  is no proof (the shared map above leaves it alone); the crc of the bytes read is.

The disk is read once (the verify's page faults fill the page cache; the apply's `pread` copies from it),
each byte crosses one read syscall (the apply's) and is checksummed twice (isal's crc32 runs at many GB/s:
Note [fast crc32]). A `pread` that comes back short (the file truncated after the verify) is an error,
never SIGBUS: the apply never touches the map. The verify's map can still fault on a file truncated while
its own window is being checked; each window first compares the file's size (`fstat`) with its end, so
only a truncation within that window's checksum (microseconds) is left to SIGBUS, as with every mmap
reader. What this leaves to the filesystem: pages the kernel evicts between the phases are read from the
disk again (a load larger than the page cache reads twice).
"""

from __future__ import annotations

import mmap
import os

from shardwise.checkpoint.format.crc import crc32
from shardwise.errors import ShardwiseError

WINDOW_BYTES = 4 * 2**20  # mapped and touched at a time; dropped from RSS after


def stamp_of(fd: int) -> tuple[int, ...]:
    """What an ordinary change to the file changes: (device, inode, size, mtime, ctime)."""
    info = os.fstat(fd)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


class MappedFile:
    """A read-only map of an open file (the verify phase's), which (key, chunk) it has checked, and the
    file's stamp when the checks began (Note [checked where applied])."""

    def __init__(self, fd: int, size: int, path) -> None:
        self.path, self.checked, self.size = path, set(), size
        self.stamp = stamp_of(fd)
        self._fd = fd
        self._map = None
        self._touched: tuple[int, int] | None = None  # bytes touched through the map, not yet dropped
        if size:
            try:
                self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                pass  # a filesystem that cannot map files: the verify reads with pread (reader.crc_of)

    @property
    def usable(self) -> bool:
        return self._map is not None

    def crc(self, start: int, size: int) -> int:
        """crc32 of bytes start:start+size, computed over the map a window at a time; a file shorter than
        the window's end is an error, not a fault (Note [checked where applied])."""
        crc = 0
        for begin, end in self._windows(start, size):
            if os.fstat(self._fd).st_size < end:
                raise ShardwiseError(f"{self.path} was truncated while the load checked it (now "
                                     f"{os.fstat(self._fd).st_size} bytes, {self.size} when opened): load it again "
                                     "once nothing writes it")
            with memoryview(self._map) as whole, whole[begin:end] as piece:
                crc = crc32(piece, crc)
            self._drop(begin, end)
        return crc

    def check_unchanged(self) -> None:
        """Refuse, before the apply reads its first row of this file, a file whose stamp changed since
        the checks began: an ordinary rewrite (`cp` over it) leaves the model untouched. Not a proof (a
        write through a shared map can leave the stamp alone): the crc of the bytes read is."""
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
