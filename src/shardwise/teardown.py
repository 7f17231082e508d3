"""What shardwise closes when a process ends without `sw.shutdown()` (Note [exit teardown]).

Note [exit teardown]: a 2-rank zero3 job that ended with `sys.exit(0)` and no
`sw.shutdown()` aborted on one rank in 3 of 36 runs at exit ("terminate called without an
active exception", exit code -6), so torchrun reported the job failed. The core dump shows
why: a gloo worker thread (`ProcessGroupGloo::runLoop`) destroys a finished `AsyncGatherWork`
after `wait()` has returned on the main thread; when Python has already dropped the tensor it
sent (`sw.full_state_dict`'s gather of a temporary), that destruction must take the GIL to
free the tensor's Python object, and if the interpreter is finalizing by then, taking the
GIL ends the thread with a forced unwind through a noexcept frame: std::terminate. So the
exit hook gives the GIL up for a moment (`_DRAIN_S`) before the interpreter finalizes, so
that such a worker finishes while Python still runs; what remains is a worker not scheduled
at all within that time. Beyond that, whatever shardwise opens registers how to close it
here, and one `atexit` hook (registered on first use) closes it all while the interpreter is
still whole, newest first: a background save's thread is done
by then (Python joins non-daemon threads before atexit hooks run) and an error nobody
waited for is logged; then the groups shardwise made (reduce groups, checkpoint groups),
then the default group and its store when `sw.init()` formed them. Nothing collective runs
at exit: ranks reach their exit at different times (one may have raised), so a barrier there
could wait for a rank that never comes. A process killed by a signal runs no atexit hook;
its peers' groups fail their next collective within `sw.init(timeout=...)` as before.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from typing import Callable

import torch.distributed as dist

log = logging.getLogger("shardwise")

# (what, how to close it, a weak reference to what it closes or None), oldest first. Weak: a closer
# must not keep a group (its gloo threads and sockets) alive after the engine that made it is gone.
_closers: list[tuple[str, Callable[[], None], weakref.ref | None]] = []
_lock = threading.Lock()
_hooked = False


def at_exit(what: str, close: Callable[[], None], *, owner: weakref.ref | None = None) -> None:
    """Have `close` run when the process exits without tearing down (Note [exit teardown]),
    after everything registered later. `what` names it in the log if closing fails; once
    `owner` (a weak reference) is dead, the closer is dropped."""
    global _hooked
    with _lock:
        _closers[:] = [c for c in _closers if c[2] is None or c[2]() is not None]
        _closers.append((what, close, owner))
        if not _hooked:
            atexit.register(close_all)
            _hooked = True


def close_group_at_exit(group: dist.ProcessGroup, what: str) -> dist.ProcessGroup:
    """Destroy `group` at exit unless it is gone by then (`sw.shutdown()`, the user's
    `destroy_process_group`); returns `group`."""
    ref = weakref.ref(group)
    at_exit(what, lambda: _destroy(ref()), owner=ref)
    return group


# How long the exit hook leaves the GIL to the collectives' worker threads (Note [exit teardown]).
_DRAIN_S = 0.1


def close_all() -> None:
    """Run every registered closer, newest first, each once; a failure is logged, not raised
    (the process is ending: its exit code must stay its own). Then let the collectives'
    worker threads finish the work they hold while the interpreter still runs."""
    while True:
        with _lock:
            if not _closers:
                time.sleep(_DRAIN_S)  # releases the GIL (Note [exit teardown])
                return
            what, close, _ = _closers.pop()
        try:
            close()
        except Exception as error:  # noqa: BLE001 - logged: the exit code stays the script's
            log.warning("shardwise: closing %s at exit failed: %s", what, error)


def _destroy(group: dist.ProcessGroup | None) -> None:
    if group is None or not dist.is_initialized():
        return  # the whole package was torn down (destroy_process_group())
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return  # this group was destroyed already
    if group is dist.group.WORLD:
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(group)
