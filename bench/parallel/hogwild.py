"""Benchmark: `sw.hogwild` with 1, 2 and 4 processes beside one plain process and torch DDP (2 and 4
ranks), on scikit-learn's digits (8x8 images, 10 classes), at the same number of samples.

    python bench/parallel/hogwild.py                      # 3 interleaved rounds, 30 epochs
    python bench/parallel/hogwild.py --rounds 1 --epochs 3    # a quick check

Every config trains the same MLP (64-128-10, the same seeded init) with plain SGD, batch 16 per
process, on the same 1437 training images for `--epochs` epochs in total: a Hogwild worker or a
DDP rank takes every N-th image, so the sample count is the same for all. Samples/s is the
samples of all processes over the training's wall time (first start to last finish, start-up
excluded). The held-out loss (360 images) is read every `--eval-every` samples by process 0:
for Hogwild from the shared parameters while the others keep writing, against a shared count of
the samples all workers have stepped on (they do not run in step: a worker the scheduler holds
back finds the others thousands of samples ahead). Writes
bench/parallel/results/hogwild.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

CONFIGS = ("one", "hogwild1", "hogwild2", "hogwild4", "ddp2", "ddp4")
LABELS = {"one": "one process", "hogwild1": "hogwild, 1 process", "hogwild2": "hogwild, 2 processes",
          "hogwild4": "hogwild, 4 processes", "ddp2": "torch DDP, 2 ranks", "ddp4": "torch DDP, 4 ranks"}
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="images per process per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=2000, help="samples (all processes) between held-out losses")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def digits():
    """(train x, train y, test x, test y): scaled to [0, 1], a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]


def build_model(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def held_out(model, data) -> tuple[float, float]:
    _, _, x, y = data
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def train_part(rank: int, num_procs: int, model: nn.Module, args, barrier=None, counter=None) -> dict:
    """This process's part: rows rank::num_procs of each epoch's shuffled order, SGD. Process 0
    records the held-out loss against the samples all processes have seen: `counter` (a shared
    count every Hogwild worker adds its batches to: they do not run in step), else its own x
    num_procs (DDP ranks run in step). `barrier`: all start together, so the wall time is the
    training's."""
    torch.set_num_threads(1)
    data = digits()
    if barrier is not None:
        barrier.wait()
    x, y = data[0], data[1]
    optim = torch.optim.SGD(model.parameters(), lr=args.lr)
    curve, seen, next_eval = [], 0, 0
    start = time.time()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))[rank::num_procs]
        for batch in order.split(args.batch):
            total = counter.value if counter is not None else seen * num_procs
            if rank == 0 and total >= next_eval:
                curve.append((total, held_out(model, data)[0]))
                next_eval = total + args.eval_every
            optim.zero_grad()
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            optim.step()
            seen += len(batch)
            if counter is not None:
                with counter.get_lock():
                    counter.value += len(batch)
    return {"start": start, "end": time.time(), "seen": seen, "curve": curve}


def _ddp_rank(rank: int, num_procs: int, port: int, args, out) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_procs)
    model = build_model(args.hidden)
    ddp = DDP(model)
    digits()  # loaded before the barrier, as the Hogwild workers do
    dist.barrier()
    record = train_part(rank, num_procs, ddp, args)
    if rank == 0:
        record["final"] = held_out(model, digits())
    out.put((rank, record))
    dist.destroy_process_group()


def run_config(config: str, args) -> dict:
    import shardwise as sw

    if config == "one":
        model = build_model(args.hidden)
        records = [train_part(0, 1, model, args)]
    elif config.startswith("hogwild"):
        model = build_model(args.hidden)
        num_procs = int(config[-1])
        context = mp.get_context("spawn")
        barrier, counter = context.Barrier(num_procs), context.Value("q", 0)
        records = sw.hogwild(train_part, model, num_procs=num_procs, args=(args, barrier, counter),
                             threads_per_proc=1, timeout=1800).values
    else:
        num_procs = int(config[-1])
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        queue = mp.get_context("spawn").SimpleQueue()
        mp.start_processes(_ddp_rank, args=(num_procs, port, args, queue), nprocs=num_procs, start_method="spawn")
        records = [r for _, r in sorted(queue.get() for _ in range(num_procs))]
        model = None
    final = held_out(model, digits()) if model is not None else records[0]["final"]
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    samples = sum(r["seen"] for r in records)
    return {"samples": samples, "wall_s": wall, "samples_per_s": samples / wall, "final_loss": final[0],
            "final_accuracy": final[1], "curve": records[0]["curve"] + [(samples, final[0])]}


def spread(values: list[float], spec: str) -> str:
    return f"{format(statistics.median(values), spec)} ({format(min(values), spec)}–{format(max(values), spec)})"


def markdown(args, runs: dict) -> str:
    lines = [f"scikit-learn digits: 1437 training / 360 held-out images; MLP 64-{args.hidden}-10; plain SGD lr "
             f"{args.lr}, batch {args.batch} per process; {args.epochs} epochs = the same "
             f"{args.epochs * 1437} samples for every config; 1 thread per process on {os.cpu_count()} cores. "
             f"Median (min–max) over {args.rounds} interleaved rounds; the speed-up is samples/s over one "
             "process's in the same round.", "",
             "| config | samples/s | × one process | final held-out loss | final held-out accuracy |",
             "|---|---:|---:|---:|---:|"]
    base = runs.get("one")
    for config, results in runs.items():
        speed = [r["samples_per_s"] for r in results]
        ratio = spread([r["samples_per_s"] / b["samples_per_s"] for r, b in zip(results, base)], ".2f") \
            if base else "—"
        lines.append(f"| {LABELS[config]} | {spread(speed, '.0f')} | {ratio} | "
                     f"{spread([r['final_loss'] for r in results], '.3f')} | "
                     f"{spread([r['final_accuracy'] for r in results], '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for config, results in runs.items():
        curve = results[0]["curve"]
        axes[0].plot([s for s, _ in curve], [loss for _, loss in curve], label=LABELS[config], marker=".")
    axes[0].set_xlabel("samples seen (all processes)")
    axes[0].set_ylabel("held-out cross-entropy")
    axes[0].set_yscale("log")
    axes[0].set_title("held-out loss against samples seen (round 1)")
    axes[0].legend(fontsize=8)
    names = list(runs)
    for i, config in enumerate(names):
        speeds = [r["samples_per_s"] for r in runs[config]]
        axes[1].bar(i, statistics.median(speeds), color="tab:blue")
        axes[1].scatter([i] * len(speeds), speeds, color="black", s=12, zorder=3)
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels([LABELS[c] for c in names], rotation=25, ha="right", fontsize=8)
    axes[1].set_title("samples/s (bar: median; dots: each round)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> None:
    from tqdm import tqdm

    configs = [c for c in args.configs.split(",") if c]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    started = time.time()
    for rnd, config in tqdm([(r, c) for r in range(args.rounds) for c in configs], desc="runs", unit="run"):
        result = run_config(config, args)
        runs[config].append(result)
        tqdm.write(f"round {rnd + 1} {config}: {result['samples_per_s']:.0f} samples/s, "
                   f"held-out loss {result['final_loss']:.3f}, accuracy {result['final_accuracy']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(args, runs)
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "wall_s": time.time() - started}
    (out / "hogwild.json").write_text(json.dumps({"settings": vars(args), "meta": meta, "runs": runs}, indent=1))
    (out / "hogwild.md").write_text(table)
    plot(runs, out / "hogwild.png")
    print(table)


if __name__ == "__main__":
    main(parse_args())
