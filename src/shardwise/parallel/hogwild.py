"""`sw.hogwild(train_fn, model, num_procs=N)`: N processes update one shared copy of the parameters, lock-free.

Note [hogwild semantics] (Recht et al., 2011; PyTorch's mnist_hogwild example):
- The model's parameters and buffers are moved to shared memory (`model.share_memory()`)
  and every worker process holds views of the same pages. Each worker computes gradients
  on its own part of the data into its own `.grad` (gradients are per process) and writes
  its update straight into the shared parameters, with no lock and no synchronization.
- Reads may be stale or torn: a worker's forward can see a parameter that another worker is
  halfway through updating, so its gradient is for a model that never existed as a whole.
  For sparse or small updates this converges (the paper's claim); it is never equal to one
  process run on the same samples, nor reproducible from run to run.
- Optimizers: plain SGD (`p -= lr * g`, without momentum) is the safe case: its update needs
  no state. An optimizer with per-parameter state (SGD momentum, Adam's moments) built inside
  a worker keeps that state per process: each worker's moments see only its own gradients,
  which is well-defined but not Adam over all samples. Sharing the state tensors between
  processes as well (Adam's moments in shared memory) makes their read-modify-write updates
  race too, and fused/foreach kernels then mix several workers' steps: not recommended.
- Speed: N processes compete for the host's cores; `threads_per_proc` (default
  cores // N, at least 1) keeps them from oversubscribing it.

Failures: the parent watches every worker. A worker that raises has its traceback re-raised
in the parent as a `ShardwiseError`; one that dies without a word (killed, out of memory, a
segfault) is noticed from its exit code within `poll_s`; either way the other workers are
stopped and the error names the worker. Past `timeout` seconds all are stopped and the error
says so. The shared parameters keep whatever the finished updates wrote (a step interrupted
between parameters leaves those it reached updated): the model stays usable in the parent.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from torch import nn

from shardwise.engine.protocol import engine_of
from shardwise.errors import ShardwiseError

_SIGNALS = {-9: "SIGKILL: killed, e.g. by the out-of-memory killer", -11: "SIGSEGV", -15: "SIGTERM", -6: "SIGABRT"}


@dataclass(frozen=True)
class HogwildResult:
    """What `hogwild` returns: each worker's return value and the wall time of the run."""

    values: list[Any]
    seconds: float


def _worker(train_fn, rank: int, num_procs: int, model: nn.Module, args, threads: int, results) -> None:
    torch.set_num_threads(threads)
    try:
        value = train_fn(rank, num_procs, model, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def hogwild(train_fn: Callable[..., Any], model: nn.Module, *, num_procs: int, args: tuple = (),
            timeout: float | None = None, threads_per_proc: int | None = None, poll_s: float = 0.2,
            start_method: str = "spawn") -> HogwildResult:
    """Run `train_fn(rank, num_procs, model, *args)` in `num_procs` processes that share
    `model`'s parameters, each updating them without locks (Note [hogwild semantics]).

    `train_fn` must be picklable (a module-level function) and pick its own part of the data
    from `rank` and `num_procs` (e.g. `DistributedSampler(dataset, num_procs, rank)` or
    rows `rank::num_procs`), build its optimizer over `model.parameters()` (plain SGD is the
    safe choice) and train. Its return value comes back in `HogwildResult.values[rank]`.
    A worker that raises or dies stops the others and raises `ShardwiseError` here, as does
    running past `timeout` seconds. After the call `model` holds the trained parameters
    (in shared memory). `num_procs=1` runs one worker process (the reference).
    """
    if not isinstance(num_procs, int) or num_procs < 1:
        raise ShardwiseError(f"num_procs={num_procs!r} must be a positive int")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ShardwiseError("hogwild shares parameters through host shared memory: move the model to the CPU "
                             "(GPUs have no lock-free shared updates across processes here)")
    if engine_of(model) is not None:
        raise ShardwiseError("this model is sharded (sw.shard); hogwild needs a plain model, whose parameters "
                             "every process shares whole")
    threads = threads_per_proc or max(1, (os.cpu_count() or 1) // num_procs)
    model.share_memory()  # Note [hogwild semantics]: every worker maps these pages
    context = mp.get_context(start_method)
    results = context.Queue()
    workers = [context.Process(target=_worker, args=(train_fn, rank, num_procs, model, args, threads, results),
                               daemon=True, name=f"hogwild-{rank}") for rank in range(num_procs)]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    try:
        values = _collect(workers, results, started, timeout, poll_s)
    finally:
        _stop(workers)
    return HogwildResult(values, time.monotonic() - started)


def _collect(workers, results, started: float, timeout: float | None, poll_s: float) -> list[Any]:
    """Every worker's value, or a ShardwiseError for the first that raised, died or ran out of time."""
    values: dict[int, Any] = {}
    while len(values) < len(workers):
        try:
            rank, status, payload = results.get(timeout=poll_s)
        except queue.Empty:
            for rank, worker in enumerate(workers):
                if rank not in values and worker.exitcode is not None:
                    _drain_then_refuse(workers, results, values, rank)
            if timeout is not None and time.monotonic() - started > timeout:
                waiting = [rank for rank in range(len(workers)) if rank not in values]
                raise ShardwiseError(f"hogwild: worker(s) {waiting} of {len(workers)} did not finish within "
                                     f"{timeout:.0f} s; stopped all workers (the shared parameters keep the "
                                     "updates written so far)") from None
            continue
        if status == "error":
            raise ShardwiseError(f"hogwild worker {rank} of {len(workers)} raised; stopped the others "
                                 f"(the shared parameters keep the updates written so far):\n{payload}")
        values[rank] = payload
    return [values[rank] for rank in range(len(workers))]


def _drain_then_refuse(workers, results, values: dict, rank: int) -> None:
    """Worker `rank` exited without a value in the queue: its answer may still be in flight
    (it exits right after its put), so give the queue one more look before calling it dead."""
    try:
        while True:
            other, status, payload = results.get(timeout=1.0)
            if status == "error":
                raise ShardwiseError(f"hogwild worker {other} of {len(workers)} raised; stopped the others:\n"
                                     f"{payload}")
            values[other] = payload
    except queue.Empty:
        pass
    if rank in values:
        return
    code = workers[rank].exitcode
    how = _SIGNALS.get(code, f"signal {-code}" if code < 0 else "it called exit")
    raise ShardwiseError(f"hogwild worker {rank} of {len(workers)} died with exit code {code} ({how}) before "
                         "finishing; stopped the other workers. The shared parameters keep the updates written "
                         "so far; run again (with fewer processes if memory ran out)")


def _stop(workers) -> None:
    for worker in workers:
        if worker.is_alive():
            worker.terminate()
    for worker in workers:
        worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=5)
