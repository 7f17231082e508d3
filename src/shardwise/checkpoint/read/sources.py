"""What `sw.load` reads from: a checkpoint directory, a safetensors file, a torch.save'd state dict (and,
through hf_dir.py, a Hugging Face model directory).

Three sources here, one interface (`Source.tensors`: name -> `SourceTensor`, each able to
read any row range): a shardwise checkpoint directory (index.json + row slices in
safetensors files), one safetensors file, or a `torch.save`d state dict (read with
`weights_only=True`, so no code runs). Names are cleaned of wrapper prefixes and
renamed on the way in (Note [wrapper prefixes] in names.py).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from shardwise.checkpoint.format.names import clean_name
from shardwise.checkpoint.format.records import INDEX, Index, TensorRecord
from shardwise.checkpoint.format.schema import read_index
from shardwise.checkpoint.read.hf_dir import HF_INDEX, HFDirectory, is_hf_dir
from shardwise.checkpoint.read.hf_names import HFNames
from shardwise.checkpoint.read.reader import FileReader
from shardwise.checkpoint.read.source_base import Source, SourceNames, SourceTensor
from shardwise.engine.layout.rows import num_rows
from shardwise.errors import ShardwiseError


class CheckpointDir(Source):
    """A directory `sw.save` wrote (see save.py for the layout), read through its typed index
    records (Note [index records] in schema.py)."""

    def __init__(self, path: Path, renamer: Callable[[str], str]):
        super().__init__()
        self.path = path
        self.index = index = read_index(path)
        self.description, self.values_file = str(path), str(path / INDEX)
        self.world_size, self.strategy = index.world_size, index.strategy
        self.readers: dict[str, FileReader] = {}
        self._expected = _expected_headers(index)
        for name, entry in index.files.items():
            file = path / name
            if not os.path.lexists(file):
                raise ShardwiseError(
                    f"shard file {name} listed in {path / INDEX} is missing: the checkpoint is incomplete "
                    "(a partial copy, or a file deleted since). Load an earlier checkpoint."
                )
            if os.lstat(file).st_size != entry.nbytes or os.path.islink(file):
                FileReader(file, expected_bytes=entry.nbytes, what="shard file", follow_symlinks=False).close()
        self.rename = lambda name: renamer(clean_name(name))
        names = SourceNames(path / INDEX)
        for records in (index.params, index.buffers):
            for name, record in records.items():
                tensor = self._source_tensor(names.add(self.rename(name), name), record)
                tensor.aliases = tuple(names.add(self.rename(a), a) for a in record.aliases)
                self.tensors[tensor.name] = tensor
        self.optimizers = tuple(replace(
            saved, groups=tuple(replace(g, params=tuple(map(self.rename, g.params))) for g in saved.groups),
            state={self.rename(n): s for n, s in saved.state.items()}) for saved in index.optimizers)
        self.several = index.several
        self.scheduler = index.scheduler
        self.objects = index.objects
        self.objects_by_rank = index.objects_by_rank
        self.extra = index.extra

    def _source_tensor(self, name: str, record: TensorRecord) -> SourceTensor:
        return SourceTensor(name, record.shape, record.dtype, (),
                            lambda lo, hi, out: self._read(name, record, lo, hi, out), record.slices,
                            lambda start, stop: self._read_flat(name, record, start, stop))

    def optimizer_tensor(self, number: int, name: str, key: str, *, whole: bool = False) -> SourceTensor:
        state = self.optimizers[number].state[name]
        return self._source_tensor(f"{number}:{name}:{key}{':whole' if whole else ''}",
                                   (state.whole if whole else state.tensors)[key])

    def reader(self, file: str) -> FileReader:
        """The open reader of `file`, its header checked against the index (dtype, shape, digest)."""
        if file not in self.readers:
            reader = FileReader(self.path / file, expected_bytes=self.index.files[file].nbytes, what="shard file",
                                follow_symlinks=False)
            try:
                owner = reader.metadata.get("checkpoint_id")
                if owner != self.index.id:
                    raise ShardwiseError(
                        f"shard file {self.path / file} belongs to checkpoint {owner}, but {INDEX} is that of "
                        f"checkpoint {self.index.id}: index.json was copied from another checkpoint. Load an "
                        "earlier checkpoint.")
                reader.check_header(self._expected[file], self.index.files[file].digest)
            except BaseException:
                reader.close()
                raise
            self.readers[file] = reader
        return self.readers[file]

    def verify(self, needs: list[tuple[SourceTensor, int, int]]) -> None:
        """Open every file the reads in `needs` touch and check every chunk they will read, so that
        the reads that follow (into a model) cannot fail on a bad byte (Note [validate, then apply])."""
        for tensor, lo, hi in needs:
            for piece, a, b in self._parts(tensor.name, tensor.slices, lo, hi):
                self.reader(piece.file).verify_rows(piece.key, a - piece.lo, b - piece.lo, crcs=piece.crcs,
                                                    chunk=piece.chunk)

    def _parts(self, name, slices, lo, hi):
        parts = [(s, max(lo, s.lo), min(hi, s.hi)) for s in slices if s.lo < hi and s.hi > lo]
        if sum(b - a for _, a, b in parts) != hi - lo:
            raise ShardwiseError(f"{self.path / INDEX} does not cover rows {lo}:{hi} of {name!r}: the index is damaged")
        return parts

    def _read(self, name, record: TensorRecord, lo, hi, out):
        parts = self._parts(name, record.slices, lo, hi)

        def rows(piece, a, b, into):  # checked again: the file may have changed since verify() (Note [validate,
            return self.reader(piece.file).read_rows(piece.key, a - piece.lo, b - piece.lo, out=into,  # then apply])
                                                     crcs=piece.crcs, chunk=piece.chunk)

        if len(parts) == 1:
            return rows(*parts[0], out)
        target = out if out is not None else torch.empty((hi - lo, *record.shape[1:]), dtype=record.dtype)
        for piece, a, b in parts:
            view = target[a - lo : b - lo]
            got = rows(piece, a, b, view)
            if got is not view:
                view.copy_(got.reshape(view.shape))
        return target

    def _read_flat(self, name, record: TensorRecord, start: int, stop: int) -> Tensor:
        row = math.prod(record.shape[1:])  # elements per row
        rows = num_rows(record.shape)
        parts = self._parts(name, record.slices, start // max(row, 1), min(rows, -(-stop // max(row, 1))))
        pieces = [self.reader(piece.file).read_span(piece.key, max(start, a * row) - piece.lo * row,
                                                    min(stop, b * row) - piece.lo * row) for piece, a, b in parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def rng_of(self, rank: int):
        if rank >= len(self.index.rng):
            return None
        entry = self.index.rng[rank]
        reader = self.reader(entry.file)
        tensors = {key: reader.read_rows(key, 0, reader.entry(key).rows, crcs=crcs, chunk=chunk)
                   for key, (chunk, crcs) in entry.tensors.items()}
        return tensors, entry.scalars

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()


def _expected_headers(index: Index) -> dict[str, dict]:
    """Per file: {key: (dtype, shape, crcs)} of every tensor the index says it holds; an RNG
    tensor's dtype and shape are the header's own (the index records only its crcs)."""
    expected: dict[str, dict] = {name: {} for name in index.files}
    records = [*index.params.values(), *index.buffers.values()]
    for optimizer in index.optimizers:
        records += [t for state in optimizer.state.values() for t in (*state.tensors.values(), *state.whole.values())]
    for record in records:
        for piece in record.slices:
            shape = (piece.hi - piece.lo, *record.shape[1:])
            if piece.key in expected[piece.file]:
                raise ShardwiseError(f"{index.path / INDEX} names tensor {piece.key!r} of {piece.file} twice: the "
                                     "index is damaged")
            expected[piece.file][piece.key] = (record.dtype, shape, piece.crcs)
    for entry in index.rng:
        for key, (_, crcs) in entry.tensors.items():
            if key in expected[entry.file]:
                raise ShardwiseError(f"{index.path / INDEX} names tensor {key!r} of {entry.file} twice: the "
                                     "index is damaged")
            expected[entry.file][key] = (None, None, crcs)
    return expected


class SafetensorsFile(Source):
    """One safetensors file (an export, or a model from a hub): full tensors, read by rows, under
    transformers' names for a transformers model (Note [transformers names] in hf_names.py)."""

    def __init__(self, path: Path, hf_names: HFNames):
        super().__init__()
        self.description, self.hf_names = str(path), hf_names
        self.file = FileReader(path, what="safetensors file")
        names = SourceNames(path)
        renamer = hf_names.rename
        ignored = [key for key in self.file.entries if hf_names.ignored(key)]
        if ignored:
            self.notes.append(f"{len(ignored)} tensors transformers ignores when it loads this model were not read "
                              f"({', '.join(ignored[:4])}{', ...' if len(ignored) > 4 else ''})")
        for key, entry in self.file.entries.items():
            if key in ignored:
                continue
            name = names.add(renamer(key), key)
            self.tensors[name] = SourceTensor(
                name, entry.shape, entry.dtype, (),
                lambda lo, hi, out, key=key: self.file.read_rows(key, lo, hi, out=out),
                read_flat=lambda start, stop, key=key: self.file.read_span(key, start, stop))
        # Tied weights stored once: safetensors' save_model (and sw.export) record each
        # dropped name in the metadata as {dropped: kept}.
        for dropped, kept in self.file.metadata.items():
            if kept in self.file.entries and dropped not in self.file.entries and renamer(kept) in self.tensors:
                kept_tensor = self.tensors[renamer(kept)]
                kept_tensor.aliases += (names.add(renamer(dropped), dropped),)

    def may_be_absent(self, name: str) -> bool:
        return self.hf_names.may_be_absent(name)

    def close(self) -> None:
        self.file.close()


class TorchFile(Source):
    """A `torch.save`d state dict, read with `weights_only=True` (no code runs) and mmap."""

    def __init__(self, path: Path, renamer: Callable[[str], str]):
        super().__init__()
        self.description = str(path)
        try:
            try:
                loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                loaded = torch.load(path, map_location="cpu", weights_only=True)  # legacy format
        except Exception as error:  # noqa: BLE001 - torch raises many types for a bad file
            # Not torch's message: it advises weights_only=False, which runs whatever code the file holds.
            raise ShardwiseError(
                f"{path} could not be read as a torch.save'd state dict with weights_only=True "
                f"({type(error).__name__}: it is not one, or holds objects other than tensors). shardwise never "
                "unpickles arbitrary objects: pass a shardwise checkpoint directory, a Hugging Face model directory, "
                "a .safetensors file, or a torch.save'd state dict of tensors."
            ) from None
        state = _find_state_dict(loaded, path)
        by_storage: dict[tuple, str] = {}
        names = SourceNames(path)
        for key, value in state.items():
            identity = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                        value.stride(), value.dtype) if value.numel() else None
            name = names.add(renamer(clean_name(key)), key)
            if identity is not None and identity in by_storage:  # tied: one tensor under two keys
                first = self.tensors[by_storage[identity]]
                first.aliases += (name,)
                continue
            if identity is not None:
                by_storage[identity] = name
            self.tensors[name] = SourceTensor(name, tuple(value.shape), value.dtype, (),
                                              lambda lo, hi, out, value=value: _rows(value)[lo:hi],
                                              read_flat=lambda start, stop, value=value: value.reshape(-1)[start:stop])


def _rows(tensor: Tensor) -> Tensor:
    return tensor.reshape(-1) if tensor.dim() == 0 else tensor


def _find_state_dict(loaded, path: Path) -> dict[str, Tensor]:
    def is_state(value):
        return isinstance(value, dict) and value and all(isinstance(v, Tensor) for v in value.values())

    if is_state(loaded):
        return loaded
    if isinstance(loaded, dict):
        for key in ("state_dict", "model", "module", "model_state_dict"):
            if is_state(loaded.get(key)):
                return loaded[key]
        raise ShardwiseError(f"{path} holds a dict with keys {sorted(map(str, loaded))[:8]} but no state dict of "
                             "tensors at the top level or under 'state_dict'/'model'")
    raise ShardwiseError(f"{path} holds a {type(loaded).__name__}, not a state dict of tensors")


def open_source(path, renamer: Callable[[str], str], model=None) -> Source:
    """The right Source for `path`: a checkpoint directory, a Hugging Face model directory (or its
    `model.safetensors.index.json`), a .safetensors file or a torch file. `model`, when given, is what the
    source loads into: a Hugging Face file's names are matched to it as transformers would (hf_names.py)."""
    path = Path(path)
    if path.name == INDEX:
        path = path.parent
    elif path.name == HF_INDEX or path.name.endswith(".safetensors.index.json"):
        if not path.exists():
            raise ShardwiseError(f"{path} does not exist")
        if path.name != HF_INDEX:
            raise ShardwiseError(f"{path} is a sharded safetensors index under another name than {HF_INDEX} (a "
                                 f"variant's): rename it {HF_INDEX} in a directory of its own, with its files")
        return HFDirectory(path.parent, HFNames(model, renamer), use_index=True)
    if path.is_dir():
        if not (path / INDEX).exists() and is_hf_dir(path):
            return HFDirectory(path, HFNames(model, renamer))
        return CheckpointDir(path, renamer)
    if not path.exists():
        raise ShardwiseError(f"{path} does not exist")
    if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device would block the read below
        raise ShardwiseError(f"{path} is not a regular file (a FIFO, a socket or a device): pass a checkpoint "
                             "directory, a .safetensors file or a torch.save'd file")
    if path.suffix == ".json":
        raise ShardwiseError(f"{path} is a JSON file, not weights: pass the directory that holds it (a shardwise "
                             f"checkpoint's index.json, or a Hugging Face model's {HF_INDEX} and its files)")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        head = f.read(9)
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{"):
        return SafetensorsFile(path, HFNames(model, renamer))
    return TorchFile(path, renamer)
