"""Run documentation sessions (tests/helpers/doc_blocks.py) one after another in this process.

`python doc_sessions.py SESSIONS.json RESULTS.json`, or the same under torchrun (each rank
runs every session; rank r > 0 writes RESULTS.json.r). Each session is a script file
written from its blocks; it runs as `__main__` (runpy, so a spawned child re-imports it as a
user's script would be) in a directory of its own, with what it prints captured per block.
After it: the default process group left, Accelerate's shared state cleared, the environment,
the working directory and the levels of the loggers it found restored (a session that quiets a
library's logger must not quiet the next session's). What a library does once a process
(DeepSpeed says which device it guessed, the first time any session reaches it) shows in that
session only: tests/scripts/fresh_clone_trial.py runs each session as a process of its own.
Before a session, its name goes to stderr, where the libraries print, so the launch's output can
be split by session. One launch for many sessions saves a Python + torch start (seconds on 2
busy cores) per session. Under torchrun, a session that fails on one rank ends the launch: the
others could otherwise wait for that rank, in the session's collectives or the next one's
sw.init, until sw.init's timeout (10 minutes), and the launch would hang instead of failing.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import logging
import os
import runpy
import signal
import sys
import time
import traceback
import warnings
from pathlib import Path

END = "\x00doctest-block-end"
SESSION = "\x00doctest-session "  # then the session's name, on stderr before it runs


def run(script: Path) -> tuple[list[str], str]:
    """Run one session's script; (what each block printed, the traceback or "")."""
    import torch.distributed as dist

    environ, cwd, levels = dict(os.environ), os.getcwd(), logger_levels()
    captured, error = io.StringIO(), ""
    os.chdir(script.parent)
    try:
        with contextlib.redirect_stdout(captured), warnings.catch_warnings():
            runpy.run_path(str(script), run_name="__main__")
    except BaseException:  # noqa: BLE001 - SystemExit included: the session's failure is the result
        error = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if "accelerate" in sys.modules:  # a session's Accelerator(mixed_precision=...) outlives it
            from accelerate.state import AcceleratorState
            AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        for logger, level in levels.items():  # a logger born in the session keeps the level its library gave it
            logger.setLevel(level)
        release(captured)
    return captured.getvalue().split(END + "\n"), error


def logger_levels() -> dict[logging.Logger, int]:
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    return {logger: logger.level for logger in loggers if isinstance(logger, logging.Logger)}


def release(captured: io.StringIO) -> None:
    """A handler a library made while the session ran (DeepSpeed's: StreamHandler(sys.stdout)) holds the
    session's capture: point it at the real stdout, so that what it prints later is seen, not lost."""
    for logger in logger_levels():
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is captured:
                handler.setStream(sys.stdout)


def main(sessions_file: str, results_file: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a timed-out launch asks each rank for its stacks
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank:
        results_file = f"{results_file}.{rank}"
    results = {}
    for name, script in json.loads(Path(sessions_file).read_text()).items():
        sys.stdout.flush()
        print(SESSION + name, file=sys.stderr, flush=True)
        start = time.perf_counter()
        printed, error = run(Path(script))
        results[name] = {"printed": printed, "error": error, "seconds": round(time.perf_counter() - start, 1)}
        Path(results_file).write_text(json.dumps(results))  # what ran so far, should a session hang
        if error and world_size > 1:
            # The other ranks may wait in this session's collectives, or join the next session's group without
            # this rank, each until sw.init's timeout: end the launch now (torchrun stops every rank).
            print(f"rank {rank} stops the launch: session {name} failed", file=sys.stderr, flush=True)
            sys.exit(1)
    print(f"ran {len(results)} sessions", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
