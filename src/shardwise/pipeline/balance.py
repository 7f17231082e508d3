"""Balancing layers over stages: a cost per layer, then the contiguous split whose
most expensive stage is cheapest (the pipeline runs at the pace of its slowest stage).

Costs are either parameter counts (free, deterministic, a proxy for memory) or measured
forward + backward seconds of each layer on one micro-batch (what sets the pace; noisy,
so the trainer measures on one rank and broadcasts the numbers, and every rank cuts the
same way).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from torch import Tensor, nn

from shardwise.errors import ShardwiseError
from shardwise.pipeline.layers import LayerChain


def partition(costs: Sequence[float], num_stages: int) -> list[tuple[int, int]]:
    """Split layers 0..len(costs) into `num_stages` non-empty contiguous ranges
    `[start, end)` minimizing the largest stage cost (exact, by dynamic programming)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ShardwiseError(f"cannot split {n} layers into {num_stages} non-empty stages; use 1..{n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the smallest possible largest-stage cost of layers [0, i) in s stages;
    # cut[s][i]: where the last of those s stages starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        bounds.append((start, end))
        end = start
    return bounds[::-1]


def stage_costs(costs: Sequence[float], bounds: Sequence[tuple[int, int]]) -> list[float]:
    """The summed cost of each stage's layers."""
    return [float(sum(costs[a:b])) for a, b in bounds]


def param_costs(chain: LayerChain) -> list[float]:
    """Parameter elements per layer; a tied parameter counts in every layer that holds it
    (each stage holding it keeps a copy)."""
    return [float(sum(p.numel() for _, p in chain.layer_params(i))) for i in range(chain.num_layers)]


def measure_layer_times(layers: Sequence[nn.Module], example: Tensor, repeats: int = 3) -> list[float]:
    """Median seconds of forward + backward of each layer on `example` (one micro-batch),
    each layer fed the previous layer's output. Gradients it leaves are cleared."""
    times = []
    x = example
    for layer in layers:
        samples = []
        for _ in range(repeats + 1):  # the first run warms up allocations; not counted
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out))
            samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples[1:]))
        x = out.detach()
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return times
