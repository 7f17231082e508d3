"""Benchmark: the collectives the engine could use for a unit's gather and reduce, per backend.

    python bench/comm/collectives.py                       # gloo, 2 and 4 ranks, 1-64 MiB
    python bench/comm/collectives.py --world-sizes 2 --sizes-mib 1 4 --repeats 3
    python bench/comm/collectives.py --sizes-mib 0.125 0.25 0.5 1     # small units

Each size runs every form in interleaved rounds inside the same ranks (the machine's load
swings), one thread per rank, a barrier before each call; the table is the median over
rounds of the slowest rank's time. It is the measurement behind Note [gloo collectives]
(engine/comm/collectives.py): which form of all-gather and reduce-scatter the engine issues on gloo.
Results: bench/comm/results/collectives.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.common.launch import publish, run_per_world_size  # noqa: E402

FORMS = {"all_gather": "all-gather (torch's)", "broadcasts": "one broadcast per rank",
         "reduce_scatter": "reduce-scatter (torch's, AVG)", "all_reduce": "all-reduce + own rows",
         "all_to_all": "all-to-all + sum", "sends": "a send to each rank + sum"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64], help="whole buffer, all ranks' rows")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def forms(full: torch.Tensor, shard: torch.Tensor, rank: int, world_size: int):
    """Each form as a call that leaves its result where the engine would read it."""
    import torch.distributed as dist

    def broadcasts():
        rows = full.view(world_size, -1)
        rows[rank].copy_(shard)
        for work in [dist.broadcast(rows[r], src=r, async_op=True) for r in range(world_size)]:
            work.wait()

    def all_reduce():
        dist.all_reduce(full)
        shard.copy_(full.view(world_size, -1)[rank]).div_(world_size)

    received = torch.empty_like(full)

    def all_to_all():
        dist.all_to_all_single(received, full)
        torch.sum(received.view(world_size, -1), dim=0, out=shard).div_(world_size)

    def sends():
        rows, into = full.view(world_size, -1), received.view(world_size, -1)
        works = [op(rows[r] if op is dist.isend else into[r], r) for r in range(world_size) if r != rank
                 for op in (dist.isend, dist.irecv)]
        into[rank].copy_(rows[rank])
        for work in works:
            work.wait()
        torch.sum(into, dim=0, out=shard).div_(world_size)

    return {"all_gather": lambda: dist.all_gather_single(full, shard),
            "broadcasts": broadcasts,
            "reduce_scatter": lambda: dist.reduce_scatter_single(shard, full, op=dist.ReduceOp.AVG),
            "all_reduce": all_reduce,
            "all_to_all": all_to_all,
            "sends": sends}


def worker(args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    for mib in args.sizes_mib:
        full = torch.randn(int(mib * 2**20) // 4 // world_size * world_size)  # whole rows per rank
        shard = torch.empty(full.numel() // world_size)
        calls = forms(full, shard, rank, world_size)
        times = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, call in calls.items():
                dist.barrier()
                start = time.perf_counter()
                call()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[name].append(elapsed.item())
        results[f"{mib:g}"] = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    if rank == 0:
        args.out.write_text(json.dumps(results))
    dist.destroy_process_group()


def launch(args) -> dict:
    worker_args = ["--repeats", str(args.repeats), "--backend", args.backend, "--sizes-mib", *map(str, args.sizes_mib)]
    return run_per_world_size(__file__, args.world_sizes, worker_args)


def report(table: dict, args) -> str:
    lines = [f"{args.backend}, one thread per rank, loopback; median of {args.repeats} interleaved rounds of the "
             "slowest rank's time, ms. `python bench/comm/collectives.py`", "",
             "| ranks | MiB | " + " | ".join(FORMS.values()) + " | gather ÷ | reduce ÷ |",
             "|---:|---:|" + "---:|" * (len(FORMS) + 2)]
    for world_size, sizes in table.items():
        for mib, ms in sizes.items():
            lines.append(f"| {world_size} | {mib} | " + " | ".join(f"{ms[name]:.1f}" for name in FORMS)
                         + f" | {ms['all_gather'] / ms['broadcasts']:.2f}× | "
                         f"{ms['reduce_scatter'] / ms['all_to_all']:.2f}× |")
    lines += ["", "gather ÷ = torch's all-gather time over the broadcasts'; reduce ÷ = torch's reduce-scatter "
              "over the all-to-all's (above 1: the engine's form is faster). The engine gathers with the broadcasts "
              "and reduces with the all-to-all, zero1's kept gradients included (Note [gloo collectives])."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    table = launch(args)
    publish(Path(__file__).resolve().parent / "results", "collectives", report(table, args), table)


if __name__ == "__main__":
    main()
