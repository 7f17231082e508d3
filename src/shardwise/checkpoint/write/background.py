"""`sw.save_async`: a checkpoint that does not stop training.

Note [background save]: the save is cut where training may go on. On the caller's thread,
every rank checks what can be refused and starts the partial directory (as `sw.save` does),
then copies the rows this rank writes (its shard without padding; a ddp or plain replica's
1/N share, not the whole), their optimizer rows, the buffers and its RNG states to host
memory (one copy of this rank's share of the checkpoint: the price of not waiting). A
thread then writes the rank file and publishes the directory exactly as `sw.save` does (Note
[atomic save]): the gather of the ranks' records and rank 0's rename run on a gloo group of
their own, made once per model group, so they never pair with training's collectives. One
background save runs at a time: the next `sw.save` / `sw.save_async` waits for it first and
raises its error, if any, on every rank; `pending.wait()` does the same, and then the error is the
caller's: the next save neither raises it again nor is lost to it. Call `wait()` before
the process group ends (the end of training); a script that exits without it still has its
save finished (Python joins the thread before the groups close, Note [exit teardown]), and a
failure nobody waited for is logged.

Note [cheap background save]: on a host with no core to spare (every core runs a rank's training)
the background write takes its CPU time (crc32, the copy into the page cache) from training, so
it must cost less of it than a blocking save: (1) the host copy goes into a staging copy kept per
model and reused by the next save (a fresh 100 MB buffer page-faults each save: several times the
cost of a copy into memory already mapped); on a GPU that staging copy is pinned, so the
device-to-host copy runs at full speed (stated, not measured here); (2) the writer thread runs at
the cheapest priority the OS grants it: SCHED_IDLE where it may (Linux lets any thread take it, per
thread), else nice 19 (`lower_priority`), so the scheduler gives training the core whenever both
want it and the write fills the gaps (collectives, data loading). SCHED_IDLE rather than nice 19:
against a busy thread a nice-19 thread still gets about 1.5% of the core (weight 15 of 1024+15),
a SCHED_IDLE one about 0.3% (weight 3), so the write leaves a busy core to training yet runs at full
speed on an idle one. Only while nothing waits for it, though: on a host busy with other work a
SCHED_IDLE thread may not run for a long while, so `wait()` (which the next save calls too) and the
interpreter's exit put the writer back to training's policy first, as unprivileged threads may undo
SCHED_IDLE (not nice 19). What it cannot lower is the GIL: while the writer holds it (between its
crc32 and write calls, which release it) a training thread of the same process waits, whatever
the writer's priority; those stretches are short (per 4 MiB chunk), and the writer is runnable then,
so the scheduler runs it on the core the waiting training thread left idle. (3) it writes
4 MiB chunks and fsyncs once per file, its writeback started early (Note [early writeback] in
disk.py), and its index and directory fsyncs overlap the files' (Note [one wait for the disk] in
commit.py). The price of (1): the staging copy stays allocated between saves (one copy of this
rank's share of the checkpoint), where before it was freed after each write. `pending.cpu_s` is
the writer thread's CPU time: with no core to spare, what the background write can take from
training at most (bench/checkpoints/checkpoint.py prints it beside the blocking save's time).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from shardwise.checkpoint.format.ranks import group_of, is_sharded, rows_to_write
from shardwise.checkpoint.write.save import SaveJob, _background, complete, prepare
from shardwise.engine.layout.groups import make_group
from shardwise.engine.unit.info import row_view
from shardwise.errors import ShardwiseError
from shardwise.teardown import at_exit, log

_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}  # checkpoint groups, by their global ranks
_staging: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {what: host copy}, reused
LOW_PRIORITY = 19  # the writer thread's nice value where SCHED_IDLE is refused (Note [cheap background save])


class PendingSave:
    """A checkpoint being written in the background (Note [background save])."""

    def __init__(self, job: SaveJob, group) -> None:
        self.path = job.path
        self.error: BaseException | None = None
        self.cpu_s = 0.0  # the writer thread's CPU seconds, once done (Note [cheap background save])
        self.priority = ""  # the writer's while nobody waits (lower_priority): "SCHED_IDLE", "nice 19", "normal"
        self._waited = False
        self._scheduling = threading.Lock()  # the writer's priority: set by it, restored by a waiter
        self._waited_for = self._ended = False
        self._thread = threading.Thread(target=self._run, args=(job, group), name=f"shardwise save {job.path.name}")
        self._thread.start()

    def _run(self, job: SaveJob, group) -> None:
        with self._scheduling:
            if not self._waited_for:
                self.priority = lower_priority()
        began = time.thread_time()
        try:
            complete(job, group)
        except BaseException as error:  # noqa: BLE001 - handed to wait(), on every rank
            self.error = error
        finally:
            self.cpu_s = time.thread_time() - began
            with self._scheduling:
                self._ended = True  # from here on the thread id may be another thread's

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        """Block until the checkpoint is published; return its path, or raise why it was not."""
        self._hurry()
        self._thread.join()
        self._waited = True
        if self in _background:  # its outcome is the caller's now: the next save does not raise it again
            _background.remove(self)
        if self.error is not None:
            raise ShardwiseError(f"the background save of {self.path} failed: {self.error}") from self.error
        return self.path

    def _hurry(self) -> None:
        """Someone waits for the write: it is no longer background work, so a SCHED_IDLE writer goes back
        to training's policy (Note [cheap background save]; nice 19 cannot be undone without privilege)."""
        with self._scheduling:
            self._waited_for = True
            if self.priority == "SCHED_IDLE" and not self._ended:
                try:
                    os.sched_setscheduler(self._thread.native_id, os.SCHED_OTHER, os.sched_param(0))
                except OSError:
                    pass  # refused: the write finishes at SCHED_IDLE

    def _report_at_exit(self) -> None:
        """At exit (Note [exit teardown]) Python has joined the thread; say so when the save failed
        and nobody called wait(), instead of losing the error with the process."""
        if not self._waited and self.error is not None:
            log.error("shardwise: the background save of %s failed and was never waited for: %s", self.path,
                      self.error)


def lower_priority() -> str:
    """Put the calling thread, alone, at the cheapest priority the OS allows it (Note [cheap background
    save]): SCHED_IDLE, else nice 19; say which ("normal": neither was allowed)."""
    thread = threading.get_native_id()  # Linux schedules threads: the policy and nice value are per thread
    try:
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass  # not Linux, or a kernel or seccomp policy that refuses it
    try:
        os.setpriority(os.PRIO_PROCESS, thread, LOW_PRIORITY)
        return f"nice {LOW_PRIORITY}"
    except (AttributeError, OSError):
        return "normal"  # the write runs at training's priority


def save_async(path, model: nn.Module, optim=None, scheduler=None, *,
               keep_last: int | None = None, durable: bool = True, **extra) -> PendingSave:
    """`sw.save` that returns once this rank's state is copied to host memory; the files are
    written while training goes on (Note [background save]). Same arguments as `sw.save`;
    returns a `PendingSave` (`.wait()`, `.done()`, `.path`, `.cpu_s`: the writer's CPU seconds, and
    `.priority`: the writer's scheduling, "SCHED_IDLE" where the OS allows it)."""
    job = prepare(path, model, optim, scheduler, keep_last, durable, extra)
    try:
        copied, group = _host_copy(job), _checkpoint_group(job.model)  # job.model: a sliced model's view
    except BaseException:
        if job.lock is not None:
            job.lock.release()  # its partial directory is a dead save's leftover now (Note [save ownership])
        raise
    pending = PendingSave(copied, group)
    _background.append(pending)
    _hurry_at_exit.register()
    ref = weakref.ref(pending)  # waited for and dropped: nothing to report, the closer goes with it
    at_exit(f"the background save of {pending.path}", lambda: ref() and ref()._report_at_exit(), owner=ref)
    return pending


class _hurry_at_exit:
    """At exit Python joins the writer thread before any atexit hook runs: the hook that runs before that
    join (threading's own, as concurrent.futures uses) puts a SCHED_IDLE writer back to training's policy."""

    registered = False

    @classmethod
    def register(cls) -> None:
        register = getattr(threading, "_register_atexit", None)  # CPython >= 3.9
        if cls.registered or register is None:
            return
        try:
            register(cls.hurry)
        except RuntimeError:
            return  # the interpreter is already shutting down
        cls.registered = True

    @staticmethod
    def hurry() -> None:
        for pending in list(_background):
            pending._hurry()


def _host_copy(job: SaveJob) -> SaveJob:
    """The job with every tensor it writes copied, so training may change the originals. Only the
    rows this rank writes are copied (`rows_to_write`): each copy stands for a ShardInfo of
    exactly those rows, which the writer then takes whole."""
    sharded = is_sharded(job.model)
    staging = _staging.setdefault(job.model, {})
    copier = _Copier(staging)
    infos = {}
    for name, info in job.infos.items():
        lo, hi = rows_to_write(info, job.rank, job.world, sharded)
        infos[name] = replace(info, param=copier(("param", name), row_view(info.param, info, lo, hi), info.param),
                              row_start=lo, row_end=hi)
    plans = [{**plan, "state": {name: _copy_state(copier, number, name, entry)
                                for name, entry in plan["state"].items()}} for number, plan in enumerate(job.plans)]
    buffers = {name: copier(("buffer", name), b) for name, b in job.buffers.items()}
    copier.finish()
    return replace(job, infos=infos, plans=plans, buffers=buffers)


def _copy_state(copier, number: int, name: str, entry: dict) -> dict:
    """One param's optimizer state as save._optimizer_plan gives it, with copies of the rows this rank
    writes of its param-shaped tensors and of the whole tensors it writes."""
    info, lo, hi = entry["info"], entry["lo"], entry["hi"]
    rows = {key: copier(("rows", number, name, key), row_view(t, info, lo, hi)) for key, t in entry["rows"].items()}
    whole = {key: copier(("whole", number, name, key), t) for key, t in entry["whole"].items()}
    return {**entry, "rows": rows, "whole": whole, "info": replace(info, row_start=lo, row_end=hi)}


class _Copier:
    """Copies into the model's staging tensors, reused when the shape and dtype still fit (Note [cheap
    background save]); the previous background save has finished (prepare waited for it)."""

    def __init__(self, staging: dict) -> None:
        self.staging, self.used, self.device = staging, set(), False

    def __call__(self, what, tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        tensor = tensor.detach()
        on_device = tensor.device.type != "cpu"  # any accelerator, CUDA or not (Note [group backends])
        copy = self.staging.get(what)
        if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
            # A pinned buffer for an accelerator's tensor: the device-to-host copy at full speed.
            copy = self.staging[what] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_device)
        with torch.no_grad():  # the staging copy may require grad since the last save
            copy.copy_(tensor, non_blocking=on_device)
        self.device |= on_device
        self.used.add(what)
        requires_grad = (tensor if like is None else like).requires_grad
        return copy.requires_grad_(requires_grad) if copy.is_floating_point() else copy

    def finish(self) -> None:
        if self.device:
            torch.accelerator.synchronize()  # every non_blocking copy landed before training changes the originals
        for what in set(self.staging) - self.used:
            del self.staging[what]  # a tensor this save did not have (a param frozen since): freed


def _checkpoint_group(model: nn.Module):
    group, _, world = group_of(model)
    if group is None or world == 1:
        return group
    ranks = tuple(dist.get_process_group_ranks(group))
    cached = _groups.get(ranks)
    if cached is not None:
        try:
            dist.get_process_group_ranks(cached)  # gone when the process group was made anew
        except (KeyError, ValueError, RuntimeError):
            cached = None
    if cached is None:  # every rank of the model's group gets here at the same save
        cached = _groups[ranks] = make_group(ranks, backend="gloo", local=True, what="a checkpoint group")
    return cached
