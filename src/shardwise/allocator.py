"""The C allocator's settings a rank runs with: glibc's mmap threshold, set by `sw.init()`.

Note [allocator at init]: the estimator's figures and the planner's promise are peak RSS with glibc's
mmap threshold fixed at 64 KiB (Note [allocator] in estimate/core.py): each freed block of 64 KiB or more
goes back to the system at once. glibc's default threshold grows with the blocks freed (up to 32 MiB),
and blocks below it are kept resident after `free`: zero3's gathered units and a step's temporaries then
stay in RSS, and a plan followed in that default environment ran 12-30% over its budget (issue 60: Llama
33.7M, 900 MiB, 2 ranks: 1004-1014 MiB, 848 with the threshold). The environment variable that fixes it,
`MALLOC_MMAP_THRESHOLD_=65536`, was on the plan's `run:` line, easy to miss and absent from launch scripts.
So `sw.init()` sets the same threshold itself, through glibc's `mallopt(M_MMAP_THRESHOLD, 65536)` (which,
like the variable, also stops the threshold from growing): every rank of a job runs in the environment the
plan was made for, whatever its launcher. It applies to the allocations that follow (those torch made at
import keep their blocks). A `MALLOC_MMAP_THRESHOLD_` the user set wins (glibc read it at start; shardwise
leaves it), and `sw.init(malloc_mmap_threshold=None)` keeps glibc's default. The price is time: every large
block is a fresh mmap and its pages fault in again (DESIGN.md measured FSDP2's steps 20-60% slower so; the
engine reuses its large buffers, Note [reused buffers] in engine/comm/buffers.py). Off glibc (macOS, musl)
there is no such call and nothing is set.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD_BYTES = 65536  # what the estimate was fitted with (Note [allocator] in estimate/core.py)
ENV = "MALLOC_MMAP_THRESHOLD_"


def set_mmap_threshold(nbytes: int | None = MMAP_THRESHOLD_BYTES) -> str:
    """Fix glibc's mmap threshold at `nbytes` for this process (Note [allocator at init]); say what was done:
    "set", "kept MALLOC_MMAP_THRESHOLD_=..." (the user's), "off" (None), or "unavailable" (not glibc)."""
    if nbytes is None:
        return "off"
    if ENV in os.environ:
        return f"kept {ENV}={os.environ[ENV]}"
    mallopt = _glibc_mallopt()
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return "unavailable"
    return "set"


def _glibc_mallopt():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only: musl has mallopt as a stub that sets nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
