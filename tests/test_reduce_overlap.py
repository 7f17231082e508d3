"""When each unit's gradient reduce is issued, counted against backward's own hooks: every stage, zero1
included, issues a unit's reduce as that unit's gradients are complete (its `post_backward`), so the reduce
overlaps the rest of backward, and the step moves the same reduce bytes at every stage (Note [stages],
unit/stage.py). Events, not times: this host's timings are noise under load."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.engine.comm.collectives as coll
from shardwise.engine import engine_of
from shardwise.models.gpt import GPT, Block, GPTConfig
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice

STEPS = 2


def _record(model, events: list):
    """Wrap the driver's unit hook and backward end, and the engine's reduce, to append what ran, in order:
    ("unit", label) as a unit's gradients complete, ("reduce", bytes) as a reduce is issued, ("end",) as
    backward's final callback starts (where anything not reduced yet would be). Returns an undo."""
    driver, real_reduce = engine_of(model).driver, coll.reduce_scatter_avg
    post_backward, finalize = driver.post_backward, driver._finalize_backward

    def unit_done(unit, grads):
        events.append(("unit", unit.label))
        return post_backward(unit, grads)

    def backward_end():
        events.append(("end",))
        return finalize()

    def reduce(packed, *args, **kwargs):
        events.append(("reduce", packed.numel() * packed.element_size()))
        return real_reduce(packed, *args, **kwargs)

    driver.post_backward, driver._finalize_backward, coll.reduce_scatter_avg = unit_done, backward_end, reduce

    def undo():
        coll.reduce_scatter_avg = real_reduce
        del driver.post_backward, driver._finalize_backward

    return undo


def _gpt_events(strategy: str, micro_steps: int):
    """Per step of a 3-block GPT: each backward's events (the first micro_steps - 1 under no_sync)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=3))
    sw.shard(model, strategy=strategy, units=Block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank = dist.get_rank()
    steps, events = [], []
    undo = _record(model, events)
    try:
        for step in range(STEPS):
            backwards = []
            for micro in range(micro_steps):
                tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(100 * step + micro))
                x, y = tokens[2 * rank : 2 * rank + 2, :-1], tokens[2 * rank : 2 * rank + 2, 1:]
                events.clear()
                if micro < micro_steps - 1:
                    with sw.no_sync(model):
                        model(x, y).backward()
                else:
                    model(x, y).backward()
                backwards.append(list(events))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps.append(backwards)
    finally:
        undo()
    units = engine_of(model).units
    return steps, len(units), sum(u.mesh.shard_world * u.shard_total * 4 for u in units if u.trainable())


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_each_unit_reduced_as_its_backward_ends(ranks, strategy):
    """Catches a stage (zero1 above all) that keeps its gradients to reduce them all once backward ends, so
    none of its reduce overlaps backward: each unit's reduce must follow its own hook, before the next
    unit's backward; and one reduce per unit per step, of the full padded gradient once."""
    for steps, num_units, step_bytes in ranks.run(_gpt_events, 2, strategy, 1, timeout=90):
        for (backward,) in steps:
            expected = [kind for _ in range(num_units) for kind in ("unit", "reduce")] + ["end"]
            assert [event[0] for event in backward] == expected, (strategy, backward)
            assert sum(event[1] for event in backward if event[0] == "reduce") == step_bytes, (strategy, backward)


def test_zero1_accumulation_reduces_once_in_the_synced_backward(ranks):
    """Catches zero1 reducing inside no_sync micro-batches (each micro-batch's gradient would be averaged
    alone, and the traffic paid per micro-batch), or not overlapping the synced micro-batch's backward."""
    for steps, num_units, step_bytes in ranks.run(_gpt_events, 2, "zero1", 3, timeout=90):
        for backwards in steps:
            *quiet, synced = backwards
            for backward in quiet:
                assert [event[0] for event in backward] == ["unit"] * num_units + ["end"], backward
            expected = [kind for _ in range(num_units) for kind in ("unit", "reduce")] + ["end"]
            assert [event[0] for event in synced] == expected, synced
            assert sum(event[1] for event in synced if event[0] == "reduce") == step_bytes, synced


def _zoo_events(name: str, strategy: str):
    """Each step's events of zoo model `name` (sharing cases: a parameter used by two units' branches)."""
    spec, rank, world_size = ZOO[name], dist.get_rank(), dist.get_world_size()
    model = build(name)
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optimizer = make_optimizer(model)
    steps, events = [], []
    undo = _record(model, events)
    try:
        for step in range(STEPS):
            model.begin_step(step)
            x, y = rank_slice(global_batch(spec, step, 8), rank, world_size)
            events.clear()
            model(x, y).backward()
            steps.append(list(events))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        undo()
    return steps, sum(1 for u in engine_of(model).units if u.trainable())


@pytest.mark.parametrize("name", ["gpt", "shared_branch", "reused_block"])
def test_zero1_shared_parameters_reduced_before_backward_ends(ranks, name):
    """Tied weights, a module two branches share, a block reused three times: a unit's reduce waits for
    every use's gradient (one per unit per step), and still the first is issued before backward ends."""
    for steps, trainable_units in ranks.run(_zoo_events, 2, name, "zero1", timeout=90):
        for backward in steps:
            kinds = [event[0] for event in backward]
            assert kinds.count("reduce") == trainable_units, (name, backward)
            assert kinds[-1] == "end" and kinds.index("reduce") < kinds.index("end"), (name, backward)
            assert kinds.index("reduce") > kinds.index("unit"), (name, backward)
