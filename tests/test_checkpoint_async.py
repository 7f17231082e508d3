"""sw.save_async (Note [background save]): training goes on while the checkpoint is written, and
the checkpoint holds the state at the call, bitwise, optimizer and RNG included."""

from __future__ import annotations

import importlib
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.ckpt_ranks import build_model, run_steps

save_module = importlib.import_module("shardwise.checkpoint.write.save")  # the package's `save` is the function


def _save_in_background_while_training(tmp: str, strategy: str):
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, 3)
    at_save = sw.full_parameters(model)
    # The writer starts only once training has changed everything: what it writes must be the copy.
    released, write = threading.Event(), save_module._write_rank_file
    save_module._write_rank_file = lambda job: (released.wait(60), write(job))[1]
    try:
        pending = sw.save_async(f"{tmp}/step-3", model, optim, step=3)
        after = run_steps(model, optim, "gpt", strategy, 3, 5)
        released.set()
        path = pending.wait()
    finally:
        save_module._write_rank_file = write
    fresh, fresh_optim = build_model("gpt", strategy, seed=7)
    report = sw.load(path, fresh, fresh_optim)
    loaded = sw.full_parameters(fresh)
    again = run_steps(fresh, fresh_optim, "gpt", strategy, 3, 5)
    sw.save_async(f"{tmp}/step-5", model, optim, step=5, keep_last=1)
    sw.save(f"{tmp}/step-5b", model, keep_last=1)  # waits for the background save before its own
    return at_save, loaded, after, again, report.extra, sorted(p.name for p in Path(tmp).iterdir())


@pytest.mark.parametrize("strategy", ["zero1", "zero3", "ddp", "none"])
def test_background_save_holds_the_state_at_the_call(ranks, tmp_path, strategy):
    """Catches a background save that reads parameters or optimizer state after training changed
    them (no host copy), RNG captured late, a publish that races the next save, and keep_last
    deleting a checkpoint still being written."""
    for at_save, loaded, after, again, extra, names in ranks.run(
            _save_in_background_while_training, 2, str(tmp_path), strategy, timeout=120):
        assert extra == {"step": 3}
        for name, value in at_save.items():
            assert torch.equal(loaded[name], value), name
        assert again == after  # optimizer state and RNG at the call: the same 2 steps, bitwise
        assert names == ["step-5b"]  # each save started after the one before it was published


def _host_copy_bytes(tmp: str, strategy: str) -> tuple[int, int]:
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, 1)
    background = importlib.import_module("shardwise.checkpoint.write.background")
    job = save_module.prepare(f"{tmp}/unused", model, optim, None, None, False, {})
    copy = background._host_copy(job)
    held = sum(info.param.nbytes for info in copy.infos.values())
    held += sum(t.nbytes for plan in copy.plans for entry in plan["state"].values() for t in entry["rows"].values())
    whole = sum(p.nbytes for p in model.parameters()) * 3  # the params and AdamW's two moments, every row
    return held, whole


@pytest.mark.parametrize("strategy", ["ddp", "none"])
def test_background_save_copies_only_the_rows_this_rank_writes(ranks, tmp_path, strategy):
    """Catches a background save of a replicated model (ddp, plain) that copies every row to host memory
    on every rank, when each rank writes only its 1/N share (Note [background save])."""
    for held, whole in ranks.run(_host_copy_bytes, 2, str(tmp_path), strategy, timeout=120):
        assert held <= 0.6 * whole, (held, whole)  # half the rows, plus the rounding of odd row counts


def test_the_staging_copy_is_reused_and_refilled(tmp_path):
    """Catches a background save that allocates a fresh host copy each time (each save page-faults its
    whole share again: Note [cheap background save]), and a reused staging copy not refilled (the second
    checkpoint holding the first's values), and a writer whose CPU time is not recorded."""
    background = importlib.import_module("shardwise.checkpoint.write.background")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    saved, pointers = [], []
    for step in range(2):
        model(torch.randn(3, 8)).sum().backward()
        optim.step()
        saved.append({key: value.clone() for key, value in model.state_dict().items()})
        pending = sw.save_async(tmp_path / f"step-{step}", model, optim)
        pending.wait()
        assert 0 < pending.cpu_s < 60  # the writer thread's own CPU time (Note [cheap background save])
        pointers.append(sorted(t.data_ptr() for t in background._staging[model].values()))
    assert pointers[0] == pointers[1]
    for step in range(2):
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        sw.load(tmp_path / f"step-{step}", fresh)
        assert all(torch.equal(fresh.state_dict()[key], value) for key, value in saved[step].items())


def _policy_of(thread: int) -> tuple[int, int]:
    """(scheduling policy, nice) of thread `thread` of this process, as /proc shows them (fields 41 and 19)."""
    with open(f"/proc/self/task/{thread}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return int(fields[41 - 3]), int(fields[19 - 3])


def _save_async_seen_by_the_writer(path: Path) -> tuple[object, dict]:
    """sw.save_async of a small trained model; what the writer thread's own /proc entry said while it wrote."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    seen, write, looked = {}, save_module._write_rank_file, threading.Event()

    def watched(job):
        thread = threading.get_native_id()
        seen["policy"], seen["nice"] = _policy_of(thread)
        seen["os"], seen["thread"] = os.sched_getscheduler(thread), thread
        looked.set()
        return write(job)

    save_module._write_rank_file = watched
    try:
        pending = sw.save_async(path, model)
        assert looked.wait(60)  # before wait(), which puts the writer back to training's policy
        pending.wait()
    finally:
        save_module._write_rank_file = write
    return pending, seen


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.exists("/proc/self/task"), reason="Linux only")
def test_the_writer_runs_at_sched_idle(tmp_path):
    """Catches a background writer left at training's priority, or at nice 19 where SCHED_IDLE is allowed
    (Note [cheap background save]), and a policy set on the training thread instead of the writer's."""
    main = threading.get_native_id()
    before = _policy_of(main)
    pending, seen = _save_async_seen_by_the_writer(tmp_path / "c")
    assert seen["thread"] != main
    assert seen["policy"] == os.SCHED_IDLE and seen["os"] == os.SCHED_IDLE, seen
    assert pending.priority == "SCHED_IDLE"
    assert _policy_of(main) == before  # training's own thread untouched


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux only")
def test_the_writer_falls_back_to_nice_19(tmp_path, monkeypatch):
    """Catches a writer left at training's priority where the OS refuses SCHED_IDLE (nice 19 is the fallback)."""
    def refused(*args):
        raise PermissionError("SCHED_IDLE not allowed here")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    pending, seen = _save_async_seen_by_the_writer(tmp_path / "c")
    assert seen["policy"] == os.SCHED_OTHER and seen["nice"] == 19, seen
    assert pending.priority == "nice 19"


def _both_saves(tmp: str, strategy: str) -> dict[str, tuple[bytes, bytes]]:
    """The same state saved by sw.save and by sw.save_async, each into its own directory, with the
    checkpoint id and the clock held fixed (they are all a save's own): {file: (save's bytes, async's)}."""
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, 2)
    index_module = importlib.import_module("shardwise.checkpoint.write.index")
    uuid4, clock = save_module.uuid.uuid4, index_module.time.time
    save_module.uuid.uuid4 = lambda: uuid.UUID(int=45)
    index_module.time.time = lambda: 1.0e9
    try:
        sw.save(f"{tmp}/blocking/c", model, optim, step=2)
        sw.save_async(f"{tmp}/background/c", model, optim, step=2).wait()
    finally:
        save_module.uuid.uuid4, index_module.time.time = uuid4, clock
    files = sorted(p.name for p in Path(f"{tmp}/blocking/c").iterdir())
    assert files == sorted(p.name for p in Path(f"{tmp}/background/c").iterdir())
    return {name: (Path(f"{tmp}/blocking/c/{name}").read_bytes(), Path(f"{tmp}/background/c/{name}").read_bytes())
            for name in files}


@pytest.mark.parametrize("strategy,world", [("none", 1), ("zero3", 2)])
def test_save_async_writes_the_bytes_sw_save_writes(ranks, tmp_path, strategy, world):
    """Catches a background save (staging copy, SCHED_IDLE writer) whose checkpoint differs by any byte
    from the blocking save's of the same state: other rows, order, headers or index."""
    for files in ranks.run(_both_saves, world, str(tmp_path), strategy, timeout=120):
        assert len(files) == world + 1  # the rank files and index.json
        for name, (blocking, background) in files.items():
            assert blocking == background, name


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.exists("/proc/self/task"), reason="Linux only")
def test_a_waited_for_writer_leaves_sched_idle(tmp_path):
    """Catches a writer left at SCHED_IDLE while training waits for it (on a host busy with other work it
    may then not run for a long while: Note [cheap background save])."""
    model = torch.nn.Linear(8, 2)
    entered, go, write = threading.Event(), threading.Event(), save_module._write_rank_file
    threads = []

    def held(job):
        threads.append(threading.get_native_id())
        entered.set()
        go.wait(60)
        return write(job)

    save_module._write_rank_file = held
    try:
        pending = sw.save_async(tmp_path / "c", model)
        assert entered.wait(60)
        assert _policy_of(threads[0])[0] == os.SCHED_IDLE
        waiter = threading.Thread(target=pending.wait)
        waiter.start()
        deadline = time.monotonic() + 30
        while _policy_of(threads[0])[0] != os.SCHED_OTHER and time.monotonic() < deadline:
            time.sleep(0.01)
        policy = _policy_of(threads[0])[0]
        go.set()
        waiter.join(60)
    finally:
        go.set()
        save_module._write_rank_file = write
    assert policy == os.SCHED_OTHER
    assert pending.priority == "SCHED_IDLE"  # what it ran at in the background


def test_a_failed_background_save_raises_once(tmp_path, monkeypatch):
    """Catches a failed save_async raising its error twice: from wait(), and again from the next, healthy
    save, which was then not written. wait() raises it; the next sw.save and save_async are written."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    write = save_module._write_rank_file

    def disk_full(job):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(save_module, "_write_rank_file", disk_full)
    pending = sw.save_async(tmp_path / "a", model)
    with pytest.raises(sw.ShardwiseError, match="No space left"):
        pending.wait()
    monkeypatch.setattr(save_module, "_write_rank_file", write)
    sw.save(tmp_path / "b", model)
    sw.save_async(tmp_path / "c", model).wait()
    assert (tmp_path / "b" / "index.json").exists() and (tmp_path / "c" / "index.json").exists()
    assert not (tmp_path / "a").exists()
