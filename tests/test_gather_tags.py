"""zero3's gather tags (Note [gather tags], Note [tags on the device], engine/schedule/gather_tags.py): checked per
unit on the host where the gathers run on gloo, before the optimizer step where they run on a device. The device
form runs here on gloo ranks, forced (`gather_tags.on_device`), so its host waits and its refusals can be counted."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
import shardwise.engine.schedule.gather_tags as gather_tags
from shardwise.engine import engine_of

NAMES = "abc"


class _Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class _Chain(nn.Module):
    """Units of one size, run in the order each rank is given (their gathers collide)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({name: _Unit() for name in NAMES})
        self.order = list(NAMES)

    def forward(self, x):
        for name in self.order:
            x = self.blocks[name](x)
        return x.pow(2).mean()


@contextlib.contextmanager
def _tags(on_device: bool):
    """Engines built in the block take the device form of the tags (or the host form), on gloo."""
    original = gather_tags.on_device
    gather_tags.on_device = lambda group: on_device
    try:
        yield
    finally:
        gather_tags.on_device = original  # the pool's rank processes run later tests


def _train(on_device: bool, order: str = NAMES, steps: int = 3, evaluate: bool = False):
    """`steps` SGD steps (or, `evaluate`, forwards without grad and no step); per step the host waits on tags
    before the step (forward and backward) and at it, the losses, the parameters after; or the error and the
    parameters when it was raised."""
    torch.manual_seed(0)
    model = _Chain()
    with _tags(on_device):
        sw.shard(model, strategy="zero3", units=_Unit)
    model.order = list(order)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}  # this rank's shards
    tags = engine_of(model).driver.gathers.tags
    assert isinstance(tags, gather_tags.TagsOnDevice) == on_device
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    waits, losses, error = [], [], None
    for _ in range(steps):
        before = tags.host_waits
        try:
            if evaluate:
                with torch.no_grad():
                    model(x)
                continue
            loss = model(x)
            loss.backward()
            during = tags.host_waits - before
            optim.step()
        except sw.ShardwiseError as raised:
            error = str(raised)
            break
        optim.zero_grad()
        waits.append((during, tags.host_waits - before - during))
        losses.append(loss.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    unchanged = all(torch.equal(params[name], initial[name]) for name in params)
    return waits, losses, params, error, unchanged


def test_tags_on_a_device_block_the_host_nowhere_before_the_step(ranks):
    """Catches a host rendezvous per unit on a device's critical path (the host form waits for each tag's gloo
    all-gather before the unit's values are used: 2 x units a step): the device form waits for no tag during
    forward and backward, and once at the step, on gloo only (on NCCL it reads a flag the gathers' stream
    copied, no host group); the losses and parameters are bitwise the host form's."""
    host = ranks.run(_train, 2, False, timeout=60)
    device = ranks.run(_train, 2, True, timeout=60)
    for (host_waits, host_losses, host_params, _, _), (waits, losses, params, error, _) in zip(host, device):
        assert error is None, error
        assert all(during > 0 and at_step == 0 for during, at_step in host_waits), host_waits
        assert waits == [(0, 1)] * 3, waits
        assert losses == host_losses
        assert all(torch.equal(params[name], host_params[name]) for name in params)


def _train_with_a_forged_tag(forged_at: int, evaluate: bool = False):
    """One step (`evaluate`: forwards without grad, no step) with the tags on the device, rank 1's
    `forged_at`-th tag naming another unit (its gathers pair as every rank's do: only the tag differs);
    (parameters unchanged, the error, host waits)."""
    from shardwise.engine.unit.flat_unit import FlatUnit

    original, sent = gather_tags.GatherTags._row, []

    def forged(self, unit: FlatUnit) -> list[int]:
        row = original(self, unit)
        sent.append(row)
        if dist.get_rank() == 1 and len(sent) == forged_at:
            row[0] = (row[0] + 1) % len(self.units)
        return row

    gather_tags.GatherTags._row = forged
    try:
        waits, _, _, error, unchanged = _train(True, steps=10 if evaluate else 1, evaluate=evaluate)
    finally:
        gather_tags.GatherTags._row = original  # the pool's rank processes run later tests
    return unchanged, error, waits


@pytest.mark.parametrize("forged_at", [1, 4])  # a forward gather, a backward one
def test_tags_on_a_device_refuse_the_step_of_a_mismatched_gather_on_every_rank(ranks, forged_at):
    """Catches a tag on the device that is never compared, or compared after the step (a mismatched gather's
    values stepped into the parameters): a rank whose gather carried another unit is refused at the optimizer
    step, every rank with the same words naming each rank's order, and the step changes no parameter."""
    results = ranks.run(_train_with_a_forged_tag, 2, forged_at, timeout=60)
    messages = {message for _, message, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "different orders" in message, message
    assert "rank 0 ran" in message and "rank 1 ran" in message, message
    for unchanged, _, waits in results:
        assert unchanged, "the refused step wrote parameters"
        assert waits == [], waits  # refused at its first step


def test_tags_on_a_device_are_compared_in_a_loop_without_steps(ranks):
    """Catches tags on the device left unread where no optimizer step comes (an evaluation loop, generate()): a
    mismatched gather's tag is compared after at most SETTLE_STEPS steps' worth of gathers, and refused on every
    rank with the same words."""
    results = ranks.run(_train_with_a_forged_tag, 2, 2, True, timeout=60)
    messages = {message for _, message, _ in results}
    assert len(messages) == 1 and "different orders" in str(next(iter(messages))), messages
