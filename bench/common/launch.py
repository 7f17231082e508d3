"""One torchrun per world size for the collective micro-benchmarks (collectives.py,
gather_in_place.py): each worker writes its rank 0's JSON to `--out`, the launcher collects them
and publishes the report."""

from __future__ import annotations

import json
import os
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


def publish(stem: str, text: str, table: dict | None = None) -> None:
    """Write bench/results/STEM.md (and STEM.json when `table` is given) and print the report."""
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    if table is not None:
        (results / f"{stem}.json").write_text(json.dumps(table, indent=1))
    (results / f"{stem}.md").write_text(text)
    print(text)


def main_of(script: str, parse_args, run_worker, run_launcher, argv=None) -> None:
    """A launcher/worker bench's entry point: `--worker` runs one rank (with bench/ importable, as torchrun
    starts the script by path), else the launcher."""
    args = parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(Path(script).resolve().parent))
        run_worker(args)
    else:
        run_launcher(args)
