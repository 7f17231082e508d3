"""The reader of a safetensors file: row ranges checked over a map of the file, then read by `pread` and
checked again where they land (Note [checked where applied] in mapped.py); a file's digest recomputed from
its bytes (Note [chunk checksums] in format/files.py)."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import torch
from torch import Tensor

from shardwise.checkpoint.format.crc import crc32
from shardwise.checkpoint.format.files import DTYPES, as_bytes, chunk_rows
from shardwise.checkpoint.format.sparse_crc import crc_of_range
from shardwise.checkpoint.read.mapped import WINDOW_BYTES, MappedFile
from shardwise.errors import ShardwiseError
from shardwise.wire.st_header import Entry, read_header


class FileReader:
    """Read row ranges of the tensors in one safetensors file with `pread` (see module docstring).

    Opening checks that the file exists, that its size is what `expected_bytes` (from
    an index) says, and that the header parses and covers the file exactly.
    """

    def __init__(self, path: Path, *, expected_bytes: int | None = None, what: str = "file",
                 follow_symlinks: bool = True):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW))
        except FileNotFoundError:
            raise ShardwiseError(f"{what} {self.path} is missing") from None
        except OSError as error:
            if os.path.islink(self.path):
                raise ShardwiseError(f"{what} {self.path} is a symlink: shardwise reads only a checkpoint's "
                                     "own files (Note [contained names] in schema.py); copy the file in") from None
            raise ShardwiseError(f"cannot read {what} {self.path}: {error}") from None
        try:
            info = os.fstat(self._fd)
            if not stat.S_ISREG(info.st_mode):
                raise ShardwiseError(f"{what} {self.path} is not a regular file")
            size = info.st_size
            if expected_bytes is not None and size != expected_bytes:
                raise ShardwiseError(
                    f"{what} {self.path} is {size} bytes but the index says {expected_bytes}: the file was "
                    f"{'truncated' if size < expected_bytes else 'replaced or appended to'}, or index.json "
                    "belongs to another checkpoint. Load an earlier checkpoint (`shardwise ckpt inspect DIR` "
                    "verifies one)."
                )
            self.entries, self.metadata, self.header_bytes = self._parse(size)
            self.nbytes, self._mapped, self._applying = size, None, False
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self, size: int):
        header = read_header(lambda offset, length: os.pread(self._fd, length, offset), size, self.path)
        return header.entries, header.metadata, header.raw

    def check_header(self, expected: dict[str, tuple[torch.dtype, tuple[int, ...], tuple[int, ...]]],
                     digest: str) -> None:
        """Refuse a header that differs from what an index says the file holds: the same keys, each
        with `expected[key]`'s (dtype, shape), and the file's digest recomputed from the header bytes
        and the index's crcs (Note [chunk checksums]), so every header byte (offsets, metadata) is
        checked before any data is read."""
        if set(self.entries) != set(expected):
            odd = sorted(set(self.entries) ^ set(expected))
            raise ShardwiseError(f"{self.path}'s header lists other tensors than the index ({odd[:4]} differ): "
                                 "the file does not belong to this checkpoint or was changed. Load an earlier one.")
        for key, (dtype, shape, _) in expected.items():
            entry = self.entries[key]
            if dtype is not None and (entry.dtype, entry.shape) != (dtype, shape):
                raise ShardwiseError(
                    f"{self.path}'s header says tensor {key!r} is {DTYPES[entry.dtype]} {list(entry.shape)}, the index "
                    f"{DTYPES[dtype]} {list(shape)}: the file or index.json was changed. Load an earlier checkpoint.")
        recomputed = hashlib.sha256(self.header_bytes)
        for key, entry in sorted(self.entries.items(), key=lambda item: item[1].begin):
            for crc in expected[key][2]:
                recomputed.update(crc.to_bytes(4, "little"))
        if "sha256:" + recomputed.hexdigest() != digest:
            raise ShardwiseError(f"{self.path}'s header does not match the digest in the index: the file was changed "
                                 "(its header bytes or its tensors' offsets). Load an earlier checkpoint.")

    def verify_rows(self, key: str, lo: int, hi: int, *, crcs, chunk: int) -> None:
        """Check the crcs of every chunk holding rows lo:hi of `key`, a window in memory at a time, over a
        map of the file (no read syscall: the apply's `pread` is the one read, Note [checked where applied])."""
        entry = self.entry(key)
        if not 0 <= lo <= hi <= entry.rows:
            raise ShardwiseError(f"internal: rows {lo}:{hi} of {key!r} in {self.path} ({entry.rows} rows)")
        if self._mapped is None:
            self._mapped = MappedFile(self._fd, self.nbytes, self.path)
        mapped = self._mapped if self._mapped.usable else None
        step = chunk * entry.row_bytes
        for position in range(lo // chunk, -(-hi // chunk) if step else 0):
            if (key, chunk, position) in self._mapped.checked:
                continue
            start = entry.begin + position * step
            size = min(step, entry.end - start)
            crc = mapped.crc(start, size) if mapped is not None else self.crc_of(start, size)
            if position >= len(crcs) or crc != crcs[position]:
                self._mismatch(key, position, chunk, entry)
            self._mapped.checked.add((key, chunk, position))

    def crc_of(self, start: int, size: int) -> int:
        """The crc32 of bytes start:start+size of the file, read 4 MiB at a time (a chunk of one huge
        row is never held whole) and without reading its holes (Note [sparse files] in sparse_crc.py)."""
        return crc_of_range(self._fd, start, size, self._pread_into)

    def entry(self, key: str) -> Entry:
        if key not in self.entries:
            raise ShardwiseError(f"{self.path} has no tensor {key!r}: the file does not belong to this index")
        return self.entries[key]

    def read_rows(self, key: str, lo: int, hi: int, *, crcs: list[int] | None = None,
                  chunk: int | None = None, out: Tensor | None = None) -> Tensor:
        """Rows `lo:hi` of tensor `key`, shaped `(hi - lo, *shape[1:])` (a 0-D tensor: `(hi - lo,)`).

        With `crcs` (and `chunk`, rows per chunk) every byte read is checked against its chunk's crc
        once it is in memory, a chunk that failed zeroed before the error (Note [checked where applied]
        in mapped.py). `out`, when it is a contiguous CPU tensor of the right size and dtype, is filled
        in place and returned (no copy).
        """
        entry = self.entry(key)
        if not 0 <= lo <= hi <= entry.rows:
            raise ShardwiseError(f"internal: rows {lo}:{hi} of {key!r} in {self.path} ({entry.rows} rows)")
        row_shape = entry.shape[1:] if entry.shape else ()
        direct = (out is not None and out.device.type == "cpu" and out.is_contiguous() and out.dtype == entry.dtype
                  and out.numel() * entry.dtype.itemsize == (hi - lo) * entry.row_bytes)
        rows = out if direct else torch.empty((hi - lo, *row_shape), dtype=entry.dtype)
        if not rows.numel():
            return rows
        data = as_bytes(rows)
        if crcs is None:
            self._pread_into(data, entry.begin + lo * entry.row_bytes)
            return rows
        if self._mapped is not None and not self._applying:  # the checks ran: the apply's first read
            self._mapped.check_unchanged()
            self._applying = True
        self._read_checked(key, entry, lo, hi, chunk, crcs, data)
        return rows

    def _read_checked(self, key: str, entry: Entry, lo: int, hi: int, chunk: int, crcs, data: memoryview) -> None:
        """Rows lo:hi into `data`, each chunk's crc compared once its bytes are there (Note [checked where
        applied]): whole chunks a window at a time in place, a partial chunk whole in a staging buffer."""
        row_bytes, position = entry.row_bytes, lo // chunk
        while position * chunk < hi:
            first = position * chunk
            if first < lo or min(first + chunk, entry.rows) > hi:  # a chunk only partly in the rows
                end = min(first + chunk, entry.rows)
                staging = bytearray((end - first) * row_bytes)
                self._pread_into(memoryview(staging), entry.begin + first * row_bytes)
                self._check_read(key, entry, chunk, crcs, position, staging, None)
                a, b = max(lo, first), min(hi, end)
                data[(a - lo) * row_bytes : (b - lo) * row_bytes] = staging[(a - first) * row_bytes :
                                                                            (b - first) * row_bytes]
                position += 1
                continue
            count = max(1, min(WINDOW_BYTES // max(chunk * row_bytes, 1), (hi - first) // chunk))
            end = min(first + count * chunk, hi)
            window = data[(first - lo) * row_bytes : (end - lo) * row_bytes]
            self._pread_into(window, entry.begin + first * row_bytes)
            for index in range(count):
                piece = window[index * chunk * row_bytes : (index + 1) * chunk * row_bytes]
                self._check_read(key, entry, chunk, crcs, position + index, piece, window)
            position += count

    def _check_read(self, key, entry, chunk, crcs, position, piece, window) -> None:
        """A chunk's bytes as read against its crc; on a mismatch the `window` read with it is zeroed (no
        byte that failed its crc stays where the read put it) and the error raised."""
        if position < len(crcs) and crc32(piece) == crcs[position]:
            return
        if window is not None:
            window[:] = bytes(len(window))
        self._mismatch(key, position, chunk, entry)

    def read_span(self, key: str, start: int, stop: int) -> Tensor:
        """Elements `start:stop` of tensor `key`, flattened: part of one huge row (`ckpt diff --values`
        streams rows larger than its block so). Unchecked: verify_rows the rows first."""
        entry = self.entry(key)
        numel = (entry.end - entry.begin) // entry.dtype.itemsize
        if not 0 <= start <= stop <= numel:
            raise ShardwiseError(f"internal: elements {start}:{stop} of {key!r} in {self.path} ({numel})")
        buffer = torch.empty(stop - start, dtype=entry.dtype)
        if buffer.numel():
            self._pread_into(as_bytes(buffer), entry.begin + start * entry.dtype.itemsize)
        return buffer

    def _pread_into(self, data: memoryview, offset: int) -> None:
        done = 0
        while done < len(data):
            count = os.preadv(self._fd, [data[done:]], offset + done)
            if count == 0:
                raise ShardwiseError(f"{self.path} ended early at byte {offset + done}: the file is truncated")
            done += count

    def _mismatch(self, key, position, chunk, entry):
        row = position * chunk
        raise ShardwiseError(
            f"checksum mismatch in {self.path}, tensor {key!r}, rows {row}:{min(row + chunk, entry.rows)}: "
            "the file is corrupt (flipped bytes, a bad disk or an interrupted copy). Load an earlier "
            "checkpoint; `shardwise ckpt inspect DIR` verifies every file of one."
        )

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def file_digest(path: Path, *, follow_symlinks: bool = True) -> str:
    """Recompute a file's digest from its bytes (Note [chunk checksums]): reads it all."""
    with FileReader(path, follow_symlinks=follow_symlinks) as reader:
        digest = hashlib.sha256(reader.header_bytes)
        for key, entry in sorted(reader.entries.items(), key=lambda item: item[1].begin):
            chunk = chunk_rows(entry.shape, entry.dtype)
            step = chunk * entry.row_bytes
            for start in range(entry.begin, entry.end, max(step, 1)):
                digest.update(reader.crc_of(start, min(step, entry.end - start)).to_bytes(4, "little"))
    return "sha256:" + digest.hexdigest()
