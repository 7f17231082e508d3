"""A model whose weight's first dimension equals the world size (2): its rows are [1, 4], so a tensor of
the full shape [2, 4] meeting them would broadcast one row over both, silently (Note [rows meet a whole
tensor] in shard_param.py)."""

from __future__ import annotations

from torch import nn


class TwoRows(nn.Module):
    """A weight whose first dimension equals the world size: rows broadcast silently."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 2)

    def forward(self, x):
        return self.proj(x).sum()
