"""Each torch internal in engine/compat.py still has the shape the engine relies on: a torch
upgrade that changes one fails here, loudly, instead of switching a guard off in silence."""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from shardwise.engine.compat import Reach, reach


def _probe(mode: str) -> list[Reach]:
    seen = []
    leaf, other = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    node = get_gradient_edge(leaf).node

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(reach(node))
            return grad * 2

    loss = Probe.apply(leaf * other).sum()
    if mode == "grad":
        torch.autograd.grad(loss, [leaf])
    elif mode == "grad_of_other":
        torch.autograd.grad(loss, [other])
    else:
        loss.backward()
    return seen


def test_reach_tells_backward_from_autograd_grad():
    """Catches a torch release where `_will_engine_execute_node` changes what it answers: the engine
    would then run the step's reduce for a gradient penalty's autograd.grad (zero3 freed what its
    graph reads), or miss autograd.grad over the parameters."""
    assert _probe("backward") == [Reach.RUNS]
    assert _probe("grad") == [Reach.CAPTURES]
    assert _probe("grad_of_other") == [Reach.SKIPS]
