"""Benchmark: `sw.save` / `sw.load` against `torch.distributed.checkpoint` (DCP) on the same
sharded model, in the same run, and the cost of checkpointing to a training loop.

    python bench/checkpoints/checkpoint.py                                    # 29.5M GPT, zero3, 2 ranks
    python bench/checkpoints/checkpoint.py --d-model 128 --layers 2 --vocab 1024 --repeats 2 --rounds 3

The launcher starts `--world-size` ranks under `torch.distributed.run`; each rank builds
the GPT, shards it, takes one AdamW step (so optimizer state exists), then, `--repeats`
times, saves it with both (alternating which goes first, so neither always meets a
page cache the other warmed) and loads it back in place with both. DCP gets the same
tensors through `sw.dcp_state_dict` (DTensor views of each rank's rows). Both fsync
their files (DCP's FileSystemWriter default, sw.save's `durable=True`). Throughput is
model-state bytes (parameters and AdamW moments, all ranks) per second of the slowest
rank; peak RSS growth is the kernel's high-water mark during the call minus RSS before.
The ceiling beside them: every rank writes and fsyncs as many bytes as its shardwise file,
all in parallel, in the same rounds (the raw write speed of this disk), its write and fsync
timed apart; sw.save's own time split into phases (Note [save phases] in checkpoint/write/disk.py).
Bytes read: after the timed repeats, one more load each from a cold page cache (the files'
pages dropped with posix_fadvise), counting every rank's /proc/self/io: read_bytes (fetched
from the disk) and rchar (moved by read syscalls), against the checkpoint's bytes on disk.

`--no-early-writeback` turns off the save's early writeback (Note [early writeback]) for an A/B.

Then the same ranks train with a checkpoint every N steps, `--saves-per-period` saves to a period,
and compare sw.save_async with the blocking sw.save by the periods' wall time, paired within each
round, and by the saves' own clocks (Note [training arms] in bench/checkpoints/checkpoint_training.py), each
beside its noise row. Results: bench/checkpoints/results/checkpoint.{json,md,png}.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.checkpoints.checkpoint_training import ARM_LABELS, ARMS, overheads, step_costs, train_arms, training_table  # noqa: E402
from bench.common.launch import rss_bytes  # noqa: E402

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
    p.add_argument("--save-every", type=int, default=10, help="training steps between saves (Note [training arms])")
    p.add_argument("--saves-per-period", type=int, default=2,
                   help="saves in each training period, each followed by --save-every steps (Note [training arms])")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of the training arms (0: skip them)")
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per training step")
    p.add_argument("--scratch", default=None, help="where checkpoints are written (default: a temp dir)")
    p.add_argument("--no-early-writeback", action="store_true",
                   help="leave every byte to sw.save's last fsync (A/B of Note [early writeback])")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


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


def write_and_fsync(path: Path, payload: torch.Tensor, phases: dict) -> None:
    """The disk's ceiling for one rank: `payload`'s bytes into a fresh file, in 4 MiB writes, fsynced."""
    view, step = memoryview(payload.numpy()), 4 * MIB
    start_s = time.perf_counter()
    with open(path, "wb") as f:
        for start in range(0, len(view), step):
            f.write(view[start : start + step])
        f.flush()
        written_s = time.perf_counter()
        os.fsync(f.fileno())
    phases.update(write=written_s - start_s, fsync=time.perf_counter() - written_s)


def save_with_phases(path: Path, model, optim, phases: dict) -> None:
    """`sw.save`, keeping its phase times (Note [save phases])."""
    from shardwise.checkpoint.format.ranks import group_of
    from shardwise.checkpoint.write.save import complete, prepare

    began = time.perf_counter()
    job = prepare(path, model, optim, None, None, True, {})
    complete(job, group_of(job.model)[0])
    phases.update(job.phases.as_dict())
    # This rank's call beyond its phases: building the file's specs, the shared-directory check, the gaps.
    phases["outside"] = time.perf_counter() - began - sum(job.phases.as_dict().values())


def io_counts() -> list[int]:
    """This process's [read_bytes, rchar] from /proc/self/io; zeros where there is none."""
    try:
        with open("/proc/self/io") as f:
            fields = dict(line.split(": ") for line in f if line.strip())
        return [int(fields["read_bytes"]), int(fields["rchar"])]
    except (OSError, KeyError):
        return [0, 0]


def evict(directory: Path) -> None:
    """Drop a checkpoint's (clean, fsynced) pages from the page cache: the next read meets the disk."""
    for file in directory.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def slowest(values: dict) -> dict:
    """Each value's maximum over the ranks (a collective)."""
    import torch.distributed as dist

    tensor = torch.tensor(list(values.values()), dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return dict(zip(values, tensor.tolist()))


def run_worker(args) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import shardwise as sw
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.set_num_threads(1)
    if args.no_early_writeback:
        import shardwise.checkpoint.write.writer as files

        files.start_writeback = lambda fd, offset, nbytes: None
    sw.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                          n_layers=args.layers, n_heads=args.heads))
    sw.shard(model, strategy=args.strategy, **({} if args.strategy == "ddp" else {"units": Block}))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank))
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
    # This rank's share of a shardwise checkpoint: what the raw-write ceiling writes.
    sw.save(root / "size-probe", model, optim)
    world = dist.get_world_size()
    raw_bytes = (root / "size-probe" / f"rank-{rank:05d}-of-{world:05d}.safetensors").stat().st_size
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root / "size-probe")
    raw_total = torch.tensor([raw_bytes], dtype=torch.float64)
    dist.all_reduce(raw_total)
    payload = torch.randint(0, 256, (raw_bytes,), dtype=torch.uint8)  # random: nothing to compress or skip

    samples = {key: [] for key in ("sw_save", "dcp_save", "raw_save", "sw_load", "dcp_load")}
    rss = {key: [] for key in samples}
    phases = {"sw": [], "raw": []}  # per repeat: each phase's seconds on the slowest rank
    for repeat in range(args.repeats):
        sw_phases, raw_phases = {}, {}
        kinds = ["sw", "dcp", "raw"][repeat % 3:] + ["sw", "dcp", "raw"][:repeat % 3]
        paths = {"sw": root / f"sw-{repeat}", "dcp": root / f"dcp-{repeat}"}
        ops = {
            "sw_save": lambda: save_with_phases(paths["sw"], model, optim, sw_phases),
            "dcp_save": lambda: dcp.save(sw.dcp_state_dict(model, optim), checkpoint_id=str(paths["dcp"])),
            "raw_save": lambda: write_and_fsync(root / f"raw-{rank}.bin", payload, raw_phases),
            "sw_load": lambda: sw.load(paths["sw"], model, optim),
            "dcp_load": lambda: dcp.load(sw.dcp_state_dict(model, optim), checkpoint_id=str(paths["dcp"])),
        }
        for phase in ("save", "load"):
            for kind in kinds:
                if f"{kind}_{phase}" in ops:
                    seconds, growth = _timed(ops[f"{kind}_{phase}"])
                    samples[f"{kind}_{phase}"].append(seconds)
                    rss[f"{kind}_{phase}"].append(growth)
        phases["sw"].append(slowest(sw_phases))
        phases["raw"].append(slowest(raw_phases))
        if repeat == args.repeats - 1:
            reads = {kind: cold_read(paths[kind], ops[f"{kind}_load"], rank) for kind in ("sw", "dcp")}
        dist.barrier()
        (root / f"raw-{rank}.bin").unlink()
        if rank == 0:
            disk = {kind: sum(f.stat().st_size for f in paths[kind].rglob("*") if f.is_file()) for kind in paths}
            for path in paths.values():
                shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    payload = None  # freed before training: the arms measure time, not this buffer
    peak = torch.tensor([max(v) for v in rss.values()], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    training = train_arms(args, model, optim, root, tokens) if args.rounds > 0 else None
    if rank == 0:
        num_params = sum(torch.Size(i.full_shape).numel() for i in infos.values())
        record = {"state_bytes": state_bytes, "num_params": num_params, "seconds": samples,
                  "phases": phases, "cold_reads": reads,
                  "peak_rss_growth_bytes": dict(zip(rss, peak.tolist())), "disk_bytes": disk,
                  "raw_bytes": raw_total.item(), "training": training}
        Path(args.out_file).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def cold_read(path: Path, load, rank: int) -> dict:
    """Every rank's bytes read (read_bytes, rchar) by one `load()` of `path` from a cold page cache, and its
    seconds (slowest rank)."""
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        evict(path)
    before = io_counts()
    seconds, _ = _timed(load)
    counts = torch.tensor([a - b for a, b in zip(io_counts(), before)], dtype=torch.float64)
    dist.all_reduce(counts)
    return {"read_bytes": counts[0].item(), "rchar": counts[1].item(), "seconds": seconds}


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
    raw = med["raw_save"]
    lines += ["", f"Ceiling, in the same rounds: every rank writes and fsyncs as many bytes as its shardwise file "
              f"({record['raw_bytes'] / MB:.0f} MB in all), in parallel: {raw:.3f} s, "
              f"{record['raw_bytes'] / MB / raw:.0f} MB/s. shardwise's save takes {med['sw_save'] / raw:.2f}× the "
              f"ceiling's time, DCP's {med['dcp_save'] / raw:.2f}×."]
    lines += ["", *phase_table(record), "", *read_lines(record)]
    if record.get("training"):
        lines += ["", *training_table(args, record["training"]), "", *async_verdict(args, record["training"])]
    return "\n".join(lines) + "\n"


PHASES = ("start", "gather", "serialize", "checksum", "write", "fsync", "publish", "outside")


def phase_table(record: dict) -> list[str]:
    """Where sw.save's time goes (Note [save phases]), beside the ceiling's write and fsync."""
    sw_med = {k: statistics.median(p[k] for p in record["phases"]["sw"]) for k in PHASES}
    raw_med = {k: statistics.median(p[k] for p in record["phases"]["raw"]) for k in ("write", "fsync")}
    total = statistics.median(record["seconds"]["sw_save"])
    lines = ["sw.save by phase (Note [save phases] in checkpoint/write/disk.py: each phase's seconds on the slowest "
             "rank, median over the repeats; the phases of one rank need not add up to the save's wall time, which is "
             "the slowest rank's whole call; start = the checks, the partial directory and its id sent to every rank; "
             "publish = the records gathered, the index written and synced beside the files' fsyncs, the rename and "
             "the parent's fsync, Note [one wait for the disk] in checkpoint/write/commit.py; outside the phases = the "
             "rest of that rank's call), beside the ceiling's own write and fsync:", "",
             "| phase | sw.save s | % of the save | ceiling s |", "|---|---:|---:|---:|"]
    for key in PHASES:
        ceiling = f"{raw_med[key]:.3f}" if key in raw_med else "—"
        label = "outside the phases" if key == "outside" else key
        lines.append(f"| {label} | {sw_med[key]:.3f} | {100 * sw_med[key] / total:.0f}% | {ceiling} |")
    lines.append(f"| whole call | {total:.3f} | 100% | {statistics.median(record['seconds']['raw_save']):.3f} |")
    return lines


def read_lines(record: dict) -> list[str]:
    """Bytes a load reads, counted (issue 45: each byte once)."""
    out = []
    for kind, label in (("sw", "sw.load"), ("dcp", "DCP load")):
        reads, size = record["cold_reads"][kind], record["disk_bytes"][kind]
        out.append(f"{label} from a cold page cache: {reads['seconds']:.3f} s; read from the disk "
                   f"{reads['read_bytes'] / MB:.0f} MB ({reads['read_bytes'] / size:.2f}× the checkpoint's "
                   f"{size / MB:.0f} MB), through read syscalls {reads['rchar'] / MB:.0f} MB "
                   f"({reads['rchar'] / size:.2f}×).")
    return ["Bytes read, counted (/proc/self/io of every rank, one load after the repeats with the files' pages "
            "dropped from the page cache): " + " ".join(out) + " sw.load checks its rows over a map of each file, then "
            "reads each once with pread into the model and checks it there (Note [checked where applied] in "
            "checkpoint/read/mapped.py): its rows pass through read syscalls once."]


def async_verdict(args, training: dict) -> list[str]:
    """Issue 45's targets for sw.save_async (≤ the blocking save's cost, ≤ 2% of a step), by each measure."""
    over, costs = overheads(training), step_costs(args, training)
    a, b = statistics.median(over["sw_async"]), statistics.median(over["sw_sync"])
    noise = max(abs(v) for v in over["none"]) if over["none"] else 0.0
    paired = statistics.median(costs["paired"])
    paired_noise = max(abs(v) for v in costs["paired_noise"]) if costs["paired_noise"] else 0.0
    bound_a, bound_b = statistics.median(costs["bound_async"]), statistics.median(costs["bound_sync"])
    spare = (os.cpu_count() or 1) > args.world_size

    def verdict(ok: bool) -> str:
        return "met" if ok else "not met"

    return [f"sw.save_async against blocking sw.save (targets: ≤ the blocking save's cost, ≤ 2% of a step). "
            f"Periods' wall time: {a:+.1f}% against {b:+.1f}% of a step, {verdict(a <= b and a <= 2)}, the noise "
            f"row at most {noise:.1f}% from zero ({'resolved' if noise < abs(a - b) else 'unresolved'}). Paired "
            f"periods: {paired:+.1f}% of a step, the paired noise at most {paired_noise:.1f}% from zero "
            f"({'resolved' if paired_noise < abs(paired) else 'unresolved'}). Blocked + background CPU (from the "
            f"saves' own clocks): {bound_a:+.1f}% against {bound_b:+.1f}% of a step, "
            f"{verdict(bound_a <= bound_b and bound_a <= 2)}. "
            f"This host has {os.cpu_count()} cores for {args.world_size} ranks: "
            + ("a core to spare for the background write." if spare else
               "no core to spare, so the background write takes its CPU from training; the cheaper thing is done: "
               "the writer runs at the cheapest priority the OS allows (SCHED_IDLE, else nice 19: training gets the "
               "core whenever both want it) from a staging copy "
               "reused across saves, its fsyncs overlapped (Note [cheap background save] in "
               "checkpoint/write/background.py).")]


def plot(args, record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    training = record.get("training")
    fig, axes = plt.subplots(1, 2 if training else 1, figsize=(13 if training else 6.5, 4.2), squeeze=False)
    med = {k: statistics.median(v) for k, v in record["seconds"].items()}
    size = record["state_bytes"] / MB
    ax = axes[0][0]
    names = ["shardwise save", "DCP save", "shardwise load", "DCP load"]
    values = [size / med[k] for k in ("sw_save", "dcp_save", "sw_load", "dcp_load")]
    ax.bar(range(4), values, color=["tab:blue", "tab:orange", "tab:blue", "tab:orange"])
    ax.axhline(record["raw_bytes"] / MB / med["raw_save"], color="black", ls="--",
               label="raw parallel write+fsync (ceiling for saves)")
    ax.set_xticks(range(4))
    ax.set_xticklabels(names)
    ax.set_ylabel("MB/s (model state ÷ slowest rank's time)")
    ax.set_title(f"{args.strategy}, {args.world_size} ranks: checkpoint throughput")
    ax.legend(fontsize=8)
    if training:
        over = overheads(training)
        arms = [a for a in ARMS if over[a]]
        medians = [statistics.median(over[a]) for a in arms]
        low = [m - min(over[a]) for m, a in zip(medians, arms)]
        high = [max(over[a]) - m for m, a in zip(medians, arms)]
        ax = axes[0][1]
        ax.bar(range(len(arms)), medians, yerr=[low, high], capsize=6, color="tab:green")
        ax.axhline(5, color="red", ls="--", label="target 5%")
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels([ARM_LABELS[a] + (" (noise)" if a == "none" else "") for a in arms])
        ax.set_ylabel("% of a plain step (median, min..max over rounds)")
        ax.set_title(f"training overhead of a checkpoint every {args.save_every} steps")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_launcher(args) -> None:
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="shardwise-bench-ckpt-"))
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_file = Path(tmp, "record.json")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={args.world_size}", __file__, "--worker", "--out-file", str(out_file),
                "--scratch", str(scratch)]
        for flag in ("vocab", "d_model", "layers", "heads", "seq", "strategy", "world_size", "repeats",
                     "save_every", "saves_per_period", "rounds", "warmup_rounds", "batch"):
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        argv += ["--no-early-writeback"] if args.no_early_writeback else []
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
    plot(args, record, out / "checkpoint.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
