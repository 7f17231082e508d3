"""Disk offload: zero3 with master shards and optimizer state in memory-mapped files."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.parity import check_parity
from shardwise.estimate.measure import model_state_bytes, resident_model_state_bytes
from shardwise.models.gpt import GPT, Block, GPTConfig


@pytest.mark.parametrize("name", ["gpt", "unused_branch", "frozen", "odd_shapes"])
def test_offloaded_zero3_equals_zero3(ranks, tmp_path, name):
    """Catches a chunked optimizer step that skips, repeats or reorders an update, moments
    created in the wrong place, or masters whose writes do not reach the mapped file."""
    check_parity(ranks, "zero3", name, 2, [(1, None), (2, 0.5)], shard_kwargs={"offload": f"disk:{tmp_path}"})


def _resident_after_steps(offload):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=1024, seq_len=32, d_model=128, n_layers=4, n_heads=4))
    sw.shard(model, strategy="zero3", units=Block, offload=offload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 1024, (4, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        model(tokens, tokens).backward()
        optimizer.step()
    return resident_model_state_bytes(model, optimizer), model_state_bytes(model, optimizer)


def test_offload_drops_resident_model_state_by_70_percent(ranks, tmp_path):
    """Catches offloaded state that is still resident (pages never released, moments created
    in RAM by the optimizer, masters copied back into memory): after a step, with gradients
    held, the resident model state must be at most 30% of zero3's without offload."""
    plain = ranks.run(_resident_after_steps, 2, None)
    offloaded = ranks.run(_resident_after_steps, 2, f"disk:{tmp_path}")
    for (plain_resident, plain_total), (resident, total) in zip(plain, offloaded):
        assert total == plain_total  # the same state exists, only its place differs
        assert resident <= 0.30 * plain_resident, (resident, plain_resident)


def _offload_with(strategy, offload):
    sw.shard(torch.nn.Linear(4, 4), strategy=strategy, offload=offload)


@pytest.mark.parametrize("strategy, offload, message", [
    ("zero2", "disk:/tmp/x", "offload needs strategy='zero3'"),
    ("zero3", "tape:/dev/st0", "offload='tape:/dev/st0' is not understood"),
    ("zero3", "disk:/proc/no/such/place", "cannot be created"),
])
def test_offload_misconfiguration_is_named(ranks, strategy, offload, message):
    """Catches an offload setting that is silently ignored or fails deep inside torch."""
    with pytest.raises(AssertionError, match=message):
        ranks.run(_offload_with, 1, strategy, offload)
