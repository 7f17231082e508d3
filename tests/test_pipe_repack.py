"""Re-packing sharded pipeline stages mid-run (issue 46 point 5): a frozen prefix leaves the pipeline (whole,
cached), the active layers go onto fewer stages, their rows and optimizer rows re-cut over the new layout,
and the freed ranks join the shard or replicate dimension. Real gloo ranks against one process (fp32 1e-5)."""

from __future__ import annotations

import pytest
import torch

from helpers.pipe import GLOBAL_BATCH, MICRO, batches_of, dataset, gpt, reference_run, token_loss
from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw
from shardwise.testing import RunResult, assert_close_runs

STEPS, FREEZE_AT, FROZEN, LAYERS = 5, 2, 2, 2  # the embedding and the first block freeze before step 2


def _repack_on_rank(strategy: str, shards: int | None) -> dict:
    inputs, targets = dataset()
    config = PipelineConfig(num_stages=2, num_microbatches=MICRO, schedule="1f1b", strategy=strategy, shards=shards)
    trainer = PipeTrainer(chain_layers(gpt(LAYERS)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                          global_batch_size=GLOBAL_BATCH, config=config)
    before = (trainer.mesh.shard_world, trainer.mesh.replicate_world)
    losses = []
    for step, batch in enumerate(batches_of(trainer.sampler, STEPS)):
        if step == FREEZE_AT:
            trainer.freeze(FROZEN)
        losses.append(trainer.step(batch))
    held = torch.nonzero(trainer.cache._slot_of >= 0).flatten()
    cached, _ = trainer.cache.lookup(held)
    return {"before": before, "stages": trainer.layout.num_stages,
            "after": (trainer.mesh.shard_world, trainer.mesh.replicate_world),
            "hits": trainer.cache.hits, "cache_exact": torch.equal(cached, trainer.run_prefix(held)),
            "frozen_trained": [n for n, p in trainer.local_parameters().items() if n == "tok_emb.weight"],
            "result": RunResult(losses, [], trainer.full_parameters())}


def _check(results: list[dict], before: tuple[int, int], after: tuple[int, int], label: str) -> None:
    reference = reference_run(LAYERS, num_homes=4, steps=STEPS, freezes={FREEZE_AT: FROZEN})
    for rank, got in enumerate(results):
        where = f"{label}, rank {rank}"
        assert (got["before"], got["stages"], got["after"]) == (before, 1, after), f"{where}: {got}"
        assert got["hits"] > 0 and got["cache_exact"], f"{where}: the cache was not used, or not exact"
        assert not got["frozen_trained"], f"{where}: the frozen tied weight is still trained"
        try:
            assert_close_runs(reference, got["result"])
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None


@pytest.mark.parametrize("strategy", [pytest.param("zero1", marks=pytest.mark.slow),
                                      pytest.param("zero2", marks=pytest.mark.slow), "zero3"])
def test_a_repack_to_one_stage_of_four_shards_matches_one_process(ranks, strategy):
    """Catches a re-pack that leaves a stale shard (a rank keeping rows or optimizer rows cut for the old
    layout), optimizer state lost or reset in the move, the frozen tied weight trained on after it, and a
    cache that feeds the new stage something other than the prefix's output: pipe 2 x shard 2 at ws 4 freezes
    the embedding and the first block after 2 steps and re-packs to pipe 1 x shard 4; 5 AdamW steps of the
    tied GPT equal one process that stops training the same layers (fp32 1e-5 / 1e-6), the activation cache
    hits after the freeze and holds exactly the prefix's outputs."""
    results = ranks.run(_repack_on_rank, 4, strategy, None, timeout=180)
    _check(results, (2, 1), (4, 1), strategy)


@pytest.mark.slow  # make test re-packs to pipe 1 x shard 4 (above); the replicate form runs under make test-all
def test_a_repack_to_replicas_of_sharded_stages_matches_one_process(ranks):
    """Catches freed ranks that join as shards when the layout says replicas (rows cut four ways, gradients
    not averaged across the replicas): pipe 2 x shard 2 (shards=2) re-packs to pipe 1 x replicate 2 x shard 2
    under zero3, and equals one process as above."""
    results = ranks.run(_repack_on_rank, 4, "zero3", 2, timeout=180)
    _check(results, (2, 1), (2, 2), "zero3 shards=2")


def _auto_freeze_on_rank() -> dict:
    """The first epoch's per-layer gradient norms on the whole-copy route and on sharded stages (shard 2,
    replicate 2), and the layouts the rule then picks on sharded stages."""
    from shardwise.pipeline import FreezePolicy

    inputs, targets = dataset()
    out: dict = {"norms": {}}
    for strategy, shards in [(None, None), ("zero2", None), ("zero3", 1)]:
        policy = FreezePolicy(threshold=1e9, alpha=0.5)  # every layer counts as converged
        config = PipelineConfig(num_stages=2, num_microbatches=MICRO, strategy=strategy, shards=shards)
        trainer = PipeTrainer(chain_layers(gpt(LAYERS)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                              global_batch_size=GLOBAL_BATCH, config=config, freeze=policy)
        epochs = 3 if strategy == "zero2" else 1
        stats = [trainer.train_epoch(epoch) for epoch in range(epochs)]
        out["norms"][f"{strategy} shards={shards}"] = policy.history[0]
        if strategy == "zero2":
            out["layouts"] = [(s.num_frozen, s.num_stages) for s in stats] + [
                (trainer.layout.num_frozen, trainer.layout.num_stages)]
            out["final"] = RunResult([s.loss for s in stats], [], trainer.full_parameters())
    return out


def test_automatic_freezing_reads_whole_layer_norms_from_shards(ranks):
    """Catches the freeze rule reading a shard's part of a layer's gradient norm (or a replica's rows counted
    twice) on sharded stages, and an automatic freeze that cannot re-pack them: at ws 4 the first epoch's
    per-layer gradient norms of pipe 2 x shard 2 (zero2) and pipe 2 x replicate 2 (zero3, shards=1) equal the
    whole-copy route's (1e-5); with every layer 'converged' the rule then freezes 2 layers and re-packs to one
    stage, then a third (the cache carried forward), on every rank alike."""
    results = ranks.run(_auto_freeze_on_rank, 4, timeout=240)
    for rank, got in enumerate(results):
        whole = torch.tensor(got["norms"]["None shards=None"])
        assert bool((whole[:-1] > 0).all()), f"rank {rank}: {whole}"
        for label, norms in got["norms"].items():
            assert torch.allclose(torch.tensor(norms), whole, rtol=1e-5, atol=1e-7), f"rank {rank} {label}: {norms}"
        assert got["layouts"] == [(0, 2), (0, 2), (2, 1), (3, 1)], f"rank {rank}: {got['layouts']}"
        assert got["final"].losses == results[0]["final"].losses


def test_the_skeleton_rebuilds_layers_with_their_ties_and_refuses_running_statistics():
    """Catches a re-pack's fresh layers that untie the embedding and the head (two parameters, two updates)
    or miss a value, and a layer whose buffers train (BatchNorm's running statistics: rebuilt as built)
    re-packed silently instead of refused."""
    import shardwise as sw
    from shardwise.pipeline.repack import Skeleton

    chain = chain_layers(gpt(LAYERS))
    values = {name: torch.randn(p.shape) for name, p in chain.params.items()}
    built = Skeleton(chain).build(range(chain.num_layers), values, frozen={"pos_emb"})
    first, last = built[0], built[chain.num_layers - 1]
    assert first.tok_emb.weight is last.head.weight and torch.equal(first.tok_emb.weight, values["tok_emb.weight"])
    assert not first.pos_emb.requires_grad and first.tok_emb.weight.requires_grad
    for i, layer in built.items():
        for p, name in zip(layer.parameters(), chain.names[i]):
            assert torch.equal(p, values[name]), name
    Skeleton(chain).check()
    with pytest.raises(sw.ShardwiseError, match="running statistics"):
        Skeleton(chain_layers([torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)])).check()
