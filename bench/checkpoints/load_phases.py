"""Where `sw.load`'s CPU goes, per phase, on bench/checkpoints/checkpoint.py's load (29.5M GPT, zero3, 2 ranks,
AdamW: 354 MB of model state, loaded in place from the page cache the save filled). Each phase's
thread CPU time, not wall time, so that a busy host can still compare two trees: this tree against
another source tree (`--against`), in interleaved rounds.

    python bench/checkpoints/load_phases.py                                   # this tree, 3 rounds of 12 loads
    python bench/checkpoints/load_phases.py --against /tmp/old/src            # and another tree's src/, interleaved

Phases (the functions of checkpoint/read/load.py, load_plan.py, sources.py and mapped.py they time):
open = open_source (index.json read, parsed and checked; the rank files listed); verify = every
chunk's crc32 over the file's map (Source.verify; crc = the crc32 calls themselves); plan = the rest
of plan_load (names, optimizer groups, settings, RNG); apply = the copies from the map into the model
and its optimizer state (_write_tensors; copy = MappedFile.copy_into); agree = the three agreements'
all-gathers; whole = the sw.load call. Per arm: the minimum over every load of every round (the
load least disturbed by the host's other work), then the median, seconds, the busier rank. Prints a
table; times are not asserted anywhere.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("open", "verify", "crc", "plan", "apply", "copy", "agree", "whole")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loads", type=int, default=12, help="loads per run, after 2 warm-up loads")
    p.add_argument("--against", help="a second source tree (its src/ directory) to run as arm 'against'")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.against and not (Path(args.against) / "shardwise" / "__init__.py").is_file():
        p.error(f"--against {args.against}: no shardwise/__init__.py there; give a tree's src/ directory")
    return args


def _timed(spent: dict, phase: str, fn):
    def timed(*args, **kwargs):
        began = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[phase] = spent.get(phase, 0.0) + time.thread_time() - began
    return timed


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    sw.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8))
    sw.shard(model, strategy="zero3", units=Block)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(8192, (2, 129), generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    path = Path(args.scratch) / "checkpoint"
    sw.save(path, model, optim)

    load = importlib.import_module("shardwise.checkpoint.read.load")  # the module: sw.load is the function
    sources = importlib.import_module("shardwise.checkpoint.read.sources")
    mapped = importlib.import_module("shardwise.checkpoint.read.mapped")
    spent: dict[str, float] = {}
    load.open_source = _timed(spent, "open", load.open_source)
    load.plan_load = _timed(spent, "plan", load.plan_load)  # verify's time is taken out below
    sources.CheckpointDir.verify = _timed(spent, "verify", sources.CheckpointDir.verify)
    mapped.crc32 = _timed(spent, "crc", mapped.crc32)
    load._write_tensors = _timed(spent, "apply", load._write_tensors)
    reader = importlib.import_module("shardwise.checkpoint.read.reader")
    reader.FileReader._read_checked = _timed(spent, "copy", reader.FileReader._read_checked)  # pread + crc
    load.all_gather_object = _timed(spent, "agree", load.all_gather_object)
    loads = []
    for number in range(args.loads + 2):
        spent.clear()
        dist.barrier()
        began = time.thread_time()
        sw.load(path, model, optim)
        spent["whole"] = time.thread_time() - began
        spent["plan"] -= spent.get("verify", 0.0)
        if number >= 2:
            loads.append([spent.get(phase, 0.0) for phase in PHASES])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, loads)
    if rank == 0:
        print("LOADS " + json.dumps({"loads": every, "source": sw.__file__}), flush=True)
    dist.destroy_process_group()


def run_arm(args, src: str) -> list:
    """One torchrun importing shardwise from `src`: per rank, per load, each phase's CPU seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   __file__, "--worker", "--scratch", scratch, "--loads", str(args.loads)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        shutil.rmtree(scratch, ignore_errors=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("LOADS ")]
    if done.returncode or not lines:
        raise SystemExit(f"a run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(lines[-1][len("LOADS "):])
    if not Path(record["source"]).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"the run imported shardwise from {record['source']}, not from {src}")
    return record["loads"]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    arms = {"this tree": str(HERE.parents[1] / "src")}
    if args.against:
        arms["against"] = args.against
    runs: dict[str, list] = {arm: [] for arm in arms}
    for round_number in range(args.rounds):  # interleaved: every arm once per round
        for arm, src in arms.items():
            runs[arm].append(run_arm(args, src))
            print(f"round {round_number + 1}/{args.rounds}: {arm} done", file=sys.stderr)
    print(f"sw.load of 354 MB (zero3, 2 ranks), thread CPU ms per load, min / median over {args.rounds} rounds "
          f"x {args.loads} loads, the busier rank\n")
    print("| arm | " + " | ".join(PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for arm, rounds in runs.items():
        ranks = list(zip(*rounds))  # per rank: its loads of every round
        cells = []
        for index in range(len(PHASES)):
            per_rank = [[load[index] for run in rank_runs for load in run] for rank_runs in ranks]
            low = max(min(values) for values in per_rank)
            middle = max(statistics.median(values) for values in per_rank)
            cells.append(f"{low * 1e3:.1f} / {middle * 1e3:.1f}")
        print(f"| {arm} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
