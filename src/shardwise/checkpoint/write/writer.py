"""The writer of a rank's safetensors file: one tensor at a time, every chunk checksummed while it is hot
(Note [chunk checksums] in format/files.py), the file created O_EXCL | O_NOFOLLOW."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from shardwise.checkpoint.format.crc import crc32
from shardwise.checkpoint.format.files import TensorSpec, as_bytes, chunk_rows, dtype_code
from shardwise.checkpoint.write.disk import WRITEBACK_BYTES, SavePhases, start_writeback
from shardwise.engine.layout.rows import num_rows
from shardwise.errors import ShardwiseError


def _write_chunk(file, data: memoryview) -> None:  # the one place bytes reach the disk (tests patch it)
    file.write(data)


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
