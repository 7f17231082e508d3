"""Watch torch.distributed's collective functions: every call inside a block, its arguments bound by
name. One watcher serves every counter of traffic (shardwise.testing.count_received, the slicing
traffic counter, bench/comm/traffic.py), which each used to wrap the same functions their own way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Callable

import torch.distributed as dist

# Every collective torch.distributed offers as a function, for `watch_collectives`.
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_reduce",
               "all_to_all", "all_to_all_single", "barrier", "broadcast", "broadcast_object_list", "gather",
               "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_single",
               "reduce_scatter_tensor", "scatter", "send")


@contextlib.contextmanager
def watch_collectives(on_call: Callable[[str, dict], None], names=COLLECTIVES):
    """Call `on_call(name, arguments)` before each torch.distributed collective of `names` issued inside the
    block, its arguments bound by name with the defaults applied. A collective torch implements by calling
    another (a deprecated name calling its successor) is reported once, as the outer call. torch's functions
    are restored after. DDP's C++ reducer calls its process group directly: it is not seen."""
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    depth = threading.local()

    def watching(name, function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def call(*args, **kwargs):
            outer = getattr(depth, "n", 0)
            if not outer:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                on_call(name, bound.arguments)
            depth.n = outer + 1
            try:
                return function(*args, **kwargs)
            finally:
                depth.n = outer
        return call

    try:
        for name, function in real.items():
            setattr(dist, name, watching(name, function))
        yield
    finally:
        for name, function in real.items():
            setattr(dist, name, function)
