"""index.json: what it records (see save.py's docstring) and finding the newest complete checkpoint."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from shardwise._version import __version__
from shardwise.checkpoint.files import dtype_code
from shardwise.checkpoint.names import clean_name
from shardwise.checkpoint.publish import recover_interrupted
from shardwise.checkpoint.schema import FORMAT, INDEX, VERSION, index_digest, read_index
from shardwise.engine.info import engine_of
from shardwise.errors import ShardwiseError

__all__ = ["FORMAT", "INDEX", "VERSION", "build_index", "latest", "list_checkpoints"]
log = logging.getLogger("shardwise.checkpoint")


def build_index(job, records: list) -> dict:
    """index.json's content for a `SaveJob` (save.py) from every rank's record of its file."""
    model, infos, plan, world = job.model, job.infos, job.plan, job.world
    engine = engine_of(model)
    params = {}
    for raw, info in infos.items():
        params[clean_name(raw)] = {
            "shape": list(info.full_shape), "dtype": dtype_code(info.param.dtype),
            "aliases": [clean_name(a) for a in info.aliases],
            "requires_grad": bool(info.param.requires_grad), "slices": []}
    buffers = {name: {"shape": list(b.shape), "dtype": dtype_code(b.dtype), "slices": []}
               for name, b in job.buffers.items()}
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
    index = {
        "format": FORMAT, "version": VERSION, "id": job.checkpoint_id, "saved_at": time.time(),
        "shardwise_version": __version__, "torch_version": torch.__version__,
        "strategy": engine.strategy if engine is not None else "none", "world_size": world,
        "files": {r["file"]: {"bytes": r["bytes"], "digest": r["digest"]} for r, _ in records},
        "params": params, "buffers": buffers, "optimizer": optimizer, "scheduler": job.scheduler_state,
        "rng": [r["rng"] for r, _ in records], "objects": job.objects, "extra": job.values,
        # Note [object states]: every rank's, only when some rank's differs from rank 0's.
        "objects_by_rank": None if all(r["objects"] == job.objects for r, _ in records)
        else [r["objects"] for r, _ in records],
    }
    if job.model_config is not None:  # Note [model config] in save.py
        index["model_config"] = job.model_config
    index["digest"] = index_digest(index)  # Note [index digest] in schema.py
    return index


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete shardwise checkpoints directly inside `directory`, oldest first (by save time).

    A directory whose index.json is damaged (it fails read_index) is skipped with a log line:
    one bad sibling must not hide the others."""
    found = []
    if not directory.is_dir():
        return []
    for child in directory.iterdir():
        if child.name.startswith(".") or not (child / INDEX).exists():
            continue
        try:
            index = read_index(child)
        except ShardwiseError as error:
            log.warning("sw.latest: skipping %s: %s", child, error)
            continue
        found.append((index.saved_at, child.name, child))
    return [child for *_, child in sorted(found)]


def latest(directory) -> Path | None:
    """The most recently saved complete checkpoint directly inside `directory`, or None.

    Unfinished saves (`.NAME.partial`, Note [atomic save]) are never returned; a whole checkpoint a
    save over its own name left hidden is put back first (Note [atomic publish] in publish.py).
    """
    recover_interrupted(Path(directory))  # a save over the same name cut between its renames
    found = list_checkpoints(Path(directory))
    return found[-1] if found else None
