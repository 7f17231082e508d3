"""The agreement's headers on the device (Note [headers on the device], engine/schedule/agreement_device.py):
confirmed at each phase on the host where the collectives run on gloo, compared before the optimizer step where
they run on a device. The device form runs here on gloo ranks, forced (`agreement_device.on_device`, with zero3's tags'
`gather_tags.on_device`), so its host waits and its refusals can be counted; tests/test_agreement_fake_gpu.py runs it
on the fake accelerator."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.engine.schedule.agreement_device as agreement_device
import shardwise.engine.schedule.gather_tags as gather_tags
from shardwise.engine import engine_of
from shardwise.engine.schedule.agreement import STEP
from test_options_agree import Net, Unit, assert_refused_alike, timed


@contextlib.contextmanager
def device_form(on_device: bool):
    """Engines built in the block take the device form of the headers and tags (or the host form), on gloo."""
    headers, tags = agreement_device.on_device, gather_tags.on_device
    agreement_device.on_device = gather_tags.on_device = lambda group: on_device
    try:
        yield
    finally:  # the pool's rank processes run later tests
        agreement_device.on_device, gather_tags.on_device = headers, tags


def _build(strategy: str, on_device: bool):
    torch.manual_seed(0)
    model = Net()
    with device_form(on_device):
        sw.shard(model, strategy=strategy, units=Unit)
    agreement = engine_of(model).agreement
    assert isinstance(agreement, agreement_device.HeadersOnDevice) == on_device
    return model, agreement, engine_of(model).driver.gathers.tags


def _count(strategy: str, on_device: bool, steps: int = 3):
    """`steps` AdamW steps with sw.clip_grad_norm_; per step (header waits before the step, at it; tag waits
    before the step, at it), the losses and the parameters after."""
    model, agreement, tags = _build(strategy, on_device)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    waits, losses = [], []
    for _ in range(steps):
        headers, tagged = agreement.host_waits, tags.host_waits if tags is not None else 0
        loss = model(x)
        loss.backward()
        sw.clip_grad_norm_(model, 1.0)
        during = (agreement.host_waits - headers, (tags.host_waits - tagged) if tags is not None else 0)
        optim.step()
        optim.zero_grad()
        at_step = (agreement.host_waits - headers - during[0],
                   (tags.host_waits - tagged - during[1]) if tags is not None else 0)
        waits.append((during, at_step))
        losses.append(loss.item())
    return waits, losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_headers_on_a_device_make_no_host_rendezvous_in_a_step(ranks, strategy):
    """Catches a host rendezvous per phase on a device's critical path (the host form waits for each header on
    a gloo group: the forward's, the backward's and the step's, 3 a step): the device form waits for no header
    during forward, backward and clipping, and at the step only where its headers ran on a host group (forced
    onto gloo here: one wait, for the step's headers together; on NCCL the step reads copies the headers'
    stream made a phase earlier: 0); with zero3 the same holds for the tags; losses and parameters are bitwise
    the host form's."""
    host = ranks.run(_count, 2, strategy, False, timeout=60)
    device = ranks.run(_count, 2, strategy, True, timeout=60)
    tagged = 6 if strategy == "zero3" else 0  # zero3: a tag per block's gather, 3 in forward and 3 in backward
    for (host_waits, host_losses, host_params), (waits, losses, params) in zip(host, device):
        # zero2's first forward gathers nothing (its units are current after shard): it sends no header
        first = 2 if strategy == "zero3" else 1
        assert host_waits == [((first, tagged), (1, 0))] + [((2, tagged), (1, 0))] * 2, host_waits
        assert waits == [((0, 0), (1, int(tagged > 0)))] * 3, waits
        assert losses == host_losses
        assert all(torch.equal(params[name], host_params[name]) for name in params)


def _forged_header(strategy: str, phase: int):
    """Two steps in the device form, rank 1's first header of `phase` forging its forward count (its collectives
    pair as every rank's do: only the header differs): (error, parameters unchanged by the refused step, steps
    taken before it)."""
    original, sent = agreement_device.HeadersOnDevice.header, []

    def forged(self, *args):
        row = original(self, *args)
        if row[2] == phase:
            sent.append(row)
            if dist.get_rank() == 1 and len(sent) == 1:
                row[1] += 1
        return row

    agreement_device.HeadersOnDevice.header = forged
    try:
        model, _, _ = _build(strategy, True)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        steps, error = 0, None
        try:
            for _ in range(2):
                initial = {name: p.detach().clone() for name, p in model.named_parameters()}
                model(torch.ones(4, 8)).backward()
                sw.clip_grad_norm_(model, 1.0)
                optim.step()
                optim.zero_grad()
                steps += 1
        except sw.ShardwiseError as raised:
            error = str(raised)
    finally:
        agreement_device.HeadersOnDevice.header = original  # the pool's rank processes run later tests
    unchanged = all(torch.equal(p.detach(), initial[name]) for name, p in model.named_parameters())
    return error, unchanged, steps


@pytest.mark.parametrize("phase", [1, 2], ids=["forward", "backward"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_a_header_that_differs_on_the_device_refuses_the_step_on_every_rank(ranks, strategy, phase):
    """Catches headers on the device never compared, or compared after the step applies values: a rank whose
    forward's (or backward's) header differs from the others' is refused at the optimizer step, before any
    parameter changes, every rank with the same words."""
    results = ranks.run(_forged_header, 2, strategy, phase, timeout=60)
    messages = {error for error, _, _ in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and "run different forwards" in message, message
    for _, unchanged, steps in results:
        assert unchanged, "the refused step wrote parameters"
        # refused at the first step after the header: zero2's first forward gathers nothing and sends none
        assert steps == (1 if strategy == "zero2" and phase == 1 else 0), steps


def _uneven_on_device(micro_batches: list[int]):
    """Rank r runs `micro_batches[r]` forwards and backwards before each of three SGD steps, headers on the
    device: (error, seconds, None)."""
    def work():
        model, _, _ = _build("zero3", True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            for _ in range(micro_batches[dist.get_rank()]):
                model(torch.ones(4, 8)).backward()
            optim.step()
            optim.zero_grad()
        return []
    return timed(work)


def test_uneven_work_on_the_device_is_refused_at_the_next_step_on_every_rank(ranks):
    """Catches a STEP header on the device never compared (Note [uneven work]): rank 0 running two micro-batches
    before its step and rank 1 one is refused on every rank with the host form's words, at the next settle
    (Note [headers on the device]: the short rank's first step has run by then)."""
    results = ranks.run(_uneven_on_device, 2, [2, 1], timeout=60)
    assert_refused_alike(results, "uneven work: rank 1 (after forward number 1) reached optimizer.step() while "
                         "rank 0 was in a forward")


def _written_on_every_rank():
    """zero2, headers on the device: a write of the user's on every rank between steps (as sw.load makes) is
    agreed before its re-gather, one host wait; (header waits in that forward, the losses)."""
    model, agreement, _ = _build("zero2", True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 8)
    waits, losses = [], []
    for step in range(3):
        if step == 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.data.mul_(0.5)
        before = agreement.host_waits
        loss = model(x)
        waits.append(agreement.host_waits - before)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return waits, losses


def test_a_write_on_every_rank_is_agreed_before_its_regather_on_the_device(ranks):
    """Catches the device form issuing a user's write's re-gathers before the ranks agreed on it (the writers
    alone know of it: Note [agreement rides the traffic] (a)), or refusing a write every rank made: the forward
    after it waits once for its header (the set-up allowance) and trains on, the same losses on every rank."""
    results = ranks.run(_written_on_every_rank, 2, timeout=60)
    for waits, losses in results:
        assert waits == [0, 1, 0], waits
    assert results[0][1] == results[1][1]


def _forged_step_then_save(how: str, path: str):
    """One zero2 step in the device form, rank 1's STEP header forging its forward count (compared at the next
    settle), then `sw.<how>` to `path`: (error, whether anything was written at path or its partial)."""
    original = agreement_device.HeadersOnDevice.header

    def forged(self, *args):
        row = original(self, *args)
        if row[2] == STEP and dist.get_rank() == 1:
            row[1] += 1
        return row

    agreement_device.HeadersOnDevice.header = forged
    try:
        model, _, _ = _build("zero2", True)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(4, 8)).backward()
        optim.step()
        optim.zero_grad()
        error = None
        try:
            handle = getattr(sw, how)(path, model, optim)
            if how == "save_async":
                handle.wait()
        except sw.ShardwiseError as raised:
            error = str(raised)
    finally:
        agreement_device.HeadersOnDevice.header = original  # the pool's rank processes run later tests
    target = Path(path)
    return error, target.exists() or (target.parent / f".{target.name}.partial").exists()


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_save_after_a_step_whose_header_differed_is_refused_before_writing(ranks, tmp_path, how):
    """Catches sw.save (or save_async) between steps leaving the last STEP header unsettled on the device (Note
    [headers on the device]: it is compared at the next step's settle): a checkpoint of rows from ranks whose
    step differed was written. The save settles it first: every rank raises the same words, nothing is written."""
    results = ranks.run(_forged_step_then_save, 2, how, str(tmp_path / "ckpt"), timeout=60)
    messages = {error for error, _ in results}
    assert len(messages) == 1 and None not in messages, messages
    assert "step" in messages.pop()
    assert not any(written for _, written in results), "the refused save wrote a checkpoint"
