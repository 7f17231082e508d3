"""Publishing a checkpoint: a save over the same name is never without a whole checkpoint under
that name, an interrupted one is recovered by sw.latest, and what interrupted saves leave behind
is removed by the next save (Note [atomic publish], Note [leftovers])."""

from __future__ import annotations

import os

import pytest

import shardwise as sw
from helpers.damage import load_small, trained


class _Killed(BaseException):
    """A SIGKILL stand-in: nothing after it runs (no except Exception catches it)."""


def _kill_after_renames(monkeypatch, count: int) -> None:
    """os.rename performs `count` calls, then the process 'dies' at the next one."""
    rename, calls = os.rename, []

    def dying(src, dst):
        if len(calls) == count:
            raise _Killed
        calls.append((src, dst))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", dying)


def _save(path, step: int) -> None:
    model, optim, scheduler, sampler = trained(seed=step)
    sw.save(path, model, optim, scheduler, sampler=sampler, step=step)


def _step_of_latest(root) -> int | None:
    latest = sw.latest(root)
    if latest is None:
        return None
    parts = trained(seed=9)
    return sw.load(latest, parts[0], parts[1], parts[2], sampler=parts[3]).extra["step"]


def test_same_name_save_swaps_in_one_step(tmp_path, monkeypatch):
    """Catches a save over the same name that renames the old checkpoint away before the new one
    is in place: a kill between the two renames left no checkpoint under the name and sw.latest
    returned None (the job restarted from scratch)."""
    _save(tmp_path / "last", 1)
    _kill_after_renames(monkeypatch, 1)
    try:
        _save(tmp_path / "last", 2)
    except _Killed:
        pass
    monkeypatch.undo()
    assert _step_of_latest(tmp_path) == 2  # exchanged in one step (or, without renameat2, recovered)


def test_interrupted_fallback_publish_is_recovered(tmp_path, monkeypatch):
    """Catches sw.latest ignoring the two whole hidden directories (.last.old, .last.partial) that a
    kill between the fallback's renames leaves (a filesystem without RENAME_EXCHANGE)."""
    from shardwise.checkpoint import publish

    _save(tmp_path / "last", 1)
    monkeypatch.setattr(publish, "_renameat2", None)
    _kill_after_renames(monkeypatch, 1)
    with pytest.raises(_Killed):
        _save(tmp_path / "last", 2)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.old", ".last.partial"]
    assert _step_of_latest(tmp_path) == 2  # the newer whole one, put back under its name
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.old", "last"]
    _save(tmp_path / "other", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "other"]


def test_next_save_removes_leftovers(tmp_path):
    """Catches hidden .partial / .old directories of killed saves staying forever (keep_last skips
    them): the next save removes those of dead saves (their mark there, their lock free), and nothing
    else (Note [save ownership])."""
    import fcntl

    from shardwise.checkpoint.owner import MARKER

    for name in (".step-3.partial", ".last.old", ".x.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / MARKER).write_text('{"id": "killed"}')
        (tmp_path / name / "rank-00000-of-00001.safetensors").write_bytes(b"half")
    (tmp_path / "notes").mkdir()
    (tmp_path / ".cache").mkdir()
    fd = os.open(tmp_path / ".x.partial", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save running now owns it
    try:
        _save(tmp_path / "step-4", 4)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".cache", ".x.partial", "notes", "step-4"]
    assert load_small(tmp_path / "step-4")
