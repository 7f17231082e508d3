"""torch internals the engine relies on, in one place; tests/test_compat.py fails loudly when
a torch release changes one of them (STYLE.md: lean on torch's internals in one place)."""

from __future__ import annotations

import enum
import inspect

import torch

from shardwise.errors import ShardwiseError

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


# Note [rank-local clipping] (shard_param.py): torch's clipping functions by code object. They
# read `.grad` in a comprehension at their start, before touching any gradient.
_CLIPS = {inspect.unwrap(fn).__code__: fn.__name__ for fn in (
    torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grads_with_norm_, torch.nn.utils.clip_grad_value_)}


def refuse_clip_after_step(frame) -> None:
    """Under sw.optimizer_in_backward only: a `.grad` read from one of torch's clipping functions
    would find every gradient already stepped and dropped, and clip nothing without a word."""
    if frame is not None and frame.f_code.co_name == "<listcomp>":  # Python 3.11 gives it a frame
        frame = frame.f_back
    function = _CLIPS.get(frame.f_code) if frame is not None else None
    if function is not None:
        raise ShardwiseError(
            f"torch.nn.utils.{function} with sw.optimizer_in_backward: every unit was stepped during "
            "backward and its gradient dropped, so there is nothing left to clip. Clip without "
            "optimizer_in_backward (Note [optimizer in backward])."
        )
