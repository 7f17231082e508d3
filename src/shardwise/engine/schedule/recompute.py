"""`checkpoint_activations=True`: a unit keeps only its inputs in forward and recomputes in backward.
Uses: compat.

Note [recompute]: activation checkpointing from outside (`torch.utils.checkpoint` around a
unit, Hugging Face's `activation_checkpointing_enable()`, or `checkpoint_activations=True`)
runs a unit's forward again during backward. Its hooks then only gather the unit and
install the window's views; nothing is freed or prefetched (the backward's own hooks do
that), so the recompute never frees the root or a unit backward still needs. (A reentrant
checkpoint, `use_reentrant=True`, runs a backward of its own inside: refused, Note [one
backward at a time] in window.py.)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from shardwise.engine.compat import graph_task_id


def checkpoint_forward(module: nn.Module, before_recompute: Callable[[], None]) -> None:
    """Keep only the unit's inputs in forward and recompute it in backward.

    The unit's own hooks stay outside the checkpoint: the recompute calls the original
    forward directly, so `before_recompute()` first makes the unit's full values present
    and registered (the window may have closed after an earlier backward through it:
    Note [recompute])."""
    original = module.forward

    def recompute_or_run(*args, **kwargs):
        # Inside backward: this is the recompute. Compiled, the recompute is the graph's own and
        # reads the parameters it saved (Note [compiled] in compat.py).
        if not torch.compiler.is_compiling() and graph_task_id() != -1:
            before_recompute()
        return original(*args, **kwargs)

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(recompute_or_run, *args, use_reentrant=False, **kwargs)

    module.forward = forward
