"""Training habits that read a parameter as a whole tensor, under zero1/2/3 at 2 ranks: each works
as in one process, or stops with a ShardwiseError naming the fix on every rank (never torch's
own error from deep inside, never a silent broadcast)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from helpers.two_rows import TwoRows
from shardwise.models.zoo import ZOO, build
from shardwise.testing import assert_close_runs, global_batch, train

MODEL = "reused_block"
STRATEGIES = ["zero1", "zero2", "zero3"]


def _average(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def _hooked(strategy):
    """SGD with a hook halving every parameter's gradient and recording its shape."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if strategy else (0, 1)
    model, spec = build(MODEL), ZOO[MODEL]
    if strategy:
        sw.shard(model, strategy=strategy, units=spec.unit_class)
    shapes = set()
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: shapes.add((name, tuple(g.shape))) or g * 0.5)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    result = train(model, spec, 3, 8, rank=rank, world_size=world_size, optimizer=optim,
                   all_reduce_loss=_average if strategy else None,
                   gather_params=(lambda: sw.full_parameters(model)) if strategy else None)
    return result, shapes


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_hook_on_a_parameter_sees_its_whole_gradient(ranks, strategy):
    """Catches p.register_hook(fn) on a shard: fn received None, and what it returned was lost."""
    reference, reference_shapes = _hooked(None)
    for result, shapes in ranks.run(_hooked, 2, strategy):
        assert shapes == reference_shapes
        assert_close_runs(reference, result)


def _errors(strategy):
    """What each whole-tensor habit does on a sharded model: the ShardwiseError's text, or 'ok'."""
    torch.manual_seed(0)
    model, spec = build(MODEL), ZOO[MODEL]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    x, y = global_batch(spec, 0, 4)
    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = "ok"
        except sw.ShardwiseError as error:
            out[key] = str(error)

    attempt("post_accumulate", lambda: next(model.parameters()).register_post_accumulate_grad_hook(print))
    attempt("deepcopy", lambda: copy.deepcopy(model))
    attempt("averaged_model", lambda: torch.optim.swa_utils.AveragedModel(model))
    attempt("lerp", lambda: [before[n].lerp_(p, 0.1) for n, p in model.named_parameters()])
    attempt("foreach_lerp", lambda: torch._foreach_lerp_(list(before.values()), list(model.parameters()), 0.1))
    attempt("add", lambda: [before[n].add_(p) for n, p in model.named_parameters()])  # two arguments only
    other = build(MODEL)
    optim = torch.optim.AdamW(other.parameters())
    model(x, y).backward()
    attempt("other_model_optimizer", optim.step)
    params = list(model.parameters())  # taken before the forward, as MAML-style code keeps them
    attempt("autograd_grad", lambda: torch.autograd.grad(model(x, y), params))
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_whole_tensor_habits_are_errors_that_name_the_fix(ranks, strategy):
    """Catches torch's own errors from deep inside ("appears to not have been used in the graph",
    "cannot pickle ProcessGroup", a shape error), a silent step of nothing, and the silent
    broadcast of an EMA lerp where a parameter's first dimension equals the world size."""
    for out in ranks.run(_errors, 2, strategy):
        assert "p.register_hook(fn)" in out["post_accumulate"]
        assert "torch.autograd.grad over a sharded model" in out["autograd_grad"]
        assert "sw.EMA(model)" in out["deepcopy"] and "sw.EMA(model)" in out["averaged_model"]
        assert "full shape" in out["lerp"] and "full shape" in out["foreach_lerp"] and "full shape" in out["add"]
        assert "none of them a parameter of the model" in out["other_model_optimizer"]


def _two_rows_lerp(strategy):
    model = TwoRows()
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    sw.shard(model, strategy=strategy)
    try:
        ema["proj.weight"].lerp_(model.proj.weight, 0.1)
    except sw.ShardwiseError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_ema_lerp_that_would_broadcast_is_an_error(ranks, strategy):
    """Catches `ema.lerp_(p)` with a [2, 4] EMA tensor and a [1, 4] shard: torch broadcasts the
    one row over both, silently."""
    for message in ranks.run(_two_rows_lerp, 2, strategy):
        assert "'proj.weight'" in message and "full shape [2, 4]" in message


def _ema_run(strategy):
    """sw.EMA on the sharded model; the reference is torch's own EMA (AveragedModel) in one process."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if strategy else (0, 1)
    model, spec = build(MODEL), ZOO[MODEL]
    if strategy:
        sw.shard(model, strategy=strategy, units=spec.unit_class)
        ema = sw.EMA(model, decay=0.9)
        update = ema.update
    else:
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        update = lambda: ema.update_parameters(model)  # noqa: E731
        update()  # its first update copies the weights: the starting point sw.EMA takes at construction
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)

    def step():
        optim.step()
        update()

    result = train(model, spec, 3, 8, rank=rank, world_size=world_size, optimizer=optim, step_fn=step,
                   all_reduce_loss=_average if strategy else None)
    x, y = global_batch(spec, 9, 8)
    if strategy:
        with ema.applied():
            loss = model(x, y).item()  # every rank the same batch: the averaged model's loss
            averaged = sw.full_parameters(model)
    else:
        loss = ema.module(x, y).item()
        averaged = {n: p.detach().clone() for n, p in ema.module.named_parameters()}
    return averaged, loss, result.losses


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sw_ema_matches_one_process(ranks, strategy):
    """Catches an EMA of a sharded model that is not torch's EMA (AveragedModel) of the whole
    weights in one process, or that leaves the averaged weights in the model after `applied()`."""
    averaged, loss, losses = _ema_run(None)
    for got, got_loss, got_losses in ranks.run(_ema_run, 2, strategy):
        for name, value in averaged.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
        assert abs(got_loss - loss) < 1e-5
        assert got_losses == pytest.approx(losses, rel=1e-5)


def _sparse(strategy):
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    try:
        sw.shard(model, strategy=strategy)
    except sw.ShardwiseError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sparse_embedding_is_refused_at_shard(ranks, strategy):
    """Catches nn.Embedding(sparse=True) failing at the first backward inside torch
    ("reshape is not implemented for sparse tensors")."""
    for message in ranks.run(_sparse, 2, strategy):
        assert "sparse=False" in message
