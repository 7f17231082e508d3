"""Ranks that diverge where zero3's collectives pair by order (issue 44, items 1 and 2): each is refused on
every rank within seconds, naming what differs, before a wrong value is used; never a wrong loss and a
hang until the group's timeout."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw

NAMES = "abcd"


class Unit(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Chain(nn.Module):
    """Units of one size (their gathers collide), run in the order each rank is given."""

    def __init__(self, num_units: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({NAMES[i]: Unit() for i in range(num_units)})
        self.order = list(self.blocks)

    def forward(self, x):
        for name in self.order:
            x = self.blocks[name](x)
        return x.pow(2).mean()


def _steps(model: Chain, steps: int, losses: list[float]) -> list[float]:
    """`steps` SGD steps on one fixed batch, each loss appended to `losses` as soon as it is computed."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = model(x)
        losses.append(loss.item())
        loss.backward()
        optim.step()
        optim.zero_grad()
    return losses


def _run_in_order(strategy: str, orders: list[str], steps: int = 2):
    """Each rank runs the units in `orders[rank]`; returns (losses, error, seconds until the error)."""
    torch.manual_seed(0)
    model = Chain(len(orders[0]))
    sw.shard(model, strategy=strategy, units=Unit)
    model.order = list(orders[dist.get_rank()])
    losses, start = [], time.monotonic()
    try:
        _steps(model, steps, losses)
    except sw.ShardwiseError as error:
        return losses, str(error), time.monotonic() - start
    return losses, None, None


def _plain_losses(order: str, steps: int = 2) -> list[float]:
    torch.manual_seed(0)
    model = Chain(len(order))
    model.order = list(order)
    return _steps(model, steps, [])


@pytest.mark.parametrize("orders", [("abc", "bac"), ("abc", "cba"), ("abc", "acb"), ("abcd", "dabc"),
                                    ("abcd", "abcd", "abcd", "abdc")], ids="-".join)
def test_zero3_ranks_running_units_in_different_orders_are_refused_on_every_rank(ranks, orders):
    """Catches the one-sided re-gather of issue 44 item 1: rank 1 running C(A(B(x))) against rank 0's
    C(B(A(x))) dropped A, re-gathered it alone, and that gather paired with rank 0's gather of C (the same
    size): a wrong loss (0.056084 against 0.056572), then a backward hung until the timeout. Now every rank
    raises at the first gather whose tags differ, before its values are used, naming each rank's order."""
    results = ranks.run(_run_in_order, len(orders), "zero3", list(orders), timeout=60)
    for rank, (losses, message, seconds) in enumerate(results):
        assert message is not None, f"rank {rank} trained on: losses {losses}"
        assert "different orders" in message, message
        assert seconds < 20, f"rank {rank} refused after {seconds:.0f} s"
        for other in range(len(orders)):
            assert f"rank {other} ran" in message, message
        # No loss computed with another unit's rows: any loss a rank returned is the plain model's.
        for loss, plain in zip(losses, _plain_losses(orders[rank])):
            assert loss == pytest.approx(plain, rel=1e-5), (rank, losses)
    assert len({message for _, message, _ in results}) == 1  # the same words on every rank


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_the_same_order_on_every_rank_trains_as_one_process(ranks, strategy):
    """Catches a tag check that refuses what is allowed (a unit order other than registration order, the
    same on every rank; zero2 in any order): the losses are one process's."""
    orders = ["cab", "cab"] if strategy == "zero3" else ["abc", "cba"]
    results = ranks.run(_run_in_order, 2, strategy, orders, steps=3, timeout=60)
    for rank, (losses, message, _) in enumerate(results):
        assert message is None, message
        plain = _plain_losses(orders[rank], 3)
        # zero2: the ranks' orders differ, so after a step the model is neither rank's plain one.
        assert losses[:3 if strategy == "zero3" else 1] == pytest.approx(plain[:len(losses) if strategy == "zero3"
                                                                                 else 1], rel=1e-5, abs=1e-6)


def _shard_with_layout(strategy: str, layouts: list):
    """Each rank passes its own mesh= (a (replicate, shard) shape, or None); returns (error, seconds)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = layouts[dist.get_rank()]
    mesh = None if shape is None else init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = Chain(2)
    start = time.monotonic()
    try:
        sw.shard(model, strategy=strategy, units=Unit, mesh=mesh)
        model(torch.ones(2, 8)).backward()
    except sw.ShardwiseError as error:
        return str(error), time.monotonic() - start
    return None, None


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("layouts", [[(2, 1), None], [(2, 1), (1, 2)]], ids=["mesh-none", "2x1-1x2"])
def test_a_mesh_that_differs_per_rank_is_refused_at_shard_on_every_rank(ranks, strategy, layouts):
    """Catches issue 44 item 2: rank 0 passing a 2x1 mesh and rank 1 none (or a 1x2 one) hung in shard()
    until the timeout, then raised gloo's errors. shard()'s model check now compares the layout too."""
    results = ranks.run(_shard_with_layout, 2, strategy, layouts, timeout=60)
    for rank, (message, seconds) in enumerate(results):
        assert message is not None and "different layouts" in message, (rank, message)
        assert "2 x 1 mesh (replicate x shard)" in message, message
        assert seconds < 20, f"rank {rank} refused after {seconds:.0f} s"
    assert results[0][0] == results[1][0]
