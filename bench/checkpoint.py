"""Benchmark: `sw.save` / `sw.load` against `torch.distributed.checkpoint` (DCP) on the same
sharded model, in the same run.

    python bench/checkpoint.py                                    # 29.5M GPT, zero3, 2 ranks
    python bench/checkpoint.py --d-model 128 --layers 2 --vocab 1024 --repeats 2

The launcher starts `--world-size` ranks under `torch.distributed.run`; each rank builds
the GPT, shards it, takes one AdamW step (so optimizer state exists), then, `--repeats`
times, saves it with both (alternating which goes first, so neither always meets a
page cache the other warmed) and loads it back in place with both. DCP gets the same
tensors through `sw.dcp_state_dict` (DTensor views of each rank's rows). Both fsync
their files (DCP's FileSystemWriter default, sw.save's `durable=True`). Throughput is
model-state bytes (parameters and AdamW moments, all ranks) per second of the slowest
rank; peak RSS growth is the kernel's high-water mark during the call minus RSS before.
Results: bench/results/checkpoint.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MB, MIB = 1e6, 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--strategy", default="zero3", choices=["ddp", "zero1", "zero2", "zero3"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scratch", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def rss_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM, ...) in bytes; 0 where there is none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _timed(fn) -> tuple[float, int]:
    """(seconds of the slowest rank, this rank's peak RSS growth) of a collective call."""
    import torch.distributed as dist

    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    before = rss_bytes("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), rss_bytes("VmHWM") - before


def run_worker(args) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardwise as sw
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    sw.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                          n_layers=args.layers, n_heads=args.heads))
    sw.shard(model, strategy=args.strategy, **({} if args.strategy == "ddp" else {"units": Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(args.vocab, (2, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)

    # Model-state bytes: every parameter's real rows and its two AdamW moments, all ranks.
    infos = sw.shard_info(model)
    mine = sum((i.row_end - i.row_start) * (i.param[0].numel() if i.param.dim() > 1 else 1) * 4 * 3
               for i in infos.values())
    if args.strategy == "ddp":
        mine = sum(i.param.numel() * 4 * 3 for i in infos.values()) // dist.get_world_size()
    total = torch.tensor([mine], dtype=torch.float64)
    dist.all_reduce(total)
    state_bytes = total.item()

    root = Path(args.scratch)
    samples = {key: [] for key in ("sw_save", "dcp_save", "sw_load", "dcp_load")}
    rss = {key: [] for key in samples}
    for repeat in range(args.repeats):
        kinds = ["sw", "dcp"] if repeat % 2 == 0 else ["dcp", "sw"]
        paths = {"sw": root / f"sw-{repeat}", "dcp": root / f"dcp-{repeat}"}
        ops = {
            "sw_save": lambda: sw.save(paths["sw"], model, optim),
            "dcp_save": lambda: dcp.save(sw.dcp_state_dict(model, optim), checkpoint_id=str(paths["dcp"])),
            "sw_load": lambda: sw.load(paths["sw"], model, optim),
            "dcp_load": lambda: dcp.load(sw.dcp_state_dict(model, optim), checkpoint_id=str(paths["dcp"])),
        }
        for phase in ("save", "load"):
            for kind in kinds:
                seconds, growth = _timed(ops[f"{kind}_{phase}"])
                samples[f"{kind}_{phase}"].append(seconds)
                rss[f"{kind}_{phase}"].append(growth)
        dist.barrier()
        if rank == 0:
            disk = {kind: sum(f.stat().st_size for f in paths[kind].rglob("*") if f.is_file()) for kind in paths}
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    peak = torch.tensor([max(v) for v in rss.values()], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        num_params = sum(torch.Size(i.full_shape).numel() for i in infos.values())
        record = {"state_bytes": state_bytes, "num_params": num_params, "seconds": samples,
                  "peak_rss_growth_bytes": dict(zip(rss, peak.tolist())), "disk_bytes": disk}
        Path(args.out_file).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def markdown(args, record: dict) -> str:
    size = record["state_bytes"] / MB
    med = {k: statistics.median(v) for k, v in record["seconds"].items()}
    lines = [
        f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers ({record['num_params'] / 1e6:.1f}M "
        f"params), {args.strategy} on {args.world_size} ranks (gloo, 1 thread/rank), fp32 AdamW: "
        f"{size:.0f} MB of model state (params + 2 moments). Median of {args.repeats} repeats; both fsync; "
        "loads read from the page cache the saves filled. Disk: "
        f"shardwise {record['disk_bytes']['sw'] / MB:.0f} MB, DCP {record['disk_bytes']['dcp'] / MB:.0f} MB.",
        "",
        "| operation | shardwise s | DCP s | shardwise MB/s | DCP MB/s | shardwise ÷ DCP throughput | "
        "peak RSS growth shardwise / DCP MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for phase in ("save", "load"):
        a, b = med[f"sw_{phase}"], med[f"dcp_{phase}"]
        ra = record["peak_rss_growth_bytes"][f"sw_{phase}"] / MIB
        rb = record["peak_rss_growth_bytes"][f"dcp_{phase}"] / MIB
        lines.append(f"| {phase} | {a:.3f} | {b:.3f} | {size / a:.0f} | {size / b:.0f} | {b / a:.2f}× | "
                     f"{ra:.1f} / {rb:.1f} |")
    return "\n".join(lines) + "\n"


def run_launcher(args) -> None:
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="shardwise-bench-ckpt-"))
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp, "record.json")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.world_size}", __file__, "--worker", "--out-file", str(out_file),
                "--scratch", str(scratch)]
        for flag in ("vocab", "d_model", "layers", "heads", "seq", "strategy", "world_size", "repeats"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        started = time.time()
        done = subprocess.run(argv, env=env, timeout=args.timeout)
        if done.returncode != 0:
            sys.exit(f"the ranks failed (exit status {done.returncode})")
        record = json.loads(out_file.read_text())
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "out_file")}
    meta = {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "wall_s": time.time() - started}
    (out / "checkpoint.json").write_text(json.dumps({"settings": settings, "meta": meta, **record}, indent=1))
    table = markdown(args, record)
    (out / "checkpoint.md").write_text(table)
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
