"""A shared host and a careless neighbour (issue 35): a second job's save, a user's hidden
directories, a planted symlink or a stepped-back clock never cost a checkpoint or a file.
The two-job races run as real concurrent processes (Note [save ownership] in owner.py)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.neighbours import held_save, model, step_of
from shardwise.checkpoint.interop import tools
from shardwise.checkpoint.write.owner import MARKER
from shardwise.errors import ShardwiseError


@contextmanager
def _save_held_in_another_process(tmp_path: Path, path: Path, step: int):
    """A save of `path` running in its own process, held at its first write; yields its result's getter."""
    started, release = tmp_path / f"started-{step}", tmp_path / f"release-{step}"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pending = pool.apply_async(held_save, (str(path), step, str(started), str(release)))
        deadline = time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline and not pending.ready(), pending.get() if pending.ready() else "slow"
            time.sleep(0.05)

        def finish() -> str:
            release.touch()
            return pending.get(120)

        yield finish


def test_second_save_to_the_same_name_refuses_and_never_deletes(tmp_path):
    """Catches a second save to one name (a relaunched job while the old one still writes) deleting the
    first save's `.NAME.partial` as a crash leftover: the first then published a directory without its
    rank files, or failed, and the good checkpoint of that name was gone."""
    root = tmp_path / "ckpts"
    sw.save(root / "last", model(1), step=1)
    with _save_held_in_another_process(tmp_path, root / "last", 2) as finish:
        with pytest.raises(ShardwiseError, match="still running"):
            sw.save(root / "last", model(3), step=3)
        assert (root / ".last.partial" / MARKER).is_file()
        assert finish() == "ok"
    assert sw.latest(root) == root / "last" and step_of(root / "last") == 2
    sw.save(root / "last", model(4), step=4)  # the first save over, the name is free again
    assert step_of(sw.latest(root)) == 4 and sorted(p.name for p in root.iterdir()) == ["last"]


def test_sweep_spares_other_jobs_saves_and_user_directories(tmp_path):
    """Catches the leftover sweep deleting any directory named `.X.old` / `.X.partial` beside a
    checkpoint (`~/.ssh.old`, `~/.thesis.old`), and another job's save still running in the same
    directory (whose save then failed)."""
    root = tmp_path / "home"
    for name in (".ssh.old", ".thesis.partial"):
        (root / name).mkdir(parents=True)
        (root / name / "id_ed25519").write_text("secret")
    past = time.time() - 3600
    os.utime(root / ".ssh.old", (past, past))
    with _save_held_in_another_process(tmp_path, root / "other-job", 7) as finish:
        sw.save(root / "step-1", model(1), step=1)
        assert (root / ".other-job.partial").is_dir()
        assert finish() == "ok"
    assert step_of(root / "other-job") == 7 and step_of(root / "step-1") == 1
    for name in (".ssh.old", ".thesis.partial"):
        assert (root / name / "id_ed25519").read_text() == "secret"


def test_sweep_removes_only_dead_saves_leftovers(tmp_path):
    """Catches the sweep keeping a dead save's leftovers forever, or taking a live one (its lock held)."""
    for name in (".step-3.partial", ".last.old", ".live.partial"):
        (tmp_path / name).mkdir()
        (tmp_path / name / MARKER).write_text('{"id": "x"}')
        (tmp_path / name / "rank-00000-of-00001.safetensors").write_bytes(b"half")
    (tmp_path / ".empty.old").mkdir()  # no mark: not shardwise's, left alone
    fd = os.open(tmp_path / ".live.partial", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save running now
    try:
        sw.save(tmp_path / "step-4", model(4), step=4)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".empty.old", ".live.partial", "step-4"]


def test_export_never_writes_through_a_planted_symlink(tmp_path):
    """Catches `sw.export` / `shardwise ckpt export` opening OUT.partial with a plain open(): a symlink
    planted there in a shared directory made the export overwrite the file it points to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "shared" / "model.safetensors"
    out.parent.mkdir()
    os.symlink(victim, out.parent / "model.safetensors.partial")
    sw.export(model(1), out)
    sw.save(tmp_path / "ckpt", model(2), step=2)
    tools.export_checkpoint(tmp_path / "ckpt", out)
    assert victim.read_text() == "precious"
    from shardwise.checkpoint.format.files import TensorSpec
    from shardwise.checkpoint.write.writer import FileWriter

    os.symlink(victim, tmp_path / "planted")  # whatever name a writer opens: refused, never followed
    with pytest.raises(ShardwiseError, match="refusing to write through it"):
        FileWriter(tmp_path / "planted", [TensorSpec("x", torch.float32, (2,))], {})
    assert victim.read_text() == "precious"


def test_export_refuses_an_output_inside_the_checkpoint(tmp_path, capsys):
    """Catches `shardwise ckpt export ckpt ckpt/index.json` exiting 0 after destroying the checkpoint."""
    from shardwise.cli.main import main

    sw.save(tmp_path / "ckpt", model(2), step=2)
    for out in ("index.json", "rank-00000-of-00001.safetensors", "sub/x.safetensors"):
        (tmp_path / "ckpt" / "sub").mkdir(exist_ok=True)
        assert main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / out)]) == 2
        assert "inside the checkpoint" in capsys.readouterr().err
    (tmp_path / "ckpt" / "sub").rmdir()
    assert step_of(tmp_path / "ckpt") == 2


def test_newest_is_the_savers_order_not_the_clock(tmp_path, monkeypatch):
    """Catches "newest" read from the wall clock: after the clock stepped back keep_last deleted the
    newest checkpoint and sw.latest returned an older one; a checkpoint copied in with a later
    saved_at won every time."""
    import shutil

    clock = [2_000_000_000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    root = tmp_path / "run"
    sw.save(root / "step-1", model(1), step=1)
    clock[0] -= 86_400  # NTP, a VM restored from a snapshot
    sw.save(root / "step-2", model(2), step=2, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-2"]
    assert sw.latest(root) == root / "step-2"
    sw.save(root / "unstepped", model(2))  # no step=: after every checkpoint beside it
    assert sw.latest(root) == root / "unstepped"
    clock[0] += 10 * 86_400
    sw.save(tmp_path / "elsewhere" / "step-0", model(0), step=0)  # a later clock, an earlier step
    shutil.copytree(tmp_path / "elsewhere" / "step-0", root / "step-0")
    assert sw.latest(root) == root / "unstepped"


def _save_and_load_without_unpickling(directory):
    """2 ranks: save (over the name too) and load with torch's unpickler made to refuse."""
    import torch.distributed.distributed_c10d as c10d

    class Refuse:
        def __init__(self, *args):
            raise AssertionError("unpickled bytes that came over a collective")

    net, fresh = model(1.0), model(1.0)
    sw.shard(net, strategy="zero2")
    sw.shard(fresh, strategy="zero2")
    saved, c10d._unpickler = c10d._unpickler, Refuse
    try:
        sw.save(os.path.join(directory, "a"), net, step=1)
        sw.save(os.path.join(directory, "a"), net, step=2)
        return sw.load(os.path.join(directory, "a"), fresh).extra["step"]
    finally:  # the rank pool's processes run later tests: leave torch's unpickler as it was
        c10d._unpickler = saved


def test_no_pickle_crosses_a_collective(ranks, tmp_path):
    """Catches sw.save / sw.load exchanging reports with broadcast_object_list / all_gather_object, which
    unpickle what arrives: a process that answered as rank 0 through the store ran code in every rank."""
    assert ranks.run(_save_and_load_without_unpickling, 2, str(tmp_path), timeout=120) == [2, 2]
