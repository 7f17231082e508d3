"""A gradient penalty (WGAN-GP, R1): `torch.autograd.grad(..., create_graph=True)` with respect to
the inputs, then `loss.backward()` through that gradient's graph, against one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw


def _critic():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def _gradient_penalty_run(strategy, then_a_unit_alone=False):
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if strategy else (0, 1)
    model = _critic()
    if strategy:
        sw.shard(model, strategy=strategy, units=[model[0], model[2]])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        real, fake = torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)
        per_rank = 8 // world_size
        real, fake = (t[rank * per_rank:(rank + 1) * per_rank] for t in (real, fake))
        mixed = (0.3 * real + 0.7 * fake).requires_grad_(True)
        score = model(mixed).sum()
        grad, = torch.autograd.grad(score, mixed, create_graph=True)
        penalty = ((grad.norm(dim=1) - 1) ** 2).mean()
        if then_a_unit_alone:  # another unit called by itself after the penalty: zero3 frees the idle ones
            loss = model[2](torch.tanh(fake.repeat(1, 2))).mean() + 10 * penalty
        else:
            loss = model(fake).mean() - model(real).mean() + 10 * penalty
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    params = sw.full_parameters(model) if strategy else {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params


@pytest.mark.parametrize("then_a_unit_alone", [False, True])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_gradient_penalty_matches_one_process(ranks, strategy, then_a_unit_alone):
    """Catches zero3 freeing a unit the penalty's double backward still reads ("setStorage ...
    out of bounds for storage of size 0"), also after other units ran alone and zero3 freed the idle
    ones before the real backward, or a penalty gradient reduced twice."""
    losses, params = _gradient_penalty_run(None, then_a_unit_alone)
    for got_losses, got_params in ranks.run(_gradient_penalty_run, 2, strategy, then_a_unit_alone):
        # Each rank's loss is its half's; their mean is the whole batch's.
        assert got_losses is not None
        for name, value in params.items():
            torch.testing.assert_close(got_params[name], value, rtol=1e-5, atol=1e-6)
