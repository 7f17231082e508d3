"""Benchmark: what each matrix's Muon step really costs on this machine, beside the cost the owners are
balanced by (Note [owner cost], engine/optim/whole_step.py: m·n·min(m, n)), for the GPT of
bench/whole_tensor/whole_tensor.py.

    python bench/whole_tensor/owner_cost.py                 # vocab 4096, d_model 256, 4 layers (issue 33's figures)

With one owner per matrix, the busiest rank cannot do less than the largest matrix's share of the time:
that share bounds the owner step's busiest-rank CPU from below, whatever the world size. One thread, each
distinct shape stepped once to warm up and then `--repeats` times; prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shardwise.engine.optim.whole_step import step_cost
from shardwise.models.gpt import GPT, GPTConfig


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab", 4096), ("d-model", 256), ("layers", 4), ("heads", 8), ("seq", 64),
                          ("repeats", 3)):
        p.add_argument(f"--{flag}", type=int, default=default)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as each rank of bench/whole_tensor/whole_tensor.py
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                          n_heads=args.heads))
    names_by_shape: dict[tuple, list[str]] = {}
    for name, param in model.named_parameters():
        if param.dim() == 2:
            names_by_shape.setdefault(tuple(param.shape), []).append(name)
    seconds = {}
    for shape in names_by_shape:
        param = torch.nn.Parameter(torch.randn(shape))
        param.grad = torch.randn(shape)
        optimizer = torch.optim.Muon([param], lr=0.02)
        optimizer.step()  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - start)
        seconds[shape] = statistics.median(times)
    total_s = sum(seconds[s] * len(n) for s, n in names_by_shape.items())
    total_cost = sum(step_cost(torch.optim.Muon, s) * len(n) for s, n in names_by_shape.items())
    print("| shape | matrices | first name | s per step (each) | share of the time | share of the cost |")
    print("|---|---:|---|---:|---:|---:|")
    for shape, names in sorted(names_by_shape.items(), key=lambda item: -seconds[item[0]]):
        cost = step_cost(torch.optim.Muon, shape)
        print(f"| {shape[0]} x {shape[1]} | {len(names)} | {names[0]} | {seconds[shape]:.3f} | "
              f"{seconds[shape] * len(names) / total_s:.3f} | {cost * len(names) / total_cost:.3f} |")
    print(f"\nall matrices: {total_s:.2f} s per step; hidden (blocks.*) only: "
          f"{sum(seconds[s] * sum(n.startswith('blocks.') for n in ns) for s, ns in names_by_shape.items()):.2f} s")


if __name__ == "__main__":
    main()
