"""What `sw.load` reads from: a checkpoint directory, a safetensors file, a torch.save'd state dict.

Three sources, one interface (`Source.tensors`: name -> `SourceTensor`, each able to
read any row range): a shardwise checkpoint directory (index.json + row slices in
safetensors files), one safetensors file, or a `torch.save`d state dict (read with
`weights_only=True`, so no code runs). Names are cleaned of wrapper prefixes and
renamed on the way in (Note [wrapper prefixes] in names.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from shardwise.checkpoint.files import DTYPE_OF_CODE, FileReader
from shardwise.checkpoint.index import FORMAT, INDEX, VERSION
from shardwise.checkpoint.names import clean_name
from shardwise.errors import ShardwiseError


@dataclass
class SourceTensor:
    """One tensor a source can provide: `read(lo, hi, out)` returns rows lo:hi (into `out` when it can)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    aliases: tuple[str, ...]
    read: Callable[[int, int, Tensor | None], Tensor]
    slices: list[dict] | None = None  # a checkpoint directory's row slices: {file, key, rows, chunk, crcs}


class Source:
    """Base: a source with tensors only (no optimizer, scheduler, RNG or extras)."""

    description = ""
    world_size: int | None = None
    strategy: str | None = None

    def __init__(self) -> None:
        self.tensors: dict[str, SourceTensor] = {}
        self.optimizer: dict | None = None  # {"class", "param_groups": [{"params", "options"}], "state"}
        self.scheduler: dict | None = None
        self.objects: dict = {}
        self.extra: dict = {}

    def optimizer_tensor(self, name: str, key: str) -> SourceTensor:
        raise NotImplementedError

    def rng_of(self, rank: int):
        return None

    def object_state(self, key: str, obj, rank: int, world: int):
        """The saved state of keyword object `key` for `rank` of `world` (Note [object states])."""
        if self.world_size not in (None, world) and not getattr(obj, "state_is_global", False):
            raise ShardwiseError(
                f"{key}= was saved at world size {self.world_size} and is loaded at {world}: its state (a "
                f"{type(obj).__name__}'s) may count positions over each rank's own samples, which another number "
                f"of ranks deals differently. Resume at world size {self.world_size}, or leave {key}= out of "
                "sw.load (its epoch then restarts), or use sw.ResumableSampler, which re-deals the remaining "
                "samples to any number of ranks.")
        by_rank = getattr(self, "objects_by_rank", None)
        if by_rank is None or all(states.get(key) == self.objects[key] for states in by_rank):
            return self.objects[key]
        return by_rank[rank][key]

    def close(self) -> None:
        pass


def not_a_checkpoint(path: Path) -> ShardwiseError:
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


class CheckpointDir(Source):
    """A directory `sw.save` wrote (see save.py for the layout)."""

    def __init__(self, path: Path, renamer: Callable[[str], str]):
        super().__init__()
        self.path = path
        self.index = read_index(path)
        self.description = str(path)
        self.world_size, self.strategy = self.index["world_size"], self.index["strategy"]
        self.readers: dict[str, FileReader] = {}
        for name, entry in self.index["files"].items():
            file = path / name
            if not file.is_file():
                raise ShardwiseError(
                    f"shard file {name} listed in {path / INDEX} is missing: the checkpoint is incomplete "
                    "(a partial copy, or a file deleted since). Load an earlier checkpoint."
                )
            if file.stat().st_size != entry["bytes"]:
                FileReader(file, expected_bytes=entry["bytes"], what="shard file").close()  # raises, naming it
        self.rename = lambda name: renamer(clean_name(name))
        for kind in ("params", "buffers"):
            for name, entry in self.index[kind].items():
                tensor = self._source_tensor(self.rename(name), entry)
                tensor.aliases = tuple(self.rename(a) for a in entry.get("aliases", ()))
                self.tensors[tensor.name] = tensor
        optim = self.index.get("optimizer")
        if optim is not None:
            self.optimizer = {
                "class": optim["class"],
                "param_groups": [{"params": [self.rename(n) for n in g["params"]], "options": g["options"]}
                                 for g in optim["param_groups"]],
                "state": {self.rename(n): s for n, s in optim["state"].items()},
            }
        self.scheduler = self.index.get("scheduler")
        self.objects = self.index.get("objects", {})
        self.objects_by_rank = self.index.get("objects_by_rank")
        self.extra = self.index.get("extra", {})

    def _source_tensor(self, name: str, entry: dict) -> SourceTensor:
        shape, dtype = tuple(entry["shape"]), DTYPE_OF_CODE[entry["dtype"]]
        slices = entry["slices"]
        return SourceTensor(name, shape, dtype, (),
                            lambda lo, hi, out: self._read(name, slices, shape, dtype, lo, hi, out), slices)

    def optimizer_tensor(self, name: str, key: str) -> SourceTensor:
        entry = self.optimizer["state"][name]["tensors"][key]
        return self._source_tensor(f"{name}:{key}", entry)

    def reader(self, file: str) -> FileReader:
        if file not in self.readers:
            reader = FileReader(self.path / file, expected_bytes=self.index["files"][file]["bytes"], what="shard file")
            owner = reader.metadata.get("checkpoint_id")
            if owner != self.index["id"]:
                reader.close()
                raise ShardwiseError(
                    f"shard file {self.path / file} belongs to checkpoint {owner}, but {INDEX} is that of "
                    f"checkpoint {self.index['id']}: index.json was copied from another checkpoint. Load an "
                    "earlier checkpoint."
                )
            self.readers[file] = reader
        return self.readers[file]

    def prepare(self, needs: list[tuple[SourceTensor, int, int]]) -> None:
        """Open (and check) every file the reads in `needs` will touch, before anything is written."""
        for tensor, lo, hi in needs:
            for entry in tensor.slices or ():
                if entry["rows"][0] < hi and entry["rows"][1] > lo:
                    self.reader(entry["file"])

    def _read(self, name, slices, shape, dtype, lo, hi, out):
        row_shape = shape[1:]
        parts = [(s, max(lo, s["rows"][0]), min(hi, s["rows"][1])) for s in slices
                 if s["rows"][0] < hi and s["rows"][1] > lo]
        if sum(b - a for _, a, b in parts) != hi - lo:
            raise ShardwiseError(f"{self.path / INDEX} does not cover rows {lo}:{hi} of {name!r}: the index is damaged")
        if len(parts) == 1:
            s, a, b = parts[0]
            return self.reader(s["file"]).read_rows(s["key"], a - s["rows"][0], b - s["rows"][0],
                                                    crcs=s["crcs"], chunk=s["chunk"], out=out)
        target = out if out is not None else torch.empty((hi - lo, *row_shape), dtype=dtype)
        for s, a, b in parts:
            view = target[a - lo : b - lo]
            piece = self.reader(s["file"]).read_rows(s["key"], a - s["rows"][0], b - s["rows"][0],
                                                     crcs=s["crcs"], chunk=s["chunk"], out=view)
            if piece is not view:
                view.copy_(piece.reshape(view.shape))
        return target

    def rng_of(self, rank: int):
        entries = self.index.get("rng") or []
        if rank >= len(entries):
            return None
        entry = entries[rank]
        reader = self.reader(entry["file"])
        tensors = {key: reader.read_rows(key, 0, reader.entry(key).rows, crcs=check["crcs"], chunk=check["chunk"])
                   for key, check in entry["tensors"].items()}
        return tensors, entry

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()


def read_index(path: Path) -> dict:
    """Parse and check `path/index.json`; a ShardwiseError names what is wrong."""
    index_path = path / INDEX
    if not path.is_dir() or not index_path.is_file():
        raise not_a_checkpoint(path)
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ShardwiseError(f"{index_path} does not parse ({error}): the checkpoint is corrupt") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ShardwiseError(f"{index_path} is not a shardwise index (no \"format\": \"{FORMAT}\")")
    if index.get("version") != VERSION:
        raise ShardwiseError(f"{index_path} has format version {index.get('version')}; this shardwise reads "
                             f"version {VERSION}. Upgrade shardwise to load it.")
    missing = [k for k in ("id", "files", "params", "buffers", "world_size", "strategy") if k not in index]
    if missing:
        raise ShardwiseError(f"{index_path} lacks {missing}: the index is damaged")
    return index


class SafetensorsFile(Source):
    """One safetensors file (an export, or a model from a hub): full tensors, read by rows."""

    def __init__(self, path: Path, renamer: Callable[[str], str]):
        super().__init__()
        self.description = str(path)
        self.file = FileReader(path, what="safetensors file")
        for key, entry in self.file.entries.items():
            name = renamer(clean_name(key))
            self.tensors[name] = SourceTensor(
                name, entry.shape, entry.dtype, (),
                lambda lo, hi, out, key=key: self.file.read_rows(key, lo, hi, out=out))
        # Tied weights stored once: safetensors' save_model (and sw.export) record each
        # dropped name in the metadata as {dropped: kept}.
        for dropped, kept in self.file.metadata.items():
            if kept in self.file.entries and dropped not in self.file.entries:
                kept_tensor = self.tensors[renamer(clean_name(kept))]
                kept_tensor.aliases += (renamer(clean_name(dropped)),)

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
            raise ShardwiseError(
                f"{path} could not be read as a torch.save'd state dict with weights_only=True ({error}). "
                "shardwise never unpickles arbitrary objects: save a state dict of tensors, or a safetensors file."
            ) from None
        state = _find_state_dict(loaded, path)
        by_storage: dict[tuple, str] = {}
        for key, value in state.items():
            identity = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                        value.stride(), value.dtype) if value.numel() else None
            name = renamer(clean_name(key))
            if identity is not None and identity in by_storage:  # tied: one tensor under two keys
                first = self.tensors[by_storage[identity]]
                first.aliases += (name,)
                continue
            if identity is not None:
                by_storage[identity] = name
            self.tensors[name] = SourceTensor(name, tuple(value.shape), value.dtype, (),
                                              lambda lo, hi, out, value=value: _rows(value)[lo:hi])


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


def open_source(path, renamer: Callable[[str], str]) -> Source:
    """The right Source for `path`: a checkpoint directory, a .safetensors file or a torch file."""
    path = Path(path)
    if path.name == INDEX:
        path = path.parent
    if path.is_dir():
        return CheckpointDir(path, renamer)
    if not path.exists():
        raise ShardwiseError(f"{path} does not exist")
    with open(path, "rb") as f:
        head = f.read(9)
    if path.suffix == ".safetensors" or (len(head) == 9 and head[8:9] == b"{"):
        return SafetensorsFile(path, renamer)
    return TorchFile(path, renamer)
