"""`checkpoint_activations=True`: a unit keeps only its inputs in forward and recomputes in backward."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn


def checkpoint_forward(module: nn.Module) -> None:
    """Keep only the unit's inputs in forward and recompute it in backward.

    The unit's own hooks stay outside the checkpoint: the recompute calls the original
    forward directly, after the unit's pre-backward hook has gathered it again, and its
    uses of the full views feed the same `_GatherUnit` node as the first forward's."""
    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward
