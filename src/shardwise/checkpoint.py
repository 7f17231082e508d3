"""Checkpoints: `sw.save`, `sw.load`, `sw.export`, `sw.latest`.

A checkpoint is a directory (DESIGN.md):

    step-100/
      index.json                        names, shapes, dtypes, which file holds which rows
                                        (with a crc32 per chunk), optimizer param groups and
                                        scalars, scheduler, RNG scalars, sampler, extra JSON,
                                        strategy, world size, a digest per file
      rank-00000-of-00002.safetensors   rank 0's real rows (no padding) of every parameter
      rank-00001-of-00002.safetensors   and of its optimizer state, and its RNG states

No pickle anywhere: loading an untrusted checkpoint runs no code. Every rank writes
only its own rows, in parallel (a ddp or plain model's replicas split the rows
between ranks, so nothing is written twice); loading reads only the rows a rank
holds, from whichever files have them (_ckpt_sources.py), so any world size and any
strategy loads any checkpoint, optimizer state included.

Note [atomic save]: every rank writes into `.NAME.partial` next to the target; once
every rank has reported its file (a gather on rank 0), rank 0 writes index.json and
renames the directory to NAME. A directory without index.json is never a checkpoint,
and `.NAME.partial` never looks like one, so a crash, a full disk or a killed rank
at any point leaves the previous checkpoint as the latest and whole. A later save
to the same NAME removes the leftover partial directory. Saving over an existing
checkpoint NAME renames it to `.NAME.old` first and deletes it after the new one is in
place; a crash between those two renames leaves the old one there, under that name.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch
from torch import nn

import shardwise
from shardwise import _ckpt_state as st
from shardwise._ckpt_files import FileWriter, TensorSpec, chunk_rows, dtype_code
from shardwise._ckpt_load import load_into
from shardwise._ckpt_sources import FORMAT, INDEX, VERSION, LoadReport, open_source
from shardwise.errors import ShardwiseError
from shardwise.strategies import ShardInfo, shard_info, state_of

__all__ = ["LoadReport", "export", "latest", "load", "save"]


# ---- save ----------------------------------------------------------------------------


def save(path, model: nn.Module, optim: torch.optim.Optimizer | None = None, scheduler=None, *,
         keep_last: int | None = None, durable: bool = True, **extra) -> Path:
    """Save `model` (and `optim`, `scheduler`) as a checkpoint directory at `path`; every rank calls it.

    Each rank writes its own rows in parallel; the directory appears, whole, only once
    every rank has finished (Note [atomic save]). Also saved: each rank's RNG states
    (torch, numpy, python, CUDA) and `**extra`: JSON values (`step=100`) returned by
    `sw.load` in `report.extra`, or objects with `state_dict()`/`load_state_dict()`
    (`sampler=sw.ResumableSampler(...)`), restored by passing them to `sw.load` under
    the same keyword (rank 0's state is saved). `keep_last=K` then deletes all but the K
    newest shardwise checkpoints in `path`'s parent directory. `durable=False` skips
    fsync (faster; a machine crash may then lose the newest checkpoint, never corrupt
    an older one). An existing checkpoint at `path` is replaced; anything else there is
    refused. Returns `path`.
    """
    if keep_last is not None and keep_last < 1:
        raise ShardwiseError(f"keep_last={keep_last} must be at least 1 (or None to keep every checkpoint)")
    group, rank, world = st.group_of(model)
    path = Path(path).absolute()
    partial = path.parent / f".{path.name}.partial"
    # Everything that can be refused is checked before a byte is written, the same way on every rank.
    infos = shard_info(model)
    plan = _optimizer_plan(optim, infos) if optim is not None else None
    scheduler_state = st.to_json(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None
    objects = {k: st.to_json(v.state_dict(), f"{k}.state_dict()") for k, v in extra.items() if _is_stateful(v)}
    values = {k: st.to_json(v, f"extra value {k}=") for k, v in extra.items() if not _is_stateful(v)}

    checkpoint_id = st.broadcast_object(_start_partial(path, partial) if rank == 0 else None, group, rank, world)
    if checkpoint_id.startswith("error:"):
        raise ShardwiseError(checkpoint_id.removeprefix("error:"))
    try:
        record, error = _write_rank_file(partial, model, infos, plan, rank, world, checkpoint_id, durable), None
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
        record, error = None, f"{type(exc).__name__}: {exc}"
    records = st.gather_object((record, error), group, rank, world)
    outcome = None
    if rank == 0:
        outcome = _finish(path, partial, records, model, infos, plan, optim, scheduler_state, objects, values,
                          checkpoint_id, world, keep_last, durable)
    outcome = st.broadcast_object(outcome, group, rank, world)
    if outcome is not None:
        raise ShardwiseError(f"saving {path} failed: {outcome}. Nothing was written at {path}; earlier "
                             "checkpoints are untouched.")
    return path


def _is_stateful(value) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _start_partial(path: Path, partial: Path) -> str:
    """Rank 0: a fresh, empty partial directory; the new checkpoint's id (or "error:...")."""
    try:
        if path.exists() and not (path / INDEX).is_file():
            return (f"error:{path} exists and is not a shardwise checkpoint; refusing to overwrite it. "
                    "Choose another path or remove it.")
        path.parent.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)  # left by a save that crashed (Note [atomic save])
        partial.mkdir()
    except OSError as error:
        return f"error:cannot create {partial}: {error}"
    return uuid.uuid4().hex


def _optimizer_plan(optim, infos: dict[str, ShardInfo]) -> dict:
    """Per param (by cleaned name): its row-shaped state tensors and JSON scalars; the groups."""
    names = st.optimizer_names(optim, infos)
    scalar_keys = st.scalar_state_keys(optim)
    state, groups = {}, []
    for index, group in enumerate(optim.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in group["params"]],
                       "options": st.to_json(options, f"optimizer param group {index}")})
        for param in group["params"]:
            if optim.state.get(param):
                state[names[id(param)]] = st.split_state(names[id(param)], param, optim.state[param], scalar_keys)
    return {"class": type(optim).__name__, "groups": groups, "state": state}


def _write_rank_file(partial: Path, model, infos, plan, rank: int, world: int, checkpoint_id: str,
                     durable: bool) -> dict:
    """Write this rank's rows, optimizer rows and RNG states; return what the index needs."""
    sharded = st.is_sharded(model)
    specs, producers, slices = [], [], []
    optim_tensors: dict[str, dict[str, str]] = {}

    def add(kind, name, key, tensor, info, lo, hi, state_key=None):
        specs.append(TensorSpec(key, tensor.dtype, (hi - lo, *info.full_shape[1:])))
        producers.append(lambda: st.row_view(tensor, info, lo, hi))
        slices.append({"kind": kind, "name": name, "state_key": state_key, "key": key, "rows": [lo, hi]})

    for raw, info in infos.items():
        name = st.clean_name(raw)
        lo, hi = st.rows_to_write(info, rank, world, sharded)
        if hi > lo:
            add("param", name, f"param/{name}", info.param, info, lo, hi)
        rows_state = plan["state"].get(name, ({}, {}))[0] if plan else {}
        for state_key, tensor in rows_state.items():
            optim_tensors.setdefault(name, {})[state_key] = dtype_code(tensor.dtype)
            if hi > lo:
                add("optim", name, f"optim/{name}/{state_key}", tensor, info, lo, hi, state_key)
    if rank == 0:  # buffers are replicated and small: rank 0 writes them whole
        for name, buffer in st.persistent_buffers(model).items():
            info = ShardInfo(buffer, buffer.shape, 0, buffer.shape[0] if buffer.dim() else 1, ())
            add("buffer", name, f"buffer/{name}", buffer, info, 0, info.row_end)
    rng_tensors, rng = st.capture_rng()
    for key, tensor in rng_tensors.items():
        specs.append(TensorSpec(key, tensor.dtype, tuple(tensor.shape)))
        producers.append(lambda tensor=tensor: tensor)
    file = f"rank-{rank:05d}-of-{world:05d}.safetensors"
    writer = FileWriter(partial / file, specs, {"checkpoint_id": checkpoint_id, "rank": str(rank)}, durable=durable)
    try:
        for produce in producers:
            writer.write_next(produce())
        written = writer.close()
    except BaseException:
        writer.abort()
        raise
    for entry, spec in zip(slices, specs):
        entry.update(file=file, chunk=chunk_rows(spec.shape, spec.dtype), crcs=written.crcs[spec.key],
                     dtype=dtype_code(spec.dtype))
    rng["file"] = file
    rng["tensors"] = {key: {"chunk": chunk_rows(tuple(t.shape), t.dtype), "crcs": written.crcs[key]}
                      for key, t in rng_tensors.items()}
    scalars = {name: entry[1] for name, entry in plan["state"].items()} if plan else {}
    return {"file": file, "bytes": written.nbytes, "digest": written.digest, "slices": slices, "rng": rng,
            "optim_scalars": scalars, "optim_tensors": optim_tensors}


def _finish(path, partial, records, model, infos, plan, optim, scheduler_state, objects, values,
            checkpoint_id, world, keep_last, durable) -> str | None:
    """Rank 0: write the index and publish the directory, or clean up; None on success."""
    failed = [(r, error) for r, (_, error) in enumerate(records) if error is not None]
    try:
        if failed:
            return "; ".join(f"rank {r} could not write its file: {error}" for r, error in failed)
        index = _build_index(records, model, infos, plan, optim, scheduler_state, objects, values,
                             checkpoint_id, world)
        with open(partial / INDEX, "w") as f:
            json.dump(index, f, separators=(",", ":"))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        _fsync_dir(partial, durable)
        if path.exists():  # replace an older checkpoint of the same name
            old = path.parent / f".{path.name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(partial, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, path)
        _fsync_dir(path.parent, durable)
    except Exception as error:  # noqa: BLE001 - reported on every rank by the caller
        failed = True
        return f"{type(error).__name__}: {error}"
    finally:
        if failed:
            shutil.rmtree(partial, ignore_errors=True)
    if keep_last is not None:
        for old in _list_checkpoints(path.parent)[:-keep_last]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    return None


def _fsync_dir(path: Path, durable: bool) -> None:
    if durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _build_index(records, model, infos, plan, optim, scheduler_state, objects, values, checkpoint_id,
                 world) -> dict:
    state = state_of(model)
    params = {}
    for raw, info in infos.items():
        params[st.clean_name(raw)] = {
            "shape": list(info.full_shape), "dtype": dtype_code(info.param.dtype),
            "aliases": [st.clean_name(a) for a in info.aliases],
            "requires_grad": bool(info.param.requires_grad), "slices": []}
    buffers = {name: {"shape": list(b.shape), "dtype": dtype_code(b.dtype), "slices": []}
               for name, b in st.persistent_buffers(model).items()}
    optimizer = None
    if plan is not None:
        optimizer = {"class": plan["class"], "param_groups": plan["groups"], "state": {}}
        for record, _ in records:  # scalars agree across ranks; the first rank that has them wins
            for name, scalars in record["optim_scalars"].items():
                optimizer["state"].setdefault(name, {"scalars": scalars, "tensors": {}})
            for name, keys in record["optim_tensors"].items():
                tensors = optimizer["state"].setdefault(name, {"scalars": {}, "tensors": {}})["tensors"]
                for key, dtype in keys.items():
                    tensors.setdefault(key, {"shape": params[name]["shape"], "dtype": dtype, "slices": []})
    for record, _ in records:
        for entry in record["slices"]:
            where = {"param": params, "buffer": buffers}.get(entry["kind"])
            target = where[entry["name"]] if where is not None else \
                optimizer["state"][entry["name"]]["tensors"][entry["state_key"]]
            target["slices"].append({k: entry[k] for k in ("file", "key", "rows", "chunk", "crcs")})
    return {
        "format": FORMAT, "version": VERSION, "id": checkpoint_id, "saved_at": time.time(),
        "shardwise_version": shardwise.__version__, "torch_version": torch.__version__,
        "strategy": getattr(state, "strategy", None) or "none", "world_size": world,
        "files": {r["file"]: {"bytes": r["bytes"], "digest": r["digest"]} for r, _ in records},
        "params": params, "buffers": buffers, "optimizer": optimizer, "scheduler": scheduler_state,
        "rng": [r["rng"] for r, _ in records], "objects": objects, "extra": values,
    }


# ---- latest ---------------------------------------------------------------------------


def _list_checkpoints(directory: Path) -> list[Path]:
    """Complete shardwise checkpoints directly inside `directory`, oldest first (by save time)."""
    found = []
    if not directory.is_dir():
        return []
    for child in directory.iterdir():
        if child.name.startswith(".") or not (child / INDEX).is_file():
            continue
        try:
            index = json.loads((child / INDEX).read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(index, dict) and index.get("format") == FORMAT:
            found.append((index.get("saved_at", 0.0), child.name, child))
    return [child for *_, child in sorted(found)]


def latest(directory) -> Path | None:
    """The most recently saved complete checkpoint directly inside `directory`, or None.

    Unfinished saves (`.NAME.partial`, Note [atomic save]) are never returned.
    """
    found = _list_checkpoints(Path(directory))
    return found[-1] if found else None


# ---- load ----------------------------------------------------------------------------


def load(path, model: nn.Module, optim: torch.optim.Optimizer | None = None, scheduler=None, *,
         strict: bool = True, rename: st.Rename = None, restore_rng: bool | None = None,
         **objects) -> LoadReport:
    """Load a checkpoint into `model` (and `optim`, `scheduler`) in place; every rank calls it.

    `path` is a checkpoint directory, a single `.safetensors` file (an export, a hub
    model) or a `torch.save`d state dict (read with `weights_only=True`). Any strategy
    and world size loads any checkpoint: each rank reads only the rows it holds.
    Names are matched after stripping wrapper prefixes (`module.`, `_orig_mod.`,
    `_fsdp_wrapped_module.`) on both sides and applying `rename` to the checkpoint's
    names (a dict of exact names, or a list of `(regex, replacement)` pairs).

    `strict=True` raises a ShardwiseError carrying the report when anything is missing,
    unexpected or shaped differently, before changing anything; `strict=False` loads
    what matches (fine-tuning a new head) and returns the report (`print(report)`).
    RNG states are restored when resuming (`optim` given, same world size) unless
    `restore_rng` says otherwise. Objects passed as keywords (`sampler=...`) get the
    state saved under the same keyword.
    """
    group, rank, world = st.group_of(model)
    source, report, error = None, None, None
    try:
        source = open_source(path, st.make_renamer(rename))
        report = load_into(source, model, optim, scheduler, objects, strict, restore_rng, rank, world)
    except Exception as exc:  # noqa: BLE001 - every rank must reach the agreement below
        error = exc
    finally:
        if source is not None:
            source.close()
    # One agreement point: a rank that found a corrupt file makes every rank raise, none hangs.
    messages = st.all_gather_object(None if error is None else str(error), group, world)
    if error is not None:
        raise error
    failed = [(r, message) for r, message in enumerate(messages) if message is not None]
    if failed:
        raise ShardwiseError(f"rank {failed[0][0]} could not load {path}: {failed[0][1]}")
    return report


# ---- export ----------------------------------------------------------------------------


def export(model: nn.Module, path, *, duplicate_tied: bool = False) -> Path:
    """Write the model's full parameters and buffers to one plain `model.safetensors`; every rank calls it.

    Streams one parameter at a time (a sharded model gathers each to rank 0, writes it
    and frees it), so no rank ever holds the whole model. The file loads without
    shardwise: `safetensors.torch.load_model(model, path)`, or
    `model.load_state_dict(safetensors.torch.load_file(path), strict=False)`. A tied
    weight is stored once, under its first name; the file's metadata maps each other
    name to it (safetensors' own convention), and loading into a model that ties them
    re-ties them. `duplicate_tied=True` stores every name (the tied bytes once per
    name), for a plain strict `load_state_dict`. Returns `path`.
    """
    group, rank, world = st.group_of(model)
    path = Path(path).absolute()
    sharded = st.is_sharded(model)
    specs, producers, metadata = [], [], {"format": "pt"}
    for raw, info in shard_info(model).items():
        name = st.clean_name(raw)
        produce = (lambda info=info: _gather_full(info, group, rank, world)) if sharded else \
            (lambda info=info: info.param)
        names = [name] + [st.clean_name(a) for a in info.aliases]
        for alias in names[1:] if not duplicate_tied else ():
            metadata[alias] = name
        for spec_name in names if duplicate_tied else names[:1]:
            specs.append(TensorSpec(spec_name, info.param.dtype, tuple(info.full_shape)))
            producers.append(produce)
    for name, buffer in st.persistent_buffers(model).items():
        specs.append(TensorSpec(name, buffer.dtype, tuple(buffer.shape)))
        producers.append(lambda buffer=buffer: buffer)
    partial = path.with_name(path.name + ".partial")
    writer, error = None, None
    if rank == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = FileWriter(partial, specs, metadata)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
    for produce in producers:
        if not sharded and rank != 0:
            continue
        value = produce()  # a collective for a sharded model: every rank runs every one
        if writer is not None and error is None:
            try:
                writer.write_next(value)
            except Exception as exc:  # noqa: BLE001 - keep joining the gathers, report after
                error = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        try:
            if error is None:
                writer.close()
                os.replace(partial, path)
        except Exception as exc:  # noqa: BLE001
            error = f"{type(exc).__name__}: {exc}"
        if error is not None:
            if writer is not None:
                writer.abort()
            partial.unlink(missing_ok=True)
    error = st.broadcast_object(error, group, rank, world)
    if error is not None:
        raise ShardwiseError(f"exporting to {path} failed: {error}")
    return path


def _gather_full(info: ShardInfo, group, rank: int, world: int) -> torch.Tensor | None:
    """The full value of one sharded parameter on rank 0 (None elsewhere): a collective."""
    rows = info.full_shape[0] if len(info.full_shape) else 1
    if rows == 0:
        return torch.empty(info.full_shape, dtype=info.param.dtype)
    shard = info.param.detach().contiguous()
    per_rank = shard.shape[0]
    full = torch.empty((world * per_rank, *shard.shape[1:]), dtype=shard.dtype, device=shard.device) \
        if rank == 0 else None
    parts = [full[i * per_rank : (i + 1) * per_rank] for i in range(world)] if rank == 0 else None
    torch.distributed.gather(shard, parts, dst=torch.distributed.get_global_rank(group, 0), group=group)
    if rank != 0:
        return None
    return full[:rows].reshape(info.full_shape)
