"""The used-parameter flags on the device (Note [used flags on the device], engine/schedule/used_flags.py): sent as
a device all-reduce right after the backward's last reduce (each unit's under sw.optimizer_in_backward) and read
only by a rank that did not use some parameter. The device form runs here on gloo ranks, forced with the headers'
and tags' (as tests/test_agreement_device.py forces theirs), so its reads can be counted and its results compared
with one process; tests/test_agreement_fake_gpu.py counts it on the fake accelerator."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
import shardwise.engine.schedule.used_flags as used_flags
from shardwise.engine import engine_of
from test_agreement_device import device_form

STEPS = 3
WORLD = 2


class Branches(nn.Module):
    """A trunk every rank uses, a branch rank 0 alone uses, and a spare every rank uses in the first step only."""

    def __init__(self):
        super().__init__()
        self.trunk, self.branch, self.spare = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x, use_branch: bool, use_spare: bool):
        h = self.trunk(x)
        if use_branch:
            h = h + self.branch(h)
        if use_spare:
            h = h + self.spare(h)
        return h.pow(2).mean()


def _slice(rank: int, world: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(1))[rank * 8 // world : (rank + 1) * 8 // world]


def _uses(rank: int, step: int) -> tuple[bool, bool]:
    return rank == 0, step == 0


@contextlib.contextmanager
def flags_form():
    """Engines built in the block take the device form of the flags, headers and tags, on gloo."""
    real = used_flags.on_device
    used_flags.on_device = lambda group: True
    try:
        with device_form(True):
            yield
    finally:  # the pool's rank processes run later tests
        used_flags.on_device = real


def _reference(world: int, clip: bool):
    """One process: the global batch's loss, the mean of the ranks' (each rank its slice and its branches)."""
    torch.manual_seed(0)
    model = Branches()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    unused = []
    for step in range(STEPS):
        loss = sum(model(_slice(rank, world), *_uses(rank, step)) for rank in range(world)) / world
        loss.backward()
        unused.append(sorted(name for name, p in model.named_parameters() if p.grad is None))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optim.step()
        optim.zero_grad()
    return unused, {name: p.detach().clone() for name, p in model.named_parameters()}


def _sharded(strategy: str, in_backward: bool, mesh_shape=None):
    """STEPS AdamW steps (clipped, but in backward) with the flags on the device: (the flags' host reads per
    backward, parameters without a gradient after each backward, the full parameters after)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Branches()
    kwargs = {}
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    with flags_form():
        sw.shard(model, strategy=strategy, units=nn.Linear, **kwargs)
    flags = engine_of(model).reducer.flags
    assert isinstance(flags, used_flags.UsedFlagsOnDevice), type(flags)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    if in_backward:
        sw.optimizer_in_backward(model, optim)
    reads, unused = [], []
    for step in range(STEPS):
        before = flags.host_waits
        model(_slice(rank, world), *_uses(rank, step)).backward()
        reads.append(flags.host_waits - before)
        if not in_backward:  # stepped in backward: its step() applies nothing more, its gradients are gone
            unused.append(sorted(name for name, p in model.named_parameters() if p.grad is None))
            sw.clip_grad_norm_(model, 0.05)
        optim.step()
        optim.zero_grad()
    return reads, unused, {name: value.clone() for name, value in sw.full_parameters(model).items()}


def _check(results, world: int, clip: bool) -> None:
    unused, params = _reference(world, clip)
    for rank, (_, got_unused, got) in enumerate(results):
        if clip:  # the spare, unused by every rank after the first step, has no gradient anywhere
            assert got_unused == unused == [[], ["spare.bias", "spare.weight"], ["spare.bias", "spare.weight"]], \
                (rank, got_unused, unused)
        for name, value in params.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_flags_on_the_device_are_exact_with_a_parameter_unused_on_one_rank(ranks, strategy):
    """Catches the device form taking a rank's own flags for every rank's (a parameter rank 1 skipped would keep
    no gradient there, rank 0's average lost), or a parameter no rank used getting zeros (AdamW would decay it
    and move its moments): a branch rank 0 alone uses gets the average with rank 1's zeros, a spare no rank uses
    after the first step keeps grad=None and its values, as one process on the global batch, with clipping. A
    rank reads the flags only in a backward where it skipped a parameter: rank 0 from the second step (the
    spare), rank 1 in every one (the branch)."""
    results = ranks.run(_sharded, WORLD, strategy, False, timeout=90)
    assert [reads for reads, _, _ in results] == [[0, 1, 1], [1, 1, 1]], results
    _check(results, WORLD, clip=True)


def test_flags_on_the_device_per_unit_with_optimizer_in_backward(ranks):
    """Catches the per-unit flags of sw.optimizer_in_backward (a unit stepped as its reduce lands) lost or read
    from another unit's exchange on the device: exact against one process, each rank reading only for a unit it
    skipped a parameter of (rank 0: the spare from the second step; rank 1: the branch, then the spare too)."""
    results = ranks.run(_sharded, WORLD, "zero3", True, timeout=90)
    assert [reads for reads, _, _ in results] == [[0, 1, 1], [1, 2, 2]], results
    _check(results, WORLD, clip=False)


def test_flags_on_the_device_span_every_replica_of_a_hybrid_mesh(ranks):
    """Catches the flags agreed within a shard group only on a hybrid mesh (2 replicas x 2 shards): the replica
    without rank 0 would leave the branch without a gradient while the other applies its average."""
    results = ranks.run(_sharded, 4, "zero2", False, (2, 2), timeout=120)
    assert [reads for reads, _, _ in results] == [[0, 1, 1]] + [[1, 1, 1]] * 3, results
    _check(results, 4, clip=True)
