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
    from shardwise.checkpoint.write import publish

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

    from shardwise.checkpoint.write.owner import MARKER

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


def _disk_order(tmp: str, slow_index: bool) -> list:
    """Every fsync this rank makes during one sw.save (what it synced, when it ended) and every rename
    (when), on the machine's monotonic clock (shared by the ranks of one host). `slow_index`: the index's
    fsync takes 0.2 s longer, so a rename that does not wait for it comes first."""
    import time

    from helpers.ckpt_ranks import build_model, run_steps

    model, optim = build_model("gpt", "zero3")
    run_steps(model, optim, "gpt", "zero3", 0, 1)
    events, fsync, rename = [], os.fsync, os.rename

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if slow_index and path.endswith("index.json"):
            time.sleep(0.2)
        fsync(fd)
        events.append(("fsync", path, time.monotonic_ns()))

    def recording_rename(src, dst):
        events.append(("rename", os.fspath(dst), time.monotonic_ns()))
        rename(src, dst)

    os.fsync, os.rename = recording_fsync, recording_rename
    try:
        sw.save(f"{tmp}/step-1", model, optim)
    finally:
        os.fsync, os.rename = fsync, rename
    return events


@pytest.mark.parametrize("slow_index", [False, True])
def test_every_fsync_lands_before_the_rename_and_the_parent_after(ranks, tmp_path, slow_index):
    """Catches the publish of Note [one wait for the disk] (commit.py) reordering what the disk sees: a rank
    file, index.json or the partial directory synced after the rename (or never: a crash could then publish
    a checkpoint missing bytes), or the parent directory synced before it (the rename not durable when
    sw.save returns)."""
    events = [e for rank_events in ranks.run(_disk_order, 2, str(tmp_path), slow_index, timeout=120)
              for e in rank_events]
    renames = [at for kind, _, at in events if kind == "rename"]
    assert len(renames) == 1, events
    synced = {os.path.basename(path.rstrip("/")): at for kind, path, at in events if kind == "fsync"}
    before = ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors", "index.json",
              ".step-1.partial"]
    for name in before:
        assert name in synced and synced[name] < renames[0], (name, events)
    assert synced[tmp_path.name] > renames[0], events


def _save_past_a_stuck_leftover(tmp: str):
    """Rank 0's sweep after the publish (Note [sweep after publish], commit.py) meets a dead save's leftover it
    cannot remove: (this rank's error or None, the newest checkpoint's name, rank 0's warnings)."""
    import logging

    import torch.distributed as dist

    import shardwise.checkpoint.write.publish as publish
    from helpers.ckpt_ranks import build_model, run_steps

    model, optim = build_model("gpt", "zero2")
    run_steps(model, optim, "gpt", "zero2", 0, 1)
    warnings, remove = [], publish.remove_if_dead

    class Caught(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    def stuck(directory, **kwargs):
        raise PermissionError(13, "Permission denied", str(directory))

    if dist.get_rank() == 0:
        os.makedirs(f"{tmp}/.dead.partial")
        publish.remove_if_dead = stuck
    handler = Caught(level=logging.WARNING)
    logging.getLogger("shardwise.checkpoint").addHandler(handler)
    error = None
    try:
        sw.save(f"{tmp}/step-1", model, optim, keep_last=2)
    except Exception as raised:  # noqa: BLE001 - reported to the test
        error = f"{type(raised).__name__}: {raised}"
    finally:
        publish.remove_if_dead = remove  # rank processes are reused
        logging.getLogger("shardwise.checkpoint").removeHandler(handler)
    latest = sw.latest(tmp)
    return error, latest.name if latest is not None else None, warnings


def test_a_sweep_that_fails_after_the_publish_fails_no_rank(ranks, tmp_path):
    """Catches rank 0's sweep of leftovers after the publish raising out of the save: rank 0 raised while the
    other ranks waited for its answer in broadcast_object (a hang until the timeout), for a checkpoint that was
    published whole. The sweep's failure is a warning on rank 0; every rank's save returns, and the checkpoint is
    the latest."""
    results = ranks.run(_save_past_a_stuck_leftover, 2, str(tmp_path), timeout=60)
    for rank, (error, latest, warnings) in enumerate(results):
        assert error is None, (rank, error)
        assert latest == "step-1", (rank, latest)
    assert any("sweep after it failed" in line and "Permission denied" in line for line in results[0][2]), results[0]
    assert (tmp_path / ".dead.partial").exists()  # what could not be removed stays, for the next save
