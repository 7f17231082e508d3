"""Benchmark: Muon's step on the zoo GPT, whole-tensor owner shape against DTensor `Shard(0)`,
beside AdamW on rows, at world sizes 2 and 4 (Note [whole-tensor step], engine/optim/whole_step.py).

    python bench/whole_tensor/whole_tensor.py                                        # bench GPT (29.5M), ws 2 and 4
    python bench/whole_tensor/whole_tensor.py --d-model 64 --layers 2 --vocab 256 --rounds 1 --steps 2   # quick check
    python bench/whole_tensor/whole_tensor.py --vocab 4096 --d-model 256 --layers 4 --seq 64 --batch 2 \
        --only zero2_adamw,zero2_muon,zero3_muon,one_muon,ddp_muon          # issue 33's figures, bounded
    python bench/whole_tensor/whole_tensor.py --vocab 4096 --d-model 1024 --layers 2 --seq 64 --batch 2 --steps 2 \
        --only zero2_adamw,zero2_muon,zero3_muon,one_muon --newton-schulz float32 --name whole_tensor_d1024
        # a host without a fast bf16 matmul (newton_schulz.py); its floor: owner_bound.py beside it, same flags

Arms: shardwise zero2/zero3 with AdamW (rows, the fast path) and with Muon on 2-D parameters + AdamW
(the owner shape, inside optimizer.step()); the same optimizers on `Shard(0)` DTensor parameters (step
only, on fixed random gradients); one process stepping the same optimizers on the whole global batch (rank
0 alone) and ddp (Moonlight's redundant shape: every rank runs Newton-Schulz on every matrix). Timed:
optimizer.step() after a real forward/backward, and the whole step. A round launches each world size once
(torch.distributed.run, gloo, 1 thread/rank), its ranks running every arm in a rotated order; medians
over rounds, per-round ranges, ratios to zero2 AdamW paired per round. Issue 33's targets, per round
paired: the Muon+AdamW step's wall time over one process's and the redundant shape's (ws 2), the busiest
rank's CPU seconds in the step over one process's (ws 4: four ranks on two cores), and the bytes the most
receiving rank gets per training step (counted at torch.distributed's calls: shardwise.testing.count_received)
over AdamW zero2's. A parity job compares 3 steps on fixed gradients with one process on whole tensors.
The arms, one rank's side, are in bench/whole_tensor/whole_tensor_arms.py.
Writes bench/whole_tensor/results/whole_tensor.{json,md,png} (`--name NAME`: NAME.{json,md,png}, as
whole_tensor_d1024 and whole_tensor_all2d; bench/README.md says which file answers which question); `--worker`
(set by the launcher) makes it one rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.whole_tensor import newton_schulz  # noqa: E402
from bench.whole_tensor.whole_tensor_arms import PHASES, parity_job, time_arm  # noqa: E402

ARMS = ("zero2_adamw", "zero2_muon", "zero3_adamw", "zero3_muon", "dtensor_adamw", "dtensor_muon", "one_muon",
        "ddp_muon")
LABELS = {"zero2_adamw": "shardwise zero2, AdamW (rows)", "zero2_muon": "shardwise zero2, Muon+AdamW (owner)",
          "zero3_adamw": "shardwise zero3, AdamW (rows)", "zero3_muon": "shardwise zero3, Muon+AdamW (owner)",
          "dtensor_adamw": "DTensor Shard(0), AdamW", "dtensor_muon": "DTensor Shard(0), Muon+AdamW",
          # issue 33's anchors: the whole global batch and step in one process (rank 0; the others wait at
          # the barriers), and Moonlight's redundant shape (ddp: every rank runs Newton-Schulz on every matrix)
          "one_muon": "one process, Muon+AdamW (global batch)", "ddp_muon": "ddp, Muon+AdamW (redundant)"}
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab", 8192), ("d-model", 512), ("layers", 8), ("heads", 8), ("seq", 128),
                          ("batch", 4)):  # the bench GPT of bench/speed/strategies.py; batch: sequences per rank
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm per round (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--only", default=",".join(ARMS),
                   help="the arms to run, comma-separated (zero2_adamw, the ratios' base, always runs)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW's")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--muon-on", choices=("hidden", "all-2d"), default="hidden",
                   help="hidden: the blocks' 2-D matrices, the standard recipe (default); all-2d: every 2-D "
                        "parameter, the tied embedding/head and pos_emb included")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--newton-schulz", choices=newton_schulz.CHOICES, default="bfloat16",
                   help="Muon's Newton-Schulz dtype: bfloat16 (torch's own), or float32 on a host without a fast "
                        "bf16 matmul (bench/whole_tensor/newton_schulz.py); pass the same to owner_bound.py beside it")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before one launch is killed")
    p.add_argument("--out", default=str(RESULTS), help="folder of the results (default bench/whole_tensor/results)")
    p.add_argument("--name", default="whole_tensor",
                   help="file name stem: writes OUT/NAME.{json,md,png}; one name per question, bench/README.md")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # "timing" or "parity"
    p.add_argument("--arms", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def run_worker(args) -> None:
    Path(args.out_dir, f"pid{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))  # for a kill on timeout
    torch.set_num_threads(1)  # ranks share 2 cores; more threads only fight each other
    newton_schulz.use(args.newton_schulz)
    sw.init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    if args.worker == "parity":
        record = parity_job(args, rank, mesh)
    else:
        record = {arm: time_arm(arm, args, world_size, rank, mesh) for arm in args.arms.split(",")}
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def launch(args, job: str, world_size: int, arms: list[str]) -> dict:
    """One torchrun of `job` at `world_size`; the per-rank records, or the error and the log's tail."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
            __file__, "--worker", job, "--arms", ",".join(arms)]
    for flag in ("vocab", "d_model", "layers", "heads", "seq", "batch", "steps", "warmup", "seed", "lr",
                 "muon_lr", "muon_on", "weight_decay", "newton_schulz"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out_dir:
        log = Path(out_dir, "output.log")  # a file, not a pipe: a rank left behind cannot block a read
        with open(log, "w") as sink:
            proc = subprocess.Popen(argv + ["--out-dir", out_dir], env=env, stdout=sink, stderr=subprocess.STDOUT)
            try:
                error = None if proc.wait(timeout=args.timeout) == 0 else f"exit status {proc.returncode}"
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.timeout:.0f} s"
                proc.terminate()
                proc.wait()
                for pid_file in Path(out_dir).glob("pid*"):  # ranks torchrun left alive
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        if error:
            return {"error": error, "log_tail": log.read_text()[-3000:]}
        return {"ranks": [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]}


def median_over_steps(ranks: list[dict], arm: str, key: str, warmup: int) -> float | None:
    """Median over timed steps of the slowest (busiest, most receiving) rank's value (a step lasts as long as
    its slowest rank)."""
    if ranks[0][arm].get(key) is None:
        return None
    per_step = [max(r[arm][key][i] for r in ranks) for i in range(len(ranks[0][arm][key]))]
    return statistics.median(per_step[warmup:])


def phase_medians(ranks: list[dict], arm: str, warmup: int) -> dict | None:
    """Muon's gather / compute / broadcast / AdamW, each the median over steps of its max over ranks."""
    if ranks[0][arm]["phases"] is None:
        return None
    ranks = [r for r in ranks if r[arm]["phases"]]  # one_muon: rank 0 alone steps
    steps = range(warmup, len(ranks[0][arm]["phases"]))
    return {name: statistics.median(max(r[arm]["phases"][i][j] for r in ranks) for i in steps)
            for j, name in enumerate(PHASES)}


def chosen_arms(args) -> list[str]:
    """`--only`'s arms in ARMS order, zero2_adamw among them (every ratio's base)."""
    wanted = set(args.only.split(",")) | {"zero2_adamw"}
    unknown = wanted - set(ARMS)
    if unknown:
        sys.exit(f"--only: unknown arms {sorted(unknown)}; the arms are {', '.join(ARMS)}")
    return [arm for arm in ARMS if arm in wanted]


def _paired(values: list, bases: list) -> float | None:
    """The median over rounds of value / base, each round's pair (None where either is missing)."""
    pairs = [a / b for a, b in zip(values, bases) if a is not None and b]
    return statistics.median(pairs) if pairs else None


def targets(args, per_round: list, arm: str) -> dict:
    """Issue 33's figures for one arm: its step's wall time over one process's and the redundant shape's,
    the busiest rank's CPU seconds in the step (process and thread) over one process's, bytes received by
    the most receiving rank per step (the full step, and optimizer.step() alone) over AdamW zero2's."""
    def per(key, of=arm):
        if of not in per_round[0][0]:  # an arm --only left out
            return [None] * len(per_round)
        return [median_over_steps(ranks, of, key, args.warmup) for ranks in per_round]

    step, cpu, thread, sent = per("step_s"), per("process_s"), per("thread_s"), per("bytes_full")
    return {"round_process_s": cpu, "round_thread_s": thread, "round_bytes_full": sent,
            "round_bytes_step": per("bytes_step"),
            "x_one_wall": _paired(step, per("step_s", "one_muon")),
            "x_redundant_wall": _paired(step, per("step_s", "ddp_muon")),
            "cpu_x_one": _paired(cpu, per("process_s", "one_muon")),
            "thread_x_one": _paired(thread, per("thread_s", "one_muon")),
            "bytes_x_adamw": _paired(sent, per("bytes_full", "zero2_adamw"))}


def summarize(args, rounds: dict, world_sizes: list[int]) -> list[dict]:
    rows = []
    for ws in world_sizes:
        per_round = [rounds[(r, ws)]["ranks"] for r in range(args.rounds)]
        base = [median_over_steps(ranks, "zero2_adamw", "step_s", args.warmup) for ranks in per_round]
        base_full = [median_over_steps(ranks, "zero2_adamw", "full_s", args.warmup) for ranks in per_round]
        for arm in chosen_arms(args):
            step = [median_over_steps(ranks, arm, "step_s", args.warmup) for ranks in per_round]
            full = [median_over_steps(ranks, arm, "full_s", args.warmup) for ranks in per_round]
            row = {"arm": arm, "label": LABELS[arm], "world_size": ws, "round_step_s": step,
                   "median_step_s": statistics.median(step), "round_full_s": full,
                   "x_adamw_rows": statistics.median(a / b for a, b in zip(step, base)),
                   "phases_by_round": [phase_medians(ranks, arm, args.warmup) for ranks in per_round]}
            if full[0] is not None:
                row["median_full_s"] = statistics.median(full)
                row["full_x_adamw_rows"] = statistics.median(a / b for a, b in zip(full, base_full))
            row.update(targets(args, per_round, arm))
            rows.append(row)
    return rows


def parity_text(entry: dict | None) -> str:
    if entry is None:  # the parity job runs the owner shape under zero2 only
        return "(see zero2)"
    if "error" in entry:
        return f"raises {entry['error'][:100]}"
    return "bitwise" if entry["bitwise"] else f"{entry['max_abs_diff']:.1e} ({entry['worst_param']})"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _mb(values: list) -> str:
    return "—" if values[0] is None else f"{statistics.median(values) / 2**20:.2f}"


def markdown(args, rows: list[dict], parity: dict, world_sizes: list[int]) -> str:
    def rng(values):
        return f"{min(values):.3f}–{max(values):.3f}"

    recipe = ("the blocks' 2-D matrices (the standard recipe), AdamW on the embeddings, the tied head and every "
              "1-D parameter" if args.muon_on == "hidden" else
              "every 2-D parameter (tied embedding/head and pos_emb included), AdamW on the rest")
    lines = [
        f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, batch "
        f"{args.batch}/rank; gloo on loopback, 1 thread/rank, {os.cpu_count()} CPU cores. Muon (lr {args.muon_lr}, "
        f"torch.optim.Muon, Newton–Schulz in {args.newton_schulz}) on {recipe}. Step s: optimizer.step() only, "
        f"slowest rank, median of {args.steps} steps after {args.warmup} warm-up per round, then median over "
        f"{args.rounds} interleaved rounds (range: per-round medians). × AdamW rows: per-round ratio to shardwise "
        "zero2 AdamW, median. Full step: forward+backward+step. zero2's re-gather of updated rows runs at the next "
        "forward, so it is in full step, not in step s. The machine's load moves absolute numbers: read the paired "
        "ratios. Parity: 3 steps on fixed random gradients, max |param − one process stepping whole tensors| (owner "
        "shape = shardwise zero2; worst parameter in brackets)."]
    for ws in world_sizes:
        lines += ["", f"### world size {ws}", "",
                  "| arm | median step s | range | × AdamW rows | full step s | full × AdamW rows | parity |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        for r in (r for r in rows if r["world_size"] == ws):
            full = (f"{r['median_full_s']:.3f} | {r['full_x_adamw_rows']:.2f}" if "median_full_s" in r
                    else "— | —")
            shape, kind = r["arm"].split("_")
            entry = parity[ws].get(f"{'dtensor' if shape == 'dtensor' else 'owner'}_{kind}")
            entry = "—" if shape in ("one", "ddp") else parity_text(entry if shape != "zero3" else None)
            lines.append(f"| {r['label']} | {r['median_step_s']:.3f} | {rng(r['round_step_s'])} | "
                         f"{r['x_adamw_rows']:.2f} | {full} | {entry} |")
        lines += ["", "Issue 33's targets (per-round pairs, median over rounds; CPU: the busiest rank's CPU seconds in "
                  "optimizer.step(), the process (gloo's threads too) and the stepping thread; bytes: received by "
                  "the most receiving rank in one training step, counted at torch.distributed's calls, and in "
                  "optimizer.step() alone; DDP's C++ reducer and DTensor are not counted):", "",
                  "| arm | step × one process | step × redundant | CPU s (process) | range | CPU × one process "
                  "(thread) | MB/step | MB in step | × AdamW zero2 bytes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["world_size"] == ws and r["arm"].split("_")[0] in ("zero2", "zero3", "one")):
            lines.append(f"| {r['label']} | {_x(r['x_one_wall'])} | {_x(r['x_redundant_wall'])} | "
                         f"{statistics.median(r['round_process_s']):.3f} | {rng(r['round_process_s'])} | "
                         f"{_x(r['cpu_x_one'])} ({_x(r['thread_x_one'])}) | {_mb(r['round_bytes_full'])} | "
                         f"{_mb(r['round_bytes_step'])} | {_x(r['bytes_x_adamw'])} |")
        lines += ["", f"Parity at ws {ws}, all entries: " + "; ".join(
            f"{key.replace('_', ' ')}: {parity_text(entry)}" for key, entry in parity[ws].items()) + ".",
                  "", "Where the Muon+AdamW step's time goes (s; median over rounds of each phase's median, "
                  "max over ranks; broadcast includes waiting for the most loaded owner):", "",
                  "| arm | gather | Muon compute | broadcast + write-back | AdamW |", "|---|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["world_size"] == ws and r["arm"].endswith("muon")):
            cells = [statistics.median(p[name] for p in r["phases_by_round"]) for name in PHASES]
            lines.append(f"| {r['label']} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], world_sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(world_sizes), figsize=(7 * len(world_sizes), 4.5), squeeze=False)
    for ax, ws in zip(axes[0], world_sizes):
        group = [r for r in rows if r["world_size"] == ws]
        x = list(range(len(group)))
        for offset, key, label in ((-0.2, "round_step_s", "optimizer.step()"), (0.2, "round_full_s", "full step")):
            have = [(i, r[key]) for i, r in zip(x, group) if r[key][0] is not None]
            mids = [statistics.median(v) for _, v in have]
            err = [[m - min(v) for m, (_, v) in zip(mids, have)], [max(v) - m for m, (_, v) in zip(mids, have)]]
            ax.bar([i + offset for i, _ in have], mids, 0.4, yerr=err, capsize=3, label=label)
        ax.set_xticks(x)
        ax.set_xticklabels([r["arm"] for r in group], rotation=25)
        ax.set_title(f"ws={ws}: median over rounds (s), bars = per-round range")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_launcher(args) -> None:
    from tqdm import tqdm

    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    jobs = [("parity", ws, -1) for ws in world_sizes]
    jobs += [("timing", ws, r) for r in range(args.rounds) for ws in world_sizes]
    results, started = {}, time.time()
    for job, ws, r in tqdm(jobs, desc="launches", unit="launch"):
        arms = chosen_arms(args)
        arms = arms[r % len(arms):] + arms[:r % len(arms)]  # rotated: no arm always runs first
        tqdm.write(f"ws={ws} {job}" + (f" round {r + 1}: {','.join(arms)}" if job == "timing" else ""))
        results[(r, ws)] = result = launch(args, job, ws, arms)
        if "error" in result:
            sys.exit(f"ws={ws} {job} failed: {result['error']}\n{result['log_tail']}")
    parity = {ws: results[(-1, ws)]["ranks"][0] for ws in world_sizes}
    rows = summarize(args, results, world_sizes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "arms", "out_dir")}
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "wall_s": time.time() - started}
    raw = {f"ws{ws}_round{r}": res["ranks"] for (r, ws), res in results.items() if r >= 0}
    (out / f"{args.name}.json").write_text(json.dumps({"settings": settings, "meta": meta, "parity": parity,
                                                       "rows": rows, "raw": raw}, indent=1))
    table = markdown(args, rows, parity, world_sizes)
    (out / f"{args.name}.md").write_text(table)
    plot(rows, world_sizes, out / f"{args.name}.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
