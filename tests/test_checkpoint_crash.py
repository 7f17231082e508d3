"""A background save (sw.save_async) cut off by a crash: the previous checkpoint stays the latest and whole.

Each rank holds its background write after the file's first tensor (a patched `_write_chunk`
that then blocks), so the crash always lands while the rank files are half written, then
every rank SIGKILLs itself: no atexit, no flush, no cleanup. A fresh pool then asks
`sw.latest` and loads what it names into a fresh model (Note [atomic save], Note [background
save]).
"""

from __future__ import annotations

import importlib
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.ckpt_ranks import build_model, full_optimizer_state, run_steps
from helpers.harness import RankFailed

files_module = importlib.import_module("shardwise.checkpoint.write.writer")


def _save_previous(directory: str, name: str) -> dict:
    """Train 2 steps and save `name` (blocking): what the crash must leave untouched."""
    model, optim = build_model("gpt", "zero3")
    run_steps(model, optim, "gpt", "zero3", 0, 2)
    sw.save(f"{directory}/{name}", model, optim, step=2)
    return {"params": sw.full_parameters(model), "optim": full_optimizer_state(model, optim)}


def _crash_during_background_save(directory: str, previous: str, name: str, keep_last: int | None) -> None:
    """Resume from `previous`, train a step, start `sw.save_async(name)`, and die mid-write on every rank."""
    model, optim = build_model("gpt", "zero3", seed=3)
    sw.load(f"{directory}/{previous}", model, optim)
    run_steps(model, optim, "gpt", "zero3", 2, 3)  # the new checkpoint's values differ from the previous one's
    writing, write = threading.Event(), files_module._write_chunk
    calls = []

    def held_write(file, data):
        write(file, data)
        calls.append(len(data))
        if len(calls) == 2:  # the header and the first tensor are on disk; the rest never comes
            file.flush()
            writing.set()
            threading.Event().wait()

    files_module._write_chunk = held_write
    sw.save_async(f"{directory}/{name}", model, optim, step=3, keep_last=keep_last)
    assert writing.wait(60), "the background write never started"
    dist.barrier()  # every rank is mid-write
    os.kill(os.getpid(), signal.SIGKILL)


def _load_latest(directory: str) -> dict:
    latest = sw.latest(directory)
    if latest is None:
        return {"latest": None}
    model, optim = build_model("gpt", "zero3", seed=5)
    report = sw.load(latest, model, optim)
    assert report.ok, str(report)
    return {"latest": latest.name, "step": report.extra.get("step"), "params": sw.full_parameters(model),
            "optim": full_optimizer_state(model, optim)}


@pytest.mark.parametrize("previous,name,keep_last", [("last", "last", None), ("step-2", "step-3", 1)],
                         ids=["same-name", "new-name-keep-last-1"])
def test_crash_during_background_save_keeps_previous_checkpoint(ranks, tmp_path, previous, name, keep_last):
    """Catches a background save that writes into the published directory (or opens the old rank
    files for writing), removes or replaces the previous checkpoint before the new one is whole
    (`keep_last` applied early, an overwrite that deletes first), or publishes an index before
    every rank's file is complete: each leaves `sw.latest` naming a checkpoint that is gone,
    fails to load, or holds other values."""
    directory = str(tmp_path)
    saved = ranks.run(_save_previous, 2, directory, previous, timeout=120)[0]
    with pytest.raises(RankFailed, match="died"):
        ranks.run(_crash_during_background_save, 2, directory, previous, name, keep_last, timeout=120)
    partial = tmp_path / f".{name}.partial"
    assert partial.is_dir(), f"the crash did not land mid-save: {sorted(p.name for p in tmp_path.iterdir())}"
    assert any(f.stat().st_size > 0 for f in partial.iterdir()), "no rank file was being written at the crash"
    for loaded in ranks.run(_load_latest, 2, directory, timeout=120):
        assert loaded["latest"] == previous, f"sw.latest names {loaded['latest']}, not the previous {previous}"
        assert loaded["step"] == 2
        for key, value in saved["params"].items():
            assert torch.equal(loaded["params"][key], value), key
        for key, state in saved["optim"].items():
            for state_key, value in state.items():
                assert torch.equal(torch.as_tensor(loaded["optim"][key][state_key]), torch.as_tensor(value)), (
                    key, state_key)
    assert not (Path(directory) / name).exists() or name == previous
