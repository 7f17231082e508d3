"""index.json read and checked into records.py's typed records, before anything else of a checkpoint is read.

Note [index records]: a checkpoint directory is read through these records only. `read_index` opens index.json
(a regular file, never through a symlink, at most MAX_INDEX_BYTES, read bounded), parses it (nesting at most
MAX_DEPTH), checks its digest (Note [index digest]), then every field: its type, its bounds, and its agreement
with the other fields (a slice names a listed file, its rows lie inside its tensor and tile it, one crc per
chunk; a file name is a plain name inside the directory, Note [contained names]; each kind of record names
tensors in its own namespace, `param/`, `buffer/`, `optim/`, `rng/`, so that no record can stand in for
another's header check). Any violation is a ShardwiseError naming the file and the field; the code after this
never meets a raw dict of the index, so it has no second set of checks to keep in step.

Note [index digest]: "digest" is the sha256 of every other field, encoded canonically (sorted
keys, no spaces, `index_digest`), so a changed value anywhere (an `lr`, a `step`, a dtype) is
refused before it is used. It detects damage and edits, not a forger: whoever can write the
directory can recompute it, which is why every field is still checked for what it can be.

Note [contained names]: a file named by the index is a plain name (letters, digits, `_ . -`,
ending in `.safetensors`): no separator, no `..`, no absolute path, so a load reads only
inside the checkpoint directory; the files themselves are opened without following symlinks
(read/reader.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

from shardwise.checkpoint.format.bounded_json import read_json, short
from shardwise.checkpoint.format.records import (
    FORMAT,
    INDEX,
    VERSION,
    FileRecord,
    GroupRecord,
    Index,
    OptimizerRecord,
    RngRecord,
    SliceRecord,
    StateRecord,
    TensorRecord,
)
from shardwise.engine.layout.rows import num_rows
from shardwise.errors import ShardwiseError
from shardwise.wire.st_header import DTYPE_OF_CODE

MAX_INDEX_BYTES = 64 * 2**20  # far above any real index (crcs are 4 bytes per 4 MiB of data)
MAX_DEPTH = 64  # JSON nesting: Lightning's state and a data loader's are under 12
_MAX_DIM = 2**48
_MAX_DIMS = 32
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_NOW_BOUND = 1e11  # seconds since 1970: the year 5138


def index_digest(index: dict) -> str:
    """The digest of `index` without its \"digest\" field (Note [index digest]): the reader checks it, the writer
    (write/index.py) computes it."""
    body = {k: v for k, v in index.items() if k != "digest"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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


def read_index(path: Path) -> Index:
    """Read, parse and check `path/index.json` (Note [index records]); a ShardwiseError names what is wrong."""
    path = Path(path)
    parsed = read_json(path / INDEX, MAX_INDEX_BYTES, MAX_DEPTH, not_found=lambda: _not_a_checkpoint(path))
    return parse_index(path, parsed)


def parse_index(path: Path, index) -> Index:
    """The typed records of a parsed index.json of checkpoint directory `path`."""
    f = Fields(path / INDEX)
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ShardwiseError(f"{path / INDEX} is not a shardwise index (no \"format\": \"{FORMAT}\")")
    if index.get("version") != VERSION:
        raise ShardwiseError(f"{path / INDEX} has format version {index.get('version')!r}; this shardwise reads "
                             f"version {VERSION}. Load it with the shardwise that saved it (version 1: shardwise "
                             "0.1), or save it again.")
    if index.get("digest") != index_digest(index):
        raise ShardwiseError(f"{path / INDEX} does not match its own digest: the index was changed or damaged since "
                             "it was saved (an edited value, a flipped byte). Load an earlier checkpoint.")
    world = f.int(index, "world_size", 1, 2**20)
    files = {_file_name(f, name, f"files[{name!r}]"): FileRecord(
                 f.int(entry, "bytes", 0, 2**62, f"files[{name!r}]"),
                 f.match(entry, "digest", _DIGEST, f"files[{name!r}]"))
             for name, entry in f.dict(index, "files").items()}
    params = {f.name(n, "params"): _tensor(f, e, f"params[{n!r}]", files, "param/", param=True)
              for n, e in f.dict(index, "params").items()}
    buffers = {f.name(n, "buffers"): _tensor(f, e, f"buffers[{n!r}]", files, "buffer/")
               for n, e in f.dict(index, "buffers").items()}
    optimizers = () if index.get("optimizer") is None else (_optimizer(f, index["optimizer"], params, files),)
    for number, optim in enumerate(optimizers):  # a shard group lies within the ranks that saved
        if optim.owner_world > world:
            raise f.fail(f"optimizers[{number}].owners" if len(optimizers) > 1 else "optimizer.owners",
                         f"has a shard group of {optim.owner_world} ranks, more than the world size {world}")
    several = index.get("optimizers") is not None
    if several:
        if optimizers:
            raise f.fail("optimizers", "is given beside \"optimizer\": a checkpoint holds one or the other")
        many = f.list(index, "optimizers")
        optimizers = tuple(_optimizer(f, many[i], params, files, f"optimizers[{i}]", i) for i in range(len(many)))
        names = [o.name for o in optimizers]
        if any(n is not None for n in names) and (None in names or len(set(names)) != len(names)):
            raise f.fail("optimizers", "name some optimizers and not others, or one name twice")
    scheduler = index.get("scheduler")
    if scheduler is not None:
        f.dict(index, "scheduler")
    rng = tuple(_rng(f, entry, f"rng[{i}]", files) for i, entry in enumerate(f.list(index, "rng")))
    if len(rng) not in (0, world):
        raise f.fail("rng", f"has {len(rng)} ranks' states for world size {world}")
    by_rank = index.get("objects_by_rank")
    if by_rank is not None:
        by_rank = tuple(f.dict(by_rank, i, "objects_by_rank") for i in range(len(f.list(index, "objects_by_rank"))))
        if len(by_rank) != world:
            raise f.fail("objects_by_rank", f"has {len(by_rank)} entries for world size {world}")
    order = None
    if index.get("order") is not None:
        pair = f.list(index, "order", limit=2)
        order = tuple(f.int(pair, i, 0, 2**62, "order") for i in range(len(pair)))
        if len(order) != 2:
            raise f.fail("order", "is not [step, save counter]")
    return Index(path, f.match(index, "id", re.compile(r"[0-9a-zA-Z_-]{1,64}")),
                 f.number(index, "saved_at", 0.0, _NOW_BOUND), f.str(index, "shardwise_version", 128),
                 f.str(index, "torch_version", 128), f.str(index, "strategy", 64), world, files, params, buffers,
                 optimizers, several, scheduler, rng, f.dict(index, "objects"), by_rank, f.dict(index, "extra"),
                 order, f.dict(index, "model_config") if index.get("model_config") is not None else None,
                 f.dict(index, "compression") if index.get("compression") is not None else None)


def _tensor(f: Fields, entry, where: str, files: dict, kind: str, *, param: bool = False, shape=None) -> TensorRecord:
    entry = f.dict({where: entry}, where, "")
    dims = f.list(entry, "shape", where, limit=_MAX_DIMS)
    got = f.ints(dims, 0, _MAX_DIM, f"{where}.shape")
    if shape is not None and got != shape:
        raise f.fail(f"{where}.shape", f"is {list(got)}, its parameter's is {list(shape)}")
    code = f.str(entry, "dtype", 16, where)
    if code not in DTYPE_OF_CODE:
        raise f.fail(f"{where}.dtype", f"is {code!r}, not a dtype shardwise stores ({sorted(DTYPE_OF_CODE)})")
    dtype = DTYPE_OF_CODE[code]
    if math.prod(got) * dtype.itemsize > 2**62:
        raise f.fail(f"{where}.shape", f"{list(got)} is larger than any file")
    rows = num_rows(got)
    row_bytes = math.prod(got[1:]) * dtype.itemsize
    slices = []
    for i, raw in enumerate(f.list(entry, "slices", where)):
        at = f"{where}.slices[{i}]"
        raw = f.dict({at: raw}, at, "")
        file = f.str(raw, "file", 256, at)
        if file not in files:
            raise f.fail(f"{at}.file", f"names {file!r}, which the index's files do not list")
        bounds = f.list(raw, "rows", at, limit=2)
        lo, hi = f.ints(bounds, 0, rows, f"{at}.rows") if len(bounds) == 2 else (0, -1)
        if not lo < hi:
            raise f.fail(f"{at}.rows", f"is {bounds!r}: not rows lo < hi inside the tensor's {rows}")
        chunk = f.int(raw, "chunk", 1, _MAX_DIM, at)
        crcs = _crcs(f, raw, at, -(-(hi - lo) // chunk) if row_bytes else 0)
        slices.append(SliceRecord(file, _key(f, raw, at, kind), lo, hi, chunk, crcs))
    covered = 0
    for piece in sorted(slices, key=lambda s: s.lo):
        if piece.lo != covered:
            raise f.fail(f"{where}.slices", f"leave rows {covered}:{piece.lo} uncovered or overlap at row {piece.lo}")
        covered = piece.hi
    if covered != rows:
        raise f.fail(f"{where}.slices", f"cover rows 0:{covered} of {rows}")
    aliases, requires_grad = (), None
    if param:
        names = f.list(entry, "aliases", where)
        aliases = tuple(f.name(names[i], f"{where}.aliases") for i in range(len(names)))
        requires_grad = f.bool(entry, "requires_grad", where)
    return TensorRecord(got, dtype, tuple(slices), aliases, requires_grad)


def _key(f: Fields, raw: dict, at: str, kind: str) -> str:
    """A slice's tensor name in its file, in its kind's own namespace (Note [index records]): a record of
    one kind cannot name, and so shadow the header check of, a tensor of another."""
    key = f.str(raw, "key", 4096, at)
    if not key.startswith(kind):
        raise f.fail(f"{at}.key", f"is {key[:60]!r}, not a name of the {kind}... kind (one namespace per kind)")
    return key


def _crcs(f: Fields, raw: dict, at: str, expected: int) -> tuple[int, ...]:
    crcs = f.list(raw, "crcs", at)
    if len(crcs) != expected:
        raise f.fail(f"{at}.crcs", f"has {len(crcs)} checksums for {expected} chunks")
    return f.ints(crcs, 0, 2**32 - 1, f"{at}.crcs")


def _optimizer(f: Fields, raw, params: dict, files: dict, where: str = "optimizer", number: int = 0) -> OptimizerRecord:
    prefix = "optim" if number == 0 else f"optim{number}"  # each optimizer's own namespace (save.py's keys)
    raw = f.dict({where: raw}, where, "")
    groups = []
    for i, group in enumerate(f.list(raw, "param_groups", where)):
        at = f"{where}.param_groups[{i}]"
        group = f.dict({at: group}, at, "")
        names = f.list(group, "params", at)
        for j in range(len(names)):
            if f.name(names[j], f"{at}.params") not in params:
                raise f.fail(f"{at}.params[{j}]", f"names {names[j]!r}, which the index's params do not list")
        groups.append(GroupRecord(tuple(names), f.dict(group, "options", at)))
    state = {}
    for name, entry in f.dict(raw, "state", where).items():
        at = f"{where}.state[{name!r}]"
        if name not in params:
            raise f.fail(at, "names a parameter the index's params do not list")
        entry = f.dict({at: entry}, at, "")
        tensors = {f.name(key, f"{at}.tensors"): _tensor(f, value, f"{at}.tensors[{key!r}]", files, f"{prefix}/",
                                                         shape=params[name].shape)
                   for key, value in f.dict(entry, "tensors", at).items()}
        # Note [optimizer records]: tensors of their own shapes, absent when a state has none
        whole = {} if entry.get("whole") is None else {
            f.name(key, f"{at}.whole"): _tensor(f, value, f"{at}.whole[{key!r}]", files, f"{prefix}.whole/")
            for key, value in f.dict(entry, "whole", at).items()}
        if tensors.keys() & whole.keys():
            raise f.fail(at, f"stores {sorted(tensors.keys() & whole.keys())} both as rows and whole")
        state[name] = StateRecord(f.dict(entry, "scalars", at), tensors, whole)
    label = None if raw.get("name") is None else f.str(raw, "name", 256, where)
    owners, owner_world = _owners(f, raw, params, where)
    return OptimizerRecord(f.str(raw, "class", 256, where), tuple(groups), state, label, owners, owner_world)


def _owners(f: Fields, raw: dict, params: dict, where: str) -> tuple[dict[str, int], int]:
    """The recorded owner map (Note [recorded owners] in optim_state.py): absent for most optimizers."""
    if raw.get("owners") is None:
        return {}, 0
    at = f"{where}.owners"
    record = f.dict(raw, "owners", where)
    world = f.int(record, "shard_world", 2, 2**20, at)
    owners = {}
    for name in f.dict(record, "map", at):
        if f.name(name, f"{at}.map") not in params:
            raise f.fail(f"{at}.map[{name!r}]", "names a parameter the index's params do not list")
        owners[name] = f.int(record["map"], name, 0, world - 1, f"{at}.map")
    return owners, world


def _rng(f: Fields, raw, at: str, files: dict) -> RngRecord:
    raw = f.dict({at: raw}, at, "")
    file = f.str(raw, "file", 256, at)
    if file not in files:
        raise f.fail(f"{at}.file", f"names {file!r}, which the index's files do not list")
    tensors = {}
    for key, check in f.dict(raw, "tensors", at).items():
        where = f"{at}.tensors[{key!r}]"
        check = f.dict({where: check}, where, "")
        crcs = f.list(check, "crcs", where)
        if not key.startswith("rng/"):
            raise f.fail(where, "is not an RNG state's name (rng/...): one namespace per kind (Note [index records])")
        tensors[f.name(key, f"{at}.tensors")] = (f.int(check, "chunk", 1, _MAX_DIM, where),
                                                 _crcs(f, check, where, len(crcs)))
    numpy = f.dict(raw, "numpy", at)
    f.str(numpy, "kind", 32, f"{at}.numpy")
    f.int(numpy, "pos", 0, 624, f"{at}.numpy")
    f.int(numpy, "has_gauss", 0, 1, f"{at}.numpy")
    f.number(numpy, "cached", -1e308, 1e308, f"{at}.numpy")
    python = f.dict(raw, "python", at)
    f.int(python, "version", 0, 64, f"{at}.python")
    if python.get("gauss_next") is not None:
        f.number(python, "gauss_next", -1e308, 1e308, f"{at}.python")
    f.int(raw, "cuda", 0, 4096, at)
    scalars = {"numpy": numpy, "python": python, "cuda": raw["cuda"]}
    return RngRecord(file, tensors, scalars)


def _file_name(f: Fields, value: str, where: str) -> str:
    if not _FILE_NAME.fullmatch(value) or ".." in value:
        raise f.fail(where, "is not a plain file name inside the checkpoint directory (Note [contained names]): a "
                            "path, a '..' or a name shardwise never writes")
    return value


def _not_a_checkpoint(path: Path) -> ShardwiseError:
    """The error for a directory without index.json, with what the directory does hold."""
    inside = sorted(p.name for p in path.iterdir() if (p / INDEX).is_file()) if path.is_dir() else []
    partial = sorted(p.name for p in path.iterdir() if p.name.endswith(".partial")) if path.is_dir() else []
    hint = ""
    if inside:
        more = '...' if len(inside) > 5 else ''
        hint = f" It holds checkpoints {inside[:5]}{more}: pass one of them, or sw.latest({str(path)!r})."
    elif partial:
        hint = f" It holds unfinished saves {partial}: a save that crashed before it completed."
    return ShardwiseError(f"{path} is not a shardwise checkpoint: it has no {INDEX}.{hint}")
