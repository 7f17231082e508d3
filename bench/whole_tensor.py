"""Benchmark: Muon's step on the zoo GPT, whole-tensor owner shape against DTensor `Shard(0)`,
beside AdamW on rows, at world sizes 2 and 4 (Note [whole-tensor step], engine/whole_step.py).

    python bench/whole_tensor.py                                        # bench GPT (29.5M), ws 2 and 4
    python bench/whole_tensor.py --d-model 64 --layers 2 --vocab 256 --rounds 1 --steps 2   # quick check

Arms: shardwise zero2/zero3 with AdamW (rows, the fast path) and with Muon on 2-D parameters + AdamW
(the owner shape, inside optimizer.step()); the same optimizers on `Shard(0)` DTensor parameters (step
only, on fixed random gradients); one process stepping the same optimizers on the whole global batch (rank
0 alone) and ddp (Moonlight's redundant shape: every rank runs Newton-Schulz on every matrix). Timed:
optimizer.step() after a real forward/backward, and the whole step. A round launches each world size once
(torch.distributed.run, gloo, 1 thread/rank), its ranks running every arm in a rotated order; medians
over rounds, per-round ranges, ratios to zero2 AdamW paired per round. A parity job compares 3 steps on
fixed gradients with one process on whole tensors.
Writes bench/results/whole_tensor.{json,md,png}; `--worker` (set by the launcher) makes it one rank.
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
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise as sw
from shardwise.models.gpt import GPT, Block, GPTConfig

ARMS = ("zero2_adamw", "zero2_muon", "zero3_adamw", "zero3_muon", "dtensor_adamw", "dtensor_muon", "one_muon",
        "ddp_muon")
LABELS = {"zero2_adamw": "shardwise zero2, AdamW (rows)", "zero2_muon": "shardwise zero2, Muon+AdamW (owner)",
          "zero3_adamw": "shardwise zero3, AdamW (rows)", "zero3_muon": "shardwise zero3, Muon+AdamW (owner)",
          "dtensor_adamw": "DTensor Shard(0), AdamW", "dtensor_muon": "DTensor Shard(0), Muon+AdamW",
          # issue 33's anchors: the whole global batch and step in one process (rank 0; the others wait at
          # the barriers), and Moonlight's redundant shape (ddp: every rank runs Newton-Schulz on every matrix)
          "one_muon": "one process, Muon+AdamW (global batch)", "ddp_muon": "ddp, Muon+AdamW (redundant)"}
PARITY = ("adamw", "muon", "adafactor")  # each under the owner shape (shardwise zero2) and DTensor
PHASES = ("gather", "muon_compute", "broadcast_writeback", "adamw")  # MuonAdamW's clock
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab", 8192), ("d-model", 512), ("layers", 8), ("heads", 8), ("seq", 128),
                          ("batch", 4)):  # the bench GPT of bench/strategies.py; batch: sequences per rank
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm per round (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW's")
    p.add_argument("--muon-lr", type=float, default=0.02)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds before one launch is killed")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", help=argparse.SUPPRESS)  # "timing" or "parity"
    p.add_argument("--arms", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def build_model(args):
    torch.manual_seed(args.seed)  # every arm, rank and the reference start from the same weights
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                         n_layers=args.layers, n_heads=args.heads))


class MuonAdamW:
    """Muon for 2-D parameters, AdamW for the rest (torch's Muon docs), with a clock on each phase.

    The whole-tensor step's gathers run in torch's global pre-hooks and its broadcasts in the global
    post-hooks; torch runs an instance's own pre-hooks after the global ones and its post-hooks before
    them, so the marks below split Muon's step into gather | compute | broadcast and write-back."""

    def __init__(self, params, args):
        params = list(params)
        self.muon = torch.optim.Muon([p for p in params if p.dim() == 2], lr=args.muon_lr,
                                     weight_decay=args.weight_decay)
        self.adamw = torch.optim.AdamW([p for p in params if p.dim() != 2], lr=args.lr,
                                       weight_decay=args.weight_decay)
        self.marks: list[float] = []
        self.muon.register_step_pre_hook(lambda *_: self.marks.append(time.perf_counter()))
        self.muon.register_step_post_hook(lambda *_: self.marks.append(time.perf_counter()))
        self.phases: list[list[float]] = []  # per step: gather, compute, broadcast, adamw

    def step(self):
        self.marks = [time.perf_counter()]
        self.muon.step()
        self.marks.append(time.perf_counter())
        self.adamw.step()
        self.marks.append(time.perf_counter())
        self.phases.append([b - a for a, b in zip(self.marks, self.marks[1:])])

    def zero_grad(self, set_to_none=True):
        for optimizer in (self.muon, self.adamw):
            optimizer.zero_grad(set_to_none=set_to_none)


def make_optimizer(params, kind: str, args):
    if kind == "muon":
        return MuonAdamW(params, args)
    if kind == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)


def whole_grads(shapes: dict, args, step: int) -> dict[str, torch.Tensor]:
    """Fixed random gradients of the whole shapes, by name: the same on every rank and in every arm."""
    gen = torch.Generator().manual_seed(args.seed * 1_000 + step)
    return {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in shapes.items()}


def shard0(tensors: dict, mesh) -> dict:
    """Each tensor as a `Shard(0)` DTensor; every rank holds the same whole value, so no scatter."""
    return {name: distribute_tensor(t.detach(), mesh, [Shard(0)], src_data_rank=None) for name, t in tensors.items()}


def to_dtensors(model, mesh) -> dict:
    """The model's parameters as `Shard(0)` DTensor Parameters, by name (the tied weight once)."""
    return {name: torch.nn.Parameter(d) for name, d in shard0(dict(model.named_parameters()), mesh).items()}


def set_dtensor_grads(params: dict, grads: dict, mesh) -> None:
    for name, g in shard0(grads, mesh).items():
        params[name].grad = g


def time_arm(arm: str, args, world_size: int, rank: int, mesh) -> dict:
    """Per-step times of one arm on this rank: optimizer.step(), the full step, Muon's phases."""
    shape, kind = arm.split("_")
    model = build_model(args)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if shape == "ddp":
        sw.shard(model, strategy="ddp")
    elif shape in ("zero2", "zero3"):
        sw.shard(model, strategy=shape, units=Block)  # the optimizer is built after: it sees shards
    params = to_dtensors(model, mesh) if shape == "dtensor" else dict(model.named_parameters())
    optimizer = make_optimizer(list(params.values()), kind, args)
    alone = shape == "one"  # rank 0 alone, on the whole global batch
    step_s, full_s = [], []
    for step in range(args.warmup + args.steps):
        if shape == "dtensor":
            set_dtensor_grads(params, whole_grads(shapes, args, step), mesh)
        gen = torch.Generator().manual_seed(args.seed + step)
        tokens = torch.randint(args.vocab, (world_size * args.batch, args.seq + 1), generator=gen)
        if not alone:
            tokens = tokens[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's
        start = time.perf_counter()
        if shape != "dtensor" and (not alone or rank == 0):
            model(tokens[:, :-1], tokens[:, 1:]).backward()
        dist.barrier()
        stepping = time.perf_counter()
        if not alone or rank == 0:
            optimizer.step()
        end = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        step_s.append(end - stepping)
        full_s.append(end - start)
    return {"step_s": step_s, "full_s": full_s if shape != "dtensor" else None,
            "phases": getattr(optimizer, "phases", None)}


def three_steps(args, kind: str, shape: str, mesh) -> dict:
    """Full parameters after 3 steps of `kind` on fixed gradients, stepped on whole tensors in this
    process ("whole"), by shardwise zero2's owner step ("owner") or as Shard(0) DTensors ("dtensor")."""
    model = build_model(args)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if shape == "owner":
        sw.shard(model, strategy="zero2", units=Block)
    params = to_dtensors(model, mesh) if shape == "dtensor" else dict(model.named_parameters())
    optimizer = make_optimizer(list(params.values()), kind, args)
    for step in range(3):
        grads = whole_grads(shapes, args, step)
        if shape == "dtensor":
            set_dtensor_grads(params, grads, mesh)
        elif shape == "owner":  # this rank's rows of the same whole gradient, padding zero
            for name, info in sw.shard_info(model).items():
                info.param.grad = torch.zeros_like(info.param)
                info.param.grad[: info.row_end - info.row_start] = grads[name][info.row_start:info.row_end]
        else:
            for name, p in params.items():
                p.grad = grads[name]
        optimizer.step()
    if shape == "owner":
        return sw.full_parameters(model)
    return {name: p.detach().full_tensor() if shape == "dtensor" else p.detach() for name, p in params.items()}


def parity_job(args, rank: int, mesh) -> dict:
    """Each optimizer in PARITY under the owner and DTensor shapes, against one process (on rank 0)."""
    out = {}
    for kind in PARITY:
        reference = three_steps(args, kind, "whole", mesh) if rank == 0 else None
        dist.barrier()
        for shape in ("owner", "dtensor"):
            try:
                full = three_steps(args, kind, shape, mesh)
            except Exception as error:  # noqa: BLE001 — Adafactor on DTensor raises: record what
                out[f"{shape}_{kind}"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
                print(f"rank {rank}: {shape} {kind}: {out[f'{shape}_{kind}']['error']}", file=sys.stderr)
                full = None
            if rank == 0 and full is not None:
                diffs = {name: (full[name] - ref).abs().max().item() for name, ref in reference.items()}
                worst = max(diffs, key=diffs.get)
                out[f"{shape}_{kind}"] = {"max_abs_diff": diffs[worst], "worst_param": worst,
                                          "bitwise": all(torch.equal(full[n], r) for n, r in reference.items())}
            dist.barrier()
    return out


def run_worker(args) -> None:
    Path(args.out_dir, f"pid{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))  # for a kill on timeout
    torch.set_num_threads(1)  # ranks share 2 cores; more threads only fight each other
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
                 "muon_lr", "weight_decay"):
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
    """Median over timed steps of the slowest rank's time (a step lasts as long as its slowest rank)."""
    if ranks[0][arm][key] is None:
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


def summarize(args, rounds: dict, world_sizes: list[int]) -> list[dict]:
    rows = []
    for ws in world_sizes:
        per_round = [rounds[(r, ws)]["ranks"] for r in range(args.rounds)]
        base = [median_over_steps(ranks, "zero2_adamw", "step_s", args.warmup) for ranks in per_round]
        base_full = [median_over_steps(ranks, "zero2_adamw", "full_s", args.warmup) for ranks in per_round]
        for arm in ARMS:
            step = [median_over_steps(ranks, arm, "step_s", args.warmup) for ranks in per_round]
            full = [median_over_steps(ranks, arm, "full_s", args.warmup) for ranks in per_round]
            row = {"arm": arm, "label": LABELS[arm], "world_size": ws, "round_step_s": step,
                   "median_step_s": statistics.median(step), "round_full_s": full,
                   "x_adamw_rows": statistics.median(a / b for a, b in zip(step, base)),
                   "phases_by_round": [phase_medians(ranks, arm, args.warmup) for ranks in per_round]}
            if full[0] is not None:
                row["median_full_s"] = statistics.median(full)
                row["full_x_adamw_rows"] = statistics.median(a / b for a, b in zip(full, base_full))
            rows.append(row)
    return rows


def parity_text(entry: dict | None) -> str:
    if entry is None:  # the parity job runs the owner shape under zero2 only
        return "(see zero2)"
    if "error" in entry:
        return f"raises {entry['error'][:100]}"
    return "bitwise" if entry["bitwise"] else f"{entry['max_abs_diff']:.1e} ({entry['worst_param']})"


def markdown(args, rows: list[dict], parity: dict, world_sizes: list[int]) -> str:
    def rng(values):
        return f"{min(values):.3f}–{max(values):.3f}"

    lines = [
        f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, batch "
        f"{args.batch}/rank; gloo on loopback, 1 thread/rank, 2 CPU cores. Muon (lr {args.muon_lr}, torch.optim.Muon, "
        "Newton–Schulz in bf16) on every 2-D parameter (tied embedding/head and pos_emb included), AdamW on the "
        f"rest. Step s: optimizer.step() only, slowest rank, median of {args.steps} steps after {args.warmup} "
        f"warm-up per round, then median over {args.rounds} interleaved rounds (range: per-round medians). "
        "× AdamW rows: per-round ratio to shardwise zero2 AdamW, median. Full step: forward+backward+step. "
        "zero2's re-gather of updated rows runs at the next forward, so it is in full step, not in step s. "
        "The machine was shared with other agents running tests (load swings): absolute numbers are noisy; "
        "read the paired ratios. Parity: 3 steps on fixed random gradients, max |param − one process stepping "
        "whole tensors| (owner shape = shardwise zero2; worst parameter in brackets)."]
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
        arms = list(ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)])  # rotated: no arm always runs first
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
    (out / "whole_tensor.json").write_text(json.dumps({"settings": settings, "meta": meta, "parity": parity,
                                                       "rows": rows, "raw": raw}, indent=1))
    table = markdown(args, rows, parity, world_sizes)
    (out / "whole_tensor.md").write_text(table)
    plot(rows, world_sizes, out / "whole_tensor.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
