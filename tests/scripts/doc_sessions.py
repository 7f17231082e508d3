"""Run documentation sessions (tests/helpers/doc_blocks.py) one after another in this process.

`python doc_sessions.py SESSIONS.json RESULTS.json`, or the same under torchrun (each rank
runs every session; rank r > 0 writes RESULTS.json.r). Each session is a script file
written from its blocks; it runs as `__main__` (runpy, so a spawned child re-imports it as a
user's script would be) in a directory of its own, with what it prints captured per block.
After it: the default process group left, Accelerate's shared state cleared, the environment
and the working directory restored. One launch for many sessions saves a Python + torch
start (seconds on 2 busy cores) per session.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import time
import traceback
import warnings
from pathlib import Path

END = "\x00doctest-block-end"


def run(script: Path) -> tuple[list[str], str]:
    """Run one session's script; (what each block printed, the traceback or "")."""
    import torch.distributed as dist

    environ, cwd = dict(os.environ), os.getcwd()
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
    return captured.getvalue().split(END + "\n"), error


def main(sessions_file: str, results_file: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        results_file = f"{results_file}.{rank}"
    results = {}
    for name, script in json.loads(Path(sessions_file).read_text()).items():
        start = time.perf_counter()
        printed, error = run(Path(script))
        results[name] = {"printed": printed, "error": error, "seconds": round(time.perf_counter() - start, 1)}
        Path(results_file).write_text(json.dumps(results))  # what ran so far, should a session hang
    print(f"ran {len(results)} sessions", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
