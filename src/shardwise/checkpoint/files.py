"""safetensors files written one tensor at a time and read one row range at a time.

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian
header length, a JSON header `{key: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}`, then the raw bytes. We write and read it here rather than through
`safetensors.torch`, for three reasons:

- Writing: the header needs only shapes and dtypes, so tensors can be produced and written one at
  a time (an export gathers one full parameter, writes it, frees it) instead of all being alive at
  once, and every byte is checksummed while it is hot in cache (Note [chunk checksums]).
- Reading: a load checks the chunks holding the rows a rank needs over a map of the file and copies
  exactly those rows from it into its shard, each window's pages leaving the process's RSS once used
  (Note [proved unchanged] in mapped.py); a plain `safe_open` map would count every touched page in
  RSS while the file stays open. Other reads `pread` straight into the destination tensor.
- Errors: a truncated file, a header that does not parse, a missing tensor, or a checksum mismatch
  each become a `ShardwiseError` that names the file and the fix. The header is parsed and checked
  against the file by wire/st_header.py, the one safetensors header parser (the host copy of frozen
  weights uses it too).

Files written here are ordinary safetensors files: `safetensors.safe_open` and `load_file` read them.

Note [chunk checksums]: each tensor's bytes are checksummed (crc32: 1.5 GB/s, ten times that with
ISA-L, Note [fast crc32] in crc.py; sha256 1.0 GB/s) in chunks of whole rows of about CHUNK_BYTES.
A rank that loads rows a..b of a slice reads and verifies only the chunks that hold them, so a
reshard load never reads whole files to check them, and a verified read costs at most two chunks
more than the rows themselves. The file's own digest (in the index, checked by `shardwise ckpt
inspect`) is sha256 over the header bytes and every chunk's crc32, so it changes with any byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from shardwise.checkpoint.crc import crc32
from shardwise.checkpoint.disk import WRITEBACK_BYTES, SavePhases, start_writeback
from shardwise.checkpoint.mapped import MappedFile
from shardwise.checkpoint.sparse_crc import crc_of_range
from shardwise.engine.layout.rows import num_rows, row_numel
from shardwise.errors import ShardwiseError
from shardwise.wire.st_header import CODE_OF_DTYPE, Entry, read_header

CHUNK_BYTES = 4 * 2**20

DTYPES = CODE_OF_DTYPE  # dtype -> its safetensors name ("F32"); st_header.DTYPE_OF_CODE is the reverse


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors name of `dtype` ("F32", "BF16", ...)."""
    if dtype not in DTYPES:
        raise ShardwiseError(f"dtype {dtype} cannot be stored in a safetensors file; cast it first")
    return DTYPES[dtype]


def chunk_rows(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Rows per checksum chunk for a tensor of `shape` (Note [chunk checksums])."""
    row_bytes = row_numel(shape) * dtype.itemsize
    return max(1, CHUNK_BYTES // row_bytes) if row_bytes else max(1, num_rows(shape))


def as_bytes(tensor: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _write_chunk(file, data: memoryview) -> None:  # the one place bytes reach the disk (tests patch it)
    file.write(data)


@dataclass
class TensorSpec:
    """One tensor of a file: its key, dtype and shape (known before its bytes exist)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class WrittenFile:
    """What a finished file's index entry needs: size, digest and per-tensor chunk crcs."""

    name: str
    nbytes: int
    digest: str
    crcs: dict[str, list[int]] = field(default_factory=dict)


class FileWriter:
    """Write a safetensors file tensor by tensor, in the order of `specs`.

    `write_next(tensor)` takes the next tensor (any device, contiguous or not); the file is complete
    after `close()`. `durable=True` fsyncs it, so that a machine crash cannot leave an index pointing
    at bytes that never reached the disk. The file must not exist: it is created with O_EXCL |
    O_NOFOLLOW, so a symlink or a file planted at its name (a shared directory) is refused."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str], *, durable: bool = True,
                 phases: SavePhases | None = None):
        self.path, self.specs, self.durable = Path(path), specs, durable
        self.phases = phases = phases if phases is not None else SavePhases()
        with phases.timed("serialize"):
            encoded = _encode_header(specs, metadata)
        self.nbytes = 8 + len(encoded) + sum(spec.nbytes for spec in specs)
        self._digest = hashlib.sha256(encoded)
        self._next = self._written = self._kicked = 0
        self.crcs: dict[str, list[int]] = {}
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            raise ShardwiseError(f"{self.path} already exists (a file, or a symlink someone planted): refusing to "
                                 "write through it. Remove it, or write elsewhere.") from None
        self._file = os.fdopen(fd, "wb")
        try:
            self._write(memoryview(struct.pack("<Q", len(encoded)) + encoded))
        except BaseException:
            self._file.close()
            raise

    def write_next(self, tensor: Tensor) -> None:
        spec = self.specs[self._next]
        tensor = tensor.detach()
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
            raise ShardwiseError(f"internal: {spec.key} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"the header says {spec.shape} {spec.dtype}")
        with self.phases.timed("gather"):
            tensor = tensor.cpu().contiguous()  # a copy only for a GPU or strided tensor: one at a time
        data = as_bytes(tensor)
        step = chunk_rows(spec.shape, spec.dtype) * (spec.nbytes // max(1, num_rows(spec.shape)))
        crcs = []
        for start in range(0, len(data), max(step, 1)):
            chunk = data[start : start + step]
            with self.phases.timed("checksum"):
                crcs.append(crc32(chunk))
            self._write(chunk)
        self.crcs[spec.key] = crcs
        for crc in crcs:
            self._digest.update(crc.to_bytes(4, "little"))
        self._next += 1

    def _write(self, data: memoryview) -> None:
        with self.phases.timed("write"):
            _write_chunk(self._file, data)
            self._written += len(data)
            if self.durable and self._written - self._kicked >= WRITEBACK_BYTES:  # Note [early writeback]
                self._file.flush()
                start_writeback(self._file.fileno(), self._kicked, self._written - self._kicked)
                self._kicked = self._written

    def close(self) -> WrittenFile:
        """`finish()`, then `sync()`."""
        return (self.finish(), self.sync())[0]

    def finish(self) -> WrittenFile:
        """Every byte handed to the kernel; the file left open for `sync()` (Note [one wait for the disk])."""
        if self._next != len(self.specs):
            self.abort()
            raise ShardwiseError(f"internal: {self.path.name} closed after {self._next} of {len(self.specs)} tensors")
        with self.phases.timed("write"):
            self._file.flush()  # the caller aborts on a failure, as after any write
            if self.durable:  # the tail too: the disk writes it while the ranks gather (Note [early writeback])
                start_writeback(self._file.fileno(), self._kicked, self._written - self._kicked)
        return WrittenFile(self.path.name, self.nbytes, "sha256:" + self._digest.hexdigest(), self.crcs)

    def sync(self) -> None:
        """fsync the finished file when durable, and close it."""
        try:
            if self.durable:
                with self.phases.timed("fsync"):
                    os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()  # closing twice is a no-op: abort after a sync is safe


def _encode_header(specs: list[TensorSpec], metadata: dict[str, str]) -> bytes:
    header, offset = {"__metadata__": dict(metadata)}, 0
    for spec in specs:
        header[spec.key] = {"dtype": dtype_code(spec.dtype), "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)  # safetensors pads the header to 8 bytes


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
