"""Benchmark: the least time the owner step of bench/whole_tensor.py can take on this host, against one
process's step (issue 33's ratio targets), for the standard Muon recipe (Muon on the blocks' matrices).

    python bench/owner_bound.py                      # vocab 4096, d_model 256, 4 layers, ws 2 and 4
    python bench/owner_bound.py --d-model 1024 --layers 2

An owner step cannot beat: the busiest owner's Newton-Schulz (each matrix stepped alone, one thread, owners
balanced by `step_cost` as the engine balances them) plus moving the step's bytes (each owner's gradient
rows gathered to it, its updated matrices broadcast back; Note [owner broadcast]) through gloo on this
host's loopback into buffers allocated once, with no copy, no check and no allocation. Bound = (busiest
owner compute + that traffic) / one process's Newton-Schulz. Rounds interleave compute and traffic; each
figure is the median over rounds (range in brackets). CPU columns: the busiest rank's process CPU seconds
(gloo's threads too), the figure issue 33's ws-4 target reads, since four ranks share two cores.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardwise.engine.optim.whole_step import _owners
from shardwise.models.gpt import GPT, GPTConfig


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


def _traffic_rank(rank, world_size, port, shapes, owners, repeats, out):
    torch.set_num_threads(1)
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
    out[rank] = (statistics.median(walls[1:]), statistics.median(cpus[1:]))
    dist.destroy_process_group()


def traffic_seconds(shapes, owners, world_size: int, repeats: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the step's raw collectives, the slowest and the busiest rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_traffic_rank, args=(world_size, port, shapes, owners, repeats, out), nprocs=world_size)
    return max(v[0] for v in out.values()), max(v[1] for v in out.values())


def _median_range(values) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab", 4096), ("d-model", 256), ("layers", 4), ("heads", 8), ("seq", 64),
                          ("repeats", 3), ("rounds", 3)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--world-sizes", default="2,4")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of bench/whole_tensor.py
    shapes = hidden_shapes(args)
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    rows = {w: {"one": [], "busiest": [], "wall": [], "cpu": []} for w in world_sizes}
    for _ in range(args.rounds):
        seconds = newton_schulz_seconds(shapes, args.repeats)
        for w in world_sizes:
            owners = owners_of(shapes, w)
            wall, cpu = traffic_seconds(shapes, owners, w, args.repeats)
            row = rows[w]
            row["one"].append(sum(seconds))
            row["busiest"].append(max(sum(s for s, o in zip(seconds, owners) if o == r) for r in range(w)))
            row["wall"].append(wall)
            row["cpu"].append(cpu)
    megabytes = 4 * sum(m * n for m, n in shapes) / 2**20
    print(f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers: {len(shapes)} hidden matrices, "
          f"{megabytes:.1f} MiB fp32; {args.rounds} rounds, {os.cpu_count()} cores\n")
    print("| ws | one process Newton-Schulz s | busiest owner's s | raw traffic wall s | raw traffic CPU s "
          "| bound: step × one process | bound: busiest CPU × one process |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for w, row in rows.items():
        wall_bound = [(b + t) / one for b, t, one in zip(row["busiest"], row["wall"], row["one"])]
        cpu_bound = [(b + c) / one for b, c, one in zip(row["busiest"], row["cpu"], row["one"])]
        print(f"| {w} | {_median_range(row['one'])} | {_median_range(row['busiest'])} | "
              f"{_median_range(row['wall'])} | {_median_range(row['cpu'])} | {_median_range(wall_bound)} | "
              f"{_median_range(cpu_bound)} |")


if __name__ == "__main__":
    main()
