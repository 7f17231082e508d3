"""Where a step's time goes, per config: forward, backward and `optimizer.step()` timed apart, with
each rank's user and system CPU and minor page faults, on bench/strategies.py's GPT and data.
Interleaved rounds of A/B arms: this tree against another source tree (`--against`) or against
environment variables (`--env`), so a change is measured beside what it replaces.

    python bench/phases.py --configs ddp,zero2 --rounds 3
    python bench/phases.py --configs zero2 --against /tmp/old/src           # old engine vs this one
    python bench/phases.py --configs ddp,zero2 --env MALLOC_TRIM_THRESHOLD_=68719476736

Prints a table (median over rounds of each run's median step, ms per rank) and each arm's step over
the first arm's, paired per round. Times are not asserted anywhere: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIELDS = ("forward", "backward", "optimizer", "step", "user", "sys", "minflt")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="ddp,zero2", help="bench/strategies.py's config names, comma-separated")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="timed steps per run, after 2 warm-up steps")
    p.add_argument("--against", help="a second source tree (its src/ directory) to run as arm 'against'")
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE pairs for arm 'env'")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    import shardwise as sw
    import strategies

    config = args.configs
    sw.init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    bench_args = strategies.parse_args([])
    module, optimizer = strategies.apply_config(strategies.build_model(bench_args), config, bench_args, world_size)
    rows = slice(rank * bench_args.batch, (rank + 1) * bench_args.batch)
    records = []
    for step in range(args.steps + 2):
        tokens, targets = (t[rows] for t in strategies.global_batch(bench_args, step, world_size))
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        loss = module(tokens, targets)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        t4, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        if step >= 2:
            records.append([t1 - t0, t2 - t1, t3 - t2, t4 - t0, after.ru_utime - before.ru_utime,
                            after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt])
    mine = torch.tensor([statistics.median(column) for column in zip(*records)], dtype=torch.float64)
    dist.all_reduce(mine)  # the mean over ranks of each rank's median
    if rank == 0:
        print("PHASES " + json.dumps(dict(zip(FIELDS, (mine / world_size).tolist()))), flush=True)
    dist.destroy_process_group()


def run_arm(args, config: str, src: str | None, extra_env: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra_env}
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.world_size), __file__, "--worker", "--configs", config, "--steps", str(args.steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PHASES ")]
    if done.returncode or not lines:
        raise SystemExit(f"{config} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("PHASES "):])


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from tqdm import tqdm

    arms = {"this tree": (None, {})}
    if args.against:
        arms["against"] = (args.against, {})
    if args.env:
        arms["env"] = (None, dict(pair.split("=", 1) for pair in args.env))
    configs = args.configs.split(",")
    runs = {(config, arm): [] for config in configs for arm in arms}
    with tqdm(total=args.rounds * len(runs), desc="runs") as bar:
        for _ in range(args.rounds):  # interleaved: every arm of every config once per round
            for config in configs:
                for arm, (src, env) in arms.items():
                    runs[config, arm].append(run_arm(args, config, src, env))
                    bar.update()
    first = next(iter(arms))
    print(f"ws {args.world_size}, median of {args.rounds} interleaved rounds, ms per step per rank "
          f"(minflt: faults per step)\n")
    print("| config | arm | " + " | ".join(FIELDS) + f" | step ÷ {first} (range) |")
    print("|---|---|" + "---:|" * (len(FIELDS) + 1))
    for (config, arm), results in runs.items():
        cells = [statistics.median(r[f] for r in results) * (1 if f == "minflt" else 1e3) for f in FIELDS]
        ratios = [r["step"] / base["step"] for r, base in zip(results, runs[config, first])]
        print(f"| {config} | {arm} | " + " | ".join(f"{c:.0f}" if i == 6 else f"{c:.1f}" for i, c in enumerate(cells))
              + f" | {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
