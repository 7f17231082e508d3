"""Pipeline training on real gloo ranks against one process: schedules, stages, replicas,
the tied embedding/head, and freezing + activation cache + re-packing.

The reference is the same GPT trained in one process on the same global batches (the
pipeline sampler's), with the same optimizer (testing.make_optimizer's groups and
eps=1e-3, Note [adam eps]). Bounds are DESIGN's fp32 rtol 1e-5 / atol 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.pipe import GLOBAL_BATCH, MICRO, TIED, batches_of, dataset, gpt, reference_run, token_loss
from shardwise.pipeline import FreezePolicy, PipelineConfig, PipeTrainer, chain_layers, grouped_adamw
from shardwise.testing import RunResult, assert_close_runs


def _trainer(n_layers: int, config: PipelineConfig, policy: FreezePolicy | None = None) -> PipeTrainer:
    inputs, targets = dataset()
    return PipeTrainer(chain_layers(gpt(n_layers)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                       global_batch_size=GLOBAL_BATCH, config=config, freeze=policy)


# ---- parity: schedules x stages x replicas -----------------------------------------


def _different_data_on_rank() -> str | None:
    """Rank 1 draws its dataset from another seed (docs/pipeline.md's set-up drew it before the seed)."""
    inputs, targets = dataset()
    if dist.get_rank() == 1:
        inputs, targets = torch.randint(0, 64, inputs.shape), torch.randint(0, 64, targets.shape)
    try:
        PipeTrainer(chain_layers(gpt(2)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                    global_batch_size=GLOBAL_BATCH, config=PipelineConfig(num_stages=2, num_microbatches=MICRO))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_different_datasets_on_the_ranks_are_refused(ranks):
    """Catches issue 44 item 13: each rank passing its own inputs and targets trained the first stage on
    rank 0's inputs and scored rank 1's targets, silently (the loss jumped 5.424 -> 5.533 at the re-pack).
    The trainer compares a fingerprint of the dataset across ranks, as sw.slice does its inputs."""
    for message in ranks.run(_different_data_on_rank, 2):
        assert message is not None and "different datasets" in message, message


def _subgroup_on_rank() -> str | None:
    """Rank 0 builds a trainer over a group of itself alone; rank 1 builds none."""
    inputs, targets = dataset()
    alone = dist.new_group([0])
    if dist.get_rank() != 0:
        return None
    try:
        PipeTrainer(chain_layers(gpt(2)), token_loss, grouped_adamw(eps=1e-3), inputs, targets, group=alone,
                    global_batch_size=GLOBAL_BATCH, config=PipelineConfig(num_stages=1, num_microbatches=MICRO))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_a_group_smaller_than_the_world_is_refused(ranks):
    """Catches a hang: the layout's groups are collectives of the world (the engine's
    ParallelLayout.pipelined), so a trainer over a smaller group waited for ranks that never came.
    It is refused, naming the fix."""
    message = ranks.run(_subgroup_on_rank, 2, timeout=60)[0]
    assert message is not None and "drop group=" in message.lower(), message


def _parity_on_rank(num_stages: int, schedules: list[str], steps: int) -> list[tuple[RunResult, torch.Tensor | None]]:
    out = []
    for schedule in schedules:
        trainer = _trainer(2, PipelineConfig(num_stages=num_stages, num_microbatches=MICRO, schedule=schedule,
                                             cache=False))
        losses = [trainer.step(b) for b in batches_of(trainer.sampler, steps)]
        # This rank's own copy of the tied weight, before full_parameters overwrites it.
        holds_tie = any(TIED in trainer.chain.names[i] for i in range(*trainer.layout.bounds[
            trainer.layout.coords(trainer.rank)[1]]))
        copy = trainer.chain.params[TIED].detach().clone() if holds_tie else None
        out.append((RunResult(losses, [], trainer.full_parameters()), copy))
    return out


@pytest.mark.parametrize("world_size,num_stages", [(2, 2), (4, 4), (4, 2)])
def test_pipeline_matches_single_process(ranks, world_size, num_stages):
    """Catches a wrong micro-batch scale (sum instead of mean), a stage boundary that drops or
    repeats a layer, a replica average missing, and a tied embedding/head whose two copies'
    gradients are not summed across the first and last stage: 5 AdamW steps of the tied GPT
    under GPipe and 1F1B with 4 micro-batches must equal one process (fp32 1e-5/1e-6), and
    every rank's copy of the tied weight must be bitwise equal to every other's."""
    schedules = ["gpipe", "1f1b"]
    results = ranks.run(_parity_on_rank, world_size, num_stages, schedules, 5, timeout=90)
    reference = reference_run(2, num_homes=world_size, steps=5)
    for k, schedule in enumerate(schedules):
        copies = [r[k][1] for r in results if r[k][1] is not None]
        assert len(copies) == 2 * (world_size // num_stages), f"{schedule}: expected the tie on first and last stages"
        for copy in copies[1:]:
            assert torch.equal(copy, copies[0]), f"{schedule}: tied copies drifted apart"
        for rank, r in enumerate(results):
            try:
                assert_close_runs(reference, r[k][0])
            except AssertionError as e:
                raise AssertionError(f"{schedule}, {num_stages} stages, rank {rank}: {e}") from None


# ---- freezing + activation cache + re-packing --------------------------------------

# After epoch 0 the embedding (with the tied head weight) freezes; after epoch 1 the first
# block too. With 6 equal-cost layers on 4 stages (budget 2 layers a stage), the first
# freeze keeps 4 stages and the second re-packs to 2 stages x 2 replicas.
FREEZES = {1: 1, 2: 2}  # epoch -> frozen layers from its start


def _freeze_on_rank(repack: bool, cache_memory_bytes: int) -> dict:
    """4 ranks, 4 stages, 4 epochs of 4 steps, freezing as FREEZES says."""
    config = PipelineConfig(num_stages=4, num_microbatches=MICRO, schedule="1f1b", balance=(1.0,) * 6,
                            repack=repack, cache=True, cache_memory_bytes=cache_memory_bytes)
    trainer = _trainer(4, config)
    chain = trainer.chain
    losses, cache_counts, at_freeze = [], [], {}
    for epoch in range(4):
        if epoch in FREEZES:
            trainer.freeze(FREEZES[epoch])
            for i in range(FREEZES[epoch]):
                for n, p in chain.layer_params(i):
                    at_freeze.setdefault(n, p.detach().clone())
        hits, misses = trainer.cache.hits, trainer.cache.misses
        losses += [trainer.step(b) for b in trainer.sampler.batches(epoch)]
        cache_counts.append((trainer.cache.hits - hits, trainer.cache.misses - misses))
    frozen = {n: chain.params[n] for n in at_freeze}
    optimizer = trainer.optimizer
    optimized = {id(p) for group in (optimizer.param_groups if optimizer else []) for p in group["params"]}
    report = {
        "layout": (trainer.layout.num_stages, trainer.layout.num_replicas),
        "stage": trainer.layout.coords(trainer.rank)[1],
        "frozen_unchanged": all(torch.equal(p, at_freeze[n]) for n, p in frozen.items()),
        "frozen_untouched": all(p.grad is None and not p.requires_grad and id(p) not in optimized
                                and (optimizer is None or p not in optimizer.state) for p in frozen.values()),
        "cache_counts": cache_counts,
    }
    if report["stage"] == 0:
        cache = trainer.cache
        held = torch.nonzero(cache._slot_of >= 0).flatten()
        cached, hit = cache.lookup(held)
        report.update(num_cached=len(held), all_hit=bool(hit.all()), bytes_on_disk=cache.bytes_on_disk,
                      cache_max_diff=float((cached - trainer.run_prefix(held)).abs().max()))
    report["result"] = RunResult(losses, [], trainer.full_parameters())
    return report


@pytest.mark.parametrize("repack", [True, False], ids=["repack", "no-repack"])
def test_freeze_cache_repack_matches_single_process(ranks, repack):
    """Catches a frozen layer that still trains (weight decay, a stale gradient, optimizer
    state kept), a cache that returns another sample's or a shorter prefix's activations,
    one that recomputes what it holds (a fill epoch after every freeze), and parameters or
    optimizer state lost or mixed up when layers move to other ranks on re-packing (4
    stages -> 2 stages x 2 replicas): 16 steps with freezes after 4 and 8 must equal one
    process that stops training the same layers (fp32 1e-5/1e-6, with and without
    re-packing, so training after re-packing equals training without it within that bound)."""
    reports = ranks.run(_freeze_on_rank, 4, repack, 16 * 1024, timeout=120)
    reference = reference_run(4, num_homes=4, steps=16, freezes={4 * e: k for e, k in FREEZES.items()})
    assert reports[0]["layout"] == ((2, 2) if repack else (4, 1))
    for rank, report in enumerate(reports):
        assert report["frozen_unchanged"], f"rank {rank}: a frozen parameter changed"
        assert report["frozen_untouched"], f"rank {rank}: a frozen parameter has a gradient or optimizer state"
        assert_close_runs(reference, report["result"])
    n = 4 * GLOBAL_BATCH  # samples a replica sees in an epoch at 1 replica; half that at 2
    # (hits, misses) per epoch: epoch 1 fills the cache; the second freeze carries it forward
    # on rank 0 (which keeps its half of the samples after the re-pack), while rank 2 is a
    # first stage for the first time and fills its own.
    expected = {0: [(0, 0), (0, n), (n // 2, 0), (n // 2, 0)], 2: [(0, 0), (0, 0), (0, n // 2), (n // 2, 0)]} \
        if repack else {0: [(0, 0), (0, n), (n, 0), (n, 0)]}
    for rank, counts in expected.items():
        report = reports[rank]
        assert report["cache_counts"] == counts, f"rank {rank}: cache (hits, misses) per epoch"
        # Exact: each cached row came from the same layers on the same inputs.
        assert report["cache_max_diff"] == 0.0, f"rank {rank}: cached activations differ from recomputed ones"
        assert report["num_cached"] == counts[-1][0] and report["all_hit"]
        assert report["bytes_on_disk"] > 0, "the 16 KiB budget should have spilled to the memory-mapped file"


def _auto_freeze_on_rank() -> list[tuple[int, int, int]]:
    policy = FreezePolicy(threshold=1e9, alpha=0.5)  # every layer counts as converged
    trainer = _trainer(2, PipelineConfig(num_stages=2, num_microbatches=MICRO, cache=True), policy)
    stats = [trainer.train_epoch(epoch) for epoch in range(3)]
    return [(s.num_frozen, s.num_stages, s.num_replicas) for s in stats] + [
        (trainer.layout.num_frozen, trainer.layout.num_stages, trainer.layout.num_replicas)]


def test_auto_freeze_grows_by_alpha_and_repacks(ranks):
    """Catches ranks that decide differently (a deadlock or two layouts), a rule that freezes
    before it has two windows to compare, and a prefix growing by more than alpha of the
    active layers: with every layer 'converged', 4 layers and alpha=0.5, the prefix is 0
    after epoch 0, 2 after epoch 1 (re-packed to one stage x 2 replicas), 3 after epoch 2."""
    results = ranks.run(_auto_freeze_on_rank, 2, timeout=60)
    assert results[0] == results[1]
    assert results[0] == [(0, 2, 1), (0, 2, 1), (2, 1, 2), (3, 1, 2)]


def _time_balance_on_rank() -> tuple[list[float], tuple, float]:
    trainer = _trainer(2, PipelineConfig(num_stages=2, num_microbatches=MICRO, balance="time", cache=False))
    loss = trainer.step(trainer.sampler.batches(0)[0])
    return trainer.costs, trainer.layout.bounds, loss


def test_time_balance_is_the_same_on_every_rank(ranks):
    """Catches ranks that each measure their own layer times and cut different stages (their
    pipelines would mispair sends and hang or train the wrong layers)."""
    results = ranks.run(_time_balance_on_rank, 2, timeout=60)
    assert results[0] == results[1]
    assert all(c > 0 for c in results[0][0])


def _move_state_without_unpickling(extra):
    """2 ranks: rank 0 sends a parameter and its SGD momentum to rank 1, torch's unpickler made to refuse."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from shardwise.errors import ShardwiseError
    from shardwise.pipeline._moves import broadcast_entries

    class Refuse:
        def __init__(self, *args):
            raise AssertionError("unpickled bytes that came over a collective")

    rank = dist.get_rank()
    params = {"w": torch.nn.Parameter(torch.full((3, 2), float(rank)))}
    optimizer = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    if rank == 0:
        optimizer.state[params["w"]] = {"momentum_buffer": torch.arange(6.0).view(3, 2), "extra": extra}
    saved, c10d._unpickler = c10d._unpickler, Refuse
    try:
        state = broadcast_entries(params, ["w"], optimizer, 0, dist.group.WORLD, True)
    except ShardwiseError as error:
        return str(error)
    finally:
        c10d._unpickler = saved
    return params["w"].tolist(), state["w"]["momentum_buffer"].tolist(), state["w"]["extra"]


def test_moving_optimizer_state_sends_no_pickle(ranks):
    """Catches the pipeline's re-pack sending the optimizer state's layout with broadcast_object_list,
    which unpickles what arrives (Note [no pickle on the wire]): the layout goes as JSON, the values
    arrive whole; a state value JSON cannot carry is refused on both ranks, not a hang on one."""
    moved = ([[0.0, 0.0]] * 3, [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], 7)
    assert ranks.run(_move_state_without_unpickling, 2, 7, timeout=120) == [moved, moved]
    for message in ranks.run(_move_state_without_unpickling, 2, object(), timeout=120):
        assert "extra=object" in message, message


def test_no_object_collective_in_the_source():
    """Catches a pickle between ranks coming back anywhere in src (Note [no pickle on the wire])."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "shardwise"
    pattern = re.compile(r"dist\.(broadcast_object_list|all_gather_object|gather_object|scatter_object_list)\(")
    found = [f"{path.relative_to(src)}:{n}" for path in sorted(src.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == []
