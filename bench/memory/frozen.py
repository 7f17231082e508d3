"""Benchmark: a frozen GPT base (>= 200M parameters) with small LoRA adapters, 4 local ranks:
host memory and step time for torch DDP, FSDP2, shardwise zero3 and shardwise with the host copy.

    python bench/memory/frozen.py                                    # full: 210M base, 4 ranks, 3 rounds
    python bench/memory/frozen.py --d-model 128 --layers 2 --vocab 512 --rounds 1 --steps 2   # a quick check

Host memory is the sum over the ranks of PSS (/proc/<pid>/smaps_rollup), which counts a page
that N processes map as 1/N in each: a frozen base that every rank maps once counts once.
Each rank reads its PSS after `sw.init()` (before any model exists) and again after the timed
steps; the difference, summed over ranks and divided by the base's bytes, is the host memory
the run costs in copies of the base (the adapters, their Adam state and the activations are
in it too). Every run sets MALLOC_MMAP_THRESHOLD_=65536 so freed blocks leave RSS (DESIGN.md:
otherwise glibc keeps them and PSS shows what was once held, not what is held).

Configs run in interleaved rounds (every config once per round), so a burst of load on this
shared machine hits them alike; each ratio to DDP is taken within a round, and the table gives
the median over rounds with the spread (min-max). Writes bench/memory/results/frozen.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.common.launch import run_logged  # noqa: E402

CONFIGS = ("ddp", "fsdp2", "zero3", "host")
LABELS = {"ddp": "torch DDP", "fsdp2": "FSDP2 fully_shard", "zero3": "shardwise zero3",
          "host": "shardwise ddp + frozen='host'"}
MIB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--rank-lora", type=int, default=8, help="LoRA rank on qkv and attn_proj")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


def build_model(args):
    """The GPT base (same seed on every rank and config) with LoRA adapters; the base frozen."""
    import peft

    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                         n_heads=args.heads))
    lora = peft.LoraConfig(r=args.rank_lora, lora_alpha=2 * args.rank_lora, lora_dropout=0.0,
                           target_modules=["qkv", "attn_proj"])
    return peft.get_peft_model(base, lora)  # freezes every base parameter


def apply_config(model, config: str, world_size: int):
    """Wrap or shard `model`; return the module to call."""
    import shardwise as sw
    from shardwise.models.gpt import Block

    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.base_model.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if config == "zero3":
        return sw.shard(model, strategy="zero3", units=Block)
    if config == "host":
        return sw.shard(model, strategy="ddp", frozen="host")
    raise ValueError(f"unknown config {config!r}")


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw

    torch.set_num_threads(1)
    sw.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    import peft.tuners.lora  # noqa: F401 - every library loaded before the first PSS reading
    from torch.distributed import fsdp  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    build_model(argparse.Namespace(**{**vars(args), "vocab": 16, "d_model": 16, "layers": 1, "heads": 1}))
    dist.barrier()
    pss_before = pss_bytes()
    model = build_model(args)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    num_base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    module = apply_config(model, args.config, world)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(args.vocab, (world * args.batch, args.seq + 1), generator=gen)
        rows = slice(rank * args.batch, (rank + 1) * args.batch)
        dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's
        start = time.perf_counter()
        loss = module(tokens[rows, :-1], tokens[rows, 1:])
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    dist.barrier()
    record = {"rank": rank, "pss_before": pss_before, "pss_after": pss_bytes(), "step_times": times,
              "losses": losses, "base_bytes": base_bytes, "num_base": num_base, "num_trainable": num_trainable}
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()  # no rank unmaps the host copy before every rank has read its PSS
    dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def launch(args, config: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    with tempfile.TemporaryDirectory() as out_dir:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
                __file__, "--worker", "--config", config, "--out-dir", out_dir]
        for flag in ("vocab", "d_model", "layers", "heads", "seq", "batch", "rank_lora", "steps", "warmup"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        error, log = run_logged(argv, env, out_dir, args.timeout)
        if error:
            return {"error": error, "output_tail": log[-3000:]}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    ranks.sort(key=lambda r: r["rank"])
    step = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
    return {"median_step_s": statistics.median(step[args.warmup:]), "step_times": step,
            "losses": ranks[0]["losses"], "pss_after_mib": sum(r["pss_after"] for r in ranks) / MIB,
            "pss_model_mib": sum(r["pss_after"] - r["pss_before"] for r in ranks) / MIB,
            "base_mib": ranks[0]["base_bytes"] / MIB, "num_base": ranks[0]["num_base"],
            "num_trainable": ranks[0]["num_trainable"]}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def summarize(args, runs: dict) -> tuple[list[dict], str]:
    configs = [c for c in args.configs.split(",") if c]
    rows = []
    for config in configs:
        ok = [r for r in runs[config] if "error" not in r]
        row = {"config": config, "label": LABELS[config], "runs": runs[config]}
        if ok:
            row.update(median_step_s=statistics.median(r["median_step_s"] for r in ok),
                       pss_model_mib=statistics.median(r["pss_model_mib"] for r in ok),
                       base_copies=statistics.median(r["pss_model_mib"] / r["base_mib"] for r in ok),
                       base_mib=ok[0]["base_mib"], losses=ok[0]["losses"])
            if config != "ddp" and "ddp" in runs:
                pairs = [(r, d) for r, d in zip(runs[config], runs["ddp"]) if "error" not in r and "error" not in d]
                row["step_vs_ddp"] = [r["median_step_s"] / d["median_step_s"] for r, d in pairs]
                row["max_loss_diff_vs_ddp"] = max((abs(a - b) for r, d in pairs for a, b in zip(r["losses"],
                                                                                                d["losses"])),
                                                  default=None)
        rows.append(row)
    first = next(r for rs in runs.values() for r in rs if "error" not in r)
    lines = [f"GPT base: vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, seq {args.seq}, "
             f"{first['num_base'] / 1e6:.1f}M frozen parameters ({first['base_mib']:.0f} MiB fp32); "
             f"LoRA r={args.rank_lora} on qkv and attn_proj ({first['num_trainable'] / 1e6:.2f}M trainable, AdamW); "
             f"{args.world_size} ranks on one host, gloo, 1 thread/rank, batch {args.batch}×{args.seq} tokens/rank, "
             f"MALLOC_MMAP_THRESHOLD_=65536. {args.rounds} interleaved rounds of {args.warmup} warm-up + "
             f"{args.steps} timed steps; step time: median over rounds of each run's median (max over ranks), "
             "ratio to DDP: median (min–max) of the per-round ratios. Host memory: Σ over ranks of PSS after "
             "the steps minus Σ PSS before the model was built.", "",
             "| config | median step s | step × DDP | host memory MiB (Σ PSS) | in copies of the base | "
             "max abs loss diff vs DDP |", "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "median_step_s" not in row:
            lines.append(f"| {row['label']} | failed: {row['runs'][0].get('error')} | | | | |")
            continue
        ratio = spread(row["step_vs_ddp"]) if row.get("step_vs_ddp") else "1.00"
        diff = row.get("max_loss_diff_vs_ddp")
        lines.append(f"| {row['label']} | {row['median_step_s']:.3f} | {ratio} | {row['pss_model_mib']:.0f} | "
                     f"{row['base_copies']:.2f} | {'—' if diff is None else format(diff, '.1e')} |")
    return rows, "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "median_step_s" in r]
    names = [r["config"] for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    axes[0].bar(names, [r["pss_model_mib"] for r in ok], color="tab:green")
    axes[0].axhline(ok[0]["base_mib"], color="black", linestyle="--", label="one copy of the base")
    axes[0].set_title("host memory: Σ PSS over 4 ranks (MiB)")
    axes[0].legend()
    for i, r in enumerate(ok):
        per_round = [x["median_step_s"] for x in r["runs"] if "error" not in x]
        axes[1].scatter([i] * len(per_round), per_round, color="gray", s=12, zorder=3)
    axes[1].bar(names, [r["median_step_s"] for r in ok], color="tab:blue")
    axes[1].set_title("median step time (s); dots: each round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_launcher(args) -> None:
    from tqdm import tqdm

    configs = [c for c in args.configs.split(",") if c]
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    started = time.time()
    order = [(r, c) for r in range(args.rounds) for c in configs]
    for rnd, config in tqdm(order, desc="runs", unit="run"):
        result = launch(args, config)
        runs[config].append(result)
        tqdm.write(f"round {rnd + 1} {config}: " + (f"FAILED {result['error']}\n{result['output_tail'][-1500:]}"
                                                    if "error" in result else
                                                    f"{result['median_step_s']:.3f} s/step, "
                                                    f"Σ PSS {result['pss_model_mib']:.0f} MiB"))
    rows, table = summarize(args, runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "cpus": os.cpu_count(), "wall_s": time.time() - started}
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "config", "out_dir")}
    (out / "frozen.json").write_text(json.dumps({"settings": settings, "meta": meta, "rows": rows}, indent=1))
    (out / "frozen.md").write_text(table)
    plot(rows, out / "frozen.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
