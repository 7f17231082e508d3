"""Rank functions for tests/test_estimate_lowbit.py (module level, so `ranks.run` can pickle them): torchao's
low-bit AdamW after a real step, its state bytes as the engine holds them on each rank. The model is
helpers/lowbit.py's Net: its blocks' 128 x 32 matrices are quantized, its 130 x 32 head, input layer and
biases keep fp32 state (Note [low-bit estimate] in estimate/lowbit_bytes.py); `wide()` the same with wider
blocks, for the step's buffers in RSS."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from helpers.lowbit import Block, Net, batch, make_optimizer
from shardwise.allocator import set_mmap_threshold
from shardwise.engine.optim.lowbit import flatten_state
from shardwise.estimate.measure import model_state_bytes


def held_after_step(strategy: str, name: str, in_backward: bool = False) -> dict:
    """One step of `name` on Net sharded by `strategy` (`in_backward`: under sw.optimizer_in_backward); this
    rank's optimizer-state bytes (every state tensor as its plain parts: codes, scales, code map, the step
    counter) and its model-state bytes, after the step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    sw.shard(model, strategy=strategy, **({"units": Block} if strategy != "ddp" else {}))
    optim = make_optimizer(model.parameters(), name)
    if in_backward:
        sw.optimizer_in_backward(model, optim)
    model(batch(0, rank, world)).backward()
    optim.step()  # measured after the step, before zero_grad: the most a step keeps
    state = sum(t.numel() * t.element_size() for p, s in optim.state.items()
                for t in flatten_state(s, "a parameter").values() if isinstance(t, torch.Tensor))
    return {"state": state, "model_state": model_state_bytes(model, optim)}


def wide() -> Net:
    """Net with four blocks of two 1 MiB matrices (256 x 1024, quantized): a step's buffers large enough to read
    in RSS."""
    return Net(width=256, hidden=1024, out=3, depth=4)


def _status(key: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))


def step_peak(strategy: str, name: str, steps: int = 3) -> float:
    """Bytes this rank's `optimizer.step()` adds at its peak (VmHWM over the RSS before it) on `wide()`, at the last
    of `steps` steps (the first compiles torchao's step), with glibc returning freed blocks of 64 KiB and more
    at once, as sw.init() sets it (Note [allocator at init])."""
    set_mmap_threshold()
    torch.manual_seed(0)
    model = wide()
    sw.shard(model, strategy=strategy, units=Block)
    optim = make_optimizer(model.parameters(), name)
    x = torch.randn(4, 16)
    for _ in range(steps):
        optim.zero_grad(set_to_none=True)
        model(x).backward()
        before = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak (VmHWM) from here
        optim.step()
    return _status("VmHWM") - before
