"""`model.state_dict()` / `load_state_dict()` on a sharded model (Note [state dict]): full shapes
as Shard(0) DTensors, full values in, `sw.full_state_dict` for an export, DCP on it directly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice

STRATEGIES = ["zero1", "zero2", "zero3"]


class SharedThrice(torch.nn.Module):
    """One Linear registered under three names, and a list of units under two."""

    def __init__(self):
        super().__init__()
        self.a = self.b = self.c = torch.nn.Linear(4, 4)
        self.h = self.h_again = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])


def _build(name: str, seed: int = 0):
    if name == "shared_thrice":
        torch.manual_seed(seed)
        return SharedThrice(), torch.nn.ModuleList
    return build(name, seed), ZOO[name].unit_class


def _shapes_and_values(strategy, name="gpt"):
    plain, _ = _build(name)
    model, units = _build(name)
    sw.shard(model, strategy=strategy, units=units if name == "gpt" else model.h)
    state = model.state_dict()
    expected = plain.state_dict()
    problems = [] if list(state) == list(expected) else [("keys", list(state), list(expected))]
    for key, value in state.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if isinstance(expected[key], torch.nn.Parameter) or key.endswith("weight") or key.endswith("bias"):
            if not isinstance(value, DTensor):
                problems.append((key, "not a DTensor"))
        if whole.shape != expected[key].shape or not torch.equal(whole, expected[key]):
            problems.append((key, tuple(whole.shape), tuple(expected[key].shape)))
    full = sw.full_state_dict(model)
    if dist.get_rank() == 0:
        _build(name, seed=3)[0].load_state_dict(full)  # strict: every key, full shapes
        problems += [(k, "full_state_dict") for k in expected if not torch.equal(full[k], expected[k])]
    elif full:
        problems.append(("full_state_dict on rank 1", sorted(full)))
    return problems


@pytest.mark.parametrize("name", ["gpt", "shared_thrice"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_dict_has_full_shapes_and_values(ranks, strategy, name):
    """Catches state_dict() handing out this rank's rows as if whole ([250, 64] for [500, 64]),
    which save_pretrained then wrote and from_pretrained failed on far from the cause; also
    under the middle name of a module registered under three (it came out as [2, 4])."""
    for problems in ranks.run(_shapes_and_values, 2, strategy, name):
        assert problems == []


def _load_full_values(strategy):
    source = build("gpt", seed=1)  # different values from the sharded model's seed 0
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=ZOO["gpt"].unit_class)
    model.load_state_dict(source.state_dict())
    x, y = global_batch(ZOO["gpt"], 0, 8)
    loss = model(*rank_slice((x, y), dist.get_rank(), 2)).detach()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    expected = source(x, y).item()
    full = sw.full_parameters(model)
    same = all(torch.equal(full[n], p) for n, p in source.named_parameters())
    bad = build("gpt")
    sw.shard(bad, strategy=strategy, units=ZOO["gpt"].unit_class)
    wrong = {k: v[:-1] if k == "tok_emb.weight" else v for k, v in source.state_dict().items()}
    try:
        bad.load_state_dict(wrong)
        message = None
    except RuntimeError as error:
        message = str(error)
    return same, abs(loss.item() - expected), message


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_load_state_dict_takes_full_values(ranks, strategy):
    """Catches a full state dict refused for its shapes, loaded into the wrong rows, or loaded
    without zero1/zero2 re-gathering (the next forward would use the old values)."""
    for same, loss_diff, message in ranks.run(_load_full_values, 2, strategy):
        assert same and loss_diff < 1e-5
        # Reported under the full shapes (vocab 64), not this rank's rows (32 of them).
        assert "size mismatch for tok_emb.weight" in message and "(63, 32)" in message, message
        assert "current model is (64, 32)" in message, message


def _dcp_round_trip(tmp, save_strategy, load_strategy):
    model = build("gpt", seed=2)
    sw.shard(model, strategy=save_strategy, units=ZOO["gpt"].unit_class)
    dcp.save(model.state_dict(), checkpoint_id=tmp)
    target = build("gpt")
    sw.shard(target, strategy=load_strategy, units=ZOO["gpt"].unit_class)
    state = target.state_dict()
    dcp.load(state, checkpoint_id=tmp)  # in place: the DTensors view the shards
    expected = sw.full_parameters(model)
    got = sw.full_parameters(target)
    return all(torch.equal(expected[n], got[n]) for n in expected)


def test_torch_distributed_checkpoint_on_state_dict(ranks, tmp_path):
    """Catches a state_dict() that DCP cannot save or load in place across strategies."""
    assert all(ranks.run(_dcp_round_trip, 2, str(tmp_path), "zero2", "zero3"))


def _registrations_between_steps(strategy):
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=ZOO["gpt"].unit_class)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = rank_slice(global_batch(ZOO["gpt"], step, 8), dist.get_rank(), 2)
        model(x, y).backward()
        optim.step()
        optim.zero_grad()
    shards = {id(info.param) for info in sw.shard_info(model).values()}
    registered = list(model.named_parameters(remove_duplicate=False))
    return [name for name, p in registered if id(p) not in shards], model.head.weight is model.tok_emb.weight


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_between_steps_every_registration_is_the_shard(ranks, strategy):
    """Catches a registration left holding a full view after a step (the tied head's second
    name): parameters() would then hand an optimizer a tensor the engine never updates."""
    for stray, tied in ranks.run(_registrations_between_steps, 2, strategy):
        assert stray == [] and tied


def _export_a_submodule(tmp):
    from safetensors.torch import load_file
    torch.manual_seed(0)
    outer = torch.nn.Module()
    outer.inner = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 6))
    outer.head = torch.nn.Linear(6, 2)
    expected = {k: v.clone() for k, v in outer.inner.state_dict().items()}
    sw.shard(outer, strategy="zero3", units=torch.nn.Linear)
    sw.export(outer.inner, f"{tmp}/inner.safetensors")
    full = sw.full_state_dict(outer.inner)
    dist.barrier()
    written = load_file(f"{tmp}/inner.safetensors")
    problems = [k for k, v in expected.items() if k not in written or not torch.equal(written[k], v)]
    if dist.get_rank() == 0:
        problems += [f"full_state_dict {k}" for k, v in expected.items() if not torch.equal(full[k], v)]
    return problems + sorted(set(written) - set(expected))


def test_export_of_a_submodule_of_a_sharded_model_is_whole(ranks, tmp_path):
    """Catches sw.export / save_pretrained of the model inside a sharded one (the HF model in a
    LightningModule) writing rank 0's rows as the whole tensors: (3, 4) for a (6, 4) weight."""
    for problems in ranks.run(_export_a_submodule, 2, str(tmp_path)):
        assert problems == []


def _meshes_by_device_type():
    from torch.distributed.tensor import Shard

    from shardwise.engine.layout.parallel_layout import ParallelLayout

    layout = ParallelLayout.flat(dist.group.WORLD)
    first, _ = layout.dtensor_placements("cpu")
    second, placements = layout.dtensor_placements("meta")
    again, _ = layout.dtensor_placements("cpu")
    return first.device_type, second.device_type, again is first, placements == [Shard(0)]


def test_each_device_type_gets_its_own_mesh(ranks):
    """Catches ParallelLayout.dtensor_placements keeping the first mesh it built whatever the device type asked
    (rows on the host beside rows on the device, Note [state dict]): the second type's DTensors got a mesh of
    the first's type. Each type gets its own mesh, built once."""
    for result in ranks.run(_meshes_by_device_type, 2):
        assert result == ("cpu", "meta", True, True), result
