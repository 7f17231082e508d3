"""A safetensors file's header, parsed and checked against the file before any of its data is used.
Uses: nothing of the engine (it sits below it).

The one parser of safetensors headers in shardwise: the checkpoint reader (checkpoint/format/files.py)
and the host copy (host_copy.py, Note [host copy]) both use it. Both trust nothing a header
says until it has been checked against the file: the host copy makes parameters views of the
file's bytes at the offsets its header names, so an entry's `data_offsets` that moved by 8
bytes would map every weight shifted by two floats, and an end past the file's size would be a
SIGBUS at the first read; the checkpoint reader `pread`s rows at those offsets. The rules are
the safetensors format's own: a length-prefixed JSON object of `{name: {dtype, shape,
data_offsets}}` (and an optional `__metadata__` of strings), each entry's bytes exactly its
shape times its dtype's size, the entries tiling the data from its first byte to the file's
last with no gap or overlap. (The engine holds it because the layers point down: checkpoint/
may import the engine, never the reverse.)
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
# What parsing JSON may build, counted on the raw bytes before it does: a 64 MiB `[{},{},...]` is
# 21 million objects (3 GiB of Python). A real header or index spends more than 18 bytes of text per
# object or list (`{"dtype":"F32","shape":[8],"data_offsets":[0,32]}`: 3 in 50) and more than 8 per
# value (a crc32 is up to 10 digits): text denser than that is refused unparsed.
BYTES_PER_CONTAINER = 12
BYTES_PER_ITEM = 4
_MAX_COUNT = 2**62  # a shape entry or an offset beyond any file; bounds the arithmetic on them

CODE_OF_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        CODE_OF_DTYPE[getattr(torch, _name)] = _code
DTYPE_OF_CODE = {code: dtype for dtype, code in CODE_OF_DTYPE.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its dtype and shape, and its bytes' absolute offsets in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return (self.end - self.begin) // self.rows if self.rows else 0


@dataclass(frozen=True)
class Header:
    """A checked header: its entries by name, its `__metadata__`, and its raw bytes (a checkpoint
    file's digest covers them, Note [chunk checksums] in checkpoint/format/files.py)."""

    entries: dict[str, Entry]
    metadata: dict[str, str]
    raw: bytes


def read_header(read: Callable[[int, int], bytes], size: int, path) -> Header:
    """The header of the safetensors file of `size` bytes that `read(offset, length)` reads; a
    ShardwiseError naming `path` and the fault unless it parses and tiles the file exactly."""
    corrupt = f"{path} is not a valid safetensors file"
    raw = read(0, 8)
    if len(raw) < 8:
        raise ShardwiseError(f"{corrupt}: only {size} bytes (truncated?)")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ShardwiseError(f"{corrupt}: its header claims {length} bytes but the file has {size} "
                             "(truncated, or not a safetensors file)")
    header_bytes = read(8, length)
    check_json_cost(header_bytes, f"{path}'s header")
    try:
        header = json.loads(header_bytes)
    except ValueError as error:  # UnicodeDecodeError too
        raise ShardwiseError(f"{corrupt}: its header does not parse ({str(error)[:200]}); it is corrupt") from None
    except RecursionError:
        raise ShardwiseError(f"{corrupt}: its header nests too deeply to be a safetensors header; the file is "
                             "corrupt") from None
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
            raise ShardwiseError(f"{corrupt}: its tensors leave a gap or overlap at byte {entry.begin - data_start} "
                                 "of its data (the header's data_offsets do not match the data; the file was edited "
                                 "or is damaged)")
        covered = entry.end
    if covered != size:
        raise ShardwiseError(f"{corrupt}: its header describes {covered} bytes but the file has {size} "
                             f"({'truncated' if size < covered else 'trailing bytes'})")
    return Header(entries, metadata, bytes(header_bytes))


def check_json_cost(raw: bytes, what: str) -> None:
    """Refuse JSON text denser in objects and lists (or values) than any shardwise writes or reads,
    before parsing it: what it builds stays within a few times its size (an upper bound on the count:
    brackets and commas inside strings count too)."""
    containers, items = raw.count(b"{") + raw.count(b"["), raw.count(b",")
    if containers > 4096 + len(raw) // BYTES_PER_CONTAINER or items > 4096 + len(raw) // BYTES_PER_ITEM:
        raise ShardwiseError(f"{what} holds up to {containers} JSON objects and lists and {items} values in "
                             f"{len(raw)} bytes, denser than any index or header shardwise writes or reads: it is "
                             "damaged or crafted, and was not parsed")


def parse_header(read: Callable[[int, int], bytes], size: int, path) -> tuple[dict[str, Entry], dict[str, str]]:
    """`read_header`'s entries and `__metadata__`."""
    header = read_header(read, size, path)
    return header.entries, header.metadata


def _entry(corrupt: str, key: str, value, data_start: int) -> Entry:
    try:
        dtype = DTYPE_OF_CODE[value["dtype"]]
        shape = tuple(_count(d) for d in value["shape"])
        begin, end = (_count(x) for x in value["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ShardwiseError(f"{corrupt}: entry {key!r} has no valid dtype/shape/data_offsets") from None
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise ShardwiseError(f"{corrupt}: entry {key!r} has data_offsets [{begin}, {end}] ({end - begin} bytes) for "
                             f"shape {list(shape)} {value['dtype']} ({math.prod(shape) * dtype.itemsize} bytes)")
    return Entry(dtype, shape, data_start + begin, data_start + end)


def _count(value) -> int:
    """A shape entry or an offset: a non-negative JSON integer (not a bool, a float or a string)."""
    if type(value) is not int or not 0 <= value < _MAX_COUNT:
        raise ValueError(value)
    return value
