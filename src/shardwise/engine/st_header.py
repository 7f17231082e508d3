"""A safetensors file's header, parsed and checked against the file before anything is mapped.
Uses: nothing of the engine.

The host copy (host_copy.py, Note [host copy]) makes parameters views of a file's bytes at
the offsets its header names, so a header that lies about them must be refused before the
first view exists: an entry's `data_offsets` that moved by 8 bytes would otherwise map every
weight shifted by two floats, and an end past the file's size would be a SIGBUS at the first
read. The rules are the safetensors format's own, as `checkpoint/files.py`'s reader applies
them to checkpoint files (the layers point down, so that reader cannot serve the engine; it
may import this one): a length-prefixed JSON object of `{name: {dtype, shape, data_offsets}}`
(and an optional `__metadata__` of strings), each entry's bytes exactly its shape times its
dtype's size, the entries tiling the data from its first byte to the file's last with no gap
or overlap.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from shardwise.errors import ShardwiseError

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit

DTYPE_OF_CODE = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}
CODE_OF_DTYPE = {dtype: code for code, dtype in DTYPE_OF_CODE.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its dtype and shape, and its bytes' absolute offsets in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def parse_header(read: Callable[[int, int], bytes], size: int, path) -> tuple[dict[str, Entry], dict[str, str]]:
    """The entries and `__metadata__` of the safetensors file of `size` bytes that `read(offset,
    length)` reads; a ShardwiseError naming `path` and the fault unless the header tiles the file."""
    corrupt = f"{path} is not a valid safetensors file"
    raw = read(0, 8)
    if len(raw) < 8:
        raise ShardwiseError(f"{corrupt}: only {size} bytes (truncated?)")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ShardwiseError(f"{corrupt}: its header claims {length} bytes but the file has {size}")
    try:
        header = json.loads(read(8, length))
    except (ValueError, RecursionError) as error:
        raise ShardwiseError(f"{corrupt}: its header does not parse ({type(error).__name__})") from None
    if not isinstance(header, dict):
        raise ShardwiseError(f"{corrupt}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ShardwiseError(f"{corrupt}: its __metadata__ is not an object of strings")
    data_start = 8 + length
    entries = {key: _entry(corrupt, key, value, data_start) for key, value in header.items()}
    covered = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if entry.begin != covered:
            raise ShardwiseError(f"{corrupt}: its tensors leave a gap or overlap at byte {entry.begin} (the header's "
                                 "data_offsets do not match the data; the file was edited or is damaged)")
        covered = entry.end
    if covered != size:
        raise ShardwiseError(f"{corrupt}: its header describes {covered} bytes but the file has {size} "
                             f"({'truncated' if size < covered else 'trailing bytes'})")
    return entries, metadata


def _entry(corrupt: str, key: str, value, data_start: int) -> Entry:
    try:
        dtype = DTYPE_OF_CODE[value["dtype"]]
        shape = tuple(value["shape"])
        begin, end = value["data_offsets"]
        if not all(type(x) is int for x in (*shape, begin, end)):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise ShardwiseError(f"{corrupt}: entry {key!r} has no valid dtype/shape/data_offsets") from None
    if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise ShardwiseError(f"{corrupt}: entry {key!r} has data_offsets [{begin}, {end}] for shape {list(shape)} "
                             f"{value['dtype']} ({math.prod(shape) * dtype.itemsize} bytes)")
    return Entry(dtype, shape, data_start + begin, data_start + end)
