"""How the benches launch ranks and write results: one torchrun per world size for the launcher/worker benches
(comm/collectives.py, comm/gather_in_place.py, comm/traffic.py, correctness/loss_curves.py: each worker writes its
rank 0's JSON to `--out`, the launcher collects them and publishes the report), a torchrun logged to a file and
stopped on a timeout (`run_logged`: speed/strategies.py, memory/, estimate/), and a process's RSS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def run_per_world_size(script: str, world_sizes: list[int], worker_args: list[str]) -> dict:
    """{world size: the JSON `script --worker --out PATH *worker_args` wrote}, with one thread per rank."""
    from tqdm import tqdm

    table = {}
    for world_size in tqdm(world_sizes, desc="world sizes"):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(world_size), script, "--worker", "--out", str(out), *worker_args]
            subprocess.run(command, check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL)
            table[world_size] = json.loads(out.read_text())
    return table


def publish(results: Path, stem: str, text: str, table: dict | None = None) -> None:
    """Write RESULTS/STEM.md (and STEM.json when `table` is given; RESULTS: the bench's own results/ folder) and
    print the report."""
    results.mkdir(exist_ok=True)
    if table is not None:
        (results / f"{stem}.json").write_text(json.dumps(table, indent=1))
    (results / f"{stem}.md").write_text(text)
    print(text)


def main_of(parse_args, run_worker, run_launcher, argv=None) -> None:
    """A launcher/worker bench's entry point: `--worker` runs one rank, else the launcher."""
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
    else:
        run_launcher(args)


def run_logged(cmd: list[str], env: dict, out_dir: str, timeout: float) -> tuple[str | None, str]:
    """Run `cmd` (torchrun) with its output in OUT_DIR/output.log; (error or None, the log).

    A file, not a pipe: a rank left behind can never block the launcher's read."""
    log = Path(out_dir, "output.log")
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=timeout)
            error = None if proc.returncode == 0 else f"exit status {proc.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
            stop(proc, out_dir)
    return error, log.read_text()


def stop(proc: subprocess.Popen, out_dir: str) -> None:
    """End a run that timed out: torchrun stops its ranks on SIGTERM; any rank still alive
    after that (torchrun starts them in their own sessions) is killed by the pid it wrote."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid_file in Path(out_dir).glob("pid*"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass


def rss_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in bytes; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
