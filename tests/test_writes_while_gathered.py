"""A write to the rows of a zero3 unit that is still gathered from an earlier forward (the root, for a
whole window; the last unit to run, kept for backward) must reach the next forward, as it does in one
process and under zero1/zero2 (Note [kept while gathered], freshness.py)."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.models.gpt import GPT, Block, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss_after_a_load_mid_window(strategy: str, path: str, keep_loss: bool) -> list[float]:
    """Train 2 steps and save; train a third; then, with (or without) the next forward's loss alive,
    load the step-2 checkpoint and run a forward: its loss, and the same forward on a fresh model that
    loaded the same checkpoint."""
    torch.manual_seed(0)
    model = GPT(CFG)
    sw.shard(model, strategy=strategy, units=Block)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = _batch(step)
        model(x, y).backward()
        optim.step()
        optim.zero_grad()
        if step == 1:
            sw.save(path, model, optim, step=2)
    x, y = _batch(7)
    alive = model(x, y)  # a forward whose loss stays alive: its window (root, last unit) stays gathered
    if not keep_loss:
        del alive
    sw.load(path, model, optim)
    after_load = model(x, y).item()
    torch.manual_seed(1)
    fresh = GPT(CFG)
    sw.shard(fresh, strategy=strategy, units=Block)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    sw.load(path, fresh, fresh_optim)
    return [after_load, fresh(x, y).item()]


@pytest.mark.parametrize("strategy", ["zero3", "zero2"])
@pytest.mark.parametrize("keep_loss", [True, False])
def test_a_load_reaches_units_gathered_by_a_live_forward(ranks, tmp_path, strategy, keep_loss):
    """Catches zero3 units gathered by a forward whose loss is still alive (the root, the last unit
    run) keeping the values from before an sw.load, so the next forward silently computes with them
    (ws 2: loss 4.169 where 4.145 is right)."""
    for after_load, fresh in ranks.run(_loss_after_a_load_mid_window, 2, strategy, str(tmp_path / "ckpt"),
                                       keep_loss, timeout=180):
        assert after_load == fresh, (after_load, fresh)
