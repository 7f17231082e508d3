"""Rank functions for tests/test_estimate_lowbit.py (module level, so `ranks.run` can pickle them): torchao's
low-bit AdamW after a real step, its state bytes as the engine holds them on each rank. The model is
helpers/lowbit.py's Net: its blocks' 128 x 32 matrices are quantized, its 130 x 32 head, input layer and
biases keep fp32 state (Note [low-bit estimate] in estimate/lowbit_bytes.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from helpers.lowbit import Block, Net, batch, make_optimizer
from shardwise.engine.optim.lowbit import flatten_state
from shardwise.estimate.measure import model_state_bytes


def held_after_step(strategy: str, name: str) -> dict:
    """One step of `name` on Net sharded by `strategy`; this rank's optimizer-state bytes (every state tensor
    as its plain parts: codes, scales, code map, the step counter) and its model-state bytes, after the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    sw.shard(model, strategy=strategy, **({"units": Block} if strategy != "ddp" else {}))
    optim = make_optimizer(model.parameters(), name)
    model(batch(0, rank, world)).backward()
    optim.step()  # measured after the step, before zero_grad: the most a step keeps
    state = sum(t.numel() * t.element_size() for p, s in optim.state.items()
                for t in flatten_state(s, "a parameter").values() if isinstance(t, torch.Tensor))
    return {"state": state, "model_state": model_state_bytes(model, optim)}
