"""Checkpoints: `sw.save`, `sw.load`, `sw.export`, `sw.latest`.

A checkpoint is a directory:

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
holds, from whichever files have them (sources.py), so any world size and any
strategy loads any checkpoint, optimizer state included.

Note [atomic save]: every rank writes into `.NAME.partial` next to the target; once
every rank has reported its file (a gather on rank 0), rank 0 writes index.json and
renames the directory to NAME. A directory without index.json is never a checkpoint,
and `.NAME.partial` never looks like one, so a crash, a full disk or a killed rank
at any point leaves the previous checkpoint as the latest and whole. Saving over an
existing NAME swaps the two directories in one step (Note [atomic publish] in
publish.py); the hidden directories interrupted saves leave are removed by the next
save (Note [leftovers]).

Note [one shared directory]: every rank writes into the one partial directory rank 0 made, so
the checkpoint directory must be one that every rank shares (a file system every node mounts at
the same path). Rank 0 writes a marker holding the checkpoint's id into the partial directory;
each rank reads it before writing its file, and a rank that cannot (a node-local disk, another
path on each rank) fails the save on every rank with that message, before any file is written
there. Rank 0 removes the marker before it writes the index, so no checkpoint holds it.

Note [model config]: a Hugging Face model's config (`model.config`, as `config.json` holds it) is
recorded in the index as `model_config`, so `shardwise ckpt export` can write the config.json that
`from_pretrained` needs beside the weights; any other model records none.

Note [object states]: keyword objects (`sampler=`, `loader=` a torchdata `StatefulDataLoader`)
are saved as JSON (small tensors such as a generator's state as base64 bytes). Their state
is usually the same on every rank (sw.ResumableSampler's position is global) and is then
stored once; when some rank's differs (a loader over its own rank's samples) every rank's
is stored and each rank gets its own back, at the same world size only (refused otherwise:
those positions cannot be dealt to another number of ranks).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from shardwise.checkpoint.files import FileWriter, TensorSpec, chunk_rows, dtype_code
from shardwise.checkpoint.index import INDEX, build_index, list_checkpoints
from shardwise.checkpoint.names import clean_name, persistent_buffers
from shardwise.checkpoint.optim_state import optimizer_names, scalar_state_keys, split_state
from shardwise.checkpoint.publish import clean_leftovers, publish
from shardwise.checkpoint.ranks import broadcast_object, gather_object, group_of, is_sharded, rows_to_write
from shardwise.checkpoint.values import capture_rng, to_json
from shardwise.engine.info import ShardInfo, row_view, shard_info
from shardwise.engine.protocol import slicing_of
from shardwise.errors import ShardwiseError


@dataclass
class SaveJob:
    """One `sw.save` call on this rank: where it writes and what it writes."""

    path: Path  # the checkpoint directory, once published
    partial: Path  # where every rank writes until then (Note [atomic save])
    model: nn.Module
    infos: dict[str, ShardInfo]  # this rank's rows of every parameter
    plan: dict | None  # the optimizer's groups and state (_optimizer_plan), or None
    optim: torch.optim.Optimizer | None
    scheduler_state: dict | None  # JSON
    objects: dict  # stateful keyword objects' state, JSON
    values: dict  # plain keyword values, JSON
    buffers: dict[str, torch.Tensor]  # persistent buffers, by clean name
    rng: tuple[dict, dict]  # this rank's RNG states at the save (capture_rng)
    checkpoint_id: str
    rank: int
    world: int
    keep_last: int | None
    durable: bool
    started: float = 0.0  # time.time() when the save began (Note [leftovers])
    model_config: dict | None = None  # a Hugging Face model's config, JSON (Note [model config])


def save(path, model: nn.Module, optim: torch.optim.Optimizer | None = None, scheduler=None, *,
         keep_last: int | None = None, durable: bool = True, **extra) -> Path:
    """Save `model` (and `optim`, `scheduler`) as a checkpoint directory at `path`; every rank calls it.

    Each rank writes its own rows in parallel; the directory appears, whole, only once
    every rank has finished (Note [atomic save]). Also saved: each rank's RNG states
    (torch, numpy, python, CUDA) and `**extra`: JSON values (`step=100`) returned by
    `sw.load` in `report.extra`, or objects with `state_dict()`/`load_state_dict()`
    (`sampler=sw.ResumableSampler(...)`), restored by passing them to `sw.load` under
    the same keyword (Note [object states]). `keep_last=K` then deletes all but the K
    newest shardwise checkpoints in `path`'s parent directory. `durable=False` skips
    fsync (faster; a machine crash may then lose the newest checkpoint, never corrupt
    an older one). An existing checkpoint at `path` is replaced; anything else there is
    refused. Returns `path`.
    """
    job = prepare(path, model, optim, scheduler, keep_last, durable, extra)
    complete(job, group_of(job.model)[0])  # job.model: the unsliced view of a sliced model
    return job.path


def prepare(path, model, optim, scheduler, keep_last, durable, extra) -> SaveJob:
    """Check everything that can be refused, the same way on every rank, and start the partial
    directory (a collective); the job then holds every value the save writes. A background
    save still running is waited for first (its error, if any, raised here)."""
    wait_for_background_save()
    slicing = slicing_of(model)  # sliced by sw.slice: save its whole tensors (Note [unsliced view])
    if slicing is not None:
        view = slicing.checkpoint_view(model, optim)
        model, optim = view.model, view.optim
    if keep_last is not None and keep_last < 1:
        raise ShardwiseError(f"keep_last={keep_last} must be at least 1 (or None to keep every checkpoint)")
    group, rank, world = group_of(model)
    path = Path(path).absolute()
    partial = path.parent / f".{path.name}.partial"
    infos = shard_info(model)
    plan = _optimizer_plan(optim, infos) if optim is not None else None
    scheduler_state = to_json(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None
    objects = {k: to_json(v.state_dict(), f"{k}.state_dict()") for k, v in extra.items() if _is_stateful(v)}
    values = {k: to_json(v, f"extra value {k}=") for k, v in extra.items() if not _is_stateful(v)}

    started = time.time()
    checkpoint_id = broadcast_object(_start_partial(path, partial) if rank == 0 else None, group, rank, world)
    if checkpoint_id.startswith("error:"):
        raise ShardwiseError(checkpoint_id.removeprefix("error:"))
    return SaveJob(path, partial, model, infos, plan, optim, scheduler_state, objects, values,
                   persistent_buffers(model), capture_rng(), checkpoint_id, rank, world, keep_last, durable,
                   started, model_config(model) if rank == 0 else None)


def complete(job: SaveJob, group) -> None:
    """Write this rank's file, then (rank 0) the index, and publish; a ShardwiseError on every
    rank if any rank failed. `group` carries the gather: the model's, or a checkpoint group of
    the same ranks when the save runs in the background (background.py)."""
    try:
        _check_shared(job)
        record, error = _write_rank_file(job), None
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
        record, error = None, f"{type(exc).__name__}: {exc}"
    records = gather_object((record, error), group, job.rank, job.world)
    outcome = _finish(job, records) if job.rank == 0 else None
    outcome = broadcast_object(outcome, group, job.rank, job.world)
    if outcome is not None:
        raise ShardwiseError(f"saving {job.path} failed: {outcome}. Nothing was written at {job.path}; earlier "
                             "checkpoints are untouched.")


SHARED_MARKER = ".shardwise-shared"  # Note [one shared directory]
_background: list = []  # this process's background save still running (background.py), at most one


def wait_for_background_save() -> None:
    """Wait for this process's background save, if any; raise its error on every rank."""
    while _background:
        _background.pop().wait()


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
        checkpoint_id = uuid.uuid4().hex
        (partial / SHARED_MARKER).write_text(checkpoint_id)  # Note [one shared directory]
    except OSError as error:
        return f"error:cannot create {partial}: {error}"
    return checkpoint_id


def _check_shared(job: SaveJob) -> None:
    """Note [one shared directory]: this rank sees the partial directory rank 0 made, or a ShardwiseError."""
    marker = job.partial / SHARED_MARKER
    try:
        seen = marker.read_text()
    except OSError:
        seen = None
    if seen != job.checkpoint_id:
        raise ShardwiseError(
            f"rank {job.rank} does not see {marker}, which rank 0 has just written: the checkpoint directory is "
            "not one directory that every rank shares (a node-local disk, or another path on each rank). sw.save "
            "needs a file system every node mounts at the same path (NFS, Lustre, a cloud file store): put the "
            "checkpoint there (docs/checkpoints.md, several nodes)")


def model_config(model: nn.Module) -> dict | None:
    """Note [model config]: a Hugging Face model's config as JSON, or None for any other model."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return None  # a config that does not serialize: the checkpoint then says it has none


def _optimizer_plan(optim, infos: dict[str, ShardInfo]) -> dict:
    """Per param (by cleaned name): its row-shaped state tensors and JSON scalars; the groups."""
    names = optimizer_names(optim, infos)
    scalar_keys = scalar_state_keys(optim)
    state, groups = {}, []
    for index, group in enumerate(optim.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in group["params"]],
                       "options": to_json(options, f"optimizer param group {index}")})
        for param in group["params"]:
            if optim.state.get(param):
                state[names[id(param)]] = split_state(names[id(param)], param, optim.state[param], scalar_keys)
    return {"class": type(optim).__name__, "groups": groups, "state": state}


def _write_rank_file(job: SaveJob) -> dict:
    """Write this rank's rows, optimizer rows and RNG states; return what the index needs."""
    infos, plan, rank, world = job.infos, job.plan, job.rank, job.world
    sharded = is_sharded(job.model)
    specs, producers, slices = [], [], []
    optim_tensors: dict[str, dict[str, str]] = {}

    def add(kind, name, key, tensor, info, lo, hi, state_key=None):
        specs.append(TensorSpec(key, tensor.dtype, (hi - lo, *info.full_shape[1:])))
        producers.append(lambda: row_view(tensor, info, lo, hi))
        slices.append({"kind": kind, "name": name, "state_key": state_key, "key": key, "rows": [lo, hi]})

    for raw, info in infos.items():
        name = clean_name(raw)
        lo, hi = rows_to_write(info, rank, world, sharded)
        if hi > lo:
            add("param", name, f"param/{name}", info.param, info, lo, hi)
        rows_state = plan["state"].get(name, ({}, {}))[0] if plan else {}
        for state_key, tensor in rows_state.items():
            optim_tensors.setdefault(name, {})[state_key] = dtype_code(tensor.dtype)
            if hi > lo:
                add("optim", name, f"optim/{name}/{state_key}", tensor, info, lo, hi, state_key)
    if rank == 0:  # buffers are replicated and small: rank 0 writes them whole
        for name, buffer in job.buffers.items():
            info = ShardInfo(buffer, buffer.shape, 0, buffer.shape[0] if buffer.dim() else 1, ())
            add("buffer", name, f"buffer/{name}", buffer, info, 0, info.row_end)
    rng_tensors, rng = job.rng[0], dict(job.rng[1])
    for key, tensor in rng_tensors.items():
        specs.append(TensorSpec(key, tensor.dtype, tuple(tensor.shape)))
        producers.append(lambda tensor=tensor: tensor)
    file = f"rank-{rank:05d}-of-{world:05d}.safetensors"
    writer = FileWriter(job.partial / file, specs, {"checkpoint_id": job.checkpoint_id, "rank": str(rank)},
                        durable=job.durable)
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
            "optim_scalars": scalars, "optim_tensors": optim_tensors, "objects": job.objects}


def _finish(job: SaveJob, records: list) -> str | None:
    """Rank 0: write the index and publish the directory, or clean up; None on success."""
    path, partial, durable = job.path, job.partial, job.durable
    failed = [(r, error) for r, (_, error) in enumerate(records) if error is not None]
    try:
        if failed:
            return "; ".join(f"rank {r} could not write its file: {error}" for r, error in failed)
        (partial / SHARED_MARKER).unlink()  # every rank saw it (Note [one shared directory]); never published
        index = build_index(job, records)
        with open(partial / INDEX, "w") as f:
            json.dump(index, f, separators=(",", ":"))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        _fsync_dir(partial, durable)
        publish(partial, path, job.checkpoint_id)  # Note [atomic publish]
        _fsync_dir(path.parent, durable)
    except Exception as error:  # noqa: BLE001 - reported on every rank by the caller
        failed = True
        return f"{type(error).__name__}: {error}"
    finally:
        if failed:
            shutil.rmtree(partial, ignore_errors=True)
    if job.keep_last is not None:
        for old in list_checkpoints(path.parent)[:-job.keep_last]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    clean_leftovers(path.parent, job.started)  # Note [leftovers]
    return None


def _fsync_dir(path: Path, durable: bool) -> None:
    if durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
