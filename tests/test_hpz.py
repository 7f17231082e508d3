"""hpZ (`shard(..., strategy="zero3", reshard_after_forward=N)`, Note [secondary shards]): a secondary shard of
each unit kept in the node after forward, so backward re-gathers there; the result is one process's."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardwise as sw
from helpers.parity import check_parity, run_on_rank
from shardwise.engine import engine_of
from shardwise.engine.phase import Phase
from shardwise.errors import ShardwiseError
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice

CONFIGS = [(1, None), (2, 0.5)]  # plain steps; 2 micro-batches under no_sync with clipping
NODE = 2  # 4 ranks as 2 nodes of 2 (ranks 0-1, 2-3)


def _cross_node_mesh():
    """A 2 x 2 hybrid mesh whose shard groups cross the simulated nodes ({0, 2}, {1, 3}) and whose replicas are
    in-node ({0, 1}, {2, 3}): backward's re-gather over the shard group would leave the node."""
    return DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("replicate", "shard"))


def _run(strategy, name, configs, steps, global_batch_size, seed, shard_kwargs, prepare):
    kwargs = dict(shard_kwargs)
    if kwargs.pop("layout") == "hsdp":
        kwargs["mesh"] = _cross_node_mesh()
    return run_on_rank(strategy, name, configs, steps, global_batch_size, seed, kwargs, prepare)


@pytest.mark.parametrize("layout", ["flat", "hsdp"])
@pytest.mark.parametrize("name", ["gpt", "reused_block"])
def test_hpz_matches_one_process(ranks, name, layout):
    """Catches a secondary shard cut from the wrong chunk, gathered into the wrong place, kept from an earlier
    step or missing a reused block's second use: zero3 with reshard_after_forward=2 on 4 ranks as 2 nodes, flat
    and on a 2 x 2 mesh whose shard groups cross the nodes, with a tied GPT and a reused block, accumulation and
    clipping, equals one process (fp32 1e-5/1e-6) over 4 steps."""
    check_parity(ranks, "zero3", name, 4, CONFIGS, steps=4,
                 shard_kwargs={"layout": layout, "reshard_after_forward": NODE}, rank_fn=_run)


def _params_after(reshard_after_forward, steps=3):
    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy="zero3", units=spec.unit_class, reshard_after_forward=reshard_after_forward)
    optimizer = make_optimizer(model)
    for step in range(steps):
        x, y = rank_slice(global_batch(spec, step, 8), dist.get_rank(), dist.get_world_size())
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return sw.full_parameters(model)


def test_hpz_is_bitwise_plain_zero3(ranks):
    """Catches hpZ changing any value (the in-node gather must deliver exactly the shard group's bytes): 3 steps
    with and without it end in bitwise equal parameters."""
    plain = ranks.run(_params_after, 4, True)[0]
    hpz = ranks.run(_params_after, 4, NODE)[0]
    assert plain.keys() == hpz.keys() and all(torch.equal(plain[k], hpz[k]) for k in plain)


def _gathers_by_group(layout):
    """Two zero3 steps with hpZ: each unit gather the engine issued, as (phase, ranks of its group), and this
    rank's node."""
    spec = ZOO["gpt"]
    model = build("gpt")
    mesh = {"mesh": _cross_node_mesh()} if layout == "hsdp" else {}
    sw.shard(model, strategy="zero3", units=spec.unit_class, reshard_after_forward=NODE, **mesh)
    optimizer = make_optimizer(model)
    engine = engine_of(model)
    seen = []
    real = engine.comm.gather_into

    def gather(rows, regions, world_size, group, what, own_in_place=False, **options):  # options: exact=
        seen.append((engine.clock.phase.value, tuple(dist.get_process_group_ranks(group))))
        return real(rows, regions, world_size, group, what, own_in_place, **options)

    engine.comm.gather_into = gather
    for step in range(2):
        x, y = rank_slice(global_batch(spec, step, 8), dist.get_rank(), dist.get_world_size())
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    node = dist.get_rank() // NODE
    return seen, tuple(range(node * NODE, node * NODE + NODE)), tuple(
        dist.get_process_group_ranks(engine.mesh.shard_group))


@pytest.mark.parametrize("layout", ["flat", "hsdp"])
def test_backward_issues_no_cross_node_gather(ranks, layout):
    """Catches backward's re-gather leaving the node under hpZ (the secondary shard unused, or cut over the shard
    group): every gather in backward runs on this rank's node group, every one in forward on the shard group,
    and backward has some."""
    for seen, node, shard_group in ranks.run(_gathers_by_group, 4, layout, timeout=120):
        backward = [ranks_ for phase, ranks_ in seen if phase == Phase.BACKWARD.value]
        forward = [ranks_ for phase, ranks_ in seen if phase == Phase.FORWARD.value]
        assert backward and set(backward) == {node}, seen
        assert forward and set(forward) == {shard_group}, seen


def _hpz_model(reshard_after_forward, layout: str, seed: int):
    """The tied GPT under zero3 (hpZ when `reshard_after_forward` is an int), with the parity tests' AdamW."""
    spec = ZOO["gpt"]
    model = build("gpt", seed)
    ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
    mesh = {"mesh": _cross_node_mesh()} if layout == "hsdp" else {}
    sw.shard(model, strategy="zero3", units=spec.unit_class, reshard_after_forward=reshard_after_forward, **mesh)
    return model, make_optimizer(model, ndim_by_name=ndim_by_name)


def _save_and_resume(layout: str, path: str, steps: int = 6, save_at: int = 3):
    """Train hpZ for `steps` steps, saving after `save_at` and going on; then load that checkpoint into a fresh
    hpZ run and a fresh plain zero3 run (both built from another seed) and train the remaining steps in each.
    Each run's losses after the save and its final full parameters."""
    from helpers.ckpt_ranks import run_steps

    model, optim = _hpz_model(NODE, layout, seed=0)
    run_steps(model, optim, "gpt", "zero3", 0, save_at)
    sw.save(path, model, optim, step=save_at)
    runs = {"uninterrupted": (run_steps(model, optim, "gpt", "zero3", save_at, steps), sw.full_parameters(model))}
    for name, reshard in (("hpz", NODE), ("zero3", True)):
        model, optim = _hpz_model(reshard, layout, seed=7)
        sw.load(path, model, optim)
        runs[name] = (run_steps(model, optim, "gpt", "zero3", save_at, steps), sw.full_parameters(model))
    return runs


@pytest.mark.parametrize("layout", [pytest.param("flat", marks=pytest.mark.slow), "hsdp"])
def test_hpz_checkpoint_round_trip(ranks, tmp_path, layout):
    """Catches a checkpoint that carries hpZ's secondary shard or misses its effect: a save that disturbs the run
    (a chunk cut or dropped by the save), a load whose rows backward never sees (a secondary shard kept from
    before the load), or a checkpoint plain zero3 cannot read. Save after 3 of 6 steps under zero3 + hpZ and go
    on; load into a fresh hpZ run and a fresh plain zero3 run: the last 3 losses and the final parameters are
    bitwise those of the run that went on."""
    for rank, runs in enumerate(ranks.run(_save_and_resume, 4, layout, str(tmp_path / "ckpt"), timeout=180)):
        losses, params = runs["uninterrupted"]
        for name in ("hpz", "zero3"):
            got_losses, got_params = runs[name]
            assert got_losses == losses, f"rank {rank}, loaded into {name}: losses {got_losses} != {losses}"
            for key, value in params.items():
                assert torch.equal(got_params[key], value), f"rank {rank}, loaded into {name}: {key} differs"


def _write_between_forwards(reshard_after_forward):
    """Two forwards in one window (the first's loss kept alive), a write to blocks.0's rows between them, one
    backward of the second and a step: its loss and the full parameters."""
    if reshard_after_forward is None:  # both, in one launch
        return {"zero3": _write_between_forwards(True), "hpz": _write_between_forwards(NODE)}
    model, optim = _hpz_model(reshard_after_forward, "flat", seed=0)
    x, y = rank_slice(global_batch(ZOO["gpt"], 0, 8), dist.get_rank(), dist.get_world_size())
    first = model(x, y)
    with torch.no_grad():
        for param in model.blocks[0].parameters():
            param.mul_(0.5)  # every rank: a write the engine must see (Note [writes the engine must see])
    second = model(x, y)
    second.backward()
    optim.step()
    del first
    return second.item(), sw.full_parameters(model)


def test_rows_written_between_forwards_are_seen(ranks):
    """Catches a secondary shard that outlives the forward that cut it: rows written between two forwards of one
    window (a load, a user's write, while the first loss lives) must reach the second forward and backward, so
    hpZ gives plain zero3's loss and parameters bitwise, not the chunk cut before the write."""
    runs = ranks.run(_write_between_forwards, 4, None)[0]
    plain, hpz = runs["zero3"], runs["hpz"]
    assert hpz[0] == plain[0], (hpz[0], plain[0])
    assert all(torch.equal(hpz[1][k], plain[1][k]) for k in plain[1])


def _secondary_held_and_estimated(layout: str):
    """hpZ's chunks held right after a forward (measured: the bytes of every unit's chunk) and sw.estimate's."""
    spec = ZOO["gpt"]
    predicted = sw.estimate(build("gpt"), "zero3", dist.get_world_size(), units=spec.unit_class,
                            reshard_after_forward=NODE)
    model, _ = _hpz_model(NODE, layout, seed=0)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    loss = model(x, y)
    held = sum(unit.secondary.chunk.nbytes for unit in engine_of(model).units
               if unit.secondary is not None and unit.secondary.held)
    loss.backward()
    return held, predicted.secondary, predicted.total - sw.estimate(
        build("gpt"), "zero3", dist.get_world_size(), units=spec.unit_class).total


def test_estimate_counts_the_secondary_chunks(ranks):
    """Catches sw.estimate leaving hpZ's chunks out, or counting them at another size (the root's, one node's
    worth of full values, the shard group's rows): the chunks held after forward on 4 ranks as 2 nodes of 2
    are the estimate's `secondary` within 5%, and its peak grows by exactly that."""
    for held, predicted, grown in ranks.run(_secondary_held_and_estimated, 4, "flat", timeout=120):
        assert held > 0 and abs(predicted - held) <= 0.05 * held, (held, predicted)
        assert grown == predicted, (grown, predicted)


def _refused(case):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    kwargs = {"units": torch.nn.Linear}
    try:
        if case == "zero2":
            sw.shard(model, strategy="zero2", reshard_after_forward=2, **kwargs)
        elif case == "false":
            sw.shard(model, strategy="zero3", reshard_after_forward=False, **kwargs)
        elif case == "not a divisor":
            sw.shard(model, strategy="zero3", reshard_after_forward=3, **kwargs)
        elif case == "whole world":
            sw.shard(model, strategy="zero3", reshard_after_forward=4, **kwargs)
        elif case == "in-node shards":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            sw.shard(model, strategy="zero3", reshard_after_forward=2, mesh=mesh, **kwargs)
    except ShardwiseError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, words", [
    ("zero2", "is a zero3 option"),
    ("false", "use strategy='zero2'"),
    ("not a divisor", "whole nodes of 3"),
    ("whole world", "whole nodes of 4"),
    ("in-node shards", "already lies inside a node"),
])
def test_hpz_is_refused_where_it_cannot_apply(ranks, case, words):
    """Catches hpZ accepted where it cannot keep backward in the node (another strategy, nodes that do not divide
    the ranks, a shard group already inside the node) or failing with a hang or torch's error: a ShardwiseError
    naming the fix on every rank."""
    messages = ranks.run(_refused, 4, case, timeout=60)
    assert all(message is not None and words in message for message in messages), messages
