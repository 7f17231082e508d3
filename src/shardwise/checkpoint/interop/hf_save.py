"""`sw.save_pretrained`: a Hugging Face model directory written from a sharded model as transformers'
`save_pretrained` writes it, its weights in one `model.safetensors`, or above `max_shard_size` in several
`model-0000K-of-0000N.safetensors` and `model.safetensors.index.json` (Note [Hugging Face files out]).

Note [Hugging Face files out]: tensors go into files in the model's order, a file closed when the next
tensor would take it past `max_shard_size` (a tensor larger than that gets a file of its own), as
transformers' `save_pretrained` splits them; a tied weight is stored once under its first name (the
file's metadata maps its other names to it, as safetensors' `save_model` does), which `from_pretrained`
re-ties (`tie_word_embeddings`). Every rank joins each parameter's gather (one at a time: no rank holds
the model); rank 0 writes each file under a hidden partial name and renames it into place only when
all are whole, then the index (written the same way), then removes the weights files a previous save
left that the new set does not name (as `save_pretrained` cleans its folder), so the directory never
mixes two saves' files under one index.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

from torch import nn

from shardwise.checkpoint.format.files import TensorSpec
from shardwise.checkpoint.format.model_config import held_config, model_config, prepare_config
from shardwise.checkpoint.format.names import clean_name, persistent_buffers
from shardwise.checkpoint.format.ranks import broadcast_object, group_of, is_sharded
from shardwise.checkpoint.interop.export import _gather_full, full_state_dict, partial_name
from shardwise.checkpoint.read.hf_dir import HF_INDEX, SINGLE
from shardwise.checkpoint.write.writer import FileWriter
from shardwise.engine.unit.info import shard_info
from shardwise.errors import ShardwiseError

_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def size_in_bytes(size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or a number and a unit as transformers writes them ("5GB", "500MiB")."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = str(size).strip().upper()
    for unit, factor in _UNITS.items():
        if text.endswith(unit) and text[: -len(unit)].strip().isdigit() and int(text[: -len(unit)]) > 0:
            return int(text[: -len(unit)]) * factor
    raise ShardwiseError(f"max_shard_size={size!r} is not a size: pass bytes (an int > 0) or a number and a unit, "
                         "as save_pretrained takes it (\"5GB\", \"500MB\", \"2GiB\")")


def save_pretrained(model: nn.Module, directory, *, max_shard_size: int | str = "50GB") -> Path:
    """Write a Hugging Face model as `from_pretrained` reads it: `model.safetensors` (full values,
    streamed one parameter at a time, tied weights once), or above `max_shard_size` (bytes, or "5GB",
    "500MiB", as transformers' `save_pretrained` takes it; its default too) several
    `model-0000K-of-0000N.safetensors` with `model.safetensors.index.json` (Note [Hugging Face files
    out]), and the model's `config.json` (and `generation_config.json` when it has one). Every rank
    calls it; rank 0 writes.

    A PEFT model (LoRA adapters over a base) is written as PEFT writes it: its trainable
    parameters gathered (not the base), then `adapter_model.safetensors` and
    `adapter_config.json` by `model.save_pretrained` on rank 0, for `PeftModel.from_pretrained`."""
    if hasattr(model, "peft_config") and hasattr(model, "save_pretrained"):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        state = full_state_dict(model, only=trainable.__contains__)  # a collective
        directory = Path(directory).absolute()
        if group_of(model)[1] == 0:
            model.save_pretrained(directory, state_dict=state)
        return directory
    config = getattr(model, "config", None)
    if not hasattr(config, "save_pretrained"):
        raise ShardwiseError(f"{type(model).__name__} has no Hugging Face config (model.config.save_pretrained): "
                             "use sw.export(model, path) for a plain safetensors file")
    why = held_config(model)
    if why is not None:  # Note [model config]: from_pretrained would load none of the tensors
        raise ShardwiseError(f"{type(model).__name__} {why}, which from_pretrained would not load. Save the "
                             "Hugging Face model itself")
    directory = Path(directory).absolute()
    write_weights(model, directory, max_shard_size, check=lambda shapes: prepare_config(  # config.json replaced,
        model_config(model), shapes, directory, replace=True, where=f"{type(model).__name__}.config"))  # as HF does
    _, rank, _ = group_of(model)
    if rank == 0:
        config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(directory)
    return directory


def write_weights(model: nn.Module, directory: Path, max_shard_size: int | str,
                  check: Callable[[dict[str, tuple[int, ...]]], object] | None = None) -> list[str]:
    """Write `model`'s full tensors into `directory` (Note [Hugging Face files out]); every rank calls it,
    rank 0 writes, after `check(shapes)` (the tensors' names -> shapes) passed there, so that a refusal
    leaves the directory as it was. Returns the names of the files written."""
    limit = size_in_bytes(max_shard_size)
    group, rank, world = group_of(model)
    sharded = is_sharded(model)
    entries, metadata = [], {"format": "pt"}  # (spec, produce) in the model's order
    for raw, info in shard_info(model).items():
        name = clean_name(raw)
        for alias in info.aliases:
            metadata[clean_name(alias)] = name
        produce = (lambda info=info: _gather_full(info, rank)) if sharded else (lambda info=info: info.param)
        entries.append((TensorSpec(name, info.param.dtype, tuple(info.full_shape)), produce))
    for name, buffer in persistent_buffers(model).items():
        entries.append((TensorSpec(name, buffer.dtype, tuple(buffer.shape)), lambda buffer=buffer: buffer))
    files = _split(entries, limit)
    names = [SINGLE] if len(files) == 1 else [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
                                              for k in range(len(files))]
    error, done = None, []
    if rank == 0 and check is not None:
        try:
            check({spec.key: spec.shape for spec, _ in entries})
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {exc}"
    for name, group_entries in zip(names, files):
        writer = None
        if rank == 0 and error is None:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                kept = {k: v for k, v in metadata.items() if k == "format" or v in {s.key for s, _ in group_entries}}
                writer = FileWriter(partial_name(directory / name), [s for s, _ in group_entries], kept)
            except Exception as exc:  # noqa: BLE001 - reported on every rank below
                error = f"{type(exc).__name__}: {exc}"
        error = _stream(group_entries, writer if error is None else None, sharded or rank == 0) or error
        if writer is not None:
            if error is None:
                try:
                    writer.close()
                    done.append((writer.path, directory / name))
                except Exception as exc:  # noqa: BLE001
                    error = f"{type(exc).__name__}: {exc}"
            if error is not None:
                writer.abort()
                writer.path.unlink(missing_ok=True)
    if rank == 0:
        error = _publish(directory, done, files, names) if error is None else error
        for partial, _ in done if error is not None else ():
            partial.unlink(missing_ok=True)
    error = broadcast_object(error, group, rank, world)
    if error is not None:
        raise ShardwiseError(f"writing the weights of {directory} failed: {error}")
    return names


def _stream(entries: list, writer: FileWriter | None, produces: bool) -> str | None:
    """Each entry's value (a gather every rank of a sharded model joins, whatever happened before) into
    `writer` while it takes them; the first failure as text, reported on every rank by the caller."""
    error = None
    for _, produce in entries if produces else ():
        value = produce()
        try:
            if writer is not None and error is None:
                writer.write_next(value)
        except Exception as exc:  # noqa: BLE001 - keep joining the gathers
            error = f"{type(exc).__name__}: {exc}"
    return error


def _split(entries: list, limit: int) -> list[list]:
    """The entries in files of at most `limit` bytes each, in order; a larger tensor alone in its own."""
    files, size = [[]], 0
    for entry in entries:
        nbytes = entry[0].nbytes
        if files[-1] and size + nbytes > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += nbytes
    return files


def _publish(directory: Path, done: list, files: list, names: list[str]) -> str | None:
    """Rename the finished files into place, then the index (or remove a stale one), then the stale weights files."""
    try:
        for partial, final in done:
            os.replace(partial, final)
        index = directory / HF_INDEX
        if len(names) > 1:
            weight_map = {spec.key: name for name, entries in zip(names, files) for spec, _ in entries}
            total = sum(spec.nbytes for entries in files for spec, _ in entries)
            partial = partial_name(index)
            partial.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
            os.replace(partial, index)
        else:
            index.unlink(missing_ok=True)
        for old in directory.iterdir():
            if old.name not in names and (old.name == SINGLE or _SHARD_FILE.fullmatch(old.name)):
                old.unlink()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
