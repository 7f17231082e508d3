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

Note [atomic save]: every rank writes into `.NAME.partial` next to the target (rank 0 creates it
and owns it for the save's life, Note [save ownership] in owner.py: a second save to the same
name refuses rather than deletes it); once
every rank has reported its file (a gather on rank 0), rank 0 writes index.json, and once
every file and the index are on the disk (Note [one wait for the disk] in commit.py) it
renames the directory to NAME. A directory without index.json is never a checkpoint,
and `.NAME.partial` never looks like one, so a crash, a full disk or a killed rank
at any point leaves the previous checkpoint as the latest and whole. Saving over an
existing NAME swaps the two directories in one step (Note [atomic publish] in
publish.py); the hidden directories killed saves leave are removed by the next save
(Note [leftovers]). Which checkpoint is newest is the saver's sequence, not the clock
(Note [newest] in index.py).

Note [one shared directory]: every rank writes into the one partial directory rank 0 made, so
the checkpoint directory must be one that every rank shares (a file system every node mounts at
the same path). Rank 0 writes a marker holding the checkpoint's id into the partial directory;
each rank reads it before writing its file, and a rank that cannot (a node-local disk, another
path on each rank) fails the save on every rank with that message, before any file is written
there. Rank 0 removes the marker before it writes the index, so no checkpoint holds it.

Note [object states]: keyword objects (`sampler=`, `loader=` a torchdata `StatefulDataLoader`)
are saved as JSON (small tensors such as a generator's state as base64 bytes). Their state
is usually the same on every rank (sw.ResumableSampler's position is global) and is then
stored once; when some rank's differs (a loader over its own rank's samples) every rank's
is stored and each rank gets its own back, at the same world size only (refused otherwise:
those positions cannot be dealt to another number of ranks).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.format.files import TensorSpec, chunk_rows, dtype_code
from shardwise.checkpoint.format.model_config import model_config
from shardwise.checkpoint.format.names import clean_name, persistent_buffers
from shardwise.checkpoint.format.optim_state import (
    SEVERAL,
    class_name,
    full_info,
    held_params,
    named_optimizers,
    optimizer_names,
    placements,
    recorded_owners,
    scalar_state_keys,
    split_state,
)
from shardwise.checkpoint.format.ranks import broadcast_object, gather_object, group_of, is_sharded, rows_to_write
from shardwise.checkpoint.format.values import capture_rng, to_json
from shardwise.checkpoint.write.commit import SHARED_MARKER, finish_commit, start_commit
from shardwise.checkpoint.write.disk import SavePhases
from shardwise.checkpoint.write.index import INDEX, next_order
from shardwise.checkpoint.write.owner import SaveLock, claim_partial
from shardwise.checkpoint.write.writer import FileWriter
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.protocol import engine_of, slicing_of
from shardwise.engine.unit.info import ShardInfo, row_view, shard_info
from shardwise.errors import ShardwiseError


@dataclass
class SaveJob:
    """One `sw.save` call on this rank: where it writes and what it writes."""

    path: Path  # the checkpoint directory, once published
    partial: Path  # where every rank writes until then (Note [atomic save])
    model: nn.Module
    infos: dict[str, ShardInfo]  # this rank's rows of every parameter
    plans: list[dict]  # each optimizer's groups and state (_optimizer_plan), in the order given
    form: str  # how the optimizers were given: "none", "one", "list", "dict" (optim_state.named_optimizers)
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
    sharded: bool  # rows split across ranks (ranks.is_sharded): each rank writes its own
    lock: SaveLock | None = None  # rank 0's hold on `partial` (Note [save ownership] in owner.py)
    order: tuple[int, int] | None = None  # rank 0: (step, save counter), Note [newest] in index.py
    model_config: dict | None = None  # a Hugging Face model's config, JSON (Note [model config] in model_config.py)
    phases: SavePhases = field(default_factory=SavePhases)  # where this rank's time went (Note [save phases])


def save(path, model: nn.Module, optim=None, scheduler=None, *,
         keep_last: int | None = None, durable: bool = True, **extra) -> Path:
    """Save `model` (and `optim`, `scheduler`) as a checkpoint directory at `path`; every rank calls it.

    `optim` is one optimizer, or several as a list (`[muon, adamw]`) or a dict by name
    (`{"muon": muon, "adamw": adamw}`); `sw.load` then takes the same. Any optimizer's state is
    saved, whatever its shapes (Note [optimizer records] in optim_state.py).

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


def prepare(path, model, optim, scheduler, keep_last, durable, extra, group=None) -> SaveJob:
    """Check everything that can be refused, the same way on every rank, and start the partial
    directory (a collective); the job then holds every value the save writes. A background
    save still running is waited for first (its error, if any, raised here). `group`: the ranks
    that save together when they are more than the model's own (a pipeline's stages, each
    holding part of the model: pipeline/checkpoint/); None: the model's group."""
    wait_for_background_save()
    began = time.perf_counter()  # the "start" phase (Note [save phases] in disk.py)
    engine = engine_of(model)
    if engine is not None:  # headers still in flight on a device (the last step's): refused before any write
        engine.settle_agreement()
    for key, value in extra.items():
        if hasattr(value, "param_groups") and hasattr(value, "state"):
            raise ShardwiseError(f"{key}= is an optimizer: keyword values are JSON or small objects. Save several "
                                 f"optimizers as a list or a dict in the optimizer's place: {SEVERAL}")
    optimizers, form = named_optimizers(optim)
    slicing = slicing_of(model)  # sliced by sw.slice: save its whole tensors (Note [unsliced view])
    if slicing is not None:
        if form in ("list", "dict"):
            raise ShardwiseError("a sliced model (sw.slice) checkpoints one optimizer: build one optimizer over "
                                 "every parameter")
        view = slicing.checkpoint_view(model, optimizers[0][1] if optimizers else None)
        model, optimizers = view.model, [(None, view.optim)] if optimizers else []
    if keep_last is not None and keep_last < 1:
        raise ShardwiseError(f"keep_last={keep_last} must be at least 1 (or None to keep every checkpoint)")
    group, rank, world = group_of(model) if group is None else (group, dist.get_rank(group),
                                                                 dist.get_world_size(group))
    path = Path(path).absolute()
    partial = path.parent / f".{path.name}.partial"
    infos = shard_info(model)
    sharded = is_sharded(model)
    plans = [_optimizer_plan(one, name, infos, rank, world, sharded) for name, one in optimizers]
    scheduler_state = to_json(scheduler.state_dict(), "scheduler.state_dict()") if scheduler is not None else None
    objects = {k: to_json(v.state_dict(), f"{k}.state_dict()") for k, v in extra.items() if _is_stateful(v)}
    values = {k: to_json(v, f"extra value {k}=") for k, v in extra.items() if not _is_stateful(v)}

    lock, order, checkpoint_id = None, None, None
    if rank == 0:
        try:
            lock, order = _start_partial(path, partial, values.get("step"))
            checkpoint_id = lock.checkpoint_id
        except ShardwiseError as error:
            checkpoint_id = f"error:{error}"
        except Exception as error:  # noqa: BLE001 - the other ranks wait for rank 0's word: never leave them
            checkpoint_id = f"error:cannot start the save at {partial}: {type(error).__name__}: {error}"
    checkpoint_id = broadcast_object(checkpoint_id, group, rank, world)
    if checkpoint_id.startswith("error:"):
        raise ShardwiseError(checkpoint_id.removeprefix("error:"))
    return SaveJob(path, partial, model, infos, plans, form, scheduler_state, objects, values,
                   persistent_buffers(model), capture_rng(), checkpoint_id, rank, world, keep_last, durable, sharded,
                   lock, order, model_config(model) if rank == 0 else None,
                   SavePhases(start=time.perf_counter() - began))


def complete(job: SaveJob, group) -> None:
    """Write this rank's file, then (rank 0) the index, and publish; a ShardwiseError on every
    rank if any rank failed. `group` carries the gather: the model's, or a checkpoint group of
    the same ranks when the save runs in the background (background.py)."""
    writer = None
    try:
        try:
            _check_shared(job)
            writer, record = _write_rank_file(job)  # its bytes written, not yet synced
            error = None
        except Exception as exc:  # noqa: BLE001 - every rank must reach the gather below
            record, error = None, f"{type(exc).__name__}: {exc}"
        # Note [one wait for the disk] in commit.py: rank 0's index syncs while every rank syncs its file.
        with job.phases.timed("publish"):
            records = gather_object((record, error), group, job.rank, job.world)
            started = start_commit(job, records) if job.rank == 0 else None
        synced = _sync(writer) if error is None else error
        with job.phases.timed("publish"):
            synced = gather_object(synced, group, job.rank, job.world)
            outcome = finish_commit(job, started, synced) if job.rank == 0 else None
            outcome = broadcast_object(outcome, group, job.rank, job.world)
    finally:
        if writer is not None:
            writer.abort()  # closed already, unless this save failed on the way
        if job.lock is not None:
            job.lock.release()  # the save is over, however it ended (Note [save ownership])
    if outcome is not None:
        raise ShardwiseError(f"saving {job.path} failed: {outcome}. Nothing was written at {job.path}; earlier "
                             "checkpoints are untouched.")


_background: list = []  # this process's background save still running (background.py), at most one


def wait_for_background_save() -> None:
    """Wait for this process's background save, if any; raise its error on every rank."""
    while _background:
        _background.pop().wait()


def _sync(writer: FileWriter) -> str | None:
    """This rank's file on the disk (FileWriter.sync): None, or why not, for rank 0 to hear."""
    try:
        writer.sync()
        return None
    except Exception as exc:  # noqa: BLE001 - every rank must reach the gather after it
        return f"{type(exc).__name__}: {exc}"


def _is_stateful(value) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _start_partial(path: Path, partial: Path, step) -> tuple[SaveLock, tuple[int, int]]:
    """Rank 0: the partial directory, created and owned (Note [save ownership]), and the new
    checkpoint's order (Note [newest])."""
    if path.exists() and not (path / INDEX).is_file():
        raise ShardwiseError(f"{path} exists and is not a shardwise checkpoint; refusing to overwrite it. "
                             "Choose another path or remove it.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        order = next_order(path.parent, step)
        lock = claim_partial(partial, uuid.uuid4().hex)
        (partial / SHARED_MARKER).write_text(lock.checkpoint_id)  # Note [one shared directory]
        return lock, order
    except OSError as error:
        raise ShardwiseError(f"cannot create {partial}: {error}") from None


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


def _optimizer_plan(optim, label: str | None, infos: dict[str, ShardInfo], rank: int, world: int,
                    sharded: bool) -> dict:
    """One optimizer's groups, and per param it holds state for on this rank (by cleaned name): its
    param-shaped tensors with the rows this rank writes of them, its JSON scalars, and the whole
    tensors this rank writes (Note [optimizer records])."""
    names = optimizer_names(optim, infos)
    where = placements(optim, infos)
    info_of = {id(info.param): info for info in infos.values()}
    scalar_keys = scalar_state_keys(optim)
    state, groups = {}, []
    for index, group in enumerate(optim.param_groups):
        options = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in held_params(group)],
                       "options": to_json(options, f"optimizer param group {index}")})
        for param in held_params(group):
            place, name = where[id(param)], names[id(param)]
            if not optim.state.get(param) or not place.mine:
                continue  # no state yet, or an owner rank's (Note [whole-tensor step])
            info = info_of[id(param)]
            if place.owner is not None:
                if info.mesh.replicate_rank != 0:
                    continue  # each replica's owner holds the same state: replica 0's writes it (Note [mesh info])
                info = full_info(info)
                lo, hi = info.row_start, info.row_end
                shape, writes_whole = info.full_shape, True
            else:
                lo, hi = rows_to_write(info, rank, world, sharded)
                shape, writes_whole = param.shape, rank == 0
            rows, scalars, whole = split_state(name, shape, optim.state[param], scalar_keys,
                                               whole_allowed=not sharded or world == 1 or place.owner is not None)
            state[name] = {"rows": rows, "scalars": scalars, "whole": whole if writes_whole else {},
                           "info": info, "lo": lo, "hi": hi}
    return {"class": class_name(optim), "name": label, "groups": groups, "state": state,
            "owners": recorded_owners(optim, names, where)}


def _write_rank_file(job: SaveJob) -> tuple[FileWriter, dict]:
    """Write this rank's rows, optimizer rows and RNG states; return the writer, its file written but not
    yet synced (`FileWriter.sync`, Note [one wait for the disk] in commit.py), and what the index needs."""
    infos, rank, world, sharded = job.infos, job.rank, job.world, job.sharded
    specs, producers, slices = [], [], []

    def add(kind, name, key, tensor, info, lo, hi, state_key=None, optim=None):
        specs.append(TensorSpec(key, tensor.dtype, (hi - lo, *info.full_shape[1:])))
        producers.append(lambda: row_view(tensor, info, lo, hi))
        slices.append({"kind": kind, "name": name, "state_key": state_key, "optim": optim, "key": key,
                       "rows": [lo, hi]})

    for raw, info in infos.items():
        name = clean_name(raw)
        lo, hi = rows_to_write(info, rank, world, sharded)
        if hi > lo:
            add("param", name, f"param/{name}", info.param, info, lo, hi)
    optims = []
    for number, plan in enumerate(job.plans):
        prefix = "optim" if number == 0 else f"optim{number}"  # distinct keys when two hold one param
        tensors, whole = {}, {}
        for name, entry in plan["state"].items():
            info, lo, hi = entry["info"], entry["lo"], entry["hi"]
            for state_key, tensor in entry["rows"].items():
                tensors.setdefault(name, {})[state_key] = dtype_code(tensor.dtype)
                if hi > lo:
                    add("optim", name, f"{prefix}/{name}/{state_key}", tensor, info, lo, hi, state_key, number)
            for state_key, tensor in entry["whole"].items():
                whole.setdefault(name, {})[state_key] = {"shape": list(tensor.shape), "dtype": dtype_code(tensor.dtype)}
                rows = tensor.shape[0]
                if rows:
                    add("optim_whole", name, f"{prefix}.whole/{name}/{state_key}", tensor,
                        ShardInfo(tensor, tensor.shape, 0, rows, ()), 0, rows, state_key, number)
        optims.append({"scalars": {name: entry["scalars"] for name, entry in plan["state"].items()},
                       "tensors": tensors, "whole": whole})
    if rank == 0:  # buffers are replicated and small: rank 0 writes them whole
        for name, buffer in job.buffers.items():
            info = ShardInfo(buffer, buffer.shape, 0, num_rows(buffer.shape), ())
            add("buffer", name, f"buffer/{name}", buffer, info, 0, info.row_end)
    rng_tensors, rng = job.rng[0], dict(job.rng[1])
    for key, tensor in rng_tensors.items():
        specs.append(TensorSpec(key, tensor.dtype, tuple(tensor.shape)))
        producers.append(lambda tensor=tensor: tensor)
    file = f"rank-{rank:05d}-of-{world:05d}.safetensors"
    writer = FileWriter(job.partial / file, specs, {"checkpoint_id": job.checkpoint_id, "rank": str(rank)},
                        durable=job.durable, phases=job.phases)
    try:
        for produce in producers:
            writer.write_next(produce())
        written = writer.finish()
    except BaseException:
        writer.abort()
        raise
    for entry, spec in zip(slices, specs):
        entry.update(file=file, chunk=chunk_rows(spec.shape, spec.dtype), crcs=written.crcs[spec.key],
                     dtype=dtype_code(spec.dtype))
    rng["file"] = file
    rng["tensors"] = {key: {"chunk": chunk_rows(tuple(t.shape), t.dtype), "crcs": written.crcs[key]}
                      for key, t in rng_tensors.items()}
    return writer, {"file": file, "bytes": written.nbytes, "digest": written.digest, "slices": slices, "rng": rng,
            "optims": optims, "objects": job.objects}
