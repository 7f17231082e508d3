"""index.json: what it records (see save.py's docstring) and finding the newest complete checkpoint.

Note [newest]: which checkpoint is newest is what its saver wrote, never the clock: `order` is
[step, save counter], the step the save was given (`step=` passed to sw.save; otherwise the
largest step among the checkpoints beside it) and one more than the largest save counter among
them. So a clock stepped back (NTP, a restored VM) changes nothing, and a checkpoint copied in
from elsewhere is newer only if its own step says so. `saved_at` is shown, and orders only
checkpoints saved before shardwise wrote `order` (which all sort before those that have it).
`keep_last` and `sw.latest` both use this order.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from shardwise._version import __version__
from shardwise.checkpoint.format.files import dtype_code
from shardwise.checkpoint.format.names import clean_name
from shardwise.checkpoint.format.records import FORMAT, INDEX, VERSION
from shardwise.checkpoint.format.schema import index_digest, read_index
from shardwise.checkpoint.write.publish import recover_interrupted
from shardwise.engine.unit.info import engine_of
from shardwise.errors import ShardwiseError

__all__ = ["FORMAT", "INDEX", "VERSION", "build_index", "latest", "list_checkpoints", "next_order", "remove_older"]
log = logging.getLogger("shardwise.checkpoint")


def build_index(job, records: list) -> dict:
    """index.json's content for a `SaveJob` (save.py) from every rank's record of its file."""
    model, infos, world = job.model, job.infos, job.world
    engine = engine_of(model)
    params = {}
    for raw, info in infos.items():
        params[clean_name(raw)] = {
            "shape": list(info.full_shape), "dtype": dtype_code(info.param.dtype),
            "aliases": [clean_name(a) for a in info.aliases],
            "requires_grad": bool(info.param.requires_grad), "slices": []}
    buffers = {name: {"shape": list(b.shape), "dtype": dtype_code(b.dtype), "slices": []}
               for name, b in job.buffers.items()}
    optimizers = []
    for number, plan in enumerate(job.plans):
        optimizer = {"class": plan["class"], "param_groups": plan["groups"], "state": {}}
        if job.form == "dict":
            optimizer["name"] = plan["name"]
        if plan["owners"] is not None:  # Note [recorded owners] in optim_state.py
            optimizer["owners"] = plan["owners"]
        state = optimizer["state"]
        for record, _ in records:  # scalars agree across ranks; the first rank that has them wins
            mine = record["optims"][number]
            for name, scalars in mine["scalars"].items():
                state.setdefault(name, {"scalars": scalars, "tensors": {}})
            for name, keys in mine["tensors"].items():
                tensors = state.setdefault(name, {"scalars": {}, "tensors": {}})["tensors"]
                for key, dtype in keys.items():
                    tensors.setdefault(key, {"shape": params[name]["shape"], "dtype": dtype, "slices": []})
            for name, keys in mine["whole"].items():  # Note [optimizer records]: only when there are some
                whole = state.setdefault(name, {"scalars": {}, "tensors": {}}).setdefault("whole", {})
                for key, spec in keys.items():
                    whole.setdefault(key, {**spec, "slices": []})
        optimizers.append(optimizer)
    for record, _ in records:
        for entry in record["slices"]:
            kind = entry["kind"]
            if kind in ("param", "buffer"):
                target = (params if kind == "param" else buffers)[entry["name"]]
            else:
                state = optimizers[entry["optim"]]["state"][entry["name"]]
                target = state["tensors" if kind == "optim" else "whole"][entry["state_key"]]
            target["slices"].append({k: entry[k] for k in ("file", "key", "rows", "chunk", "crcs")})
    index = {
        "format": FORMAT, "version": VERSION, "id": job.checkpoint_id, "saved_at": time.time(),
        "order": list(job.order),  # Note [newest]
        "shardwise_version": __version__, "torch_version": torch.__version__,
        "strategy": engine.strategy if engine is not None else "none", "world_size": world,
        "files": {r["file"]: {"bytes": r["bytes"], "digest": r["digest"]} for r, _ in records},
        "params": params, "buffers": buffers, "scheduler": job.scheduler_state,
        # one optimizer as it always was; several (a list or a dict, sw.save's optim=) as a list
        **({"optimizer": optimizers[0] if optimizers else None} if job.form in ("none", "one")
           else {"optimizer": None, "optimizers": optimizers}),
        "rng": [r["rng"] for r, _ in records], "objects": job.objects, "extra": job.values,
        # Note [object states]: every rank's, only when some rank's differs from rank 0's.
        "objects_by_rank": None if all(r["objects"] == job.objects for r, _ in records)
        else [r["objects"] for r, _ in records],
    }
    if job.model_config is not None:  # Note [model config] in model_config.py
        index["model_config"] = job.model_config
    if engine is not None and engine.compression is not None:  # the weights were trained through quantized
        index["compression"] = engine.compression.record()    # collectives: the index says so
    index["digest"] = index_digest(index)  # Note [index digest] in schema.py
    return index


def scan_checkpoints(directory: Path) -> list:
    """(Index, path) of the complete shardwise checkpoints directly inside `directory`, oldest first
    (Note [newest]). A directory whose index.json is damaged (it fails read_index) is skipped with a
    log line: one bad sibling must not hide the others."""
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
        found.append((index.newness, child.name, index, child))
    return [(index, child) for *_, index, child in sorted(found, key=lambda item: item[:2])]


def list_checkpoints(directory: Path) -> list[Path]:
    """Complete shardwise checkpoints directly inside `directory`, oldest first (Note [newest])."""
    return [child for _, child in scan_checkpoints(directory)]


def remove_older(path: Path, keep_last: int) -> None:
    """`keep_last`: remove all but the newest `keep_last` checkpoints beside `path`, never `path` itself."""
    for old in list_checkpoints(path.parent)[:-keep_last]:
        if old != path:
            shutil.rmtree(old, ignore_errors=True)


def next_order(directory: Path, step) -> tuple[int, int]:
    """The order a new save into `directory` records (Note [newest]): `step` when it is a count
    (else the largest step beside it), and one more than the largest save counter beside it."""
    orders = [index.order for index, _ in scan_checkpoints(directory) if index.order is not None]
    if type(step) is not int or not 0 <= step < 2**62:
        step = max((o[0] for o in orders), default=0)
    return step, max((o[1] for o in orders), default=0) + 1


def latest(directory) -> Path | None:
    """The newest complete checkpoint directly inside `directory` (Note [newest]), or None.

    Unfinished saves (`.NAME.partial`, Note [atomic save]) are never returned; a whole checkpoint a
    save over its own name left hidden is put back first (Note [atomic publish] in publish.py).
    """
    recover_interrupted(Path(directory))  # a save over the same name cut between its renames
    found = list_checkpoints(Path(directory))
    return found[-1] if found else None
