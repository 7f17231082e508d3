"""torch internals the engine relies on, in one place; tests/test_compat.py fails loudly when
a torch release changes one of them (STYLE.md: lean on torch's internals in one place)."""

from __future__ import annotations

import torch

_GRAD_CALL = "autograd.grad"


def running_autograd_grad(node) -> bool:
    """Whether the autograd graph task now running is `torch.autograd.grad` (not `backward`).

    torch offers no public query; `_will_engine_execute_node` on a leaf's AccumulateGrad node
    raises inside `autograd.grad` with a message naming it (torch 2.13), and answers in `backward`."""
    if node is None:
        return False
    try:
        torch._C._will_engine_execute_node(node)
    except RuntimeError as error:
        if _GRAD_CALL in str(error):
            return True
        raise
    return False
