"""Any optimizer and any in-place write between steps, under zero1/2/3, against one process.

zero1/zero2 re-gather a unit only when its rows may have changed (Note [writes the engine
must see] in engine/unit/shard_param.py); these runs write the rows every way a user does and
compare every parameter with a single process doing the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import assert_close_runs, global_batch, rank_slice, train

MODEL = "reused_block"  # a unit used 3 times per forward, a head in the root unit

# (optimizer class, implementation flag, extra options); "loop" is the for-loop implementation.
OPTIMIZERS = [
    ("SGD", "loop", {"momentum": 0.9}), ("SGD", "foreach", {"momentum": 0.9}), ("SGD", "fused", {"momentum": 0.9}),
    ("AdamW", "loop", {}), ("AdamW", "foreach", {}), ("AdamW", "fused", {}),
    ("Adagrad", "loop", {}), ("Adagrad", "foreach", {}), ("Adagrad", "fused", {}),
    ("RMSprop", "loop", {}), ("RMSprop", "foreach", {}),
]


def make(params, name: str, impl: str, options: dict):
    flags = {"foreach": False} if impl == "loop" else {impl: True}
    if name == "AdamW":
        options = {"eps": 1e-3, **options}  # testing.py's Note [adam eps]
    return getattr(torch.optim, name)(params, lr=1e-2, **flags, **options)


def _average(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def between_steps(model, write: str) -> None:
    """A write to every parameter between steps, as users make them."""
    if write == "data":  # weight clipping through .data (WGAN style)
        for p in model.parameters():
            p.data.clamp_(-0.15, 0.15)
    elif write == "no_grad":  # an in-place op under no_grad
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.97)
    elif write == "set_data":  # rebinding .data to a tensor of the same shape
        for p in model.parameters():
            p.data = p.data * 0.97


def run(strategy: str | None, optimizer: tuple, write: str | None = None, order: str = "after",
        world: int | None = None):
    """Train MODEL 4 steps; `strategy=None` is the single-process reference on the whole batch."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if strategy else (0, 1)
    model = build(MODEL)
    spec = ZOO[MODEL]
    later = []  # order "group_after_a_step": the parameters the optimizer takes after its first step
    if order == "group_after_a_step":  # the reference too: the same groups at the same steps
        if strategy:
            sw.shard(model, strategy=strategy, units=spec.unit_class)
        params = list(model.parameters())
        optim, later = make(params[:1], *optimizer), params[1:]
    elif strategy and order == "before":  # the order Accelerate and HF examples use
        optim = make(model.parameters(), *optimizer)
        sw.shard(model, strategy=strategy, units=spec.unit_class)
    elif strategy and order == "added_later":
        sw.shard(model, strategy=strategy, units=spec.unit_class)
        params = list(model.parameters())
        optim = make(params[:1], *optimizer)
        optim.add_param_group({"params": params[1:]})
    else:
        if strategy:
            sw.shard(model, strategy=strategy, units=spec.unit_class)
        optim = make(model.parameters(), *optimizer)

    probe = rank_slice(global_batch(spec, 0, 8), rank, world_size)

    def step():
        optim.step()
        if later:
            optim.add_param_group({"params": later[:]})
            later.clear()
        if write:
            # An evaluation forward first: it re-gathers what the step changed, so the write
            # below is the only change the next forward can see (the step's mark is spent).
            with torch.no_grad():
                model(*probe)
            between_steps(model, write)

    result = train(model, spec, 4, 8, rank=rank, world_size=world_size, optimizer=optim, step_fn=step,
                   all_reduce_loss=_average if strategy else None,
                   gather_params=(lambda: sw.full_parameters(model)) if strategy else None)
    return result


_REFERENCES: dict[str, object] = {}  # by optimizer: plain torch in this process, the same for all 9 cells of its row


def reference_of(optimizer: tuple):
    if repr(optimizer) not in _REFERENCES:
        _REFERENCES[repr(optimizer)] = run(None, optimizer)
    return _REFERENCES[repr(optimizer)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=[f"{n}-{i}" for n, i, _ in OPTIMIZERS])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_every_optimizer_implementation(ranks, strategy, optimizer, world_size):
    """Catches a re-gather decided from version counters alone: fused kernels bump none, so
    zero1/zero2 kept stale full parameters (2e-2 off after 3 fused AdamW steps)."""
    reference = reference_of(optimizer)
    for result in ranks.run(run, world_size, strategy, optimizer):
        assert_close_runs(reference, result)


@pytest.mark.parametrize("write", ["data", "no_grad", "set_data"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_writes_between_steps(ranks, strategy, write):
    """Catches a write through `p.data` (its own version counter on a plain Parameter) or a
    rebinding of `.data` that zero1/zero2 never re-gather, or that breaks the shard's aliasing."""
    optimizer = ("AdamW", "fused", {})
    reference = run(None, optimizer, write)
    for result in ranks.run(run, 2, strategy, optimizer, write):
        assert_close_runs(reference, result)


@pytest.mark.parametrize("order", ["before", "added_later"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_optimizer_built_before_shard_or_groups_added_later(ranks, strategy, order):
    """Catches an optimizer built before sw.shard() that steps tensors the model no longer
    uses (losses stayed flat, no error), and param groups added after shard()."""
    optimizer = ("AdamW", "foreach", {})
    reference = run(None, optimizer)
    for result in ranks.run(run, 2, strategy, optimizer, None, order):
        assert_close_runs(reference, result)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_group_added_after_a_step_is_marked_stepped(ranks, strategy):
    """Catches an optimizer's step plan (Note [step plan]) kept after a parameter group is added between steps:
    the new group's units were never marked stepped, and fused AdamW bumps no version counter, so zero1/zero2
    kept their full values from before every later step."""
    optimizer = ("AdamW", "fused", {})
    reference = run(None, optimizer, order="group_after_a_step")
    for result in ranks.run(run, 2, strategy, optimizer, None, "group_after_a_step"):
        assert_close_runs(reference, result)


def test_set_data_with_another_shape_is_refused():
    """Catches `.data = t` silently breaking the shard's place in the flat buffer (or a cast
    after shard() that the engine never sees)."""
    sw.init()
    model = build(MODEL)
    sw.shard(model, strategy="zero2", units=ZOO[MODEL].unit_class)
    param = next(model.parameters())
    with pytest.raises(sw.ShardwiseError, match="before sw.shard"):
        param.data = param.data.double()
    with pytest.raises(sw.ShardwiseError, match="before sw.shard"):
        model.half()
    sw.shutdown()


def _write_on_rank_1_only(strategy):
    model = build(MODEL)
    spec = ZOO[MODEL]
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), 2)
    if dist.get_rank() == 1:  # only rank 1 changes its rows
        for p in model.parameters():
            p.data.mul_(0.5)
    try:
        model(x, y).backward()
    except sw.ShardwiseError as error:
        return str(error)
    return None


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_a_write_on_one_rank_is_refused_on_every_rank(ranks, strategy):
    """Catches re-gathers decided per rank: a write only rank 1 made re-gathered the unit on rank 1
    alone (a one-sided gather mismatches the collectives), or went unseen by the others. Every rank
    raises, naming the unit and the rank that wrote (Note [agreement rides the traffic]); a write on
    every rank is re-gathered exactly (test_writes_between_steps)."""
    for message in ranks.run(_write_on_rank_1_only, 2, strategy, timeout=60):
        assert message is not None and "written on rank 1" in message, message
