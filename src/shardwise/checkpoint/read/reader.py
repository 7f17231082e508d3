"""The reader of a safetensors file: row ranges by `pread`, or checked and copied over a map of the file
(Note [proved unchanged] in mapped.py); a file's digest recomputed from its bytes (Note [chunk checksums] in
format/files.py)."""

from __future__ import annotations

import hashlib
import math
import os
import stat
from pathlib import Path

import torch
from torch import Tensor

from shardwise.checkpoint.format.crc import crc32
from shardwise.checkpoint.format.files import DTYPES, as_bytes, chunk_rows
from shardwise.checkpoint.format.sparse_crc import crc_of_range
from shardwise.checkpoint.read.mapped import MappedFile
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
            self.nbytes, self._mapped = size, None
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
        """Check the crcs of every chunk holding rows lo:hi of `key`, a window in memory at a time: over
        a map of the file, from which `read_rows` then copies them unread (Note [proved unchanged])."""
        entry = self.entry(key)
        if not 0 <= lo <= hi <= entry.rows:
            raise ShardwiseError(f"internal: rows {lo}:{hi} of {key!r} in {self.path} ({entry.rows} rows)")
        if self._mapped is None:
            self._mapped = MappedFile(self._fd, self.nbytes, self.path)  # Note [proved unchanged] in mapped.py
        mapped = self._mapped if self._mapped.usable else None
        step = chunk * entry.row_bytes
        for position in range(lo // chunk, -(-hi // chunk) if step else 0):
            if mapped is not None and (key, chunk, position) in mapped.checked:
                continue
            start = entry.begin + position * step
            size = min(step, entry.end - start)
            crc = mapped.crc(start, size) if mapped is not None else self.crc_of(start, size)
            if position >= len(crcs) or crc != crcs[position]:
                self._mismatch(key, position, chunk, entry)
            if mapped is not None:
                mapped.checked.add((key, chunk, position))

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

        With `crcs` (and `chunk`, rows per chunk) every chunk holding those rows is read and
        verified, unless `verify_rows` checked them all through the file's map: then they are copied
        from it, the file proved unchanged since (Note [proved unchanged] in mapped.py). `out`, when it
        is a contiguous CPU tensor of the right size and dtype (and, read again, the rows are
        chunk-aligned), is filled in place and returned (no copy).
        """
        entry = self.entry(key)
        row_shape = entry.shape[1:]
        if not 0 <= lo <= hi <= entry.rows:
            raise ShardwiseError(f"internal: rows {lo}:{hi} of {key!r} in {self.path} ({entry.rows} rows)")
        if crcs is not None and self._mapped is not None and self._mapped.covers(key, chunk, lo, hi):
            return self._copy_checked(entry, lo, hi, out)
        span_lo, span_hi = lo, hi
        if crcs is not None:
            span_lo = lo // chunk * chunk
            span_hi = min(-(-hi // chunk) * chunk, entry.rows)
        direct = (out is not None and span_lo == lo and span_hi == hi and out.device.type == "cpu"
                  and out.is_contiguous() and out.dtype == entry.dtype and out.numel() * entry.dtype.itemsize
                  == (hi - lo) * entry.row_bytes)
        buffer = out if direct else torch.empty((span_hi - span_lo) * max(1, math.prod(row_shape)), dtype=entry.dtype)
        if math.prod(row_shape) == 0:
            buffer = torch.empty((span_hi - span_lo, *row_shape), dtype=entry.dtype)
        data = as_bytes(buffer) if buffer.numel() else memoryview(b"")
        self._pread_into(data, entry.begin + span_lo * entry.row_bytes)
        if crcs is not None:
            self._verify(key, data, span_lo, span_hi, chunk, crcs, entry)
        if direct:
            return out
        rows = buffer.reshape(span_hi - span_lo, *row_shape) if row_shape or entry.shape else buffer.reshape(-1)
        return rows[lo - span_lo : hi - span_lo]

    def _copy_checked(self, entry: Entry, lo: int, hi: int, out: Tensor | None) -> Tensor:
        row_shape = entry.shape[1:] if entry.shape else ()
        direct = (out is not None and out.device.type == "cpu" and out.is_contiguous() and out.dtype == entry.dtype
                  and out.numel() * entry.dtype.itemsize == (hi - lo) * entry.row_bytes)
        rows = out if direct else torch.empty((hi - lo, *row_shape), dtype=entry.dtype)
        if rows.numel():
            self._mapped.copy_into(entry.begin + lo * entry.row_bytes, as_bytes(rows))
        return rows

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

    def _verify(self, key, data, span_lo, span_hi, chunk, crcs, entry) -> None:
        step = chunk * entry.row_bytes
        first = span_lo // chunk
        for index, start in enumerate(range(0, len(data), max(step, 1))):
            position = first + index
            if position >= len(crcs) or crc32(data[start : start + step]) != crcs[position]:
                self._mismatch(key, position, chunk, entry)

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
