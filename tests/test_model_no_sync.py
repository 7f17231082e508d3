"""`with model.no_sync():` on a sharded model (issue 60 item 13): the DDP / FSDP1 / Accelerate habit is
`sw.no_sync(model)`, the same gradient accumulation, under every strategy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from shardwise.testing import watch_collectives


def _accumulate(strategy: str, spelling: str) -> dict[str, torch.Tensor]:
    """Two steps of two micro-batches each, the first under `model.no_sync()` or `sw.no_sync(model)`; returns
    the full parameters after them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    sw.shard(model, strategy=strategy, units=nn.Linear if strategy != "ddp" else "auto")
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(4, 4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    reduces_inside = []
    for step in range(2):
        with model.no_sync() if spelling == "model" else sw.no_sync(model):
            with watch_collectives(lambda name, _: reduces_inside.append(name) if "reduce" in name else None):
                model(data[2 * step]).pow(2).mean().backward()
        model(data[2 * step + 1]).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    assert reduces_inside == [], reduces_inside  # the accumulation skipped the reduce (ddp's: in C++, not seen)
    if strategy == "ddp":
        return {name: p.detach().clone() for name, p in model.named_parameters()}
    return {name: value.clone() for name, value in sw.full_parameters(model).items()}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_model_no_sync_accumulates_as_sw_no_sync(ranks, strategy):
    """Catches `with model.no_sync():` raising a bare AttributeError on a sharded model (DDP's, FSDP1's and
    Accelerate users' habit): it is sw.no_sync(model), bitwise the same parameters after two accumulated
    steps, whose micro-batches differ per rank (so a reduce skipped on the wrong backward would show)."""
    by_spelling = {spelling: ranks.run(_accumulate, 2, strategy, spelling, timeout=120)
                   for spelling in ("model", "sw")}
    for rank in range(2):
        mine, theirs = by_spelling["model"][rank], by_spelling["sw"][rank]
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (strategy, rank, name)


def test_a_model_class_with_its_own_no_sync_keeps_it(ranks):
    """Catches shard() replacing a no_sync the model's class defines (the user's own, or a framework's)."""
    results = ranks.run(_own_no_sync, 2, timeout=60)
    assert results == ["own", "own"]


class _WithNoSync(nn.Sequential):
    def no_sync(self):
        return "own"


def _own_no_sync() -> str:
    model = _WithNoSync(nn.Linear(4, 4))
    sw.shard(model, strategy="zero2")
    return model.no_sync()
