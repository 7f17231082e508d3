"""Each torch internal in engine/compat.py still has the shape the engine relies on: a torch
upgrade that changes one fails here, loudly, instead of switching a guard off in silence."""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

from shardwise.engine.compat import running_autograd_grad


def _probe(mode: str) -> list[bool]:
    seen = []
    leaf = torch.randn(3, requires_grad=True)
    node = get_gradient_edge(leaf).node

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(running_autograd_grad(node))
            return grad * 2

    loss = Probe.apply(leaf).sum()
    if mode == "grad":
        torch.autograd.grad(loss, [leaf])
    else:
        loss.backward()
    return seen


def test_running_autograd_grad_tells_grad_from_backward():
    """Catches a torch release where `_will_engine_execute_node` no longer raises inside
    autograd.grad (the engine would then reduce gradients for a call that is not a backward)."""
    assert _probe("grad") == [True]
    assert _probe("backward") == [False]
