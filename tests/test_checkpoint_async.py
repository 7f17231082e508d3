"""sw.save_async (Note [background save]): training goes on while the checkpoint is written, and
the checkpoint holds the state at the call, bitwise, optimizer and RNG included."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.ckpt_ranks import build_model, run_steps

save_module = importlib.import_module("shardwise.checkpoint.save")  # the package's `save` is the function


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
    background = importlib.import_module("shardwise.checkpoint.background")
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
    background = importlib.import_module("shardwise.checkpoint.background")
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
