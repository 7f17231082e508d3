"""Benchmark: a unit's gather on gloo, packed or with large parameters broadcast straight into place.

    python bench/comm/gather_in_place.py                   # 2 and 4 ranks, the bench GPT's block (d_model 512)
    python bench/comm/gather_in_place.py --world-sizes 2 --repeats 3

Runs the engine's own `collectives.gather_into` on one GPT block's 12 parameters (4 matrices, 8
vectors), 9 units per call as in bench/speed/strategies.py's model, under three values of
GLOO_IN_PLACE_FROM_BYTES: every parameter packed (the form before Note [gathered in place]), the
engine's threshold, and every parameter in place. The forms alternate inside the same ranks, round
after round (the machine's load swings); the table gives the median over rounds with the range,
of the slowest rank's wall time and of the ranks' mean process CPU (gloo's threads included).
Results: bench/comm/results/gather_in_place.md.
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

UNITS = 9  # the bench GPT: 8 blocks and the root, each refilled once per step (zero1/zero2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def block_shapes(d: int) -> list[tuple[int, ...]]:
    """A GPT block's parameters in registration order (shardwise.models.gpt.Block)."""
    return [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]


def worker(args) -> None:
    import torch.distributed as dist

    import shardwise.engine.comm.collectives as coll

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shapes = block_shapes(args.d_model)
    numels = [-(-shape[0] // world_size) * (shape[1] if len(shape) > 1 else 1) for shape in shapes]
    units = []
    for _ in range(UNITS):  # like a zero2 unit: full values param-major, this rank's rows in place
        full = torch.randn(world_size * sum(numels))
        regions = list(full.split([world_size * n for n in numels]))
        units.append(([r.view(world_size, -1)[rank] for r in regions], regions))
    forms = {"packed": 2**62, "engine": coll.GLOO_IN_PLACE_FROM_BYTES, "all in place": 0}
    wall = {name: [] for name in forms}
    cpu = {name: [] for name in forms}
    for _ in range(args.repeats):
        for name, threshold in forms.items():
            coll.GLOO_IN_PLACE_FROM_BYTES = threshold
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for rows, regions in units:
                coll.gather_into(rows, regions, world_size, dist.group.WORLD, async_op=False, own_in_place=True)
            spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start])
            dist.all_reduce(spent[:1], op=dist.ReduceOp.MAX)
            dist.all_reduce(spent[1:], op=dist.ReduceOp.SUM)
            wall[name].append(spent[0].item() * 1e3)
            cpu[name].append(spent[1].item() * 1e3 / world_size)
    if rank == 0:
        args.out.write_text(json.dumps({"wall": wall, "cpu": cpu, "mib_per_rank": sum(numels) * 4 / 2**20}))
    dist.destroy_process_group()


def launch(args) -> dict:
    worker_args = ["--repeats", str(args.repeats), "--d-model", str(args.d_model)]
    return run_per_world_size(__file__, args.world_sizes, worker_args)


def spread(values: list[float], spec: str = ".1f") -> str:
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}–{max(values):{spec}})"


def report(table: dict, args) -> str:
    lines = [f"gloo, one thread per rank, loopback; {UNITS} GPT blocks (d_model {args.d_model}) gathered per call; "
             f"median of {args.repeats} interleaved rounds (range), ms. `python bench/comm/gather_in_place.py`", "",
             "| ranks | MiB per rank per unit | form | wall (slowest rank) | CPU per rank | wall ÷ packed |",
             "|---:|---:|---|---:|---:|---:|"]
    for world_size, result in table.items():
        packed = result["wall"]["packed"]
        for name in result["wall"]:
            ratios = [w / p for w, p in zip(result["wall"][name], packed)]
            lines.append(f"| {world_size} | {result['mib_per_rank']:.1f} | {name} | {spread(result['wall'][name])} | "
                         f"{spread(result['cpu'][name])} | {spread(ratios, '.2f')} |")
    lines += ["", "packed: every parameter through one rank-major buffer and a copy-out (the form before Note "
              "[gathered in place]); engine: parameters from GLOO_IN_PLACE_FROM_BYTES per rank broadcast into "
              "place, the rest packed; all in place: one broadcast per parameter per rank."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    publish(Path(__file__).resolve().parent / "results", "gather_in_place", report(launch(args), args))


if __name__ == "__main__":
    main()
