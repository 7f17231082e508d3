"""`sw.clip_grad_norm_` does torch's arithmetic: per-tensor norms in the gradients' dtype, then the
norm of norms (Note [clip arithmetic] in engine/optim/grads.py)."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch


def _clip_one_rank(strategy, name):
    spec = ZOO[name]
    x, y = global_batch(spec, 0, 8)
    plain, sharded = build(name), build(name)
    sw.shard(sharded, strategy=strategy, units=spec.unit_class)
    plain(x, y).backward()
    sharded(x, y).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    got = sw.clip_grad_norm_(sharded, 0.05)
    # At one rank a shard is the whole tensor; a 0-D parameter's shard has one row (shape [1]).
    full = {name: p.grad for name, p in plain.named_parameters()}
    same = all(p.grad is full[name] is None or torch.equal(p.grad.reshape(-1), full[name].reshape(-1))
               for name, p in sharded.named_parameters())
    return torch.equal(got, expected), same


@pytest.mark.parametrize("name", ["gpt", "reused_block", "odd_shapes", "frozen"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_clip_is_bitwise_torch_at_one_rank(ranks, strategy, name):
    """Catches a norm computed in float64 over every element (1.15e-4 from one process on an OPT
    model after 5 clipped AdamW steps, torch DDP 1.3e-6): at one rank it must be torch's bitwise."""
    for same_norm, same_grads in ranks.run(_clip_one_rank, 1, strategy, name):
        assert same_norm and same_grads
