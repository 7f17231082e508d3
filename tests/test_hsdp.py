"""Hybrid sharding (`shard(..., mesh=2-D DeviceMesh)`, Note [mesh info]) against the single process."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from helpers.parity import check_parity, run_on_rank
from shardwise.engine.protocol import engine_of
from shardwise.engine.unit.info import shard_info
from shardwise.errors import ShardwiseError
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice

# (accum, clip): plain steps, then 2 micro-batches under no_sync with clipping (the clipped norm is compared
# with the reference's, step by step: a norm counted once per replica is sqrt(R) too large).
CONFIGS = [(1, None), (2, 0.5)]
SHAPES = [(2, 2), (1, 4), (4, 1)]
# zero2 and zero3 at every shape; zero1, whose reduce path is zero2's with kept gradients, at 2x2.
GRID = [(strategy, shape) for strategy in ("zero2", "zero3") for shape in SHAPES] + [("zero1", (2, 2))]


def _mesh(shape):
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard"))


def _run_on_mesh(strategy, name, configs, steps, global_batch_size, seed, shard_kwargs, prepare):
    kwargs = dict(shard_kwargs)
    mesh = _mesh(kwargs.pop("mesh_shape"))
    return run_on_rank(strategy, name, configs, steps, global_batch_size, seed, {**kwargs, "mesh": mesh}, prepare)


# `make test` runs the tied GPT at every grid point and every model at 2x2; the rest is `make test-all`.
PARITY = [pytest.param(strategy, shape, name, id=f"{strategy}-{shape[0]}x{shape[1]}-{name}",
                       marks=() if name == "gpt" or tuple(shape) == (2, 2) else pytest.mark.slow)
          for strategy, shape in GRID for name in ("gpt", "reused_block", "unused_branch", "odd_shapes")]


@pytest.mark.parametrize("strategy, shape, name", PARITY)
def test_hybrid_parity_with_single_process(ranks, strategy, name, shape):
    """Catches a gradient not averaged across replicas (each replica would step on its own half of the batch),
    a norm summed over every rank instead of the shard group (sqrt(R) too large: clipping differs), rows cut
    over the whole world instead of the shard group, or unused-parameter flags agreed within one replica only:
    5 AdamW steps, with no_sync accumulation and clipping, equal one process (fp32 1e-5/1e-6)."""
    check_parity(ranks, strategy, name, 4, CONFIGS, shard_kwargs={"mesh_shape": shape}, rank_fn=_run_on_mesh)


def _train_bf16(strategy, shape, steps):
    spec = ZOO["gpt"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    mesh = {"mesh": _mesh(shape)} if shape is not None else {}
    sw.shard(model, strategy=strategy, units=spec.unit_class, precision="bf16", **mesh)
    optimizer = make_optimizer(model, ndim_by_name=ndim)
    losses = []
    for step in range(steps):
        x, y = rank_slice(global_batch(spec, step, 8), rank, world_size)
        loss = model(x, y)
        loss.backward()
        sw.clip_grad_norm_(model, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses, sw.full_parameters(model)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_hybrid_bf16_matches_flat_bf16(ranks, strategy):
    """Catches the replica average skipped or taken on the bf16 compute copy under precision="bf16": a 2x2 mesh
    trains as flat sharding over the same 4 ranks does. Not bitwise: the mesh averages over 2 ranks, then over 2
    replicas, in fp32, where the flat layout averages 4 copies at once (measured: losses equal, parameters within
    1.5e-4 after 6 steps; bound 1e-3)."""
    flat_losses, flat_params = ranks.run(_train_bf16, 4, strategy, None, 6)[0]
    mesh_losses, mesh_params = ranks.run(_train_bf16, 4, strategy, (2, 2), 6)[0]
    assert max(abs(a - b) for a, b in zip(flat_losses, mesh_losses)) < 1e-3, (flat_losses, mesh_losses)
    for name, value in flat_params.items():
        torch.testing.assert_close(mesh_params[name], value, rtol=1e-3, atol=1e-3)


def _rows_and_groups(shape):
    model = torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Linear(10, 3))
    sw.shard(model, strategy="zero3", mesh=_mesh(shape), units=lambda module: False)
    mesh = engine_of(model).mesh
    infos = shard_info(model)
    return (mesh.shard_rank, mesh.shard_world, mesh.replicate_rank, mesh.replicate_world,
            {name: (info.row_start, info.row_end) for name, info in infos.items()})


def test_rows_are_chunked_over_the_shard_group(ranks):
    """Catches rows cut over all 4 ranks under a 2x2 mesh: each replica's 2 shard ranks hold half of each
    parameter, replica r's shard rank s the same rows as every other replica's shard rank s."""
    out = ranks.run(_rows_and_groups, 4, (2, 2), timeout=60)
    for rank, (shard_rank, shard_world, replica, replicas, rows) in enumerate(out):
        assert (shard_rank, shard_world, replica, replicas) == (rank % 2, 2, rank // 2, 2)
        assert rows["0.weight"] == ((0, 5) if shard_rank == 0 else (5, 10))
        assert rows == out[shard_rank][4]


def _refusal(case):
    model = torch.nn.Linear(4, 4)
    if case == "ddp":
        sw.shard(model, strategy="ddp", mesh=_mesh((2, 2)))
    elif case == "names":
        sw.shard(model, strategy="zero2", mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp")))
    elif case == "3d":
        sw.shard(model, strategy="zero2", mesh=init_device_mesh("cpu", (2, 1, 2),
                                                                mesh_dim_names=("replicate", "shard", "tp")))
    elif case == "1d":
        sw.shard(model, strategy="zero2", mesh=init_device_mesh("cpu", (4,), mesh_dim_names=("shard",)))
    elif case == "not a mesh":
        sw.shard(model, strategy="zero3", mesh=(2, 2))


def _refused_on_rank(case):
    try:
        _refusal(case)
    except ShardwiseError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, words", [
    ("ddp", "does not take mesh="),
    ("names", "mesh_dim_names=(\"replicate\", \"shard\")"),
    ("3d", 'mesh["replicate", "shard"]'),
    ("1d", "must be 2-D"),
    ("not a mesh", "takes a torch DeviceMesh"),
])
def test_a_mesh_that_cannot_be_honoured_is_refused_on_every_rank(ranks, case, words):
    """Catches a wrong mesh (strategy, names, dimensions, ranks) that trains silently on a layout the user did not
    ask for, or fails with torch's own error on some ranks: each is a ShardwiseError on every rank naming the fix."""
    messages = ranks.run(_refused_on_rank, 4, case, timeout=60)
    assert all(message is not None and words in message for message in messages), messages


def _collectives_by_group(shape):
    """One zero3 step of the zoo GPT on a mesh of `shape`: the world size of every unit gather, reduce-scatter
    and replica all-reduce the engine issued, and the number of units with trainable parameters."""
    import shardwise.engine.comm.collectives as coll

    seen = {"gather": [], "reduce": [], "replicas": []}
    real = coll.gather_into, coll.reduce_scatter_avg, coll.all_reduce_avg_async

    def gather(rows, regions, world_size, group, *args, **kwargs):
        seen["gather"].append((world_size, dist.get_world_size(group)))
        return real[0](rows, regions, world_size, group, *args, **kwargs)

    def reduce(packed, world_size, group, *args, **kwargs):
        seen["reduce"].append((world_size, dist.get_world_size(group)))
        return real[1](packed, world_size, group, *args, **kwargs)

    def replicas(tensor, group, *args, **kwargs):
        seen["replicas"].append(dist.get_world_size(group))
        return real[2](tensor, group, *args, **kwargs)

    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy="zero3", units=spec.unit_class, mesh=_mesh(shape))
    trainable_units = sum(1 for unit in engine_of(model).units if unit.trainable())
    coll.gather_into, coll.reduce_scatter_avg, coll.all_reduce_avg_async = gather, reduce, replicas
    try:
        x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
        model(x, y).backward()
    finally:
        coll.gather_into, coll.reduce_scatter_avg, coll.all_reduce_avg_async = real
    return seen, trainable_units


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_unit_collectives_stay_inside_the_shard_group(ranks, shape):
    """Catches a gather or reduce-scatter issued over every rank of the mesh (its bytes would cross the slow links
    between nodes), or a replica all-reduce missing, repeated, or issued where there is one replica: every unit
    gather and reduce-scatter spans the shard group, and each unit's rows are all-reduced once over the replicas.
    A shard group of one rank gathers by a copy (Note [comm strategies]): no gather reaches collectives.py."""
    replicas, shard_ranks = shape
    for seen, trainable_units in ranks.run(_collectives_by_group, 4, shape, timeout=120):
        if shard_ranks == 1:
            assert seen["gather"] == [], seen["gather"]
        else:
            assert seen["gather"] and set(seen["gather"]) == {(shard_ranks, shard_ranks)}
        assert len(seen["reduce"]) == trainable_units and set(seen["reduce"]) == {(shard_ranks, shard_ranks)}
        assert seen["replicas"] == ([replicas] * trainable_units if replicas > 1 else [])


def _step_in_backward(model, optimizer):
    sw.optimizer_in_backward(model, optimizer)


@pytest.mark.parametrize("name", ["gpt", "unused_branch"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_hybrid_optimizer_in_backward_parity(ranks, strategy, name):
    """Catches a unit stepped in backward before its rows were averaged across replicas (each replica then steps
    its own half of the batch), or the used flags agreed within one replica: equal to one process on 2 x 2."""
    check_parity(ranks, strategy, name, 4, [(1, None), (2, None)], shard_kwargs={"mesh_shape": (2, 2)},
                 rank_fn=_run_on_mesh, prepare=_step_in_backward)
