"""Benchmark: the least time the owner step of bench/whole_tensor/whole_tensor.py can take on this host, against one
process's step (issue 33's ratio targets), for the standard Muon recipe (Muon on the blocks' matrices).

    python bench/whole_tensor/owner_bound.py                # vocab 4096, d_model 256, 4 layers, ws 2 and 4
    python bench/whole_tensor/owner_bound.py --d-model 1024 --layers 2
    python bench/whole_tensor/owner_bound.py --d-model 1024 --layers 2 --newton-schulz float32  # no fast bf16 matmul

An owner step cannot beat: the busiest owner's Newton-Schulz (each matrix stepped alone, one thread, owners
balanced by `step_cost` as the engine balances them) plus moving the step's bytes (each owner's gradient
rows gathered to it, its updated matrices broadcast back; Note [owner broadcast]) through gloo on this
host's loopback into buffers allocated once, with no copy, no check and no allocation. Bound = (busiest
owner compute + that traffic) / one process's Newton-Schulz. Rounds interleave compute and traffic; each
figure is the median over rounds (range in brackets). CPU columns: the busiest rank's process CPU seconds
(gloo's threads too), the figure issue 33's ws-4 target reads, since four ranks share two cores.

Note [owners at once]: the first table times each matrix's Newton-Schulz alone, the other cores idle. In a
run every owner computes at the same moment, sharing the host's caches, memory bandwidth and (at ws 4 on
two cores) the cores themselves, which no implementation avoids; so each round also times every rank
stepping the matrices it owns at once, and the second table bounds the step by the busiest of those plus
the same traffic. That is the floor a run of N ranks on this host can reach; the first is below it.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from shardwise.engine.optim.whole_step import _owners
from shardwise.models.gpt import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.whole_tensor import newton_schulz  # noqa: E402


def hidden_shapes(args) -> list[tuple[int, int]]:
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads))
    return [tuple(p.shape) for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("blocks.")]


def owners_of(shapes, world_size: int) -> list[int]:
    params = [SimpleNamespace(_sw_layout=SimpleNamespace(shape=shape)) for shape in shapes]
    return _owners(params, world_size, {}, torch.optim.Muon)


def newton_schulz_seconds(shapes, repeats: int) -> list[float]:
    """Each matrix's Muon step alone, one thread (median of `repeats` after a warm-up)."""
    seconds = []
    for shape in shapes:
        param = torch.nn.Parameter(torch.randn(shape))
        param.grad = torch.randn(shape)
        optimizer = torch.optim.Muon([param], lr=0.02)
        optimizer.step()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return seconds


def _owner_rank(rank, world_size, port, shapes, owners, repeats, out):
    torch.set_num_threads(1)
    newton_schulz.use(out["newton_schulz"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    batches = []  # per owner: (rows sent, gathered parts on the owner, whole matrices broadcast)
    for owner in range(world_size):
        mine = [s for s, o in zip(shapes, owners) if o == owner]
        row_numel = sum(math.ceil(m / world_size) * n for m, n in mine)
        send = torch.randn(row_numel)
        parts = [torch.empty(row_numel) for _ in range(world_size)] if rank == owner else None
        batches.append((owner, send, parts, torch.randn(sum(m * n for m, n in mine))))
    walls, cpus = [], []
    for _ in range(repeats + 1):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        works = [dist.gather(send, parts, dst=owner, async_op=True) for owner, send, parts, _ in batches]
        for work in works:
            work.wait()
        works = [dist.broadcast(whole, src=owner, async_op=True) for owner, _, _, whole in batches]
        for work in works:
            work.wait()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    compute_wall, compute_cpu = _owned_compute(rank, shapes, owners, repeats)
    out[rank] = (statistics.median(walls[1:]), statistics.median(cpus[1:]), compute_wall, compute_cpu)
    dist.destroy_process_group()


def _owned_compute(rank, shapes, owners, repeats) -> tuple[float, float]:
    """(wall, CPU) seconds of this rank's Muon step on the matrices it owns, every rank stepping at once as
    in a run (Note [owners at once]): one optimizer over them, as the engine's owner steps them."""
    mine = [torch.nn.Parameter(torch.randn(shape)) for shape, owner in zip(shapes, owners) if owner == rank]
    for param in mine:
        param.grad = torch.randn(param.shape)
    optimizer = torch.optim.Muon(mine, lr=0.02) if mine else None
    walls, cpus = [], []
    for _ in range(repeats + 1):
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
        if optimizer is not None:
            optimizer.step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls[1:]), statistics.median(cpus[1:])


def owner_seconds(shapes, owners, world_size: int, repeats: int, dtype: str) -> tuple[float, ...]:
    """(wall, CPU) seconds of the step's raw collectives, then of the owners' compute with every rank
    stepping at once: each the slowest (busiest) rank's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict(newton_schulz=dtype)
    mp.spawn(_owner_rank, args=(world_size, port, shapes, owners, repeats, out), nprocs=world_size)
    ranks = [out[rank] for rank in range(world_size)]
    return tuple(max(values[i] for values in ranks) for i in range(4))


def _median_range(values) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def _bounds(row: dict, busiest: list, busiest_cpu: list) -> tuple[str, str]:
    """The wall and CPU bounds per round, over one process's Newton-Schulz: (busiest owner + traffic) / one."""
    wall = [(b + t) / one for b, t, one in zip(busiest, row["wall"], row["one"])]
    cpu = [(b + c) / one for b, c, one in zip(busiest_cpu, row["cpu"], row["one"])]
    return _median_range(wall), _median_range(cpu)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab", 4096), ("d-model", 256), ("layers", 4), ("heads", 8), ("seq", 64),
                          ("repeats", 3), ("rounds", 3)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--newton-schulz", choices=newton_schulz.CHOICES, default="bfloat16",
                   help="Muon's Newton-Schulz dtype, as the run it bounds "
                        "(bench/whole_tensor/whole_tensor.py --newton-schulz)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of bench/whole_tensor/whole_tensor.py
    newton_schulz.use(args.newton_schulz)
    shapes = hidden_shapes(args)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    rows = {w: {"one": [], "busiest": [], "wall": [], "cpu": [], "at_once": [], "at_once_cpu": []}
            for w in world_sizes}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        seconds = newton_schulz_seconds(shapes, args.repeats)
        for w in world_sizes:
            owners = owners_of(shapes, w)
            wall, cpu, at_once, at_once_cpu = owner_seconds(shapes, owners, w, args.repeats, args.newton_schulz)
            row = rows[w]
            row["one"].append(sum(seconds))
            row["busiest"].append(max(sum(s for s, o in zip(seconds, owners) if o == r) for r in range(w)))
            row["wall"].append(wall)
            row["cpu"].append(cpu)
            row["at_once"].append(at_once)
            row["at_once_cpu"].append(at_once_cpu)
    megabytes = 4 * sum(m * n for m, n in shapes) / 2**20
    print(f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers: {len(shapes)} hidden matrices, "
          f"{megabytes:.1f} MiB fp32; Newton-Schulz in {args.newton_schulz}; {args.rounds} rounds, "
          f"{os.cpu_count()} cores\n")
    _table(rows, ["one process Newton-Schulz s", "busiest owner's s", "raw traffic wall s", "raw traffic CPU s",
                  "bound: step × one process", "bound: busiest CPU × one process"],
           lambda row: [_median_range(row[key]) for key in ("one", "busiest", "wall", "cpu")]
           + list(_bounds(row, row["busiest"], row["busiest"])))
    print("\nNote [owners at once]: the owners stepping at once, as in a run (every rank its own matrices, "
          "one optimizer over them, after a barrier):\n")
    _table(rows, ["busiest owner's s, at once", "its CPU s", "bound at once: step × one process",
                  "bound at once: busiest CPU × one process"],
           lambda row: [_median_range(row["at_once"]), _median_range(row["at_once_cpu"])]
           + list(_bounds(row, row["at_once"], row["at_once_cpu"])))


def _table(rows: dict, columns: list[str], cells) -> None:
    """A markdown table, one line per world size: `cells(row)` gives the columns after ws."""
    print("| ws | " + " | ".join(columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for w, row in rows.items():
        print(f"| {w} | " + " | ".join(cells(row)) + " |")

if __name__ == "__main__":
    main()
