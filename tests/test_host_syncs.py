"""Host reads of device values in the engine's hot path (`.item()`, `bool()`, `.tolist()`, `.cpu()`,
indexing a tensor into Python): each would stall a GPU's stream. Counted by helpers/host_reads.py;
per forward in test_forward_traffic.py."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.host_reads import HOST_VALUES, count_host_reads
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice


def _count(strategy):
    model, spec = build("gpt"), ZOO["gpt"]
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optim = torch.optim.AdamW(model.parameters(), foreach=True)  # torch's for-loop reads `step` per param
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    for _ in range(2):  # the second step is counted: set-up and first-call work are done
        counts = collections.Counter()
        with count_host_reads(counts):
            model(x, y).backward()
            sw.clip_grad_norm_(model, 1.0)
            optim.step()
            optim.zero_grad()
    return dict(counts)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_engine_host_reads_per_step(ranks, strategy):
    """Catches a host read of a device value in a step: the used flags were read one `bool()` per
    trainable parameter (26 per step on the zoo GPT), then one `.tolist()` per unit (6), from the
    reduce-scatter's output; now none. The reads of host values (HOST_VALUES) are allowed."""
    for counts in ranks.run(_count, 2, strategy):
        engine = {where: n for where, n in counts.items() if where != "torch or the test"}
        device_reads = {where: n for where, n in engine.items() if where not in HOST_VALUES}
        assert device_reads == {}, counts
        # each still runs (the test sees them); zero3's gather tags are zero3's alone (Note [gather tags])
        expected = HOST_VALUES if strategy == "zero3" else HOST_VALUES - {"engine/schedule/gather_tags.py:check"}
        assert set(engine) == expected, counts


def _count_scaled():
    model, spec = build("gpt"), ZOO["gpt"]
    sw.shard(model, strategy="zero2", units=spec.unit_class, precision="fp16")
    optim = torch.optim.AdamW(model.parameters(), foreach=True)
    scaler = sw.LossScaler(model)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    for _ in range(2):
        counts = collections.Counter()
        with count_host_reads(counts):
            scaler.scale(model(x, y)).backward()
            scaler.step(optim)
            scaler.update()
            optim.zero_grad()
    return dict(counts)


def test_loss_scaler_reads_the_host_once_per_step(ranks):
    """Catches the loss scaler's overflow check reading each gradient on the host (a `bool()` per
    tensor before: a GPU stall per parameter); what remains is the one read that decides in Python
    whether to step, as torch's GradScaler makes it."""
    for counts in ranks.run(_count_scaled, 2):
        engine = {where: n for where, n in counts.items() if where != "torch or the test" and where not in HOST_VALUES}
        assert engine == {"engine/memory/precision.py:unscale_": 1}, counts
