"""The main job: train the small GPT, character level, on the Python standard library's source.

    python -m shardwise.demo                      # launches 2 ranks through torchrun
    python -m shardwise.demo --strategy ddp --nproc 4
    torchrun --nproc-per-node 2 -m shardwise.demo # the same script, launched by hand

Without torchrun's environment the script is the launcher: for each strategy asked
for it starts `--nproc` fresh ranks through torchrun (fresh processes, so each
strategy's peak memory is its own), then one process alone on the same global batches
(the reference), then prints a table of loss and per-rank memory and writes the loss
curves to `demo-out/`. Under torchrun it is one rank of training.

Note [demo drift]: every strategy, torch's DDP included, adds the same numbers in another
order than one process does, so their losses leave the reference's by float rounding,
amplified step after step (within 3e-6 over the first 10 steps here; by step 100, 8e-2 for
ddp as for zero3).
The table prints each strategy's largest distance from the reference beside DDP's: zero3 drifts
as far as DDP itself, which is what "changes memory, never the result" means at fp32.

Note [demo data]: the text is this Python's standard-library source, so the losses printed depend
on the Python version (the README's figures: Python 3.11); on one version they are the same on
every machine and every run.

Note [demo memory]: the ranks run with `MALLOC_MMAP_THRESHOLD_=65536` (unless set): glibc's
malloc otherwise keeps freed blocks resident, and zero3's gathered units, freed after each
use, would count in its peak RSS as if kept. The model is sized so that its state (16
bytes per parameter for ddp, 16/N for zero3) outweighs what a step adds on top.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.estimate.measure import model_state_bytes
from shardwise.models.gpt import GPT, Block, GPTConfig

BYTE_VOCAB = 256  # character level on bytes: every file decodes, no tokenizer to ship
# Note [demo memory]: a model whose state outweighs a step's own memory, trained briefly.
STEPS, BATCH, SEQ, LAYERS, WIDTH = 100, 2, 64, 6, 320
REFERENCE = "one process"  # the run every strategy is compared with (Note [demo drift])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m shardwise.demo",
        description="Train a small GPT on the Python standard library's source, on several ranks.",
    )
    parser.add_argument("--strategy", default="ddp,zero3",
                        help=f"comma-separated strategies to run one after another, from {sw.STRATEGIES} "
                             "(default: ddp,zero3)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (default: 2)")
    # --nproc as the ranks are handed it: torchrun reads any abbreviation of --nproc-per-node as its own.
    parser.add_argument("--world", dest="nproc", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default: {STEPS})")
    parser.add_argument("--batch", type=int, default=BATCH, help=f"sequences per rank per step (default: {BATCH})")
    parser.add_argument("--seq", type=int, default=SEQ, help=f"characters per sequence (default: {SEQ})")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"transformer blocks (default: {LAYERS})")
    parser.add_argument("--width", type=int, default=WIDTH, help=f"d_model (default: {WIDTH})")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the one-process run the strategies are compared with")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--out", default="demo-out", help="where results and plots go (default: demo-out)")
    return parser.parse_args(argv)


def load_text(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's .py files, sorted and concatenated: the same bytes wherever the same
    Python version runs (another version's standard library is other text, so other losses)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def global_batch(text: torch.Tensor, step: int, size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows chosen from (seed, step) alone, so every rank draws the same global batch."""
    generator = torch.Generator().manual_seed(1234 + step)
    starts = torch.randint(0, len(text) - seq - 1, (size,), generator=generator)
    windows = torch.stack([text[s : s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def train_rank(args: argparse.Namespace, strategy: str) -> None:
    """One rank of training under torchrun (or, as the reference, one process on the whole
    global batch); rank 0 writes the results file."""
    reference = strategy == REFERENCE
    torch.set_num_threads(1)  # one thread per process (more threads on busy cores only wait for each other)
    sw.init()
    rank, world_size = sw.get_rank(), sw.get_world_size()
    batch = args.batch * (args.nproc if reference else 1)  # the reference takes every rank's rows
    text = load_text()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=BYTE_VOCAB, seq_len=args.seq, d_model=args.width,
                       n_layers=args.layers, n_heads=4)
    model = GPT(config)
    params = model.num_params()  # before sharding: zero3's parameters then hold this rank's rows
    if not reference:
        sw.shard(model, strategy=strategy, **({} if strategy == "ddp" else {"units": Block}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    losses, step_times = [], []
    progress = _progress(args.steps, strategy) if rank == 0 else None
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = global_batch(text, step, args.batch * args.nproc, args.seq)
        rows = slice(rank * batch, (rank + 1) * batch)
        loss = model(x[rows], y[rows])
        loss.backward()
        if reference:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            sw.clip_grad_norm_(model, 1.0)
        optimizer.step()
        if step == args.steps - 1:  # measured with gradients still held, as the ZeRO formulas count
            state_bytes = model_state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        losses.append(mean_loss.item())
        step_times.append(time.perf_counter() - start)
        if progress is not None:
            progress.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)  # update() redraws
            progress.update()

    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0,
                         float(state_bytes)])
    everyone = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        progress.close()
        result = {
            "strategy": strategy, "world_size": world_size, "params": params,
            "losses": losses, "median_step_s": sorted(step_times)[len(step_times) // 2],
            "peak_rss_mib": [m[0].item() / 2**20 for m in everyone],
            "model_state_mib": [m[1].item() / 2**20 for m in everyone],
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{strategy.replace(' ', '_')}.json").write_text(json.dumps(result))
    sw.shutdown()


def _progress(total: int, strategy: str):
    from tqdm import tqdm

    # In a log file (CI) every redraw is a new line: refresh every 10 s there, not 10 times a second.
    every = 0.1 if sys.stderr.isatty() else 10.0
    desc = strategy if strategy == REFERENCE else f"{strategy} rank 0"
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=every)


def launch(args: argparse.Namespace) -> int:
    """Start `--nproc` ranks through torchrun for each strategy, then summarize."""
    from torch.distributed.run import main as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; also silences torchrun
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # Note [demo memory]
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    unknown = [s for s in strategies if s not in sw.STRATEGIES]
    if unknown:
        print(f"unknown strategy {unknown}; choose from {sw.STRATEGIES}", file=sys.stderr)
        return 2
    results, started = [], time.perf_counter()
    for strategy in strategies + ([] if args.no_reference else [REFERENCE]):
        nproc = 1 if strategy == REFERENCE else args.nproc
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "shardwise.demo", *rank_argv(args, strategy)])
        results.append(json.loads((Path(args.out) / f"{strategy.replace(' ', '_')}.json").read_text()))
    print_summary(results, args.nproc)
    print(f"took {time.perf_counter() - started:.0f} s")
    plot_losses(results, Path(args.out) / "loss.png")
    return 0


def rank_argv(args: argparse.Namespace, strategy: str) -> list[str]:
    """The options each rank of one run starts with: every option as parsed, with this run's strategy.
    Rebuilt from the parsed values, not filtered from the command line, where `--strategy zero3` (the
    form `make demo STRATEGY=zero3` writes) left a stray `zero3` that every rank refused."""
    argv = []
    for name, value in {**vars(args), "strategy": strategy}.items():
        flag = "--world" if name == "nproc" else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv.append(f"{flag}={value}")
    return argv


def bytes_per_param(strategy: str, world_size: int) -> float:
    """fp32 AdamW model state per parameter per rank, as the ZeRO paper counts it (docs/measured.md's memory table)."""
    n = world_size
    return {"ddp": 16, "zero1": 8 + 8 / n, "zero2": 4 + 12 / n, "zero3": 16 / n}.get(strategy, 16)


def print_summary(results: list[dict], world_size: int) -> None:
    """Loss, its distance from one process (Note [demo drift]) and memory per rank, per strategy."""
    first = results[0]
    params = first["params"]
    reference = next((r for r in results if r["strategy"] == REFERENCE), None)
    print(f"\nGPT with {params:,} parameters, {world_size} ranks, {len(first['losses'])} steps on the Python "
          f"{sys.version_info.major}.{sys.version_info.minor} standard library's source (another Python version: "
          "other text, other losses); model state = parameters + gradients + AdamW's two moments")
    print(f"{'strategy':<12}{'loss end':>9}{'max |loss - 1 proc|':>21}{'median step':>13}"
          f"  {'model state MiB/rank (formula)':<32}peak RSS MiB/rank")
    for r in results:
        drift = "" if reference is None or r is reference else (
            f"{max(abs(a - b) for a, b in zip(r['losses'], reference['losses'])):.1e}")
        ranks = 1 if r["strategy"] == REFERENCE else world_size
        formula = bytes_per_param(r["strategy"], ranks) * params / 2**20
        state = " ".join(f"{m:6.1f}" for m in r["model_state_mib"]) + f" ({formula:.1f})"
        rss = " ".join(f"{m:7.1f}" for m in r["peak_rss_mib"])
        print(f"{r['strategy']:<12}{r['losses'][-1]:>9.4f}{drift:>21}"
              f"{r['median_step_s'] * 1000:>10.1f} ms  {state:<32}{rss}")
    if reference is not None:
        print("ddp and zero3 each leave the one-process losses by float rounding, amplified over the steps: "
              "zero3 by as much as torch's DDP does (Note [demo drift] in shardwise/demo.py)")


def plot_losses(results: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # the plot is a convenience; the table above carries the numbers
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for r in results:
        axes.plot(r["losses"], label=r["strategy"])
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (nats/char)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"loss curves: {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "RANK" in os.environ:
        train_rank(args, args.strategy)
        return 0
    return launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
