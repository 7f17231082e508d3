"""Benchmark: shardwise zero1/zero2/zero3 against torch DDP, DDP + ZeroRedundancyOptimizer,
FSDP2 `fully_shard` and DeepSpeed ZeRO 1/2/3, on the same GPT, the same data and the same seed,
in one run.

    python bench/speed/strategies.py                                   # full: 29.5M GPT, ws 2 and 4
    python bench/speed/strategies.py --d-model 64 --layers 2 --vocab 256 --steps 3 --world-sizes 2
    python bench/speed/strategies.py --configs ddp,zero3,ds_zero3      # a subset of the arms
    python bench/speed/strategies.py --world-sizes 4 --out bench/comm/results \
        --configs local,ddp,zero3,zero3_hsdp,zero3_hpz,zero3_hpz_q8,zero3_hpz_q4 --name strategies_comm_ws4
                                                                 # issue 47's arms, 2 x 2 nodes (comm_arms.py)
    python bench/speed/strategies.py --world-sizes 2 \
        --configs ddp,fsdp2,zero2,zero3,ddp+compile,fsdp2+compile,zero1+compile,zero2+compile,zero3+compile
                                                                 # compiled arms (--compile-backend, default inductor)

The DeepSpeed arms (bench/speed/deepspeed_arms.py) are skipped, with the reason printed, where
deepspeed is not installed.

Without `--worker` the script is the launcher: every (config, world size) runs as
fresh ranks under `torch.distributed.run`, so each peak RSS is that config's own (the timed
runs go in rounds, each round in its own shuffled order: Note [round order]), then the
launcher writes bench/speed/results/strategies.{json,md,png} (`--name NAME`: NAME.{json,md,png}; which
file answers which question: bench/README.md). With `--worker` it is one rank (or the single-process
reference) and writes its numbers to `--out-dir`.

Note [two RSS runs]: glibc keeps freed heap blocks resident, so on CPU a sharded
strategy's savings hardly show in RSS. Each config therefore runs twice: the timed
run with the default allocator, and a short run with MALLOC_MMAP_THRESHOLD_=65536
(large blocks are mmap'd and returned on free) that reports only peak RSS, since
that allocator makes steps slower.

Note [CPU-bound]: on the CPU machine every rank runs one compute thread and the ranks share
the cores, and gloo's transfers over loopback are CPU work too (copies through the kernel).
Each run therefore also records each rank's process CPU time per step (all its threads); summed
over the ranks, it comes near cores x step time when the cores were saturated. There overlap
buys nothing and an arm is faster only by doing less work: less communication, fewer copies,
less Python, a smaller optimizer step.

Note [engine-free bound]: zero1 and zero2 move the bytes DDP moves (a reduce-scatter and an
all-gather in place of an all-reduce) and each rank steps 1/N of the optimizer. An engine that
cost nothing more, over collectives that cost what DDP's all-reduce does, would therefore step in
DDP's step time less (N-1)/N of DDP's optimizer step: the first bound, "optimizer only". zero3 moves
one more all-gather of the parameters (backward gathers each unit again), so its bound adds one.
On gloo the two collectives do not cost what the one all-reduce does: at 2 ranks the reduce-scatter
and all-gather of the bench GPT's values, in the engine's fastest forms, took 1.00-1.44x DDP's
bucketed all-reduce of the same bytes, median 1.21 over 15 timings in five runs (`python -m
torch.distributed.run --standalone --nproc-per-node=2 bench/speed/raw_forms.py`: 111-118 ms against 87-91;
docs/measured.md). So the DDP run also times the
three forms with no engine around them (bench/speed/raw_forms.py, Note [raw forms]), and the second
bound, "with gloo's forms", adds (reduce + gather - all-reduce) over DDP's step: the floor of any
engine that steps 1/N of the optimizer between a reduce-scatter and an all-gather on these
collectives, and for zero3 one gather more. Both per round, as ratios to DDP; a first-order floor
(each form timed on an idle host, where in a step it shares the cores with compute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
import bench.speed.comm_arms as comm  # noqa: E402
import bench.speed.deepspeed_arms as ds  # noqa: E402
from bench.common.launch import run_logged  # noqa: E402
from bench.speed.raw_forms import FORMS, raw_forms_seconds  # noqa: E402
from bench.speed.strategies_report import markdown, plot  # noqa: E402

# Note [compiled arms]: "X+compile" is arm X under torch.compile (--compile-backend), each the way its
# users compile it: torch DDP and shardwise compile the whole model (`torch.compile(model)`); FSDP2
# applies fully_shard per block and then compiles each block (torchtitan's order and grain). The
# warm-up steps take the compilation, so the timed steps exclude it.
COMPILED = ("ddp", "fsdp2", "zero1", "zero2", "zero3")
# Note [hybrid arms]: "zero3_hsdp" is shardwise zero3 and "fsdp2_hsdp" FSDP2's fully_shard on a 2-D
# ("replicate", "shard") mesh of 2 replicas x N/2 ranks (HSDP). On one host the links between the "nodes"
# are loopback like the rest, so the split between in-node and across-node traffic is simulated only.
HYBRID = ("zero3_hsdp", "fsdp2_hsdp")
# "zero3_kept": zero3 with sw.shard(keep_comm_buffers=True), its pool kept between steps (Note [lean tail] in
# engine/comm/buffers.py): the speed side of that trade, asked for by name (bench/overhead/paired_steps.py --arms).
CONFIGS = ("local", "ddp", "ddp_zero", "fsdp2", "zero1", "zero2", "zero3", "zero3_kept", *HYBRID, *comm.CONFIGS,
           *ds.CONFIGS, *(f"{c}+compile" for c in COMPILED))
DEFAULT_CONFIGS = tuple(c for c in CONFIGS if c not in comm.CONFIGS  # those need ws >= 4 (Note [comm arms])
                        and c != "zero3_kept")
LABELS = {"local": "no communication (each rank alone)",
          "ddp": "torch DDP", "ddp_zero": "DDP + ZeroRedundancyOptimizer", "fsdp2": "FSDP2 fully_shard",
          "zero1": "shardwise zero1", "zero2": "shardwise zero2", "zero3": "shardwise zero3",
          "zero3_kept": "shardwise zero3, comm buffers kept between steps",
          "zero3_hsdp": "shardwise zero3, 2 x N/2 mesh", "fsdp2_hsdp": "FSDP2 HSDP, 2 x N/2 mesh", **comm.LABELS,
          **ds.LABELS}
LABELS.update({f"{c}+compile": f"{LABELS[c]}, compiled" for c in COMPILED})
# ZeRO paper's model-state bytes per parameter for fp32 AdamW (4 param + 4 grad + 8 moments),
# as (replicated bytes, sharded bytes / N).
FORMULA = {"local": (16, 0), "ddp": (16, 0), "ddp_zero": (8, 8), "zero1": (8, 8), "zero2": (4, 12),
           "zero3": (0, 16), "fsdp2": (0, 16), "zero3_hsdp": (0, 32), "fsdp2_hsdp": (0, 32),  # 16 / (N/2)
           **comm.FORMULA, **ds.FORMULA}
FORMULA.update({f"{c}+compile": FORMULA[c] for c in COMPILED})
MIB = 2**20
RAW_FORMS = tuple(f"raw_{form}_s" for form in FORMS)  # the DDP run's (Note [raw forms])
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mmap-steps", type=int, default=3, help="steps of the MALLOC_MMAP_THRESHOLD_ run")
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per config, in rounds of one run of each config, each round in its own "
                        "shuffled order (Note [round order]), so a burst of load on this shared machine hits "
                        "them all alike; the median of the per-run medians is reported (default: 3)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated arms (default: all but {','.join(comm.CONFIGS)}, which need "
                        "--world-sizes 4: bench/speed/comm_arms.py)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the X+compile arms")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--no-mmap-run", action="store_true", help="skip the MALLOC_MMAP_THRESHOLD_ RSS runs")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before one run is killed")
    p.add_argument("--out", default=str(RESULTS), help="folder of the results (default bench/speed/results)")
    p.add_argument("--name", default="strategies",
                   help="file name stem: writes OUT/NAME.{json,md,png}; one name per question, bench/README.md")
    # Set by the launcher only.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- one rank ----------------------------------------------------------------------


def build_model(args):
    from shardwise.models.gpt import GPT, GPTConfig

    torch.manual_seed(args.seed)  # every config and rank starts from the same weights
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                    n_layers=args.layers, n_heads=args.heads)
    return GPT(cfg)


def global_batch(args, step: int, world_size: int):
    """The same tokens for every config at this world size; each rank slices its rows."""
    gen = torch.Generator().manual_seed(args.seed * 1_000 + step)
    tokens = torch.randint(args.vocab, (world_size * args.batch, args.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def apply_config(model, config: str, args, world_size: int):
    """Wrap or shard `model` as `config` says; return (module to call, optimizer)."""
    if config.endswith("+compile"):  # Note [compiled arms]
        base = config.removesuffix("+compile")
        module, optimizer = apply_config(model, base, args, world_size)
        if base == "fsdp2":
            for block in model.blocks:
                block.compile(backend=args.compile_backend)
            return module, optimizer
        return torch.compile(module, backend=args.compile_backend), optimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import shardwise as sw
    from shardwise.models.gpt import Block

    adamw = dict(lr=args.lr, weight_decay=args.weight_decay)
    if config in ("reference", "local"):  # local: every rank trains its own rows, no collective at all
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if config == "ddp":
        ddp = DDP(model)  # torch defaults, as a user writes it
        return ddp, torch.optim.AdamW(ddp.parameters(), **adamw)
    if config == "ddp_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DDP(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **adamw)
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # root last: it owns embeddings, tied head, ln_f
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if config in HYBRID:  # Note [hybrid arms]
        from torch.distributed.device_mesh import init_device_mesh

        if world_size % 2:
            raise ValueError(f"{config} needs an even world size (2 replicas), not {world_size}")
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        if config == "zero3_hsdp":
            sw.shard(model, strategy="zero3", units=Block, mesh=mesh)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if config in ("zero1", "zero2", "zero3", "zero3_kept"):
        kept = {"keep_comm_buffers": True} if config == "zero3_kept" else {}
        sw.shard(model, strategy=config.removesuffix("_kept"), units=Block, **kept)
        # Built after shard(): the optimizer must only ever see this rank's shards.
        return model, torch.optim.AdamW(model.parameters(), **adamw)
    if config in comm.CONFIGS:  # Note [comm arms]
        return comm.apply(model, config, world_size, adamw)
    if config in ds.CONFIGS:
        return ds.initialize(model, config, args)
    raise ValueError(f"unknown config {config!r}; pick from {CONFIGS}")


def model_state_bytes(model, optimizer, config: str) -> int:
    """Bytes of distinct storages holding params, grads, optimizer state and engine buffers.

    Counted by storage, not by tensor, because zero1/zero2 shards are views into the full
    buffer and zero1's shard grads are views into `unit.grads.full`: a view costs nothing more.
    A storage resized to 0 (zero3's freed `full_flat`) counts 0.
    """
    from torch.distributed.tensor import DTensor

    storages: dict[int, int] = {}

    def add(t):
        if t is None:
            return
        if isinstance(t, DTensor):  # FSDP2: what this rank holds is the local shard
            t = t.to_local()
        s = t.untyped_storage()
        if s.nbytes() > 0:
            storages[s.data_ptr()] = s.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local AdamW
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                add(value)
    for unit in _units_of(model):
        for buffer in (unit.full_flat, unit.shard_flat, unit.grads.full):
            add(buffer)
    if config in ds.CONFIGS:
        for tensor in ds.state_tensors(model, optimizer):
            add(tensor)
    return sum(storages.values())


def _units_of(model) -> tuple:
    """The zero engine's units (none for ddp or an unsharded model)."""
    from shardwise.engine import engine_of

    engine = engine_of(model)
    return engine.units if engine is not None else ()


def run_worker(args) -> None:
    # Before any collective can hang: the launcher kills ranks by this pid on a timeout.
    Path(args.out_dir, f"pid{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))
    torch.set_num_threads(1)  # ranks share 2 cores; more threads only fight each other
    distributed = args.config != "reference"
    if distributed:
        import shardwise as sw

        sw.init()
    import torch.distributed as dist

    rank = dist.get_rank() if distributed else 0
    world_size = args.world_size  # the reference runs the global batch of this many ranks
    model = build_model(args)
    num_params = model.num_params()
    module, optimizer = apply_config(model, args.config, args, world_size)
    rows = slice(None) if not distributed else slice(rank * args.batch, (rank + 1) * args.batch)

    losses, times, cpu_times, optimizer_times, state_bytes = [], [], [], [], 0
    total = args.warmup + args.steps
    for step in range(total):
        idx, targets = global_batch(args, step, world_size)
        idx, targets = idx[rows], targets[rows]
        start, cpu_start = time.perf_counter(), time.process_time()
        if args.config in ds.CONFIGS:  # the engine's backward and step; grads are dropped inside
            loss = ds.train_step(module, idx, targets)
            if step == total - 1:
                state_bytes = model_state_bytes(model, optimizer, args.config)
        else:
            loss = module(idx, targets)
            loss.backward()
            stepping = time.perf_counter()
            optimizer.step()
            optimizer_times.append(time.perf_counter() - stepping)  # Note [engine-free bound]
            if step == total - 1:  # after a step, before grads are dropped: the most a step holds
                state_bytes = model_state_bytes(model, optimizer, args.config)
            optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)  # every thread of the rank: gloo's too
        losses.append(loss.item())

    forms = raw_forms_seconds(num_params, world_size) if args.config == "ddp" else {}  # Note [raw forms]
    record = {"rank": rank, "num_params": num_params, "losses": losses, "step_times": times, "cpu_times": cpu_times,
              "optimizer_times": optimizer_times, **{f"raw_{form}_s": seconds for form, seconds in forms.items()},
              "model_state_bytes": state_bytes,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    Path(args.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


# ---- launcher ----------------------------------------------------------------------


def worker_argv(args, config: str, world_size: int, warmup: int, steps: int, out_dir: str) -> list[str]:
    argv = [__file__, "--worker", "--config", config, "--world-size", str(world_size),
            "--out-dir", out_dir, "--warmup", str(warmup), "--steps", str(steps)]
    for flag in ("vocab", "d_model", "layers", "heads", "seq", "batch", "seed", "lr", "weight_decay",
                 "compile_backend"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if config == "reference":
        return [sys.executable] + argv
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world_size}"] + argv


# Note [round order]: the timed runs go in rounds, one run of each config a round, and every ratio is paired
# per round. Run in the same order every round, an arm always ran in the same place and after the same arm
# (zero1 right after DDP): whatever one run leaves behind for the next (a warm page cache, a core's
# frequency, a neighbour's burst ending) would favour or burden one arm the same way in every round. Each
# round therefore runs the configs in its own order, shuffled from --seed and the round (round 0 too),
# printed and saved in the JSON's meta as `round_orders`.
def round_orders(configs: list[str], repeats: int, seed: int) -> list[list[str]]:
    """The order of `configs` in each of `repeats` rounds (Note [round order])."""
    orders = []
    for r in range(repeats):
        order = list(configs)
        random.Random(seed * 1_000 + r).shuffle(order)
        orders.append(order)
    return orders


def launch(args, config: str, world_size: int, *, warmup: int, steps: int, mmap: bool) -> dict:
    """Run one config in fresh processes; return the per-rank records or the error."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(ds.env() if config in ds.CONFIGS else {}))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # Note [two RSS runs]
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = worker_argv(args, config, world_size, warmup, steps, out_dir)
        error, log = run_logged(cmd, env, out_dir, args.timeout)
        if error:
            return {"error": error, "output_tail": log[-3000:]}
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    return {"ranks": sorted(ranks, key=lambda r: r["rank"])}


def summarize(args, config: str, world_size: int, timed: dict, mmap: dict | None, reference: dict | None) -> dict:
    row = {"config": config, "label": LABELS[config], "world_size": world_size, "timed": timed, "mmap": mmap}
    if "error" in timed:
        return row
    ranks = timed["ranks"]
    # A step takes as long as its slowest rank; losses average because slices are equal-sized.
    step_max = [max(r["step_times"][i] for r in ranks) for i in range(len(ranks[0]["step_times"]))]
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(len(ranks[0]["losses"]))]
    psi = ranks[0]["num_params"]
    replicated, sharded = FORMULA[config]
    row.update(
        median_step_s=statistics.median(step_max[args.warmup:]),
        step_times_max_over_ranks=step_max,
        losses=losses,
        model_state_mib=max(r["model_state_bytes"] for r in ranks) / MIB,
        formula_mib=(replicated * psi + sharded * psi / world_size) / MIB,
        peak_rss_mib=max(r["peak_rss_bytes"] for r in ranks) / MIB,
        num_params=psi,
        # The CPU work of a step: each rank's median, summed over the ranks (Note [CPU-bound]).
        cpu_s_per_step=sum(statistics.median(r["cpu_times"][args.warmup:]) for r in ranks),
    )
    for key in RAW_FORMS:  # ddp's run: Note [engine-free bound]
        if ranks[0].get(key) is not None:
            row[key] = max(r[key] for r in ranks)
    if ranks[0]["optimizer_times"]:  # not the DeepSpeed arms, whose engine steps inside train_step
        row["optimizer_s"] = statistics.median(
            max(r["optimizer_times"][i] for r in ranks) for i in range(args.warmup, len(step_max)))
    if mmap and "ranks" in mmap:
        row["peak_rss_mmap_mib"] = max(r["peak_rss_bytes"] for r in mmap["ranks"]) / MIB
    if reference and "ranks" in reference:
        ref_losses = reference["ranks"][0]["losses"]
        row["reference_losses"] = ref_losses
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
    return row


def combine_repeats(repeats: list[dict]) -> dict:
    """One row from several timed runs of a config: the first run's memory and losses, the
    median of the per-run median step times, and their spread."""
    ok = [r for r in repeats if "median_step_s" in r]
    if not ok:
        return repeats[0]
    row = dict(ok[0])
    medians = [r["median_step_s"] for r in ok]
    cpu = [r["cpu_s_per_step"] for r in ok]
    optimizer = [r.get("optimizer_s") for r in ok]
    row.update(median_step_s=statistics.median(medians), run_medians_s=medians,
               cpu_s_per_step=statistics.median(cpu), run_cpu_s=cpu,
               run_optimizer_s=optimizer, optimizer_s=None if None in optimizer else statistics.median(optimizer),
               **{f"run_{key}": [r.get(key) for r in ok] for key in RAW_FORMS},
               max_loss_diff=max(r.get("max_loss_diff", 0.0) for r in ok))
    return row


def add_loss_diff_vs_ddp(group: list[dict]) -> None:
    """Each row's largest per-step loss difference from torch DDP's in the same run (same data,
    same seed): float rounding only, unless an arm is configured differently (printed)."""
    ddp = next((r for r in group if r["config"] == "ddp" and "losses" in r), None)
    for row in group:
        if ddp is not None and "losses" in row:
            row["max_loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(row["losses"], ddp["losses"]))
            if row["config"] in ds.CONFIGS:
                print(f"ws={row['world_size']} {row['config']}: losses {[round(x, 6) for x in row['losses']]}, "
                      f"max |loss - DDP's| = {row['max_loss_diff_vs_ddp']:.2e}")


def run_launcher(args) -> None:
    from tqdm import tqdm

    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        sys.exit(f"--configs: unknown {sorted(unknown)}; pick from {','.join(CONFIGS)}")
    unfit = comm.unfit_world_sizes(configs, world_sizes)
    if unfit:
        sys.exit(f"--configs {','.join(c for c in configs if c in comm.CONFIGS)} run on 2 simulated nodes of N/2 "
                 f"ranks: drop world sizes {unfit} (use --world-sizes 4)")
    skipped = ds.unavailable() if set(configs) & set(ds.CONFIGS) else None
    if skipped:
        print(f"skipping {', '.join(c for c in configs if c in ds.CONFIGS)}: {skipped}")
        configs = [c for c in configs if c not in ds.CONFIGS]
    mmap_run = not args.no_mmap_run
    total_steps = args.warmup + args.steps
    runs = [(ws, "reference", False, 0) for ws in world_sizes]
    orders = round_orders(configs, args.repeats, args.seed)  # Note [round order]
    print("round orders: " + "; ".join(", ".join(order) for order in orders))
    runs += [(ws, c, False, r) for ws in world_sizes for r in range(args.repeats) for c in orders[r]]
    if mmap_run:
        runs += [(ws, c, True, 0) for ws in world_sizes for c in configs]

    raw: dict = {}
    started = time.time()
    for ws, config, mmap, repeat in tqdm(runs, desc="runs", unit="run"):
        tqdm.write(f"ws={ws} {config}{' (mmap RSS)' if mmap else f' (timed run {repeat + 1})'}")
        if mmap:  # only peak RSS is read from this run (Note [two RSS runs])
            result = launch(args, config, ws, warmup=0, steps=args.mmap_steps, mmap=True)
        else:
            result = launch(args, config, ws, warmup=args.warmup, steps=args.steps, mmap=False)
        if "error" in result:
            tqdm.write(f"  FAILED: {result['error']}\n{result['output_tail'][-1500:]}")
        raw[(ws, config, mmap, repeat)] = result

    rows = []
    for ws in world_sizes:
        for c in configs:
            repeats = [summarize(args, c, ws, raw[(ws, c, False, r)], raw.get((ws, c, True, 0)),
                                 raw[(ws, "reference", False, 0)]) for r in range(args.repeats)]
            rows.append(combine_repeats(repeats))
        add_loss_diff_vs_ddp([r for r in rows if r["world_size"] == ws])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("worker", "config", "world_size", "out_dir")}
    references = {str(ws): raw[(ws, "reference", False, 0)] for ws in world_sizes}
    meta = {"round_orders": orders, "torch": torch.__version__, "deepspeed": ds.version(), "deepspeed_skipped": skipped,
            "python": sys.version.split()[0], "cpus": os.cpu_count(), "total_steps": total_steps,
            "wall_s": time.time() - started}
    (out / f"{args.name}.json").write_text(json.dumps(
        {"settings": settings, "meta": meta, "reference": references, "rows": rows}, indent=1))
    table = markdown(rows, world_sizes, args, mmap_run)
    (out / f"{args.name}.md").write_text(table)
    plot(rows, world_sizes, out / f"{args.name}.png")
    print(table)


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
