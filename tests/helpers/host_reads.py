"""Count host reads of device values (`.item()`, `bool()`, `.tolist()`, `.cpu()`, indexing a tensor into
Python), each a stall of a GPU's stream, attributed to the shardwise function that made the read.

Counted on CPU through a TorchDispatchMode that sees every `aten._local_scalar_dense` and wrappers
around `Tensor.tolist` / `Tensor.cpu` / `Tensor.numpy` (which never reach the dispatcher)."""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Reads the engine makes on purpose, each of a value that lives on the host (Note [host values],
# collectives.py): results of collectives over a CPU group (gloo, beside NCCL on a GPU). Any other
# read in a step is a device synchronisation.
HOST_VALUES = {
    "engine/schedule/agreement.py:confirm",  # a phase's header (Note [agreement rides the traffic])
    "engine/schedule/gather_tags.py:check",  # zero3's gather tags (Note [gather tags])
    "engine/comm/collectives.py:any_rank",  # which parameters any rank used, once per step
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


@contextlib.contextmanager
def count_host_reads(counts):
    """Add to `counts` (a Counter) one per host read in the block, by the shardwise function that made it
    ("torch or the test" for the others)."""
    with _CountScalarReads(counts), _count_host_copies(counts):
        yield
