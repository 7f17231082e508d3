"""`strategy="ddp"`: parity with the single process on every zoo model, the
unused-parameter error, and the in-place contract (same object, same keys, hooks once)."""

from __future__ import annotations

import pytest

import shardwise as sw
from helpers.parity import check_parity, run_on_rank
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch

NAMES = sorted(ZOO)
WORLD_SIZES = [1, 2, 4]
# Plain steps, then 2 micro-batches per rank with clipping. Every zoo model's reference
# grad norm is above 0.5 in most steps (0.50-1.98 with seed 0), so clipping scales real
# gradients; check_parity asserts it triggers at least once.
CONFIGS = [(1, None), (2, 0.5)]


@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda n: f"ws{n}")
@pytest.mark.parametrize("name", NAMES)
def test_ddp_matches_single_process(ranks, name, world_size):
    """Losses, pre-clip grad norms and final parameters on every rank equal the full-batch
    single process. Catches gradients summed instead of averaged over ranks, a reduction
    inside no_sync or a missing one after it, micro-batch scaling errors, clipping by a
    per-rank norm, ranks starting from different parameters, and any sharing pattern
    (tied, reused, shared, varying, skipped, frozen, odd shapes) DDP reduces wrongly."""
    check_parity(ranks, "ddp", name, world_size, CONFIGS, timeout=120)


def test_unused_parameter_without_flag_names_the_fix(ranks):
    """unused_branch skips its branch in step 1; without find_unused_parameters DDP fails
    at the next forward. Catches that failure surfacing as torch's internal reducer error
    (or a hang) instead of a ShardwiseError that tells the user which flag to pass."""
    with pytest.raises(AssertionError) as info:  # harness.RankFailed
        ranks.run(run_on_rank, 2, "ddp", "unused_branch", [(1, None)],
                  shard_kwargs={"find_unused_parameters": False}, timeout=60)
    message = str(info.value)
    assert type(info.value).__name__ == "RankFailed", message
    assert "shardwise.errors.ShardwiseError" in message, message
    assert "find_unused_parameters=True" in message, message


def _in_place_contract():
    model = build("gpt")
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(len(args)))
    returned = sw.shard(model, strategy="ddp")
    x, y = global_batch(ZOO["gpt"], 0, 4)
    counts = []
    for _ in range(2):
        model(x, y).backward()
        counts.append(len(calls))
    try:
        sw.shard(model, strategy="ddp")
        again = None
    except sw.ShardwiseError as error:
        again = str(error)
    return {
        "same_object": returned is model,
        "keys": list(model.state_dict()) == keys,
        "names": [n for n, _ in model.named_parameters()] == names,
        "hook_counts": counts,
        "all_grads": all(p.grad is not None for p in model.parameters()),
        "again": again,
    }


def test_shard_is_in_place(ranks):
    """Catches shard() returning a wrapper instead of the model, `module.`-prefixed
    state_dict keys (checkpoints that no longer load into a plain model), user forward
    hooks skipped or run twice per call, and a second shard() silently double-wrapping."""
    (got,) = ranks.run(_in_place_contract, 1, timeout=60)
    assert got["same_object"]
    assert got["keys"], "state_dict keys changed after shard()"
    assert got["names"], "named_parameters names changed after shard()"
    assert got["hook_counts"] == [1, 2], "forward pre-hook must run once per model(x, y) call"
    assert got["all_grads"], "backward through the sharded model left a parameter without grad"
    assert got["again"] is not None and "already sharded" in got["again"], got["again"]


def _shard_unknown_strategy():
    try:
        sw.shard(build("reused_block"), strategy="zero4")
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_unknown_strategy_lists_the_valid_ones(ranks):
    """Catches a typo'd strategy being ignored (silently unsharded training) or failing
    with a message that does not say what the choices are."""
    (message,) = ranks.run(_shard_unknown_strategy, 1, timeout=60)
    assert message is not None, "shard(strategy='zero4') did not raise ShardwiseError"
    assert "zero4" in message
    for strategy in sw.STRATEGIES:
        assert strategy in message, message
