"""zero1/zero2 re-gather after a step only what an optimizer wrote by rows (Note [stepped parameters],
freshness.py; Note [owner broadcast], owner_traffic.py). Each test checks the forward after a step
against one process's forward with the same full parameters: a parameter left out of the re-gather
while some rank's rows of it changed shows as a different loss."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice

MODEL = "reused_block"


def _setup(strategy: str):
    model = build(MODEL)
    sw.shard(model, strategy=strategy, units=ZOO[MODEL].unit_class)
    x, y = rank_slice(global_batch(ZOO[MODEL], 0, 8), dist.get_rank(), dist.get_world_size())
    return model, x, y


def _loss_gap(model, x, y) -> float:
    """|sharded forward's loss - one process's with the model's full parameters|."""
    reference = build(MODEL)
    reference.load_state_dict(sw.full_parameters(model))
    with torch.no_grad():
        return abs(float(model(x, y)) - float(reference(x, y)))


def _write_after_step(strategy: str, where: str):
    model, x, y = _setup(strategy)
    params = dict(model.named_parameters())
    frozen = next(name for name, p in params.items() if p.dim() == 1)
    params[frozen].requires_grad_(False)  # in a unit whose other parameters are stepped
    matrices = [p for p in params.values() if p.dim() == 2]
    muon = torch.optim.Muon(matrices, lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in params.items() if p.dim() != 2 and n != frozen], lr=1e-2)
    gaps = []
    for step in range(3):
        model(x, y).backward()
        muon.step()
        with torch.no_grad():
            if where == "between" and step == 1:  # a write between two optimizers' steps, every rank
                matrices[0].mul_(0.5)
        adamw.step()
        with torch.no_grad():
            if where == "after" and step == 1:  # a frozen parameter written after the steps, every rank
                params[frozen].mul_(0.5)
            if where == "one rank" and step == 1 and dist.get_rank() == 1:
                params[frozen].mul_(0.5)
        muon.zero_grad()
        adamw.zero_grad()
        try:
            gaps.append(_loss_gap(model, x, y))
        except sw.ShardwiseError as error:
            return str(error)
    return gaps


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
@pytest.mark.parametrize("where", ["after", "between"])
def test_a_write_on_every_rank_outside_a_step_is_re_gathered(ranks, strategy, where):
    """Catches the forward trusting the stepped set after a write no step made: the frozen parameter
    (never stepped) or a Muon matrix (its owner broadcast it whole) would keep every other rank's old
    rows in the full values, and the loss would differ from one process's."""
    for gaps in ranks.run(_write_after_step, 2, strategy, where):
        assert isinstance(gaps, list) and len(gaps) == 3, gaps
        assert max(gaps) < 1e-5, gaps


def test_a_write_on_one_rank_after_a_step_is_refused_on_every_rank(ranks):
    """Catches a one-rank write after a step silently left out of (or spread by) the re-gather."""
    for message in ranks.run(_write_after_step, 2, "zero2", "one rank"):
        assert isinstance(message, str) and "written on rank 1" in message, message
