"""Host reads of device values in the engine's hot path (`.item()`, `bool()`, `.tolist()`, `.cpu()`,
indexing a tensor into Python): each would stall a GPU's stream. Counted on CPU through a
TorchDispatchMode that sees every `aten._local_scalar_dense` and wrappers around `Tensor.tolist` /
`Tensor.cpu` / `Tensor.numpy` (which never reach the dispatcher), attributed to the shardwise
function that asked."""

from __future__ import annotations

import collections
import contextlib
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice

# Reads the engine makes on purpose, each of a value that lives on the host (Note [host values],
# collectives.py): results of collectives over the CPU group (the gloo group itself here, a gloo
# group beside NCCL on a GPU). Any other read in a step is a device synchronisation.
HOST_VALUES = {
    "engine/consistency.py:agree_before_forward",  # which units to re-gather, once per forward
    "engine/collectives.py:any_rank",  # which parameters any rank used, once per step
}


# torch's frames between a read and a dispatch mode (its entry is wrapped to stay out of compile)
_MODE_MACHINERY = ("/torch/_compile.py", "/torch/_dynamo/", "/torch/utils/_python_dispatch.py")


def _caller() -> str:
    """The shardwise function that made the read itself (torch's own reads, an optimizer's inside a
    step shardwise called, are torch's), as file:function."""
    frames = [f for f in traceback.extract_stack() if f.filename != __file__ and not any(
        part in f.filename for part in _MODE_MACHINERY)]
    innermost = frames[-1]
    if "/shardwise/" not in innermost.filename:
        return "torch or the test"
    return f"{innermost.filename.split('shardwise/')[-1]}:{innermost.name}"


class _CountScalarReads(TorchDispatchMode):
    def __init__(self, counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.counts[_caller()] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_host_copies(counts):
    """`Tensor.tolist` / `.cpu()` / `.numpy()` never reach the dispatcher, and a TorchFunctionMode is
    off inside backward's hooks: count them by wrapping the methods for the block."""
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def counting(method):
        def wrapper(self, *args, **kwargs):
            counts[_caller()] += 1
            return method(self, *args, **kwargs)
        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, counting(method))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def _count(strategy):
    model, spec = build("gpt"), ZOO["gpt"]
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optim = torch.optim.AdamW(model.parameters(), foreach=True)  # torch's for-loop reads `step` per param
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    for _ in range(2):  # the second step is counted: set-up and first-call work are done
        counts = collections.Counter()
        with _CountScalarReads(counts), _count_host_copies(counts):
            model(x, y).backward()
            sw.clip_grad_norm_(model, 1.0)
            optim.step()
            optim.zero_grad()
    return dict(counts)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_engine_host_reads_per_step(ranks, strategy):
    """Catches a host read of a device value in a step: the used flags were read one `bool()` per
    trainable parameter (26 per step on the zoo GPT), then one `.tolist()` per unit (6), from the
    reduce-scatter's output; now none. The reads of host values (HOST_VALUES) are allowed."""
    for counts in ranks.run(_count, 2, strategy):
        engine = {where: n for where, n in counts.items() if where != "torch or the test"}
        device_reads = {where: n for where, n in engine.items() if where not in HOST_VALUES}
        assert device_reads == {}, counts
        assert set(engine) == HOST_VALUES, counts  # both still run (the test sees them)


def _count_scaled():
    model, spec = build("gpt"), ZOO["gpt"]
    sw.shard(model, strategy="zero2", units=spec.unit_class, precision="fp16")
    optim = torch.optim.AdamW(model.parameters(), foreach=True)
    scaler = sw.LossScaler(model)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    for _ in range(2):
        counts = collections.Counter()
        with _CountScalarReads(counts), _count_host_copies(counts):
            scaler.scale(model(x, y)).backward()
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
    return dict(counts)


def test_loss_scaler_reads_the_host_once_per_step(ranks):
    """Catches the loss scaler's overflow check reading each gradient on the host (a `bool()` per
    tensor before: a GPU stall per parameter); what remains is the one read that decides in Python
    whether to step, as torch's GradScaler makes it."""
    for counts in ranks.run(_count_scaled, 2):
        engine = {where: n for where, n in counts.items() if where != "torch or the test" and where not in HOST_VALUES}
        assert engine == {"engine/precision.py:unscale_": 1}, counts
