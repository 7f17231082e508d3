"""crc32 of a file's byte range without reading its holes.

Note [sparse files]: a file may declare a terabyte that is nearly all holes (`truncate -s 1T`: 4 KiB
on disk). Its holes read as zeros, so its crc32 is well defined, but reading them takes minutes.
`crc_of_range` asks the filesystem where data lies (lseek SEEK_DATA / SEEK_HOLE), reads only that,
a bounded piece at a time, and extends the crc over each hole arithmetically: feeding zero bytes to
a CRC register is linear, so n of them are one 32x32 matrix over GF(2), raised to the n-th power by
squaring (zlib's crc32_combine does the same). A hole of any length costs about 64 matrix squarings.
"""

from __future__ import annotations

import errno
import os

from shardwise.checkpoint.format.crc import crc32

PIECE_BYTES = 4 * 2**20  # read at a time
MIN_HOLE_BYTES = 2**20  # shorter holes are read (as zeros) rather than skipped


def _times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _square(matrix: list[int]) -> list[int]:
    return [_times(matrix, matrix[n]) for n in range(32)]


_POWERS: list[list[int]] = []  # _POWERS[k]: the register's matrix for 2**k zero bytes


def extend_with_zeros(crc: int, count: int) -> int:
    """zlib.crc32(b"\\0" * count, crc), in O(log count)."""
    if not _POWERS:
        bit = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
        _POWERS.append(_square(_square(_square(bit))))  # one zero byte
        for _ in range(63):
            _POWERS.append(_square(_POWERS[-1]))
    register, power = crc ^ 0xFFFFFFFF, 0
    while count:
        if count & 1:
            register = _times(_POWERS[power], register)
        count >>= 1
        power += 1
    return register ^ 0xFFFFFFFF


def _data_extent(fd: int, position: int, end: int) -> tuple[int, int]:
    """The next run of data at or after `position` as (first byte, end), clipped to `end`; holes shorter
    than MIN_HOLE_BYTES count as data (reading them is cheaper); (position, end) where the filesystem
    cannot say."""
    try:
        data = os.lseek(fd, position, os.SEEK_DATA)
    except OSError as error:
        return (end, end) if error.errno == errno.ENXIO else (position, end)
    if data >= end:
        return end, end
    if data - position < MIN_HOLE_BYTES:
        data = position
    while True:
        try:
            hole = os.lseek(fd, max(data, position), os.SEEK_HOLE)
        except OSError:
            return data, end
        if hole >= end:
            return data, end
        try:
            after = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError:  # ENXIO: a hole to the end of the file
            after = end
        if after - hole >= MIN_HOLE_BYTES:
            return data, hole
        position = after  # a short hole: read through it


def crc_of_range(fd: int, start: int, size: int, pread_into) -> int:
    """The crc32 of bytes start:start+size of open file `fd`: data read PIECE_BYTES at a time with
    `pread_into(memoryview, offset)`, holes extended arithmetically (Note [sparse files])."""
    crc, position, end = 0, start, start + size
    scratch = memoryview(bytearray(min(size, PIECE_BYTES)))
    while position < end:
        data, data_end = _data_extent(fd, position, end)
        crc = extend_with_zeros(crc, data - position)
        for offset in range(data, data_end, PIECE_BYTES):
            piece = scratch[: min(PIECE_BYTES, data_end - offset)]
            pread_into(piece, offset)
            crc = crc32(piece, crc)
        position = data_end
    return crc
