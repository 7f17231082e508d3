"""What compression costs in accuracy (issue 47 point 3): loss curves of the bench GPT under zero3 with the quantized
collectives (`shard(..., compression=...)`, Note [quantized collectives]) against fp32 and bf16, several seeds,
the final gap to fp32 and its spread over seeds.

    python bench/loss_curves.py                                  # ws 2, 300 steps, 3 seeds, tiny GPT
    python bench/loss_curves.py --steps 20 --seeds 1             # smoke run

The data is learnable, not uniform noise (on random tokens every arm ends at ln(vocab) and no gap can show):
each sequence walks a fixed sparse transition table (every token has 4 likely successors, drawn once from
--data-seed), so the loss falls from ln(vocab) towards the table's entropy (ln 4 = 1.39 nats) and a
perturbation of the training shows as a gap. Every arm and seed sees the same batches; a seed changes the
initial weights only. The final loss is the mean of the last --tail steps' losses (averaged over ranks).
Results: bench/results/loss_curves.{md,json,png}. Counting losses, not timing: the machine's load does not
change these numbers (gloo sums in a fixed order: a rerun gives the same curves).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from _launch import publish, run_per_world_size

ARMS = {  # name -> shard() keywords on top of strategy="zero3"
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "qwZ int8 + qgZ int8": {"compression": {"gather": "int8", "reduce": "int8"}},
    "qwZ int8 + qgZ int4": {"compression": {"gather": "int8", "reduce": "int4"}},
}
RESULTS = Path(__file__).resolve().parent / "results"
SUCCESSORS = 4


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-seed", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def batch(args, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: walks of the fixed transition table (module docstring)."""
    table = torch.randint(args.vocab, (args.vocab, SUCCESSORS), generator=torch.Generator().manual_seed(args.data_seed))
    gen = torch.Generator().manual_seed(args.data_seed * 100_003 + step)
    rows = world_size * args.batch
    tokens = torch.empty(rows, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(args.vocab, (rows,), generator=gen)
    choices = torch.randint(SUCCESSORS, (rows, args.seq), generator=gen)
    for t in range(args.seq):
        tokens[:, t + 1] = table[tokens[:, t], choices[:, t]]
    return tokens[:, :-1], tokens[:, 1:]


def train(args, arm: str, seed: int) -> list[float]:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.models.gpt import GPT, Block, GPTConfig

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads))
    sw.shard(model, strategy="zero3", units=Block, **ARMS[arm])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    losses = []
    for step in range(args.steps):
        idx, targets = (t[mine] for t in batch(args, step, world_size))
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init()
    curves = {arm: [train(args, arm, seed) for seed in range(args.seeds)] for arm in ARMS}
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(curves))
    dist.barrier()
    sw.shutdown()


def summary(curves: dict, tail: int) -> dict:
    """Per arm: each seed's final loss, and its gap to the same seed's fp32 run (mean, min, max)."""
    finals = {arm: [statistics.fmean(run[-tail:]) for run in runs] for arm, runs in curves.items()}
    out = {}
    for arm, values in finals.items():
        gaps = [(v - f) / f for v, f in zip(values, finals["fp32"])]
        out[arm] = {"final": values, "gap": gaps, "gap_mean": statistics.fmean(gaps), "gap_min": min(gaps),
                    "gap_max": max(gaps)}
    return out


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, runs in curves.items():
        mean = [statistics.fmean(step) for step in zip(*runs)]
        left.plot(range(1, len(mean) + 1), mean, label=arm, linewidth=1)
        base = [statistics.fmean(step) for step in zip(*curves["fp32"])]
        right.plot(range(1, len(mean) + 1), [(a - b) / b * 100 for a, b in zip(mean, base)], label=arm,
                   linewidth=1)
    left.set_yscale("log")
    left.set_ylabel("loss (mean over seeds)")
    right.set_ylabel("gap to fp32, % (mean over seeds)")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"zero3 on the bench GPT: quantized collectives against fp32 and bf16 ({len(runs)} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_launcher(args) -> None:
    worker_args = []
    for flag in ("steps", "seeds", "vocab", "d_model", "layers", "heads", "seq", "batch", "lr", "data_seed"):
        worker_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    curves = run_per_world_size(__file__, [args.world_size], worker_args)[args.world_size]
    rows = summary(curves, args.tail)
    lines = [
        "# Loss curves: quantized collectives against fp32 and bf16 (issue 47 point 3)",
        "",
        f"Reproduce: `python bench/loss_curves.py --world-size {args.world_size} {' '.join(worker_args)} "
        f"--tail {args.tail}`. zero3 at ws {args.world_size}, the bench GPT (vocab {args.vocab}, d_model "
        f"{args.d_model}, {args.layers} layers), AdamW lr {args.lr}, {args.steps} steps, seeds 0-{args.seeds - 1} "
        f"(initial weights), learnable data (module docstring: the loss floor is ln {SUCCESSORS} = 1.39). Final loss: "
        f"the mean of the last {args.tail} steps. Gap: (arm - fp32) / fp32 for the same seed; mean and range "
        "over seeds. Losses, not times: the machine's load does not change them.",
        "",
        "| arm | final loss per seed | gap to fp32, mean | gap range over seeds |",
        "|---|---|---:|---|",
    ]
    for arm, row in rows.items():
        lines.append(f"| {arm} | {', '.join(f'{v:.4f}' for v in row['final'])} | {row['gap_mean'] * 100:+.2f}% | "
                     f"{row['gap_min'] * 100:+.2f}% .. {row['gap_max'] * 100:+.2f}% |")
    plot(curves, RESULTS / "loss_curves.png")
    publish("loss_curves", "\n".join(lines + [""]), {"curves": curves, "summary": rows})


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        run_worker(args)
    else:
        run_launcher(args)


if __name__ == "__main__":
    main()
