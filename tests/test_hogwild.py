"""`sw.hogwild`: N processes train one shared model lock-free (Note [hogwild semantics]).

Hogwild is not equal to one process (stale reads, racing updates), so the training test
holds it to a stated loss instead of 1e-5: after the same number of samples, N processes
reach one process's final loss within LOSS_SLACK, and far below the starting loss."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw

FEATURES, CLASSES, SAMPLES = 32, 4, 2048
EPOCHS, BATCH, LR = 4, 16, 0.2
# Measured, 5 runs each (2 cores, other tests running): one process ends at 0.2267 (always: one
# process is deterministic), 2 processes at 0.2265-0.2375, 4 at 0.2346-0.2458; the start is
# ln 4 = 1.386. A model whose workers' updates are lost stays at ln 4.
LOSS_SLACK = 0.05


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    teacher = torch.randn(FEATURES, CLASSES, generator=gen)
    return x, (x @ teacher + 0.5 * torch.randn(SAMPLES, CLASSES, generator=gen)).argmax(dim=1)


def _model() -> nn.Module:
    model = nn.Linear(FEATURES, CLASSES)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    return model


def _loss(model) -> float:
    x, y = _data()
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def _train(rank, num_procs, model, epochs):
    x, y = _data()
    mine = torch.arange(rank, SAMPLES, num_procs)  # this worker's rows
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(rank)
    seen = 0
    for _ in range(epochs):
        for batch in mine[torch.randperm(len(mine), generator=gen)].split(BATCH):
            optim.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optim.step()
            seen += len(batch)
    return seen


def test_hogwild_trains_to_within_a_stated_loss_of_one_process():
    """Catches updates that never reach the shared parameters (a worker training its own copy:
    the parent's model would stay at ln 4), workers that train on the same rows instead of their
    own part, and a sample count that is not the same as one process's."""
    start = _loss(_model())
    reference = _model()
    assert _train(0, 1, reference, EPOCHS) == EPOCHS * SAMPLES  # one process, here: the same loop
    final = {1: _loss(reference)}
    for num_procs in (2, 4):
        model = _model()
        result = sw.hogwild(_train, model, num_procs=num_procs, args=(EPOCHS,), timeout=120)
        assert sum(result.values) == EPOCHS * SAMPLES
        final[num_procs] = _loss(model)
    assert math.isclose(start, math.log(CLASSES), rel_tol=1e-6)
    assert final[1] < 0.5 * start, final
    for num_procs in (2, 4):
        assert final[num_procs] <= final[1] + LOSS_SLACK, final


def _killed_on_rank_1(rank, num_procs, model, stamp):
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _data()
    for step in range(1_000_000):
        if rank == 1 and step == 20:
            with open(stamp, "w") as out:
                out.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no message: only the exit code tells
        optim.zero_grad()
        F.cross_entropy(model(x[:64]), y[:64]).backward()
        optim.step()


def _raises_on_rank_0(rank, num_procs, model):
    if rank == 0:
        raise ValueError("bad batch 7")
    time.sleep(60)


def _hangs(rank, num_procs, model):
    time.sleep(600)


def test_a_killed_worker_is_an_error_in_the_parent_and_the_parameters_stay_usable(tmp_path):
    """Catches a parent that waits forever on a worker killed by a signal (the OOM killer) and
    workers left running after it: the error must come within seconds, name the worker and its
    exit code, and leave the shared model finite and usable."""
    model = _model()
    stamp = tmp_path / "killed_at"
    with pytest.raises(sw.ShardwiseError, match=r"worker 1 of 2 died with exit code -9 \(SIGKILL"):
        sw.hogwild(_killed_on_rank_1, model, num_procs=2, args=(str(stamp),), timeout=300)
    assert time.time() - float(stamp.read_text()) < 10  # noticed from the exit code, not the timeout
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hogwild-")]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert _loss(model) < math.log(CLASSES)  # the updates written before the kill are kept


def test_a_worker_that_raises_or_hangs_is_an_error_with_its_traceback_or_the_timeout():
    """Catches an exception swallowed in a worker (the parent returning as if trained) and a hung
    worker blocking the parent forever."""
    with pytest.raises(sw.ShardwiseError, match="(?s)worker 0 of 2 raised.*ValueError: bad batch 7"):
        sw.hogwild(_raises_on_rank_0, _model(), num_procs=2, timeout=120)
    started = time.monotonic()
    with pytest.raises(sw.ShardwiseError, match="did not finish within 5 s"):
        sw.hogwild(_hangs, _model(), num_procs=2, timeout=5)
    assert time.monotonic() - started < 20
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hogwild-")]
