"""In-process checks of the pipeline's parts that need no collectives: cutting a model into
layers, balancing, planning a layout, the freeze rule, the sampler and the activation cache.
(Training on real ranks is in test_pipeline_ranks.py.)"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.pipeline import (
    ActivationCache,
    FreezePolicy,
    PipelineConfig,
    ShardedStage,
    StickySampler,
    chain_layers,
    measure_layer_times,
    partition,
    plan_layout,
)

# ---- layers --------------------------------------------------------------------


def test_gpt_chain_names_and_tie():
    """Catches a chain that loses a parameter, renames one (results would not compare by
    name with the model), or misses that the head's weight is the embedding's."""
    model = GPT(GPTConfig(n_layers=3))
    chain = chain_layers(model)
    assert chain.num_layers == 5
    assert {n for names in chain.names for n in names} == set(dict(model.named_parameters()))
    assert chain.tied() == {"tok_emb.weight": [0, 4]}
    assert chain.owner_layer("tok_emb.weight") == 0
    x = torch.randint(0, 64, (2, 16))
    out = x
    for layer in chain.layers:
        out = layer(out)
    assert torch.equal(out, model(x)), "the chain must compute exactly what the model does"


def test_chain_of_sequential_and_errors():
    """Catches a list of layers named differently from nn.ModuleList's names, and a model the
    chain cannot cut being accepted silently."""
    chain = chain_layers([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)])
    assert chain.names == [["0.weight", "0.bias"], [], ["2.weight", "2.bias"]]
    with pytest.raises(ShardwiseError, match="does not know how to cut"):
        chain_layers(nn.Linear(2, 2))


# ---- balance and layout ----------------------------------------------------------


def _brute_force(costs, num_stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        edges = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


def test_partition_is_optimal_and_contiguous():
    """Catches a split that leaves a stage empty, skips or repeats a layer, or is not the
    cheapest possible slowest stage (checked against brute force)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 9, (), generator=g))
        costs = torch.randint(1, 20, (n,), generator=g).tolist()
        for num_stages in range(1, n + 1):
            bounds = partition(costs, num_stages)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
            assert max(sum(costs[a:b]) for a, b in bounds) == _brute_force(costs, num_stages)
    with pytest.raises(ShardwiseError, match="non-empty stages"):
        partition([1, 2], 3)


def test_plan_layout_repacks_to_fewest_stages_within_budget():
    """Catches re-packing that keeps idle stages (no speedup), that overloads a stage beyond
    what one rank ran before, or that picks a stage count the world size cannot hold."""
    costs = [1.0] * 8  # 4 stages of 2 layers: budget 2
    assert plan_layout(costs, num_frozen=0, world_size=4, num_stages=4, repack=True, budget=2).num_stages == 4
    layout = plan_layout(costs, num_frozen=4, world_size=4, num_stages=4, repack=True, budget=2)
    assert (layout.num_stages, layout.num_replicas, layout.bounds) == (2, 2, ((4, 6), (6, 8)))
    layout = plan_layout(costs, num_frozen=6, world_size=4, num_stages=4, repack=True, budget=2)
    assert (layout.num_stages, layout.num_replicas) == (1, 4)
    # 3 stages would fit 5 layers in budget 2 but do not divide 4 ranks.
    layout = plan_layout(costs, num_frozen=3, world_size=4, num_stages=4, repack=True, budget=2)
    assert layout.num_stages == 4
    with pytest.raises(ShardwiseError, match="cannot fill"):
        plan_layout(costs, num_frozen=6, world_size=4, num_stages=4, repack=False, budget=2)
    assert layout.coords(layout.rank_of(0, 3)) == (0, 3)
    assert layout.stage_of_layer(2) is None and layout.stage_of_layer(3) == 0


# ---- freeze policy ----------------------------------------------------------------


def test_freeze_rule_threshold_alpha_and_growth():
    """Catches freezing on one window (no change rate yet), freezing a layer whose gradient
    still moves or one behind such a layer (the prefix must stay contiguous), growing by
    more than alpha of the active layers, and a prefix that shrinks or reaches the last layer."""
    policy = FreezePolicy(threshold=0.1, alpha=0.5)
    policy.record([1.0] * 6)
    assert policy.update(6) == 0, "one window has no change rate"
    policy.record([1.05, 1.0, 2.0, 1.0, 1.0, 1.0])  # layer 2 still moves: layers 3.. are not a prefix
    assert policy.update(6) == 2
    policy.record([1.05, 1.0, 2.01, 1.0, 1.0, 1.0])  # all settled: at most floor(0.5 * 4) = 2 more
    assert policy.update(6) == 4
    policy.record([1.05, 1.0, 2.01, 1.0, 1.0, 1.0])
    assert policy.update(6) == 5, "max(1, floor(0.5 * 2)) = 1 more, and never the last layer"
    policy.record([9.0] * 6)
    assert policy.update(6) == 5, "the prefix never shrinks"
    with pytest.raises(ShardwiseError, match="only grows"):
        policy.freeze_until(2)


def test_manual_freeze_and_limits():
    """Catches freeze_until being ignored without a threshold, and max_frozen not capping it."""
    policy = FreezePolicy(max_frozen=3)
    policy.record([1.0] * 6)
    policy.record([1.0] * 6)
    assert policy.update(6) == 0, "no threshold: nothing freezes by itself"
    policy.freeze_until(5)
    assert policy.update(6) == 3
    with pytest.raises(ShardwiseError, match="alpha"):
        FreezePolicy(alpha=0)


def test_pipeline_config_validation():
    """Catches a 1F1B schedule with fewer micro-batches than stages (torch raises deep inside)
    and an unknown schedule name being accepted."""
    with pytest.raises(ShardwiseError, match="num_microbatches"):
        PipelineConfig(num_stages=4, num_microbatches=2, schedule="1f1b")
    with pytest.raises(ShardwiseError, match="schedule"):
        PipelineConfig(num_stages=2, schedule="zigzag")
    PipelineConfig(num_stages=4, num_microbatches=2, schedule="gpipe")


@pytest.mark.parametrize("fields, match", [
    ({"num_microbatches": 2.5}, "num_microbatches=2.5 must be an int"),
    ({"num_stages": True}, "num_stages=True must be an int"),
    ({"cache_memory_bytes": -1}, "cache_memory_bytes=-1 must be >= 0"),
    ({"balance": (1.0, float("nan"))}, "per-layer costs are finite"),
    ({"balance": (1.0, -2.0)}, "per-layer costs are finite"),
])
def test_pipeline_config_numbers_are_checked(fields, match):
    """Catches issue 60 item 9's pipeline half: a non-int micro-batch count, a negative cache budget or a NaN
    layer cost accepted here and failing later, far from the field (a float count in torch's schedule, a NaN
    cost cutting every layer into one stage)."""
    with pytest.raises(ShardwiseError, match=match):
        PipelineConfig(**{"num_stages": 2, "schedule": "gpipe", **fields})


def test_sharded_stage_options_are_checked():
    """Catches a strategy name or a shards= without a zero strategy accepted (sw.shard would be asked for
    it, or shards= ignored), and ShardedStage handed an unsharded module (no engine reduces its gradients
    across data-parallel ranks: each rank would step on its own micro-batches' gradients)."""
    with pytest.raises(ShardwiseError, match="strategy"):
        PipelineConfig(num_stages=2, strategy="zero4")
    with pytest.raises(ShardwiseError, match="shards"):
        PipelineConfig(num_stages=2, shards=2)
    with pytest.raises(ShardwiseError, match="ShardedStage takes a stage module sharded"):
        ShardedStage(nn.Linear(2, 2), 0, 2, torch.device("cpu"))
    PipelineConfig(num_stages=2, strategy="zero3", shards=1)


# ---- sampler and cache -----------------------------------------------------------


def test_sticky_sampler_keeps_samples_on_their_replica():
    """Catches a sampler whose batches depend on the replica count (a re-packed run would
    train on other data), one that repeats or drops samples within an epoch, and one that
    moves a sample to another replica between epochs (the per-rank cache would never hit)."""
    sampler = StickySampler(100, 16, num_homes=4, seed=3)  # 25 per home, 4 per batch: 6 steps
    assert sampler.steps_per_epoch == 6
    home_of = {}
    for epoch in range(3):
        batches = sampler.batches(epoch)
        seen = torch.cat(batches)
        assert len(set(seen.tolist())) == len(seen) == 96
        for batch in batches:
            for r in range(2):
                for i in sampler.replica_slice(batch, r, 2).tolist():
                    assert home_of.setdefault(i, r) == r
    assert not torch.equal(torch.cat(sampler.batches(0)), torch.cat(sampler.batches(1)))
    assert sampler.samples_per_replica(2) == 50


def test_cache_spills_to_file_and_reads_back_exactly(tmp_path):
    """Catches a cache that returns another sample's row, mixes memory and file slots, computes
    hits again, keeps entries (or its file) across a reset, or exceeds its capacity."""
    sampler = StickySampler(32, 8, num_homes=2)
    cache = ActivationCache(sampler, memory_bytes=5 * 3 * 4, directory=str(tmp_path))  # 5 samples of 3 floats
    cache.reset(depth=1, capacity=32)
    computed = []

    def compute(idx):
        computed.append(idx.tolist())
        return torch.stack([torch.full((3,), float(i)) + torch.arange(3.0) for i in idx])

    first = cache.fetch(torch.tensor([4, 9, 1, 30, 2, 7, 11]), compute)
    assert cache.bytes_in_memory == 5 * 12 and cache.bytes_on_disk == 27 * 12
    again = cache.fetch(torch.tensor([30, 4, 5, 11]), compute)
    assert computed == [[4, 9, 1, 30, 2, 7, 11], [5]], "only the miss is computed"
    assert torch.equal(again, compute(torch.tensor([30, 4, 5, 11])))
    assert torch.equal(first, compute(torch.tensor([4, 9, 1, 30, 2, 7, 11])))
    assert (cache.hits, cache.misses) == (3, 8)
    files = list(tmp_path.rglob("*.bin"))
    assert len(files) == 1
    cache.reset(depth=2, capacity=2)
    assert cache.num_cached == 0 and not any(os.path.exists(f) for f in files)
    with pytest.raises(ShardwiseError, match="holds 2 samples"):
        cache.fetch(torch.tensor([0, 1, 2]), compute)


def test_cache_advance_runs_only_new_layers_and_keeps_a_subset(tmp_path):
    """Catches an advance that recomputes the old prefix, keeps the shorter prefix's values,
    keeps samples now another replica's, or leaves the old file behind."""
    sampler = StickySampler(32, 8, num_homes=2)
    cache = ActivationCache(sampler, memory_bytes=4 * 2 * 4, directory=str(tmp_path))  # 4 of 8 in memory
    cache.reset(depth=1, capacity=16)
    idx = torch.tensor([0, 2, 4, 6, 1, 3, 8, 10])
    old = torch.randn(8, 2)
    cache.fetch(idx, lambda i: old)
    old_files = list(tmp_path.rglob("*.bin"))
    cache.advance(2, 8, lambda x: x * 3 + 1, keep=lambda i: sampler.replica_of(i, 2) == 0)
    kept = sampler.replica_of(idx, 2) == 0  # home 0: even indices
    assert cache.depth == 2 and cache.num_cached == int(kept.sum()) == 6
    cached, hit = cache.lookup(idx)
    assert torch.equal(hit, kept) and torch.equal(cached, old[kept] * 3 + 1)
    assert not any(os.path.exists(f) for f in old_files)


def test_measure_layer_times():
    """Catches a measurement that leaves gradients behind (they would leak into the first step)."""
    layers = [nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)]
    times = measure_layer_times(layers, torch.randn(4, 8), repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert all(p.grad is None for layer in layers for p in layer.parameters())
