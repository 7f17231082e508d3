"""`sw.EMA(model)`: an exponential moving average of a model's weights that stays sharded.

torch's `AveragedModel` and the usual EMA recipes start from `copy.deepcopy(model)`, which a
sharded model refuses (engine/guards.py: NoCopies), and an EMA copy taken before `shard()`
holds whole tensors that a rank's rows cannot be lerped into (Note [rows meet a whole
tensor]). An average is elementwise, so averaging each rank's rows is exactly the average of
the whole tensors: `EMA` keeps one copy of every parameter as the model holds it (this
rank's rows after `shard()`, 4/N bytes per parameter) and works unchanged on an unsharded model.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from shardwise.engine.compat import unwrap_compiled


class EMA:
    """`average = decay * average + (1 - decay) * weights` at each `update()`, kept as rows.

    Evaluate with the average inside `with ema.applied(): ...` (the model's own weights come
    back after it); `state_dict()` / `load_state_dict()` hold this rank's rows.
    """

    def __init__(self, model: nn.Module, decay: float = 0.999):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        model = unwrap_compiled(model)  # the compiled handle too: the module's own names
        self.model, self.decay, self.num_updates = model, decay, 0
        with torch.no_grad():
            self.average = {name: p.detach().clone() for name, p in model.named_parameters()}

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the model's current weights (call after `optimizer.step()`)."""
        for name, param in self.model.named_parameters():
            self.average[name].lerp_(param.detach(), 1.0 - self.decay)
        self.num_updates += 1

    @contextmanager
    def applied(self):
        """The model with the averaged weights in place for the block; its own weights after."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            saved = {name: param.detach().clone() for name, param in params.items()}
            for name, param in params.items():
                param.copy_(self.average[name])  # an in-place write: zero1/zero2 re-gather before the forward
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(saved[name])

    def state_dict(self) -> dict:
        return {"decay": self.decay, "num_updates": self.num_updates,
                "average": {name: value.clone() for name, value in self.average.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.decay, self.num_updates = state["decay"], state["num_updates"]
        with torch.no_grad():
            for name, value in state["average"].items():
                self.average[name].copy_(value)
