"""Run a function on N real ranks: forked from a clean server process, gloo over loopback.

Starting a rank costs about 2 s of CPU (importing torch), so a pool of rank processes lives
for the whole test session (one pool per pytest-xdist worker under `make test`), and the ranks
are forked from multiprocessing's fork server, which imported torch, shardwise and the
heavy integrations once (`_PRELOAD`): four ranks that each import transformers' Trainer pay
7.5 s of CPU each on this host, a fork pays nothing. The server is a fresh interpreter that
never ran a test, so a rank still starts from clean state (as "spawn" would give); each
call forms a fresh process group on a fresh store, runs the function on the first N
workers, and tears the group down. A call returns every rank's result, re-raises the
first rank's exception with that rank's own traceback, and after `timeout` seconds
dumps each unfinished rank's stack (faulthandler) and kills the pool, so a hang fails the test and names the rank.
The `timeout` counts the call, not the pool's start: a fresh pool (the first call, or the one after a
kill) waits for every rank to say it is ready first (Note [ready before the clock]).

The function and its arguments must be picklable: define it at module level.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

# Seconds the other ranks get to finish after one rank raised: they are usually
# blocked in a collective the failed rank will never join.
_GRACE_AFTER_ERROR = 3.0

# Note [ready before the clock]: starting a pool forks the server, which first imports torch and the
# integrations (_PRELOAD): seconds quiet, tens of seconds on a loaded host. CI once failed the hang test
# (a 5 s call) because rank 0 was still in the fork server when the clock ran out. So a fresh pool's
# ranks each report ready before any call's deadline starts, within this bound of their own.
_START_TIMEOUT_S = 300.0

# Note [collect before the group goes]: a call that catches a refusal (tests/test_stepped_regather.py's
# one-rank write) leaves collectives issued on one rank only, in a cycle (model <-> engine hooks) that
# holds the process group. When a later call's garbage collection freed it on one rank while the other
# rank's copy was alive, gloo's destructor joined a worker thread blocked on the unmatched broadcast
# until the group's 120 s timeout: every `make test` had one test (the next Trainer or Accelerate test
# on that worker) take 123 s instead of 3 (found with faulthandler and gdb: ~ProcessGroupGloo joining
# pt_gloo_runloop in gloo::broadcast's waitRecv). Every rank now collects at the end of each call,
# together, before the group is destroyed; `gc.freeze()` after the fork server's imports keeps that
# collect at about 5 ms (364 calls of two parity files: 1.9 s in all).
_READY = -1  # the call id of a ready report


# Imported once by the fork server, before any rank is forked from it (a module that fails to import
# is skipped by multiprocessing; the rank imports it itself then). Importing them runs no parallel
# torch op, so no OpenMP pool exists in the server to be forked.
_PRELOAD = ["torch", "torch.distributed", "shardwise", "helpers.harness", "transformers", "transformers.trainer",
            "accelerate"]


class RankFailed(AssertionError):
    """A rank raised; the message carries that rank's traceback."""


class RankTimeout(AssertionError):
    """Ranks did not finish in time; the message names them and shows where each was."""


@dataclass
class _Worker:
    process: mp.Process
    tasks: mp.Queue
    stack_file: Path


def _worker_main(rank_slot: int, tasks: mp.Queue, results: mp.Queue, stack_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    gc.freeze()  # the fork server's imports: never garbage, so each call's collect skips them (below)
    # SIGUSR1 makes this process write every thread's stack to its file: how the
    # parent learns where a hung rank was before killing it.
    with open(stack_file, "w") as stack_out:
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
        results.put((_READY, rank_slot, "ready", None))
        while True:
            task = tasks.get()
            if task is None:
                return
            call_id, fn, args, kwargs, rank, world_size, store_port, timeout_s = task
            # Every call starts at one thread: an earlier call may have raised it (under two pytest
            # workers, test_harness ran after some other file and its ranks found 2 threads).
            torch.set_num_threads(1)
            os.environ.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port),
            )
            try:
                store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                                      timeout=timedelta(seconds=timeout_s))
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                        timeout=timedelta(seconds=timeout_s))
                value = fn(*args, **kwargs)
                results.put((call_id, rank, "ok", value))
            except BaseException:  # noqa: BLE001 - every failure goes back to the parent
                results.put((call_id, rank, "error", traceback.format_exc()))
            finally:
                gc.collect()  # Note [collect before the group goes]
                if dist.is_initialized():
                    dist.destroy_process_group()


class RankPool:
    """A pool of `size` rank processes reused across calls (see module docstring)."""

    def __init__(self, size: int = 4):
        self.size = size
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        self._workers: list[_Worker] = []
        self._results: mp.Queue | None = None
        self._call_id = 0
        self._stack_dir = Path(tempfile.mkdtemp(prefix="shardwise-ranks-"))

    def _start(self) -> None:
        self._results = self._ctx.Queue()
        self._workers = []
        for slot in range(self.size):
            tasks = self._ctx.Queue()
            stack_file = self._stack_dir / f"rank{slot}.stack"
            process = self._ctx.Process(
                target=_worker_main, args=(slot, tasks, self._results, str(stack_file)), daemon=True
            )
            process.start()
            self._workers.append(_Worker(process, tasks, stack_file))
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        ready: set[int] = set()
        while len(ready) < self.size:
            try:
                call_id, slot, _, _ = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [s for s, w in enumerate(self._workers) if not w.process.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RankTimeout(f"the rank pool did not start: rank(s) {sorted(set(range(self.size)) - ready)} "
                                      f"not ready within {_START_TIMEOUT_S:.0f} s (dead: {dead})")
                continue
            if call_id == _READY:
                ready.add(slot)

    def run(self, fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
        """Run `fn(*args, **kwargs)` on ranks 0..world_size-1; return their results by rank."""
        import torch.distributed as dist

        if not 1 <= world_size <= self.size:
            raise ValueError(f"world_size={world_size} needs 1..{self.size} ranks; make the pool larger")
        if not self._workers or not all(w.process.is_alive() for w in self._workers):
            self.close()
            self._start()
        self._call_id += 1
        # The parent owns the store: its port is bound before any rank connects, so
        # there is no free-port race between concurrent test sessions.
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        for rank in range(world_size):
            self._workers[rank].tasks.put(
                (self._call_id, fn, args, kwargs, rank, world_size, store.port, timeout)
            )
        try:
            return self._collect(world_size, timeout)
        finally:
            del store

    def _collect(self, world_size: int, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        while len(values) + len(errors) < world_size:
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_ERROR)
            try:
                call_id, rank, status, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r in range(world_size) if not self._workers[r].process.is_alive()]
                if dead and not errors:
                    errors.update({r: f"rank {r} process died (exit code "
                                      f"{self._workers[r].process.exitcode})" for r in dead})
                if time.monotonic() > deadline:
                    break
                continue
            if call_id != self._call_id:
                continue  # a late answer from a call that already failed
            (values if status == "ok" else errors)[rank] = payload
        pending = [r for r in range(world_size) if r not in values and r not in errors]
        if errors:
            # The first error to arrive is the cause; the others are usually peers whose
            # collective broke because of it (dicts keep arrival order).
            first = next(iter(errors))
            if pending:
                self.close()  # the others are stuck in a collective the failed rank left
            also = f" (then rank(s) {sorted(set(errors) - {first})} failed too)" if len(errors) > 1 else ""
            raise RankFailed(f"rank {first} of {world_size} raised{also}:\n{errors[first]}")
        if pending:
            stacks = self._dump_stacks(pending)
            self.close()
            where = "\n".join(f"--- rank {r} was here:\n{stacks[r]}" for r in pending)
            raise RankTimeout(
                f"rank(s) {pending} of {world_size} did not finish within {timeout:.0f} s "
                f"(killed all ranks)\n{where}"
            )
        return [values[r] for r in range(world_size)]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        # The worker appends to its open file, so read only what this dump adds.
        offsets = {r: self._workers[r].stack_file.stat().st_size for r in ranks}
        for r in ranks:
            os.kill(self._workers[r].process.pid, signal.SIGUSR1)
        time.sleep(1.0)
        stacks = {}
        for r in ranks:
            with open(self._workers[r].stack_file) as f:
                f.seek(offsets[r])
                stacks[r] = f.read() or "(no stack written)"
        return stacks

    def close(self) -> None:
        """Kill every rank process (the next `run` starts a fresh pool)."""
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(timeout=5)
        self._workers = []
