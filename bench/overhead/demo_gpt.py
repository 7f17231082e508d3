"""Benchmark: `make demo`'s step (python -m shardwise.demo: its GPT, its text, its batches, its clipped AdamW step)
under torch DDP, shardwise ddp, shardwise zero3 (units=Block, the demo's settings), FSDP2 `fully_shard` per block
plus the root and the same route with no engine, every arm in the same processes and stepping in turn (Note [paired
steps] in bench/overhead/paired_steps.py), at 2 ranks and at 1 rank (Note [demo comm stripped]).

    python bench/overhead/demo_gpt.py                                  # quiet host: 2 and 1 rank, 100 rounds (~5 min)
    python bench/overhead/demo_gpt.py --rounds 2 --warmup 1 --layers 2 --width 64   # does it run

It answers issue 58's "make demo's zero3 / ddp <= 1.05": is that reachable on this host? FSDP2 per block is the
field's form of the same route (a gather before each block, a reduce-scatter after it); if it costs as much over
DDP as zero3 does, the host, not the engine, bounds the ratio. Each round every arm takes one demo step in an order
rotated per round; a step is timed as the demo times it (its batch drawn, forward, backward, clip to 1.0, AdamW,
zero_grad, the loss averaged over ranks and read) and is its slowest rank's; each ratio pairs two arms' steps of
the same round.

Note [packed arm]: on gloo the engine broadcasts each parameter of 64 KiB or more per rank straight into its
full region, one broadcast per rank (Note [gathered in place], engine/comm/collectives.py), and packs the rest
into one all-gather: a demo block (4 such matrices) is 5 broadcasts per rank per gather, 114 broadcasts a step at 2
ranks where FSDP2 issues 13 all-gathers (bench/overhead/step_counts.py). "zero3_packed" is zero3 with that
threshold raised for its own steps only (`packed_gathers`, as bench/comm/gather_in_place.py's "packed" form):
every unit's rows through one all-gather and a copy-out, 2 broadcasts per gather. It is a bench arm, not an option;
at 1 rank it is zero3 (no collective either way: OneRankForms, engine/comm/strategy.py).

Note [demo comm stripped]: at 1 rank every collective is a local copy or nothing, so an arm's step there is its
compute plus its host-side bookkeeping (hooks, views, copies into and out of flat buffers, allocations). zero3
÷ DDP at 1 rank is then what the engine's per-unit host work costs apart from communication, and the 2-rank step
less the 1-rank step is what communication (gloo's time on the same 2 cores) adds. Each rank keeps the demo's
per-rank batch at both world sizes, so a rank computes the same at 1 rank as at 2.

"manual_zero3" and "manual_zero3_gloo" are the same per-block route with no engine: plain torch.distributed, flat
shards, hooks, AdamW on 7 flat tensors (bench/overhead/manual_zero3.py, Note [engine-free route]), in torch's forms
and in the engine's gloo forms: what the route itself costs over DDP on this host. zero3 over the better of the two
is what the engine adds.

The ranks run with `MALLOC_MMAP_THRESHOLD_=65536` unless it is set, as the demo's launcher starts them (Note [demo
memory] in shardwise/demo.py; `sw.init()` would set the same threshold: Note [allocator at init]). Writes
bench/overhead/results/NAME.{json,md,png} (`--name`, default demo_gpt).
"""

from __future__ import annotations

import argparse
import contextlib
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
from bench.common.launch import publish, run_logged  # noqa: E402
from bench.common.plot import panels, save  # noqa: E402
from bench.overhead.paired_steps import _spread as spread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("torch_ddp", "sw_ddp", "zero3", "zero3_packed", "fsdp2", "manual_zero3", "manual_zero3_gloo")  # torch_ddp first
LABELS = {"torch_ddp": "torch DDP", "sw_ddp": "shardwise ddp (make demo's ddp)",
          "zero3": "shardwise zero3, units=Block",
          "zero3_kept": "zero3, comm buffers kept between steps (keep_comm_buffers=True)",
          "zero3_packed": "zero3, every gather packed (Note [packed arm])",
          "fsdp2": "FSDP2 fully_shard per block + root",
          "manual_zero3": "engine-free zero3 per block, torch's forms (Note [engine-free route])",
          "manual_zero3_gloo": "engine-free zero3 per block, the engine's gloo forms (Note [engine-free route])"}
PAIRS = (("zero3", "sw_ddp"), ("zero3_kept", "sw_ddp"), ("zero3", "zero3_kept"), ("zero3", "fsdp2"),
         ("fsdp2", "sw_ddp"), ("zero3_packed", "zero3"),
         ("zero3", "manual_zero3_gloo"), ("zero3", "manual_zero3"))  # (numerator, base)
MANUAL = {"manual_zero3": "torch", "manual_zero3_gloo": "gloo"}  # arm -> the engine-free route's forms


def parse_args(argv=None) -> argparse.Namespace:
    from shardwise import demo

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100, help="timed rounds of one step per arm, after --warmup")
    p.add_argument("--warmup", type=int, default=5, help="rounds dropped")
    p.add_argument("--world-sizes", default="2,1", help="comma-separated; 1 is the comm-stripped run")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}, zero3_kept")
    for flag, default in (("batch", demo.BATCH), ("seq", demo.SEQ), ("layers", demo.LAYERS),
                          ("width", demo.WIDTH)):  # the demo's own settings (shardwise/demo.py)
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--lr", type=float, default=3e-3, help="the demo's AdamW learning rate")
    p.add_argument("--timeout", type=float, default=1200, help="seconds before one world size's run is killed")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="demo_gpt")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the folder the ranks write into
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


@contextlib.contextmanager
def packed_gathers():
    """Every gather packed while inside (Note [packed arm]); the engine's threshold restored after."""
    import shardwise.engine.comm.collectives as coll

    previous, coll.GLOO_IN_PLACE_FROM_BYTES = coll.GLOO_IN_PLACE_FROM_BYTES, 2**62
    try:
        yield
    finally:
        coll.GLOO_IN_PLACE_FROM_BYTES = previous


def build_arm(arm: str, args, world_size: int):
    """The demo's GPT from the demo's seed, under `arm`: (module to call, optimizer, clip function, the context
    its steps run in)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardwise as sw
    from shardwise.demo import BYTE_VOCAB
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)  # the demo's seed: every arm starts from the same weights
    model = GPT(GPTConfig(vocab_size=BYTE_VOCAB, seq_len=args.seq, d_model=args.width, n_layers=args.layers,
                          n_heads=4))
    module = model
    if arm == "torch_ddp":
        module = DDP(model)  # torch defaults, as a user writes it
    elif arm in ("sw_ddp", "zero3", "zero3_packed", "zero3_kept"):  # exactly the demo's call
        strategy = {"sw_ddp": "ddp", "zero3_packed": "zero3", "zero3_kept": "zero3"}.get(arm, arm)
        options = {} if arm == "sw_ddp" else {"units": Block}
        sw.shard(model, strategy=strategy, **options, **({"keep_comm_buffers": True} if arm == "zero3_kept" else {}))
    elif arm == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # root last: embeddings, the tied head, ln_f
    elif arm in MANUAL:  # bench/overhead/manual_zero3.py: its own optimizer over flat shards and its own clip
        from bench.overhead.manual_zero3 import build

        return (*build(model, MANUAL[arm], args.lr), contextlib.nullcontext)
    else:
        raise ValueError(f"unknown arm {arm!r}; pick from {ARMS}")
    if arm in ("sw_ddp", "zero3", "zero3_packed", "zero3_kept"):
        def clip():
            return sw.clip_grad_norm_(model, 1.0)
    else:  # torch's: full gradients under DDP; DTensor gradients under FSDP2 (a global norm)
        def clip():
            return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    context = packed_gathers if arm == "zero3_packed" else contextlib.nullcontext
    return module, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1), clip, context


def demo_step(module, optimizer, clip, context, text, step: int, args, rank: int, world_size: int,
              mark=lambda phase: None) -> tuple[float, float, float]:
    """(wall, CPU, loss) of one step as shardwise/demo.py's train_rank times it, from a barrier; `mark(phase)` is
    called as each phase begins (bench/overhead/step_counts.py counts per phase)."""
    import torch.distributed as dist

    dist.barrier()
    with context():
        return _timed_step(module, optimizer, clip, text, step, args, rank, world_size, mark)


def _timed_step(module, optimizer, clip, text, step, args, rank, world_size, mark) -> tuple[float, float, float]:
    """demo_step's timed part, inside the arm's context."""
    import torch.distributed as dist

    from shardwise.demo import global_batch

    start, cpu = time.perf_counter(), time.process_time()
    x, y = global_batch(text, step, args.batch * world_size, args.seq)
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    mark("forward")
    loss = module(x[rows], y[rows])
    mark("backward")
    loss.backward()
    mark("clip")
    clip()
    mark("step")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("loss")
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    value = mean_loss.item()
    return time.perf_counter() - start, time.process_time() - cpu, value


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.demo import load_text

    Path(args.worker, f"pid{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))  # run_logged's timeout
    torch.set_num_threads(1)  # as the demo's ranks
    sw.init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    arms = args.arms.split(",")
    text = load_text()
    built = {arm: build_arm(arm, args, world_size) for arm in arms}
    record = {arm: {"wall": [], "cpu": [], "loss": []} for arm in arms}
    for r in range(args.warmup + args.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotated: no arm always first
            for key, value in zip(("wall", "cpu", "loss"), demo_step(*built[arm], text, r, args, rank, world_size)):
                record[arm][key].append(value)
    for arm in arms:  # a step lasts as long as its slowest rank
        times = torch.tensor(record[arm]["wall"], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        record[arm]["wall"] = times.tolist()
    if rank == 0:
        Path(args.worker, "record.json").write_text(json.dumps(record))
    dist.barrier()
    sw.shutdown()


# ---- launcher ----------------------------------------------------------------------


def summarize(args, record: dict) -> dict:
    """Per arm: steps, × torch DDP paired per round, CPU × DDP, loss distance from DDP; and PAIRS' ratios."""
    keep = slice(args.warmup, None)
    base = record.get("torch_ddp") or next(iter(record.values()))
    summary = {"arms": {}, "pairs": {}}
    for arm, data in record.items():
        wall, cpu = data["wall"][keep], data["cpu"][keep]
        summary["arms"][arm] = {"step_s": wall, "x_ddp": [a / b for a, b in zip(wall, base["wall"][keep])],
                                "cpu_x_ddp": [a / b for a, b in zip(cpu, base["cpu"][keep])],
                                "max_loss_diff_vs_ddp": max(abs(a - b) for a, b in zip(data["loss"], base["loss"]))}
    for top, bottom in PAIRS:
        if top in record and bottom in record:
            summary["pairs"][f"{top}/{bottom}"] = [a / b for a, b in zip(record[top]["wall"][keep],
                                                                         record[bottom]["wall"][keep])]
    return summary


def markdown(args, summaries: dict, command: str, wall_s: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    lines = [f"Command: `{command}` (commit {commit}, torch {torch.__version__}, {os.cpu_count()} cores, {wall_s:.0f} "
             "s). Machine: say here whether it was quiet.", "",
             f"make demo's GPT (vocab 256, d_model {args.width}, {args.layers} layers, 4 heads, seq {args.seq}, batch "
             f"{args.batch}/rank, AdamW lr {args.lr}, clipped to 1.0), gloo, 1 thread/rank, "
             f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 65536)}; every arm in the same "
             f"processes, one demo step each per round in a rotated order, {args.rounds} "
             f"rounds after {args.warmup} dropped (bench/overhead/demo_gpt.py). Step: the slowest rank's, from a "
             "barrier, timed as the demo times it; × DDP: over torch DDP's step of the same round, median "
             "(quartiles, range) over rounds; CPU: rank 0's process CPU seconds (gloo's threads too). At 1 rank "
             "the collectives are local: the engine's host cost apart from communication (Note [demo comm "
             "stripped])."]
    for world_size, summary in summaries.items():
        lines += ["", f"### {world_size} rank{'s' if world_size > 1 else ''}", "",
                  "| arm | step ms | × torch DDP | CPU × DDP (rank 0) | max loss diff vs DDP |",
                  "|---|---:|---:|---:|---:|"]
        for arm, row in summary["arms"].items():
            lines.append(f"| {LABELS[arm]} | {statistics.median(row['step_s']) * 1e3:.1f} | {spread(row['x_ddp'])} | "
                         f"{statistics.median(row['cpu_x_ddp']):.3f} | {row['max_loss_diff_vs_ddp']:.1e} |")
        lines += [""] + [f"- {pair}, paired per round: {spread(ratios)}" for pair, ratios in summary["pairs"].items()]
        if "torch_ddp" in summary["arms"]:
            units = args.layers + 1  # a unit per block and the root (FSDP2: fully_shard per block and the root)
            lines.append(f"- per unit, over torch DDP's step of the same round ({units} units), ms: " + "; ".join(
                f"{arm} {statistics.median(_per_unit(row, summary, units)):.2f}"
                for arm, row in summary["arms"].items() if arm != "torch_ddp" and arm != "sw_ddp"))
    if 1 in summaries and len(summaries) > 1:  # Note [demo comm stripped]
        alone = {arm: statistics.median(row["step_s"]) for arm, row in summaries[1]["arms"].items()}
        added = [f"{world_size} ranks: " + ", ".join(
            f"{arm} {(statistics.median(row['step_s']) - alone[arm]) * 1e3:.1f}"
            for arm, row in summary["arms"].items() if arm in alone)
            for world_size, summary in summaries.items() if world_size != 1]
        lines += ["", "What communication adds (the median step at N ranks less the median step at 1 rank), ms: "
                  + "; ".join(added)]
    return "\n".join(lines) + "\n"


def _per_unit(row: dict, summary: dict, units: int) -> list[float]:
    """(this arm's step - torch DDP's step of the same round) / units, ms, per round."""
    return [(a - b) * 1e3 / units for a, b in zip(row["step_s"], summary["arms"]["torch_ddp"]["step_s"])]


def plot(summaries: dict, path: Path) -> None:
    fig, axes = panels(cols=len(summaries))
    for ax, (world_size, summary) in zip(axes[0], summaries.items()):
        for arm, row in summary["arms"].items():
            if arm != "torch_ddp":
                ax.plot(row["x_ddp"], marker=".", linestyle="-",
                        label=f"{arm} (median {statistics.median(row['x_ddp']):.3f})")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.05, color="grey", linestyle=":", label="issue 58's 1.05")
        ax.set_title(f"{world_size} rank{'s' if world_size > 1 else ''}")
        ax.set_xlabel("round (one step per arm)")
        ax.set_ylabel("step time × torch DDP's, same round")
        ax.legend(fontsize=8)
    save(fig, path, "make demo's GPT: each arm's step over torch DDP's of the same round")


def run_ranks(script: str, world_size: int, timeout: float, result: str) -> dict:
    """Run `script` (this command line's flags) as `world_size` ranks under torchrun; the JSON its rank 0 wrote
    as RESULT in the folder handed to `--worker`. Exits with the log's tail when the ranks fail."""
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               script, *sys.argv[1:], "--worker", out_dir]
        env = {"MALLOC_MMAP_THRESHOLD_": "65536", **os.environ, "OMP_NUM_THREADS": "1"}  # as the demo's launcher
        error, log = run_logged(cmd, env, out_dir, timeout)
        if error:
            sys.exit(f"the {world_size}-rank run failed ({error}):\n{log[-4000:]}")
        return json.loads(Path(out_dir, result).read_text())


def run_launcher(args) -> None:
    started = time.time()
    records = {int(w): run_ranks(__file__, int(w), args.timeout, "record.json") for w in args.world_sizes.split(",")}
    summaries = {ws: summarize(args, record) for ws, record in records.items()}
    command = ("python bench/overhead/demo_gpt.py " + " ".join(sys.argv[1:])).strip()
    settings = {k: v for k, v in vars(args).items() if k != "worker"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    publish(out, args.name, markdown(args, summaries, command, time.time() - started),
            {"settings": settings, "records": records, "summaries": summaries})
    plot(summaries, out / f"{args.name}.png")


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
