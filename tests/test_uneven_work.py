"""Uneven work (issue 60, item 7): ranks that run different numbers of micro-batches before an optimizer
step are refused on every rank within seconds, before the short rank's step runs (Note [uneven work],
engine/schedule/agreement.py), and even work trains as before."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from test_options_agree import Net, Unit, assert_refused_alike, timed


def _uneven(strategy: str, micro_batches: list[int], accumulate: bool):
    """Rank r runs `micro_batches[r]` forwards and backwards (under sw.no_sync but the last, with `accumulate`)
    before each optimizer step, three steps; the same data on every rank."""
    def work():
        torch.manual_seed(0)
        model = Net()
        sw.shard(model, strategy=strategy, units=Unit)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(3):
            count = micro_batches[dist.get_rank()]
            for i in range(count):
                with sw.no_sync(model) if accumulate and i < count - 1 else contextlib.nullcontext():
                    loss = model(torch.ones(4, 8))
                    loss.backward()
                losses.append(loss.item())
            optim.step()
            optim.zero_grad()
        return losses
    return timed(work)


@pytest.mark.parametrize("accumulate", [False, True], ids=["synced", "no_sync"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_uneven_micro_batches_are_refused_on_every_rank_before_the_step(ranks, strategy, accumulate):
    """Catches issue 60 item 7: rank 0 running two micro-batches before its optimizer step and rank 1 one.
    zero3's headers paired rank 0's second forward with rank 1's first forward of the next step (both
    "forward 2"): both trained on, gathers and reduces paired across steps, and a rank whose work had ended
    left the other waiting for the group's timeout (10 minutes by default). zero1/zero2 blamed a write.
    Now an optimizer step waits for every rank's header (Note [uneven work]): every rank refuses within
    seconds, before the short rank's step runs, naming who was where."""
    results = ranks.run(_uneven, 2, strategy, [2, 1], accumulate, timeout=60)
    if not accumulate:
        assert_refused_alike(results, "uneven work: rank 1 (after forward number 1) reached optimizer.step() while "
                              "rank 0 was in a", "same number of forwards and backwards")
    elif strategy == "zero3":  # its no_sync backward re-gathers: rank 1's synced one meets it
        assert_refused_alike(results, "uneven work: rank 1 (after forward number 1) reached the backward that "
                              "reduces (the step's last) while rank 0 was in a backward under no_sync")
    else:  # zero1/zero2 communicate at the synced backward only, where the forward counts differ
        assert_refused_alike(results, "run different forwards", "the same number of micro-batches between "
                              "optimizer steps")


def test_even_micro_batches_train_as_before(ranks):
    """Catches a step agreement that refuses even work: two micro-batches on every rank (the first under
    no_sync), three steps, give zero3 the losses zero2 gives (one process's, to float rounding)."""
    by_strategy = {strategy: ranks.run(_uneven, 2, strategy, [2, 2], True, timeout=60) for strategy in ("zero2",
                                                                                                      "zero3")}
    for strategy, results in by_strategy.items():
        assert [message for message, _, _ in results] == [None, None], (strategy, results)
    assert by_strategy["zero3"][0][2] == pytest.approx(by_strategy["zero2"][0][2], rel=1e-5)
