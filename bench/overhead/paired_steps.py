"""Benchmark: zero1/zero2/zero3 against torch DDP with every arm in the same processes, stepping in turn, so
each ratio pairs steps taken seconds apart (Note [paired steps]).

    python bench/overhead/paired_steps.py                                   # bench GPT, 2 ranks, 24 rounds (9 min)
    python bench/overhead/paired_steps.py --rounds 4 --warmup 1 --d-model 64 --layers 2 --vocab 256   # quick check

Note [paired steps]: bench/speed/strategies.py launches each arm as a run of its own and pairs ratios per round of
runs, a minute apart. On this shared 2-core host the machine's speed moves by more than the arms differ
between such runs (±10% from round to round, docs/measured.md), so two runs of the same code disagree on which
arm is faster. Here each rank builds every arm (the GPT of speed/strategies.py from the same seed, each arm with its
own AdamW, DDP and the engines side by side) and the arms take one training step each in turn, in an order
rotated every round, on the same batch; a step's time is its slowest rank's, and a ratio pairs the arm's step
with DDP's of the same round. The engine-free bounds are strategies.py's (Note [engine-free bound]): DDP's step
less (N-1)/N of its optimizer step, and for zero3 one raw all-gather of the model more; then each with what gloo's
reduce-scatter and all-gather cost beyond its all-reduce (bench/speed/raw_forms.py, timed after the rounds). What
this changes against strategies.py: the arms share a process (their memory adds up; the allocator and caches
are shared), so it measures speed only; memory per strategy is strategies.py's. Writes
bench/overhead/results/NAME.{json,md,png} (`--name`, default paired_steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
import bench.speed.strategies as S  # noqa: E402
from bench.common.plot import panels, save  # noqa: E402
from bench.speed.raw_forms import raw_forms_seconds  # noqa: E402
from bench.speed.strategies_report import bound_ratio  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("ddp", "zero1", "zero2", "zero3")  # ddp first: every ratio's base; "zero3_kept" too by --arms
BOUNDS = (("bound_zero12", False, False), ("bound_zero12_forms", False, True),  # (name, zero3, gloo's forms)
          ("bound_zero3", True, False), ("bound_zero3_forms", True, True))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab", 8192), ("d-model", 512), ("layers", 8), ("heads", 8), ("seq", 128),
                          ("batch", 4)):  # strategies.py's bench GPT; batch: sequences per rank
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--rounds", type=int, default=24, help="rounds of one step per arm, after --warmup")
    p.add_argument("--warmup", type=int, default=2, help="rounds dropped")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}, zero3_kept")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the run is killed")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="paired_steps")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the folder the ranks write into
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def one_step(module, optimizer, idx, targets) -> tuple[float, float, float, float]:
    """(wall, CPU, optimizer wall, loss) of one training step, from a barrier."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    loss = module(idx, targets)
    loss.backward()
    stepping = time.perf_counter()
    optimizer.step()
    stepped = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, time.process_time() - cpu, stepped - stepping, loss.item()


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw

    torch.set_num_threads(1)  # ranks share the cores; more threads only fight each other
    sw.init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    arms = args.arms.split(",")
    built = {}
    for arm in arms:  # strategies.py's arms, each from the same seed: the same weights
        built[arm] = S.apply_config(S.build_model(args), arm, args, world_size)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    record = {arm: {"wall": [], "cpu": [], "optimizer": [], "loss": []} for arm in arms}
    from tqdm import tqdm

    for r in tqdm(range(args.warmup + args.rounds), desc="rounds", disable=rank != 0):
        idx, targets = S.global_batch(args, r, world_size)
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotated: no arm always first
            measured = one_step(*built[arm], idx[rows], targets[rows])
            for key, value in zip(("wall", "cpu", "optimizer", "loss"), measured):
                record[arm][key].append(value)
    forms = raw_forms_seconds(S.build_model(args).num_params(), world_size, repeats=9)  # Note [raw forms]
    for form, seconds in forms.items():  # the slowest rank's, as for the steps
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        forms[form] = slowest.item()
    for arm in arms:  # a step lasts as long as its slowest rank
        for key in ("wall", "optimizer"):
            times = torch.tensor(record[arm][key], dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            record[arm][key] = times.tolist()
    if rank == 0:
        Path(args.worker, "record.json").write_text(json.dumps({"arms": record, "raw_forms_s": forms}))
    dist.barrier()
    dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def _spread(values: list[float]) -> str:
    quartiles = statistics.quantiles(values, n=4)
    return (f"{statistics.median(values):.3f} (quartiles {quartiles[0]:.3f}–{quartiles[2]:.3f}, "
            f"range {min(values):.3f}–{max(values):.3f})")


def summarize(args, record: dict) -> dict:
    arms, keep = record["arms"], slice(args.warmup, None)
    ddp = {key: arms["ddp"][key][keep] for key in ("wall", "optimizer")}
    summary = {"raw_forms_s": record["raw_forms_s"], "arms": {}}
    for name, zero3, gloo_forms in BOUNDS:  # Note [engine-free bound], per round
        summary[name] = [bound_ratio(w, o, args.world_size, record["raw_forms_s"], zero3=zero3, gloo_forms=gloo_forms)
                         for o, w in zip(ddp["optimizer"], ddp["wall"])]
    for arm, data in arms.items():
        wall = data["wall"][keep]
        summary["arms"][arm] = {"step_s": wall, "cpu_s": data["cpu"][keep],
                                "x_ddp": [a / b for a, b in zip(wall, ddp["wall"])],
                                "cpu_x_ddp": [a / b for a, b in zip(data["cpu"][keep], arms["ddp"]["cpu"][keep])],
                                "max_loss_diff_vs_ddp": max(abs(a - b) for a, b in zip(data["loss"],
                                                                                       arms["ddp"]["loss"]))}
    return summary


def markdown(args, summary: dict) -> str:
    lines = [f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, batch "
             f"{args.batch}/rank, fp32 AdamW, gloo, 1 thread/rank, {args.world_size} ranks on {os.cpu_count()} cores; "
             f"every arm in the same processes, one step each per round in a rotated order, {args.rounds} rounds after "
             f"{args.warmup} dropped (Note [paired steps], bench/overhead/paired_steps.py). Step: the slowest rank's, "
             "from a barrier; × DDP: that step over DDP's step of the same round, median (quartiles, range) over "
             "rounds; CPU: rank 0's process CPU seconds in the step (gloo's threads too).", "",
             "| arm | step s | × DDP | CPU × DDP (rank 0) | max loss diff vs DDP |", "|---|---:|---:|---:|---:|"]
    for arm, row in summary["arms"].items():
        lines.append(f"| {arm} | {statistics.median(row['step_s']):.3f} | {_spread(row['x_ddp'])} | "
                     f"{statistics.median(row['cpu_x_ddp']):.3f} | {row['max_loss_diff_vs_ddp']:.1e} |")
    forms = summary["raw_forms_s"]
    lines += ["", "Engine-free bounds (Note [engine-free bound] in bench/speed/strategies.py), per round, × DDP: "
                  f"zero1/zero2 {_spread(summary['bound_zero12'])} optimizer only, "
                  f"{_spread(summary['bound_zero12_forms'])} with gloo's forms; "
                  f"zero3 {_spread(summary['bound_zero3'])} and {_spread(summary['bound_zero3_forms'])}. "
                  "The forms, timed once after the rounds with no engine around them, slowest rank, median of 9 "
                  "(Note [raw forms], bench/speed/raw_forms.py): DDP's bucketed all-reduce "
                  f"{forms['all_reduce'] * 1e3:.1f} ms, "
                  f"the engine's reduce-scatter {forms['reduce'] * 1e3:.1f} ms and all-gather "
                  f"{forms['gather'] * 1e3:.1f} ms."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    fig, ((ax,),) = panels(cols=1)
    for arm, row in summary["arms"].items():
        if arm != "ddp":
            median = statistics.median(row["x_ddp"])
            ax.plot(row["x_ddp"], marker="o", linestyle="-", label=f"{arm} (median {median:.3f})")
    for key, style in (("bound_zero12_forms", ":"), ("bound_zero3_forms", "--")):
        ax.axhline(statistics.median(summary[key]), color="grey", linestyle=style, label=key.replace("_", " "))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("round (one step per arm)")
    ax.set_ylabel("step time × DDP's, same round")
    ax.legend(fontsize=8)
    save(fig, path, "Paired steps: each arm's step over DDP's of the same round")


def run_launcher(args) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
            __file__] + [a for a in sys.argv[1:]]
    with tempfile.TemporaryDirectory() as out_dir:
        started = time.time()
        done = subprocess.run(argv + ["--worker", out_dir], env=dict(os.environ, OMP_NUM_THREADS="1"),
                              timeout=args.timeout)
        if done.returncode:
            sys.exit(f"the ranks failed (exit status {done.returncode})")
        record = json.loads(Path(out_dir, "record.json").read_text())
    summary = summarize(args, record)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "wall_s": time.time() - started}
    settings = {k: v for k, v in vars(args).items() if k != "worker"}
    (out / f"{args.name}.json").write_text(json.dumps({"settings": settings, "meta": meta, "record": record,
                                                       "summary": summary}, indent=1))
    table = markdown(args, summary)
    (out / f"{args.name}.md").write_text(table)
    plot(summary, out / f"{args.name}.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
