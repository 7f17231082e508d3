"""Where a step's host work goes, COUNTED rather than timed (a loaded host moves times, not counts): per training
step of make demo's GPT (bench/overhead/demo_gpt.py's arms, the demo's step), each arm's

- Python-level calls (cProfile's call counts, C builtins called from Python included), in all and by file,
  grouped as shardwise's engine, FSDP2 (torch/distributed/fsdp), DTensor, torch.distributed's c10d, DDP,
  autograd / nn and the rest, and the functions called most;
- collectives issued (torch.distributed's functions, by name, with their bytes) and host waits (`Work.wait`
  and `dist.barrier` called from Python);
- minor page faults (getrusage) over a plain step just before: what fresh memory costs, the storages a zero3
  gather refills (`resize_`, which the dispatch mode below does not see) and mmap'd temporaries included (the
  ranks run with MALLOC_MMAP_THRESHOLD_=65536, as the demo's: every buffer from 64 KiB is fresh pages);
- aten operations seen by a dispatch mode, by phase: all ops, fresh allocations (an output whose storage is
  no input's: count and bytes) and copies (copy_, clone, cat, ...: count and bytes), each attributed to the
  innermost Python frame of the engine or FSDP2 that issued it (else "model/autograd").

Counted on the same ranks at one step per arm after `--warmup` steps: a plain step, a step under cProfile and the
next under the dispatch mode (each would count the other's own calls). DTensor operations (FSDP2's sharded
parameters in clip and the optimizer step) are counted once at the DTensor level: the mode does not see the local
operations DTensor runs under them.
DDP's C++ reducer issues its all-reduce below Python: the mode's `c10d` ops count it.

    python bench/overhead/step_counts.py                                    # 2 ranks, the demo's GPT
    python bench/overhead/step_counts.py --layers 2 --width 64 --warmup 1   # does it run

Writes bench/overhead/results/NAME.{json,md} (`--name`, default step_counts).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
import bench.overhead.demo_gpt as D  # noqa: E402
from bench.common.launch import publish  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COPIES = {"copy_", "_to_copy", "clone", "cat", "stack", "split_with_sizes_copy", "_foreach_copy_", "narrow_copy",
          "index_select", "all_gather_copy_in", "chunk_cat", "_unsafe_view"}
# (group, path fragment): the first that matches a frame's file names its group.
GROUPS = (("shardwise engine", "shardwise/engine/"), ("shardwise", "shardwise/"), ("FSDP2", "distributed/fsdp/"),
          ("DTensor", "distributed/tensor/"), ("c10d", "distributed/distributed_c10d"),
          ("DDP", "nn/parallel/"), ("optimizer", "torch/optim/"), ("autograd", "torch/autograd/"),
          ("nn", "torch/nn/"))
# Who issued an aten op: the innermost frame in one of these (collective_watch.py is this bench's own wrapper).
OWNERS = ("shardwise/engine/", "distributed/fsdp/", "nn/parallel/", "torch/optim/", "nn/utils/clip_grad",
          "shardwise/models/", "shardwise/demo")


def parse_args(argv=None) -> argparse.Namespace:
    p = D.parse_args([])  # the demo's model flags and defaults
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="torch_ddp,zero3,zero3_packed,fsdp2,manual_zero3_gloo",
                        help=f"comma-separated, of {', '.join(D.ARMS)}")
    parser.add_argument("--warmup", type=int, default=3, help="steps per arm before the counted ones")
    parser.add_argument("--world-size", type=int, default=2)
    for flag in ("batch", "seq", "layers", "width"):
        parser.add_argument(f"--{flag}", type=int, default=getattr(p, flag))
    parser.add_argument("--lr", type=float, default=p.lr)
    parser.add_argument("--top", type=int, default=25, help="functions listed per arm")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--name", default="step_counts")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _group(filename: str) -> str:
    return next((name for name, part in GROUPS if part in filename), "other")


def _storage(t) -> tuple[int, int]:
    """(data pointer, bytes) of a tensor's storage; (0, 0) for anything without one (a DTensor: the module
    docstring; a meta tensor, a number)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return 0, 0
    try:
        storage = t.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # a wrapper subclass (DTensor) has no storage of its own
        return 0, 0


def _short(filename: str) -> str:
    for root in ("shardwise/", "torch/"):
        if root in filename:
            return root + filename.rsplit(root, 1)[1]
    return filename


class OpCounter:
    """A dispatch mode counting aten ops, fresh allocations and copies by (phase, issuer)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self
        self.phase = "batch"
        self.rows = collections.defaultdict(lambda: [0, 0, 0, 0, 0])  # (phase, owner, op): ops, allocs, B, copies, B

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.count(func, args, kwargs or {}, out)
                return out

        self.mode = Mode()

    def count(self, func, args, kwargs, out) -> None:
        from torch.utils._pytree import tree_leaves

        inputs = {_storage(t)[0] for t in tree_leaves((args, kwargs))}
        fresh = [nbytes for ptr, nbytes in map(_storage, tree_leaves(out)) if nbytes and ptr not in inputs]
        name = func.__name__.split(".")[0] if func.namespace == "aten" else f"{func.namespace}.{func._opname}"
        row = self.rows[(self.phase, self._owner(), name)]
        row[0] += 1
        row[1] += len(fresh)
        row[2] += sum(fresh)
        if name.split(".")[-1] in COPIES:
            row[3] += 1
            written = {id(t): t for t in tree_leaves((out, kwargs.get("out"))) if isinstance(t, torch.Tensor)}
            row[4] += sum(t.nbytes for t in written.values())  # an out= variant returns nothing: its `out`

    @staticmethod
    def _owner() -> str:
        frame = sys._getframe(3)
        while frame is not None:
            name = frame.f_code.co_filename
            if any(part in name for part in OWNERS):
                return f"{_short(name)}:{frame.f_code.co_name}"
            frame = frame.f_back
        return "model/autograd"


def count_arm(arm, built, text, args, rank, world_size, step) -> dict:
    """One step under cProfile, the next under the op counter and the collective watcher."""
    import torch.distributed as dist

    from shardwise.collective_watch import watch_collectives

    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    D.demo_step(*built, text, step, args, rank, world_size)  # a plain step: its page faults
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    profile = cProfile.Profile()
    profile.enable()
    D.demo_step(*built, text, step, args, rank, world_size)
    profile.disable()
    stats = pstats.Stats(profile).stats  # {(file, line, name): (primitive calls, calls, tt, ct, callers)}
    by_group, by_file, funcs, waits = (collections.Counter() for _ in range(4))
    for (filename, line, name), (_, calls, *_rest) in stats.items():
        if "/bench/" in filename or filename.endswith("cProfile.py"):  # this bench's own frames
            continue
        by_group[_group(filename)] += calls
        by_file[_short(filename)] += calls
        funcs[f"{_short(filename)}:{line}:{name}"] += calls
        if "wait" in name or name == "barrier":  # Work.wait, wait_tensor, the step's own barrier
            waits[f"{_short(filename)}:{name}"] += calls
    ops = OpCounter()
    issued = collections.Counter()

    def on_call(name, bound):
        nbytes = max((t.nbytes for t in bound.values() if isinstance(t, torch.Tensor)), default=0)
        issued[(ops.phase, name, bool(bound.get("async_op")))] += 1
        issued[(ops.phase, name + " bytes", bool(bound.get("async_op")))] += nbytes

    def mark(phase):
        ops.phase = phase

    with watch_collectives(on_call), ops.mode:
        D.demo_step(*built, text, step + 1, args, rank, world_size, mark=mark)
    dist.barrier()
    return {"python_calls": sum(by_group.values()), "page_faults": faults, "by_group": dict(by_group.most_common()),
            "by_file": dict(by_file.most_common(40)), "top": funcs.most_common(args.top), "host_waits": dict(waits),
            "collectives": [[*key, n] for key, n in sorted(issued.items())],
            "ops": [[*key, *row] for key, row in sorted(ops.rows.items())]}


def run_worker(args) -> None:
    import torch.distributed as dist

    import shardwise as sw
    from shardwise.demo import load_text

    Path(args.worker, f"pid{os.environ.get('RANK', 0)}").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    sw.init()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    text = load_text()
    arms = args.arms.split(",")
    built = {arm: D.build_arm(arm, args, world_size) for arm in arms}
    for step in range(args.warmup):
        for arm in arms:
            D.demo_step(*built[arm], text, step, args, rank, world_size)
    counted = {arm: count_arm(arm, built[arm], text, args, rank, world_size, args.warmup) for arm in arms}
    if rank == 0:
        Path(args.worker, "counts.json").write_text(json.dumps(counted))
    dist.barrier()
    sw.shutdown()


def markdown(args, counted: dict, command: str) -> str:
    arms = list(counted)
    lines = [f"Command: `{command}` (torch {torch.__version__}). Counts, not times: the host's load does not move "
             "them.", "", f"make demo's GPT (d_model {args.width}, {args.layers} layers, seq {args.seq}, batch "
             f"{args.batch}/rank), {args.world_size} ranks, rank 0, one step per arm after {args.warmup} "
             "(bench/overhead/step_counts.py). Host waits: the Python functions named wait (on CPU, torch.cpu's "
             "stream and event waits return at once; Work.wait blocks). Collectives: torch.distributed's functions "
             "called from Python, bytes the largest tensor argument; dispatched: the c10d ops the dispatcher saw "
             "(DDP's bucketed all-reduce too). FSDP2's clip and optimizer step run on DTensors, counted once at the "
             "DTensor level: their local allocations are not seen (0 below).", "",
             "| per step | " + " | ".join(arms) + " |",
             "|---|" + "---:|" * len(arms)]

    def row(label, values):
        lines.append(f"| {label} | " + " | ".join(str(v) for v in values) + " |")

    row("Python calls (cProfile)", [counted[a]["python_calls"] for a in arms])
    row("minor page faults (a plain step before)", [counted[a].get("page_faults", 0) for a in arms])
    row("  faulted MiB (4 KiB pages)", [f"{counted[a].get('page_faults', 0) * 4096 / 2**20:.1f}" for a in arms])
    groups = sorted({g for a in arms for g in counted[a]["by_group"]})
    for group in groups:
        row(f"  in {group}", [counted[a]["by_group"].get(group, 0) for a in arms])
    for wait in sorted({w for a in arms for w in counted[a]["host_waits"]}):
        row(f"host waits: {wait}", [counted[a]["host_waits"].get(wait, 0) for a in arms])
    for a in arms:
        counted[a]["_issued"] = collections.Counter()
        for phase, name, _async, n in counted[a]["collectives"]:
            counted[a]["_issued"][name] += n
    for name in sorted({n for a in arms for n in counted[a]["_issued"]}):
        row(f"collective {name}", [counted[a]["_issued"].get(name, 0) for a in arms])
    dispatched = {a: collections.Counter() for a in arms}  # c10d ops as the dispatcher sees them: DDP's too
    for a in arms:
        for phase, owner, op, n, *_rest in counted[a]["ops"]:
            if op.startswith(("c10d.", "_c10d_functional.")):
                dispatched[a][op] += n
    for op in sorted({op for a in arms for op in dispatched[a]}):
        row(f"dispatched {op}", [dispatched[a].get(op, 0) for a in arms])
    phases = ("forward", "backward", "clip", "step", "loss")
    for what, index in (("aten ops", 0), ("fresh allocations", 1), ("allocated MiB", 2), ("copies", 3),
                        ("copied MiB", 4)):
        for phase in phases:
            values = [sum(r[3 + index] for r in counted[a]["ops"] if r[0] == phase) for a in arms]
            if index in (2, 4):
                values = [f"{v / 2**20:.1f}" for v in values]
            row(f"{what}, {phase}", values)
    for a in arms:
        lines += ["", f"### {a}: where the ops, allocations and copies come from (issuer, all phases)", "",
                  "| issuer | ops | allocations | MiB | copies | MiB |", "|---|---:|---:|---:|---:|---:|"]
        owners = collections.defaultdict(lambda: [0] * 5)
        for phase, owner, op, *values in counted[a]["ops"]:
            owners[owner] = [x + v for x, v in zip(owners[owner], values)]
        for owner, v in sorted(owners.items(), key=lambda kv: -kv[1][0])[:args.top]:
            lines.append(f"| {owner} | {v[0]} | {v[1]} | {v[2] / 2**20:.2f} | {v[3]} | {v[4] / 2**20:.2f} |")
        lines += ["", f"{a}: Python calls by file (top 15): " + "; ".join(
            f"{f} {n}" for f, n in list(counted[a]["by_file"].items())[:15]),
                  "", f"{a}: functions called most: " + "; ".join(f"{f} {n}" for f, n in counted[a]["top"])]
    return "\n".join(lines) + "\n"


def run_launcher(args) -> None:
    counted = D.run_ranks(__file__, args.world_size, args.timeout, "counts.json")
    command = ("python bench/overhead/step_counts.py " + " ".join(sys.argv[1:])).strip()
    publish(Path(args.out), args.name, markdown(args, counted, command),
            {"settings": {k: v for k, v in vars(args).items() if k != "worker"}, "counts": counted})


if __name__ == "__main__":
    cli = parse_args()
    run_worker(cli) if cli.worker else run_launcher(cli)
