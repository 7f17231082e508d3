"""A Hugging Face model directory as a `sw.load` source: `model.safetensors`, or the files that
`model.safetensors.index.json` names (`model-00001-of-00003.safetensors`, ...), read by row ranges; and one
safetensors file (an export, a model from a hub), read the same way.

Note [Hugging Face directories]: each rank reads only the byte ranges of the rows it holds (`FileReader.read_rows`:
`pread` into the parameter's own rows when the dtypes agree, else into one buffer of this rank's rows of one
tensor, converted on the copy), so loading a model costs a rank its shards plus that buffer, never the model.
Everything the format carries is checked before any parameter changes (Note [validate, then apply] in
load.py): the index is read bounded and typed (a `weight_map` of key -> file name, each a plain name in the
directory), every file it names exists and its header parses and tiles the file exactly (wire/st_header.py:
every byte belongs to one tensor of the stated dtype and shape), the index and the headers agree (each key in
the file the index names, no key in two files, no tensor the index does not list), and the tensors' shapes
are matched against the model's by name (load_plan.py). What the format does not carry cannot be checked:
Hugging Face files hold no checksum of their data, so a flipped bit inside a tensor loads as it is (a
shardwise checkpoint's crc32 per chunk would catch it). Names follow transformers' (hf_names.py: one call,
`HFNames.source_names`, names every key of the files).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from shardwise.checkpoint.format.bounded_json import parse_json, read_bounded, short
from shardwise.checkpoint.format.names import model_names
from shardwise.checkpoint.read.hf_names import HFNames
from shardwise.checkpoint.read.reader import FileReader
from shardwise.checkpoint.read.source_base import Source, SourceTensor
from shardwise.errors import ShardwiseError

SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
_MAX_INDEX_BYTES = 64 * 2**20  # the largest hub indexes (~10^5 tensors) are a few MB
_MAX_DEPTH = 8  # {"metadata": {...}, "weight_map": {...}}: 2 deep
_FIX = ("Download the model again (`hf download REPO --local-dir DIR`), or write it again with "
        "`model.save_pretrained(DIR)`")


def is_hf_dir(path: Path) -> bool:
    """True for a directory holding a Hugging Face model's weights (one file or an index)."""
    return (path / HF_INDEX).exists() or (path / SINGLE).exists()


class HFDirectory(Source):
    """The weights of a Hugging Face model directory (Note [Hugging Face directories]), or of one safetensors
    file (an export, a model from a hub) when `path` is a file: full tensors, read by rows, under transformers'
    names for `model` (Note [transformers names] in hf_names.py)."""

    def __init__(self, path: Path, model, renamer: Callable[[str], str], *, use_index: bool = False):
        super().__init__()
        self.path, self.description = path, str(path)
        self.files: dict[str, FileReader] = {}
        try:
            self._open(model, renamer, use_index)
        except BaseException:
            self.close()
            raise

    def _open(self, model, renamer: Callable[[str], str], use_index: bool) -> None:
        one_file = not self.path.is_dir()
        index = self.path / HF_INDEX
        if one_file:
            self.files[self.path.name] = FileReader(self.path, what="safetensors file")
            weight_map = None
        else:
            weight_map = self._open_directory(index, use_index)
        held: dict[str, str] = {}
        for file, reader in self.files.items():
            for key in reader.entries:
                if key in held:
                    raise ShardwiseError(f"tensor {key!r} is in both {held[key]} and {file} of {self.path}: one would "
                                         f"silently replace the other. {_FIX}")
                held[key] = file
        if weight_map is not None:
            _check_agree(index, weight_map, held)
        # Tied weights stored once in one file: safetensors' save_model (and sw.export) record each dropped name
        # in the metadata as {dropped: kept}.
        tied = {} if not one_file else {dropped: kept for dropped, kept in self.files[self.path.name].metadata.items()
                                        if kept in held and dropped not in held}
        targets = model_names(model) if model is not None else set()
        self.hf_names = HFNames(model, renamer, targets)
        names = self.hf_names.source_names(held, tied, self.path)
        for key, name in names.names.items():
            reader, entry = self.files[held[key]], self.files[held[key]].entries[key]
            self.tensors[name] = SourceTensor(
                name, entry.shape, entry.dtype, names.aliases.get(name, ()),
                lambda lo, hi, out, reader=reader, key=key: reader.read_rows(key, lo, hi, out=out),
                read_flat=lambda start, stop, reader=reader, key=key: reader.read_span(key, start, stop))
        if names.ignored:
            self.notes.append(f"{len(names.ignored)} tensors transformers ignores when it loads this model were not "
                              f"read ({', '.join(names.ignored[:4])}{', ...' if len(names.ignored) > 4 else ''})")
        if not one_file:
            self.notes.append("Hugging Face files carry no checksum of their data: the headers, the index and every "
                              "tensor's shape were checked, the tensors' bytes cannot be")

    def _open_directory(self, index: Path, use_index: bool) -> dict[str, str] | None:
        """Open the directory's files: its index's (the weight_map returned, checked), or model.safetensors."""
        # As transformers: a directory's model.safetensors is read before its index (save_pretrained
        # removes the other when it writes one); the index when it is the path given.
        if index.exists() and (use_index or not (self.path / SINGLE).exists()):
            self.values_file = str(index)
            weight_map = _weight_map(index)
        else:
            self.values_file = str(self.path / SINGLE)
            weight_map = None
        for file in sorted(set(weight_map.values())) if weight_map is not None else [SINGLE]:
            full = self.path / file
            if not full.exists():
                raise ShardwiseError(
                    f"{index} names {file}, which is not in {self.path}: the download is incomplete or the file was "
                    f"deleted. Fetch the missing file. {_FIX}" if weight_map is not None else f"{full} is missing")
            self.files[file] = FileReader(full, what="safetensors file")
        return weight_map

    def may_be_absent(self, name: str) -> bool:
        return self.hf_names.may_be_absent(name)

    def close(self) -> None:
        for reader in self.files.values():
            reader.close()
        self.files.clear()


def _weight_map(index: Path) -> dict[str, str]:
    """The index's `weight_map` (key -> file name), every field checked, the file read bounded."""
    resolved = index.resolve()  # a hub cache's snapshot holds symlinks to its blobs
    raw = read_bounded(resolved, _MAX_INDEX_BYTES, not_found=lambda: ShardwiseError(f"{index} is missing"))
    try:
        value = parse_json(index, raw, _MAX_DEPTH)
    except ShardwiseError as error:
        raise ShardwiseError(f"{error}. {index} is damaged: {_FIX}") from None
    weight_map = value.get("weight_map") if isinstance(value, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ShardwiseError(f"{index} has no weight_map of tensor names to files (it holds {short(value)}): it is "
                             f"damaged or not a Hugging Face index. {_FIX}")
    for key, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors") or os.path.basename(file) != file \
                or file.startswith("."):
            raise ShardwiseError(f"{index}: weight_map[{short(key)}] is {short(file)}, not the name of a .safetensors "
                                 f"file in the same directory: the index is damaged or crafted. "
                                 f"{_FIX}")
    return weight_map


def _check_agree(index: Path, weight_map: dict[str, str], held: dict[str, str]) -> None:
    """Refuse an index and files that disagree: a key the index places in a file whose header lacks it, or a
    tensor in a file that the index does not list (an index from another revision of the model)."""
    wrong = [(key, file) for key, file in weight_map.items() if held.get(key) != file]
    if wrong:
        key, file = wrong[0]
        where = f"it is in {held[key]}" if key in held else "no file holds it"
        raise ShardwiseError(f"{index} places {len(wrong)} tensors in files that do not hold them ({key!r} in "
                             f"{file}; {where}): the index belongs to another revision of the files. "
                             f"{_FIX}")
    unlisted = sorted(set(held) - set(weight_map))
    if unlisted:
        raise ShardwiseError(f"{index} does not list {len(unlisted)} tensors its files hold ({unlisted[:4]}): the "
                             f"index belongs to another revision of the files. {_FIX}")
