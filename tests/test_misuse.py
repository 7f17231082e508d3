"""Misuse that used to train wrongly or abort deep inside gloo: each now works exactly or raises
a ShardwiseError on every rank, naming the fix."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.config import MixedPrecision
from shardwise.engine import engine_of
from shardwise.models.zoo import ZOO, build
from shardwise.testing import assert_close_runs, global_batch, make_optimizer, rank_slice, reference_run, train

MODEL = "reused_block"


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except sw.ShardwiseError as error:
        return str(error)
    return None


def _freeze_on_rank_1_then_shard():
    model = build(MODEL)
    if dist.get_rank() == 1:
        model.head.requires_grad_(False)
    return _error_of(sw.shard, model, strategy="zero2", units=ZOO[MODEL].unit_class)


def test_ranks_that_freeze_different_parameters_are_refused_at_shard(ranks):
    """Catches shard()'s model check ignoring requires_grad: the first reduce then aborted
    the process inside gloo (`op.preamble.length <= op.nbytes`)."""
    for message in ranks.run(_freeze_on_rank_1_then_shard, 2):
        assert message is not None and "freeze the same parameters" in message, message
        assert "'head.weight'" in message and "frozen" in message


def _freeze_on_rank_1_mid_training(strategy):
    model = build(MODEL)
    spec = ZOO[MODEL]
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), 2)
    model(x, y).backward()
    optim.step()
    optim.zero_grad()
    if dist.get_rank() == 1:
        model.head.weight.requires_grad_(False)
    return _error_of(lambda: model(x, y).backward())


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_freezing_on_some_ranks_mid_training_is_refused_at_the_next_forward(ranks, strategy):
    """Catches a requires_grad change on one rank that reached the reduce (a gloo abort)."""
    for message in ranks.run(_freeze_on_rank_1_mid_training, 2, strategy):
        assert message is not None and "train different parameters" in message, message


def _optimizer_before_deferred_shard():
    with sw.deferred_init():
        model = ZOO[MODEL].build()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sw.shard(model, strategy="zero3", units=ZOO[MODEL].unit_class)
    x, y = rank_slice(global_batch(ZOO[MODEL], 0, 8), dist.get_rank(), 2)
    model(x, y).backward()
    return _error_of(optim.step)


def test_optimizer_built_before_a_deferred_model_is_sharded_is_refused(ranks):
    """Catches an optimizer stepping the meta parameters a deferred model had before shard()
    replaced them: it would train nothing, without a word."""
    for message in ranks.run(_optimizer_before_deferred_shard, 2):
        assert message is not None and "Build the optimizer after sw.shard" in message, message


def _train_in_subgroups(strategy):
    """Ranks {0, 1} and {2, 3} each train the model on their own process group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[dist.get_rank() // 2]
    model = build(MODEL)
    spec = ZOO[MODEL]
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    sw.shard(model, strategy=strategy, units=spec.unit_class, process_group=group)
    engine = engine_of(model)
    separate = engine.units[0].reduce_group is not group

    def average(value):
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
        return t.item()

    result = train(model, spec, 5, 8, rank=dist.get_rank(group), world_size=2,
                   optimizer=make_optimizer(model, ndim_by_name=ndim), all_reduce_loss=average,
                   gather_params=lambda: sw.full_parameters(model))
    return separate, result


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_user_process_group_gets_its_own_reduce_group(ranks, strategy):
    """Catches reduces sharing the user's group with the gathers (the protection of Note
    [collective order] lost) or a subgroup that cannot be given one."""
    reference = reference_run(MODEL)
    for separate, result in ranks.run(_train_in_subgroups, 4, strategy):
        assert separate
        assert_close_runs(reference, result)


def _reduce_dtypes(policy):
    from shardwise.engine.comm import collectives

    seen = set()
    real = collectives.reduce_scatter_avg

    def spy(packed, *args, **kwargs):
        seen.add(str(packed.dtype))
        return real(packed, *args, **kwargs)

    collectives.reduce_scatter_avg = spy
    try:
        model = build("gpt")
        sw.shard(model, strategy="zero3", units=ZOO["gpt"].unit_class, precision=policy)
        x, y = rank_slice(global_batch(ZOO["gpt"], 0, 8), dist.get_rank(), 2)
        model(x, y).backward()
    finally:
        collectives.reduce_scatter_avg = real
    return seen


@pytest.mark.parametrize("policy, expected", [
    ("bf16", {"torch.float32"}),
    (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16), {"torch.bfloat16"}),
    (MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32), {"torch.float32"}),
])
def test_gradients_are_reduced_in_reduce_dtype(ranks, policy, expected):
    """Catches gradients reduced in another dtype than the policy's reduce_dtype (fp32 by
    default): a bf16 reduction loses the low bits of every sum."""
    for seen in ranks.run(_reduce_dtypes, 2, policy):
        assert seen == expected


def _stop_calling_collectives():
    """Rank 1 leaves after 2 steps; rank 0 starts a third and must fail, saying where."""
    model = build(MODEL)
    spec = ZOO[MODEL]
    group = dist.new_group(timeout=timedelta(seconds=3))  # the bound sw.init(timeout=...) sets
    sw.shard(model, strategy="zero3", units=spec.unit_class, process_group=group)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        if step == 2 and dist.get_rank() == 1:
            return None
        x, y = rank_slice(global_batch(spec, step, 8), dist.get_rank(), 2)
        error = _error_of(lambda: model(x, y).backward())
        if error is not None:
            return error
        optim.step()
        optim.zero_grad()
    return None


def test_a_rank_that_stops_makes_the_others_fail_naming_the_step_and_collective(ranks):
    """Catches a hang, or a raw gloo error that says nothing of where the engine was."""
    rank0, rank1 = ranks.run(_stop_calling_collectives, 2, timeout=30)
    assert rank1 is None
    assert rank0 is not None and "step 2, forward" in rank0 and "Another rank most likely died" in rank0, rank0


def _wrap_in_ddp(strategy):
    from torch.nn.parallel import DistributedDataParallel

    model = build(MODEL, seed=dist.get_rank())  # rank-different values before shard(): rank 0's win
    kwargs = {} if strategy == "ddp" else {"units": ZOO[MODEL].unit_class}
    sw.shard(model, strategy=strategy, **kwargs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    message = _error_of(DistributedDataParallel, model)
    unchanged = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    return message, unchanged


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_wrapping_a_sharded_model_in_ddp_is_refused_before_it_broadcasts(ranks, strategy):
    """Catches a second data-parallel wrapper (DDP, so Accelerate and the transformers Trainer):
    its broadcast overwrote every rank's rows with rank 0's and losses drifted without a word."""
    for message, unchanged in ranks.run(_wrap_in_ddp, 2, strategy):
        assert message is not None and "already sharded by shardwise" in message, message
        assert unchanged


def _torch_clip(strategy):
    model = build(MODEL)
    sw.shard(model, strategy=strategy, units=ZOO[MODEL].unit_class)
    x, y = rank_slice(global_batch(ZOO[MODEL], 0, 8), dist.get_rank(), dist.get_world_size())
    model(x, y).backward()
    message = _error_of(torch.nn.utils.clip_grad_norm_, model.parameters(), 0.1)
    # Its first half, get_total_norm, and a norm of one gradient are this rank's alone: refused too.
    total = _error_of(torch.nn.utils.get_total_norm, [p.grad for p in model.parameters()])
    one = _error_of(lambda: next(model.parameters()).grad.norm())
    assert (message is None) == (total is None) == (one is None), (message, total, one)
    grads_readable = all(p.grad is not None for p in model.parameters())  # any other read is plain
    return message, grads_readable


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_torch_clip_grad_norm_on_a_sharded_model_is_refused(ranks, strategy):
    """Catches torch's rank-local clip_grad_norm_ on shards (the Trainer logged one rank's norm,
    1.227 for a true 1.695, and ranks clipped by different factors), also its get_total_norm and a
    norm of one gradient (the gradient knows it is rows: Note [rank-local clipping])."""
    for message, readable in ranks.run(_torch_clip, 2, strategy):
        assert message is not None and "sw.clip_grad_norm_" in message, message
        assert readable
    for message, readable in ranks.run(_torch_clip, 1, strategy):  # one rank holds every row: exact
        assert message is None and readable
