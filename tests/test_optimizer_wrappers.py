"""Optimizers inside Accelerate's and Lightning's wrappers, on a model sharded over 2 ranks.

`accelerator.prepare(optim)` returns an `AcceleratedOptimizer` (the torch optimizer at `.optimizer`)
and a LightningModule's `self.optimizers()` a `LightningOptimizer` (at `._optimizer`, its class a
subclass of the inner one's). How shardwise steps and checkpoints an optimizer depends on its
class (Note [whole-tensor step], engine/optim/whole_step.py): an elementwise one steps and saves rows,
any other is stepped whole and its state refused by `sw.save`. Read off the wrapper, every
wrapped AdamW would be taken for an unknown class: `sw.save` then refused to checkpoint it.
"""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")
MODEL = "reused_block"


def _wrap(optim, wrapper: str):
    """`optim` as Accelerate's `prepare` or Lightning's `self.optimizers()` hands it to the user."""
    if wrapper == "accelerate":
        from accelerate.state import AcceleratorState

        from shardwise.integrations.accelerate import ShardwiseAccelerator

        AcceleratorState._reset_state(reset_partial_state=True)  # the pool's processes run many tests
        return ShardwiseAccelerator(cpu=True).prepare_optimizer(optim)
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return LightningOptimizer(optim)


def _trained(wrapper: str):
    """MODEL under zero2 after 2 steps of a wrapped AdamW (stepped through the torch optimizer:
    a LightningOptimizer steps only inside a Trainer)."""
    torch.manual_seed(0)
    model, spec = build(MODEL), ZOO[MODEL]
    sw.shard(model, strategy="zero2", units=spec.unit_class)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped = _wrap(inner, wrapper)
    for step in range(2):
        x, y = global_batch(spec, step, 4)
        model(x, y).backward()
        inner.step()
        inner.zero_grad()
    return model, inner, wrapped


def _save_and_load_adamw(tmp: str, wrapper: str) -> bool:
    model, inner, wrapped = _trained(wrapper)
    sw.save(f"{tmp}/ckpt", model, wrapped)
    fresh_model, fresh_inner, fresh = _trained(wrapper)
    fresh_inner.state.clear()
    sw.load(f"{tmp}/ckpt", fresh_model, fresh)
    saved, loaded = inner.state_dict()["state"], fresh_inner.state_dict()["state"]
    return saved.keys() == loaded.keys() and all(
        torch.equal(saved[i][key], loaded[i][key]) for i in saved for key in saved[i])


@pytest.mark.parametrize("wrapper", ["accelerate", "lightning"])
def test_wrapped_elementwise_optimizer_saves_its_rows(ranks, tmp_path, wrapper):
    """Catches the step shape read off the wrapper's class instead of the torch optimizer inside
    (whole_step._unwrapped): a wrapped AdamW taken for a whole-tensor optimizer, so `sw.save`
    refuses its state ("not supported yet") and a Trainer or Accelerate run cannot checkpoint."""
    assert ranks.run(_save_and_load_adamw, 2, str(tmp_path), wrapper) == [True, True]

