"""Where a step's time goes, per config: forward, backward and `optimizer.step()` timed apart, with
each rank's user and system CPU and minor page faults, on bench/speed/strategies.py's GPT and data.
Interleaved rounds of A/B arms: this tree against another source tree (`--against`) or against
environment variables (`--env`), so a change is measured beside what it replaces.

    python bench/overhead/phases.py --configs ddp,zero2 --rounds 3
    python bench/overhead/phases.py --configs zero2 --against /tmp/old/src           # old engine vs this one
    python bench/overhead/phases.py --configs ddp,zero2 --env MALLOC_TRIM_THRESHOLD_=68719476736
    python bench/overhead/phases.py --configs zero2 --model-args='--d-model 128 --layers 4'   # a smaller GPT

Prints a table (median over rounds of each run's median step, ms per rank) and each arm's step over
the first arm's, paired per round. Times are not asserted anywhere: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repo root, for `bench.` imports: bench/README.md
FIELDS = ("forward", "backward", "optimizer", "step", "user", "sys", "minflt")
CONFIGS = ("local", "ddp", "ddp_zero", "fsdp2", "zero1", "zero2", "zero3")  # DeepSpeed steps otherwise
WARMUP_STEPS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="ddp,zero2", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help=f"timed steps per run, after {WARMUP_STEPS} warm-up")
    p.add_argument("--against", help="a second source tree (its src/ directory) to run as arm 'against'")
    p.add_argument("--env", nargs="*", default=[], help="NAME=VALUE pairs for arm 'env'")
    p.add_argument("--model-args", default="",
                   help="bench/speed/strategies.py's model flags, e.g. --model-args='--d-model 128 --layers 2'")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)  # the worker's one config
    args = p.parse_args(argv)
    if args.worker:
        return args
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}: pick from {', '.join(CONFIGS)}")
    if min(args.rounds, args.steps, args.world_size) < 1:
        p.error("--rounds, --steps and --world-size must be at least 1")
    if args.against and not (Path(args.against) / "shardwise" / "__init__.py").is_file():
        p.error(f"--against {args.against}: no shardwise/__init__.py there; give a tree's src/ directory")
    if any("=" not in pair for pair in args.env):
        p.error(f"--env takes NAME=VALUE pairs, got {args.env}")
    return args


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import shardwise as sw
    from bench.speed import strategies

    config = args.config
    sw.init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    bench_args = strategies.parse_args(shlex.split(args.model_args))
    module, optimizer = strategies.apply_config(strategies.build_model(bench_args), config, bench_args, world_size)
    rows = slice(rank * bench_args.batch, (rank + 1) * bench_args.batch)
    records = []
    for step in range(args.steps + WARMUP_STEPS):
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
        if step >= WARMUP_STEPS:
            records.append([t1 - t0, t2 - t1, t3 - t2, t4 - t0, after.ru_utime - before.ru_utime,
                            after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt])
    mine = torch.tensor([statistics.median(column) for column in zip(*records)], dtype=torch.float64)
    dist.all_reduce(mine)  # the mean over ranks of each rank's median
    if rank == 0:
        phases = dict(zip(FIELDS, (mine / world_size).tolist()), source=sw.__file__)
        print("PHASES " + json.dumps(phases), flush=True)
    dist.destroy_process_group()


def run_arm(args, config: str, src: str, env: dict) -> dict:
    """One torchrun of `config` importing shardwise from `src`, in `env` (the arm's variables only)."""
    env = {**env, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.world_size), __file__, "--worker", "--config", config, "--steps", str(args.steps),
               f"--model-args={args.model_args}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PHASES ")]
    if done.returncode or not lines:
        raise SystemExit(f"{config} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    phases = json.loads(lines[-1][len("PHASES "):])
    if not Path(phases["source"]).resolve().is_relative_to(Path(src).resolve()):
        raise SystemExit(f"{config} imported shardwise from {phases['source']}, not from {src}")
    return phases


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from tqdm import tqdm

    this_src = str(HERE.parents[1] / "src")
    arm_env = dict(pair.split("=", 1) for pair in args.env)
    plain = {name: value for name, value in os.environ.items() if name not in arm_env}  # the others' baseline
    arms = {"this tree": (this_src, plain)}
    if args.against:
        arms["against"] = (args.against, plain)
    if args.env:
        arms["env"] = (this_src, {**plain, **arm_env})
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
        cells = [f"{statistics.median(r[f] for r in results):.0f}" if f == "minflt"
                 else f"{statistics.median(r[f] for r in results) * 1e3:.1f}" for f in FIELDS]
        ratios = [r["step"] / base["step"] for r, base in zip(results, runs[config, first])]
        print(f"| {config} | {arm} | " + " | ".join(cells)
              + f" | {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
