"""bench/traffic.py's arithmetic: the ring attribution of a call to in-node and across-node links, and the
closed-form model, agree with each other on the calls each strategy makes (issue 34 point 5). In-process,
no ranks: the counted run itself is the bench (`python bench/traffic.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from traffic import link_bytes, model_step  # noqa: E402

S, KEPT = 1_000_000, 100_000


def _calls(strategy: str, nodes: int, per_node: int) -> tuple[float, float]:
    """What the counter attributes for the calls the model assumes, made group by group."""
    world = list(range(nodes * per_node))
    total = [0.0, 0.0]

    def add(kind, nbytes, ranks):
        for i, value in enumerate(link_bytes(kind, nbytes, ranks, per_node)):
            total[i] += value

    if strategy == "ddp":
        add("all_reduce", S, world)
    elif strategy == "zero3":
        for nbytes in (S, S - KEPT, S):
            add("all_gather", nbytes, world)
    else:
        for node in range(nodes):
            for nbytes in (S, S - KEPT, S):
                add("all_gather", nbytes, world[node * per_node:(node + 1) * per_node])
        for local in range(per_node):
            add("all_reduce", S / per_node, world[local::per_node])
    return total[0], total[1]


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "zero3_hsdp"])
@pytest.mark.parametrize("nodes, per_node", [(1, 4), (2, 2), (4, 1), (3, 8)])
def test_model_equals_the_counters_attribution(strategy, nodes, per_node):
    """Catches a model whose (P-1)/P factors, crossing-link count or replica all-reduce size differ from what
    the counter attributes to the same calls: the model's check against the counted run would then compare
    two different things."""
    model = model_step(strategy, nodes, per_node, S, KEPT)
    in_node, across = _calls(strategy, nodes, per_node)
    assert model["in_node"] == pytest.approx(in_node) and model["across"] == pytest.approx(across)


def test_a_broadcast_per_rank_is_a_ring_all_gather():
    """Catches the gloo form of the engine's all-gather (one broadcast per rank, Note [gloo collectives])
    counted as anything but the ring all-gather it stands for."""
    ranks = [0, 1, 2, 3]
    by_broadcast = [sum(link_bytes("broadcast", S // 4, ranks, 2, root)[i] for root in ranks) for i in (0, 1)]
    assert by_broadcast == pytest.approx(list(link_bytes("all_gather", S, ranks, 2)))
