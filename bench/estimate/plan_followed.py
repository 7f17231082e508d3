"""Benchmark: the planner's advice, followed exactly, fits the budget it was given.

    python bench/estimate/plan_followed.py         # Qwen2 (estimate/estimator_grid.py), 720 MiB per rank, ws 2 (~2 min)
    python bench/estimate/plan_followed.py --model bench/estimate/estimator_grid.py:phi --memory 740MiB
    python bench/estimate/plan_followed.py --malloc both   # also under glibc's default allocator settings

Runs `shardwise plan MODEL --memory M --world-size W --batch B --seq S --json
[--checkpoint-activations]` in a fresh process, takes the row it chooses (the first that fits:
the cheapest), then runs that row exactly (its strategy, precision, checkpointing, this batch and
seq) as bench/estimate/estimator.py's worker on W fresh gloo ranks (one thread each, the model built
eagerly, AdamW) and records each rank's peak RSS against the budget. The plan keeps its margin for the
estimator's error (`--margin`, its default unless given: Note [plan margin] in estimate/plan.py). `--malloc mmap`
(the default) runs the ranks with MALLOC_MMAP_THRESHOLD_=65536, the environment the estimate assumes and
the plan's "run:" line prints; `--malloc glibc` runs them without it, as a user launches: `sw.init()` then
sets the same threshold itself (Note [allocator at init]); `--malloc both` runs the row both ways. Either
row over the budget fails the run. The default budget is one that ddp and zero1 exceed, so the plan must
choose.
Results are appended to OUT/plan_followed.json and written as OUT/plan_followed.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # the repo root, for `bench.` imports: bench/README.md
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=f"{HERE / 'estimator_grid.py'}:qwen2", help="path/to/file.py:function")
    p.add_argument("--memory", default="720MiB", help="per-rank budget given to `shardwise plan`")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--no-checkpoint-activations", dest="recompute", action="store_false",
                   help="plan (and run) without activation checkpointing")
    p.add_argument("--margin", default=None, help="passed to `shardwise plan`, e.g. 0%% (default: the plan's own)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--malloc", choices=("mmap", "glibc", "both"), default="mmap",
                   help="run the ranks with MALLOC_MMAP_THRESHOLD_=65536 (what the plan assumes), without it (as a "
                        "user launches: sw.init() sets the same threshold), or both")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.margin is None:  # the plan's own default, recorded as a percentage
        from shardwise.estimate.plan import PLAN_MARGIN

        args.margin = f"{PLAN_MARGIN:.0%}"
    return args


def plan(args) -> tuple[dict, int]:
    """The row `shardwise plan --json` chooses (the first that fits) and the budget in bytes."""
    from shardwise.cli.estimate import parse_bytes

    cmd = [sys.executable, "-m", "shardwise.cli", "plan", args.model, "--memory", args.memory, "--world-size",
           str(args.world_size), "--batch", str(args.batch), "--seq", str(args.seq), "--margin", args.margin, "--json"]
    done = subprocess.run(cmd + ["--checkpoint-activations"] * args.recompute, capture_output=True, text=True,
                          timeout=args.timeout)
    if done.returncode:
        raise SystemExit(f"no row fits {args.memory}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    return next(r for r in rows if r["fits"]), parse_bytes(args.memory)


def follow(args, row: dict, mmap_threshold: bool = True) -> dict:
    """The chosen row run as it says, on fresh ranks: each rank's record and the peak."""
    from bench.estimate.estimator import measure_ranks

    est = row["estimate"]
    if est["offload"]:
        raise SystemExit(f"the plan chose {row['label']}: this bench does not run offload; give another budget")
    worker = ["--arch", args.model, "--strategy", est["strategy"], "--precision", est["precision"], "--batch",
              str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--eager"]
    return measure_ranks(args.world_size, worker + ["--recompute"] * args.recompute, args.timeout,
                         mmap_threshold=mmap_threshold)


def markdown(rows: list[dict]) -> str:
    lines = ["`shardwise plan` followed exactly: the chosen row (strategy, precision, checkpointing, batch) run on "
             "fresh gloo ranks, 1 thread each, fp32 AdamW masters; peak RSS per rank against the budget the plan was "
             "given, less the plan's margin for the estimator's error (Note [plan margin]; rows measured before it had "
             "none). malloc: `mmap` = MALLOC_MMAP_THRESHOLD_=65536 (what the estimate assumes, printed on the plan's "
             "`run:` line), `glibc` = launched without it, as a user launches: sw.init() sets the same threshold "
             "(Note [allocator at init]; before it, glibc's default kept freed blocks resident). Reproduce: "
             "`python bench/estimate/plan_followed.py --malloc both` (one row; `--help` for the others).", "",
             "| model | ranks | batch x seq | checkpointing | budget MiB | margin | chosen | estimated MiB | malloc "
             "| measured MiB per rank | fits |", "|---|---:|---|---|---:|---:|---|---:|---|---|---|"]
    for r in rows:
        peaks = [x["peak_rss_bytes"] for x in r["measured"]["ranks"]]
        fits = "yes" if max(peaks) <= r["budget"] else "NO"
        lines.append(f"| {r['model']} | {r['world']} | "
                     f"{r['batch']} x {r['seq']} | {'on' if r['recompute'] else 'off'} | {r['budget'] / MIB:,.0f} | "
                     f"{r.get('margin', '0%')} | "
                     f"{r['chosen']['label']} | {r['chosen']['estimate']['total'] / MIB:,.0f} | "
                     f"{r.get('malloc', 'mmap')} | "
                     f"{', '.join(f'{p / MIB:,.0f}' for p in peaks)} | {fits} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    chosen, budget = plan(args)
    print(f"the plan chooses {chosen['label']} ({chosen['estimate']['total'] / MIB:,.0f} MiB estimated)", flush=True)
    path, _, function = args.model.rpartition(":")
    shown = f"{Path(path).resolve().relative_to(ROOT)}:{function}" if Path(path).resolve().is_relative_to(ROOT) \
        else args.model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "plan_followed.json"
    rows = json.loads(store.read_text())["rows"] if store.exists() else []
    key = ("model", "world", "batch", "seq", "recompute", "budget", "malloc")  # a rerun replaces its row
    mine = []
    for malloc in (("mmap", "glibc") if args.malloc == "both" else (args.malloc,)):
        mine.append({"model": shown, "world": args.world_size, "batch": args.batch, "seq": args.seq,
                     "recompute": args.recompute, "budget": budget, "margin": args.margin, "chosen": chosen,
                     "malloc": malloc,
                     "measured": follow(args, chosen, mmap_threshold=malloc == "mmap")})
        rows = [r for r in rows if tuple(r.get(k, "mmap") for k in key) != tuple(mine[-1][k] for k in key)]
        rows.append(mine[-1])
    store.write_text(json.dumps({"rows": rows}, indent=1))
    (out / "plan_followed.md").write_text(markdown(rows))
    print((out / "plan_followed.md").read_text())
    over = [(r["malloc"], r["measured"]["peak_rss_bytes"]) for r in mine if r["measured"]["peak_rss_bytes"] > budget]
    if over:  # glibc's row too: sw.init() puts a rank launched without the variable in the same environment
        raise SystemExit(f"the followed plan peaked at {max(p for _, p in over) / MIB:,.0f} MiB, over the "
                         f"{budget / MIB:,.0f} MiB budget, in the environment the plan prints")


if __name__ == "__main__":
    main()
