"""ResumableSampler: every sample once per epoch across ranks, and a resume at any world size."""

from __future__ import annotations

import pytest

import shardwise as sw


def test_sampler_covers_each_sample_once_and_resumes():
    """Catches a sampler that repeats or drops samples across ranks, or that resumes at the
    wrong place (same world size: the same indices; another: the same remaining set)."""
    ranks = [sw.ResumableSampler(10, seed=3, rank=r, world_size=2) for r in range(2)]
    epoch = [list(s) for s in ranks]
    assert sorted(epoch[0] + epoch[1]) == list(range(10)) and all(s.epoch == 1 for s in ranks)
    assert epoch != [list(s) for s in ranks]  # epoch 1 is another shuffle

    taken = []
    iterators = [iter(s) for s in ranks]
    for _ in range(3):
        taken += [next(it) for it in iterators]
    state = ranks[0].state_dict()
    assert state["position"] == 6 and state["epoch"] == 2
    resumed = []
    for r in range(2):
        s = sw.ResumableSampler(10, rank=r, world_size=2)
        s.load_state_dict(state)
        resumed.append(list(s))
    assert resumed == [list(it) for it in iterators]
    resized = []
    for r in range(4):  # another world size: the same samples remain, dealt differently
        s = sw.ResumableSampler(10, rank=r, world_size=4)
        s.load_state_dict(state)
        resized += list(s)
    remaining = sw.ResumableSampler(10, seed=3, world_size=1, rank=0).order(2)[6:]
    # 4 ranks pad the epoch to 12 positions (2 wrap around to its start), 2 ranks to 10.
    assert set(remaining) <= set(resized) and len(resized) == 12 - 6
    with pytest.raises(sw.ShardwiseError, match="dataset of 10 samples"):
        sw.ResumableSampler(12, rank=0, world_size=1).load_state_dict(state)
