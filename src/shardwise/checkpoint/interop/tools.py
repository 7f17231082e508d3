"""What `shardwise ckpt inspect | export | diff` do, without a model or a process group."""

from __future__ import annotations

import collections
import datetime
import math
import os
from dataclasses import dataclass
from pathlib import Path

from shardwise.checkpoint.format.files import TensorSpec, dtype_code
from shardwise.checkpoint.format.model_config import prepare_config, write_config
from shardwise.checkpoint.format.records import INDEX
from shardwise.checkpoint.format.schema import read_index
from shardwise.checkpoint.interop.export import partial_name
from shardwise.checkpoint.read.reader import file_digest
from shardwise.checkpoint.read.sources import CheckpointDir, SourceTensor, open_source
from shardwise.checkpoint.write.writer import FileWriter
from shardwise.engine.layout.rows import num_rows
from shardwise.errors import ShardwiseError

_MIB = 2**20  # MiB, as the estimator and sw.describe print


def _size(nbytes: int) -> str:
    return f"{nbytes / _MIB:.2f} MiB" if nbytes >= 10_000 else f"{nbytes} B"


def _nbytes(tensor: SourceTensor) -> int:
    count = 1
    for d in tensor.shape:
        count *= d
    return count * tensor.dtype.itemsize


def inspect(path, *, verify: bool = True) -> tuple[list[str], bool]:
    """Lines describing checkpoint directory `path`, and whether every file verified.

    With `verify`, every file is read whole and its digest recomputed (Note [chunk
    checksums] in files.py): slow for a big checkpoint, and the one complete check.
    """
    path = Path(path)
    index = read_index(path)
    saved = datetime.datetime.fromtimestamp(index.saved_at).isoformat(timespec="seconds")
    lines = [f"checkpoint {path}",
             f"  id {index.id}, saved {saved} by shardwise {index.shardwise_version} (torch {index.torch_version})",
             f"  strategy {index.strategy}, world size {index.world_size}"]
    if index.extra:
        shown = {key: _clip(repr(value)) for key, value in index.extra.items()}
        lines.append("  extra: {" + ", ".join(f"{key!r}: {value}" for key, value in shown.items()) + "}")
    for number, optim in enumerate(index.optimizers):
        groups = ", ".join("{" + ", ".join(f"{k}={_clip(repr(v))}" for k, v in g.options.items()
                                           if k in ("lr", "weight_decay", "name")) + "}" for g in optim.groups)
        label = f" {optim.name!r}" if optim.name else f" {number}" if index.several else ""
        whole = sum(len(state.whole) for state in optim.state.values())
        extra = f" ({whole} whole state tensors: factors, scales)" if whole else ""
        lines.append(f"  optimizer{label} {_clip(optim.class_name)}: {len(optim.state)} params with state{extra}; "
                     f"groups {groups}")
        if optim.owners:  # Note [recorded owners]
            lines.append(_owner_line(optim.owners, optim.owner_world))
    if not index.optimizers:
        lines.append("  optimizer: none saved")
    lines.append(f"  scheduler: {'saved' if index.scheduler is not None else 'none saved'}; "
                 f"objects: {sorted(index.objects) or 'none'}")
    total = 0
    lines.append(f"  {len(index.params)} parameters, {len(index.buffers)} buffers:")
    for kind, records in (("params", index.params), ("buffers", index.buffers)):
        for name, record in records.items():
            total += record.nbytes
            tied = f"  tied: {', '.join(record.aliases)}" if record.aliases else ""
            frozen = "  frozen" if record.requires_grad is False else ""
            suffix = "  (buffer)" if kind == "buffers" else ""
            lines.append(f"    {name:50s} {str(list(record.shape)):18s} {dtype_code(record.dtype):5s} "
                         f"{_size(record.nbytes):>10s}{tied}{frozen}{suffix}")
    lines.append(f"  model: {_size(total)}; files:")
    ok = True
    for name, entry in index.files.items():
        status = ""
        if verify:
            try:
                status = ("ok" if file_digest(path / name, follow_symlinks=False) == entry.digest
                          else "CORRUPT (digest differs)")
            except ShardwiseError as error:
                status = f"BAD: {error}"
            ok = ok and status == "ok"
        lines.append(f"    {name}  {_size(entry.nbytes)}  {entry.digest[:23]}…  {status}")
    foreign = _foreign_files(path, index.files)
    for name in foreign:
        lines.append(f"    {name}  NOT SHARDWISE'S: not listed in index.json; shardwise never reads it")
    if foreign:
        ok = False
        lines.append(f"the directory holds {len(foreign)} file(s) that are not part of the checkpoint: remove them "
                     "(or find out where they came from) before sharing or loading it elsewhere")
    if verify:
        lines.append("checksums verified: every file is intact" if ok else "checksums FAILED: see above")
    return lines, ok


_OWNING_RANKS_SHOWN = 16  # ranks listed by name on the owners' line; the rest are counted


def _owner_line(owners: dict[str, int], world: int) -> str:
    """The owners' load per rank, in one pass over the map: only the ranks that own something are
    listed (at most `_OWNING_RANKS_SHOWN`, then a count), so a forged shard group size costs nothing."""
    held = collections.Counter(owners.values())
    ranks = sorted(held)
    shown = ", ".join(f"rank {rank} {held[rank]} params" for rank in ranks[:_OWNING_RANKS_SHOWN])
    more = len(ranks) - _OWNING_RANKS_SHOWN
    rest = f", and {more} more ranks ({sum(held[r] for r in ranks[_OWNING_RANKS_SHOWN:])} params)" if more > 0 else ""
    idle = world - len(ranks)
    return (f"    whole-tensor owners (shard group of {world}): {shown}{rest}"
            + (f"; {idle} ranks own none" if idle else ""))


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _foreign_files(path: Path, files) -> list[str]:
    """Entries of checkpoint directory `path` that its index does not list (a pickle someone added)."""
    return sorted(name for name in os.listdir(path) if name != INDEX and name not in files)


@dataclass(frozen=True)
class Exported:
    """What `export_checkpoint` wrote: the safetensors file, the config.json beside it (None: none was
    written) and the code references dropped from that config (Note [model config] in model_config.py)."""

    path: Path
    config: Path | None
    dropped: tuple[str, ...] = ()


def export_checkpoint(path, out, *, replace_config: bool = False) -> Exported:
    """Write checkpoint directory `path`'s parameters and buffers to one plain safetensors
    file `out` (as `sw.export` writes from a model), one tensor in memory at a time; and,
    when the checkpoint recorded a Hugging Face config (Note [model config] in model_config.py), its
    `config.json` beside `out`: checked against the tensors, without code references, and never over
    a different config.json there unless `replace_config`. Every check runs before anything is
    written. An `out` inside the checkpoint directory is refused (it would overwrite what it reads)."""
    out = Path(out).absolute()
    inside = Path(os.path.realpath(path))
    if os.path.commonpath([inside, os.path.realpath(out.parent)]) == str(inside) or \
            os.path.realpath(out) == str(inside):
        raise ShardwiseError(f"{out} is inside the checkpoint {path} that the export reads: write it elsewhere")
    source = CheckpointDir(Path(path), lambda name: name)
    try:
        metadata, specs, tensors = {"format": "pt"}, [], []
        for tensor in source.tensors.values():
            specs.append(TensorSpec(tensor.name, tensor.dtype, tensor.shape))
            tensors.append(tensor)
            for alias in tensor.aliases:
                metadata[alias] = tensor.name
        shapes = {spec.key: spec.shape for spec in specs}
        shapes.update({alias: shapes[name] for alias, name in metadata.items() if name in shapes})
        config, dropped = prepare_config(source.index.model_config, shapes, out.parent, replace=replace_config,
                                         where=f"{Path(path) / INDEX}: its model_config",
                                         aliases={k: v for k, v in metadata.items() if k != "format"})
        partial = partial_name(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)  # as sw.export does
        except OSError as error:
            raise ShardwiseError(f"cannot create {out.parent} for the export: {error}") from None
        writer = FileWriter(partial, specs, metadata)
        try:
            for spec, tensor in zip(specs, tensors):
                rows = num_rows(spec.shape)
                writer.write_next(tensor.read(0, rows, None).reshape(spec.shape))
            writer.close()
        except BaseException:
            writer.abort()
            partial.unlink(missing_ok=True)
            raise
        os.replace(partial, out)
        written = write_config(config, out.parent) if config is not None else None
    finally:
        source.close()
    return Exported(out, written, tuple(dropped))


_BLOCK_BYTES = 16 * _MIB  # rows compared at a time by `diff --values`


def _blocks(source, tensor: SourceTensor, row_bytes: int, flat: bool):
    """`tensor`'s elements in order, flat, about _BLOCK_BYTES at a time: whole rows, or parts of a
    row larger than that (its chunks' crcs checked first, streaming, by `source.verify`)."""
    rows = num_rows(tensor.shape)
    if not flat:
        step = max(1, _BLOCK_BYTES // max(1, row_bytes))
        for lo in range(0, rows, step):
            yield tensor.read(lo, min(rows, lo + step), None).reshape(-1)
        return
    source.verify([(tensor, 0, rows)])
    numel, step = math.prod(tensor.shape), max(1, _BLOCK_BYTES // tensor.dtype.itemsize)
    for start in range(0, numel, step):
        yield tensor.read_flat(start, min(numel, start + step))


def _largest_difference(first, second, x: SourceTensor, y: SourceTensor) -> float:
    """max |x - y| over two tensors of one shape, read _BLOCK_BYTES at a time (never whole, nor a
    whole row larger than that) and compared 2^20 elements at a time in float64."""
    rows = num_rows(x.shape)
    row_bytes = _nbytes(x) // max(rows, 1)
    largest = 0.0
    flat = row_bytes > _BLOCK_BYTES and x.read_flat is not None and y.read_flat is not None  # the same blocks
    for a, b in zip(_blocks(first, x, row_bytes, flat), _blocks(second, y, row_bytes, flat)):
        for start in range(0, a.numel(), 2**20):
            piece = (a[start : start + 2**20].double() - b[start : start + 2**20].double()).abs().max()
            block = float(piece)
            if block != block:  # NaN on one side: they differ
                return block
            largest = max(largest, block)
    return largest


def diff(a, b, *, values: bool = False) -> tuple[list[str], bool]:
    """Lines saying how sources `a` and `b` differ (keys, shapes, dtypes; with `values`, the
    largest absolute difference of each common tensor), and whether they match."""
    first, second = open_source(a, lambda n: n), open_source(b, lambda n: n)
    try:
        lines = [f"--- {a}", f"+++ {b}"]
        for label, x, y in (("strategy", first.strategy, second.strategy),
                            ("world size", first.world_size, second.world_size)):
            if x != y and x is not None and y is not None:
                lines.append(f"  {label}: {x} vs {y} (any strategy and world size loads either)")
        only_a = [n for n in first.tensors if n not in second.tensors]
        only_b = [n for n in second.tensors if n not in first.tensors]
        for name in only_a:
            lines.append(f"- {name} {list(first.tensors[name].shape)}")
        for name in only_b:
            lines.append(f"+ {name} {list(second.tensors[name].shape)}")
        changed = 0
        for name, x in first.tensors.items():
            y = second.tensors.get(name)
            if y is None:
                continue
            if x.shape != y.shape or x.dtype != y.dtype:
                changed += 1
                lines.append(f"~ {name}: {list(x.shape)} {dtype_code(x.dtype)} "
                             f"vs {list(y.shape)} {dtype_code(y.dtype)}")
            elif values:
                largest = _largest_difference(first, second, x, y)
                if largest != 0.0:
                    changed += 1
                    lines.append(f"~ {name}: values differ, max |a - b| = {largest:.3g}")
        kinds = [[(o.name, o.class_name) for o in c.optimizers] for c in (first, second)]
        if kinds[0] != kinds[1]:
            has = [", ".join(f"{n + ': ' if n else ''}{k}" for n, k in kind) or "none" for kind in kinds]
            lines.append(f"  optimizer state: {has[0]} vs {has[1]}")
        same = not (only_a or only_b or changed)
        lines.append("same keys, shapes and dtypes" + (" and values" if values else "") if same else
                     f"differ: {len(only_a)} only in the first, {len(only_b)} only in the second, {changed} changed")
        return lines, same
    finally:
        first.close()
        second.close()
