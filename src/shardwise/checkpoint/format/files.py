"""The rank files of a checkpoint: safetensors, written one tensor at a time (write/writer.py) and read one
row range at a time (read/reader.py).

The format (https://github.com/huggingface/safetensors) is an 8-byte little-endian
header length, a JSON header `{key: {dtype, shape, data_offsets}, "__metadata__":
{str: str}}`, then the raw bytes. We write and read it here rather than through
`safetensors.torch`, for three reasons:

- Writing: the header needs only shapes and dtypes, so tensors can be produced and written one at
  a time (an export gathers one full parameter, writes it, frees it) instead of all being alive at
  once, and every byte is checksummed while it is hot in cache (Note [chunk checksums]).
- Reading: a load checks the chunks holding the rows a rank needs over a map of the file, each
  window's pages leaving the process's RSS once checked (a plain `safe_open` map would count every
  touched page in RSS while the file stays open), then `pread`s exactly those rows into its shard and
  checks them again there (Note [checked where applied] in mapped.py).
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

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from shardwise.engine.layout.rows import num_rows, row_numel
from shardwise.errors import ShardwiseError
from shardwise.wire.st_header import CODE_OF_DTYPE

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


@dataclass
class TensorSpec:
    """One tensor of a file: its key, dtype and shape (known before its bytes exist)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize
