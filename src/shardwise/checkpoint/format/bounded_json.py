"""Reading a JSON file that may be damaged or hostile: bounded in size and in nesting, never
through a symlink, with typed field access whose errors name the file and the field."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from shardwise.errors import ShardwiseError
from shardwise.wire.st_header import check_json_cost


class Fields:
    """Typed, bounded access to the fields of one parsed JSON file; errors name the file and the field."""

    def __init__(self, file: Path):
        self.file = file

    def fail(self, where, what: str) -> ShardwiseError:
        return ShardwiseError(f"{self.file}: field {where} {what}: the file is damaged or was edited. Load an "
                              "earlier checkpoint.")

    # Each accessor checks first and names the field only on failure: an index holds thousands of
    # fields (a crc per 4 MiB chunk), and formatting each one's path cost a load more than its checks.
    def _get(self, obj, key, at: str):
        if isinstance(obj, dict):
            if key in obj:
                return obj[key]
        elif isinstance(obj, list) and isinstance(key, int):
            if 0 <= key < len(obj):
                return obj[key]
        else:
            raise self.fail(at or "(the whole file)", f"is {short(obj)}, not an object")
        raise self.fail(self.where(key, at), "is missing")

    @staticmethod
    def where(key, at: str) -> str:
        """The path of field `key` of the value at path `at`, as errors name it."""
        return f"{at}.{key}" if at and isinstance(key, str) else f"{at}[{key}]" if at else str(key)

    def dict(self, obj, key, at: str = "") -> dict:
        value = self._get(obj, key, at)
        if not isinstance(value, dict):
            raise self.fail(self.where(key, at), f"is a {type(value).__name__}, not an object")
        return value

    def list(self, obj, key, at: str = "", *, limit: int | None = None) -> list:
        value = self._get(obj, key, at)
        if not isinstance(value, list) or limit is not None and len(value) > limit:
            raise self.fail(self.where(key, at),
                            f"is {short(value)}, not a list" + (f" of at most {limit}" if limit else ""))
        return value

    def int(self, obj, key, lo: int, hi: int, at: str = "") -> int:
        value = self._get(obj, key, at)
        if type(value) is not int or not lo <= value <= hi:
            raise self.fail(self.where(key, at), f"is {short(value)}, not an integer in {lo}..{hi}")
        return value

    def ints(self, values: list, lo: int, hi: int, at: str) -> tuple[int, ...]:
        """Every item of list `values` (at path `at`) an integer in lo..hi, checked in one pass."""
        if all(type(value) is int and lo <= value <= hi for value in values):
            return tuple(values)
        return tuple(self.int(values, i, lo, hi, at) for i in range(len(values)))  # names the first bad one

    def number(self, obj, key, lo: float, hi: float, at: str = "") -> float:
        value = self._get(obj, key, at)
        if type(value) not in (int, float) or not lo <= value <= hi:
            raise self.fail(self.where(key, at), f"is {short(value)}, not a number in {lo:g}..{hi:g}")
        return float(value)

    def bool(self, obj, key, at: str = "") -> bool:
        value = self._get(obj, key, at)
        if type(value) is not bool:
            raise self.fail(self.where(key, at), f"is {short(value)}, not true or false")
        return value

    def str(self, obj, key, limit: int, at: str = "") -> str:
        value = self._get(obj, key, at)
        if not isinstance(value, str) or len(value) > limit:
            raise self.fail(self.where(key, at), f"is {short(value)}, not a string of at most {limit} characters")
        return value

    def match(self, obj, key, pattern: re.Pattern, at: str = "") -> str:
        value = self.str(obj, key, 256, at)
        if not pattern.fullmatch(value):
            raise self.fail(f"{at}.{key}" if at else key, f"is {short(value)}, not of the form {pattern.pattern}")
        return value

    def name(self, value, where: str, limit: int = 4096) -> str:
        if not isinstance(value, str) or not 0 < len(value) <= limit:
            raise self.fail(where, f"holds {short(value)}, not a name")
        return value


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
