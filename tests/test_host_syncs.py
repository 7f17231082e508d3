"""Host reads of device values (`.item()`, `bool()`, indexing a tensor into Python) in the engine's hot
path: each would stall a GPU's stream. Counted on CPU through a TorchDispatchMode that sees every
`aten._local_scalar_dense`, attributed to the shardwise file that asked."""

from __future__ import annotations

import collections
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice


class _CountScalarReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.by_file = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            ours = [f for f in traceback.extract_stack() if "/shardwise/" in f.filename]
            self.by_file[ours[-1].filename.split("shardwise/")[-1] if ours else "torch or the test"] += 1
        return func(*args, **(kwargs or {}))


def _count(strategy):
    model, spec = build("gpt"), ZOO["gpt"]
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optim = torch.optim.AdamW(model.parameters(), foreach=True)  # torch's for-loop reads `step` per param
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    for _ in range(2):  # the second step is counted: set-up and first-call work are done
        mode = _CountScalarReads()
        with mode:
            model(x, y).backward()
            sw.clip_grad_norm_(model, 1.0)
            optim.step()
            optim.zero_grad()
    return dict(mode.by_file)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_engine_host_reads_per_step(ranks, strategy):
    """Catches a host read per parameter (the used flags were read one `bool()` per trainable
    parameter, 26 per step on the zoo GPT) or any new one in the hot path. What remains, named:
    consistency.py's agreement before each forward (one per forward: it decides, on host, which
    units to re-gather; issue 21 moves it onto a CPU group beside NCCL)."""
    for by_file in ranks.run(_count, 2, strategy):
        engine = {f: n for f, n in by_file.items() if f != "torch or the test"}
        assert engine == {"engine/consistency.py": 1}, by_file
