"""Reading a JSON file that may be damaged or hostile: bounded in size and in nesting, never through a
symlink (`read_json`); schema.py's `Fields` then checks each field's type and bounds."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.wire.st_header import check_json_cost


def short(value) -> str:
    """`value`'s repr, cut to 60 characters (an error quotes a damaged value, not a megabyte of it)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_bounded(file: Path, limit: int, *, not_found) -> bytes:
    """The bytes of `file`, a regular file opened without following a symlink, at most limit."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise not_found() from None
    except OSError as error:
        if os.path.islink(file):
            raise ShardwiseError(f"{file} is a symlink: shardwise reads a checkpoint's own files only "
                                 "(Note [contained names] in schema.py); copy the file in") from None
        if os.path.isdir(file.parent) and not os.path.exists(file):
            raise not_found() from None
        raise ShardwiseError(f"cannot read {file}: {error}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ShardwiseError(f"{file} is not a regular file")
        if info.st_size > limit:
            raise ShardwiseError(f"{file} is {info.st_size} bytes, more than any index shardwise writes "
                                 f"({limit}, shardwise.checkpoint.format.schema.MAX_INDEX_BYTES): it is damaged "
                                 "or not an index")
        chunks, left = [], limit + 1
        while left > 0:
            data = os.read(fd, min(left, 2**20))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        if left <= 0:
            raise ShardwiseError(f"{file} grew past {limit} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(file: Path, raw: bytes, max_depth: int):
    """`raw` parsed, refusing what would build too much (check_json_cost, before parsing), what does
    not parse and what nests deeper than max_depth."""
    check_json_cost(raw, str(file))
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ShardwiseError(f"{file} does not parse ({short(str(error))}): the checkpoint is corrupt") from None
    except RecursionError:
        raise ShardwiseError(f"{file} nests deeper than Python parses: it is damaged or crafted") from None
    level, depth = [value] if type(value) in _CONTAINERS else [], 1
    while level:  # one nesting level at a time; a list of numbers (crcs) is passed over in C, by its items' types
        if depth > max_depth:
            raise ShardwiseError(f"{file} nests values {depth} deep, more than the {max_depth} shardwise allows: "
                                 "it is damaged or crafted")
        inner = []
        for item in level:
            children = item.values() if type(item) is dict else item
            if not _CONTAINERS.isdisjoint(map(type, children)):
                inner.extend(child for child in children if type(child) in _CONTAINERS)
        level, depth = inner, depth + 1
    return value


_CONTAINERS = frozenset((dict, list))  # what json.loads builds that holds values


def read_json(file: Path, limit: int, max_depth: int, *, not_found):
    """`file` read (`read_bounded`) and parsed (`parse_json`): one call for a JSON file that may be hostile."""
    raw = read_bounded(file, limit, not_found=not_found)
    return parse_json(file, raw, max_depth)
