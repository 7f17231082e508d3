"""torch internals the engine relies on, in one place; tests/test_compat.py fails loudly when
a torch release changes one of them (STYLE.md: lean on torch's internals in one place)."""

from __future__ import annotations

import enum

import torch

_GRAD_CALL = "autograd.grad"


class Reach(enum.Enum):
    """What the autograd graph task now running does with a parameter's AccumulateGrad node."""

    RUNS = "runs"  # a backward that accumulates into the parameter (loss.backward())
    SKIPS = "skips"  # a task that does not need the parameter (autograd.grad(out, inputs))
    CAPTURES = "captures"  # autograd.grad with the parameter among its inputs


def reach(accumulate_node) -> Reach:
    """torch offers no public query. `_will_engine_execute_node` answers for the running task
    (True for every node in a plain backward), and raises, naming autograd.grad, for a leaf's
    AccumulateGrad node that autograd.grad captures as one of its inputs (torch 2.13)."""
    try:
        return Reach.RUNS if torch._C._will_engine_execute_node(accumulate_node) else Reach.SKIPS
    except RuntimeError as error:
        if _GRAD_CALL in str(error):
            return Reach.CAPTURES
        raise
