"""Refusing a second data-parallel wrapper around a sharded model, before it can do harm.
Uses: nothing of the engine.

Note [no second wrapper]: torch's DistributedDataParallel (and so Accelerate's `prepare`
and transformers' `Trainer`, which wrap in it) broadcasts rank 0's parameters to every
rank when it is built: on a sharded model that overwrites each rank's own rows with rank
0's, and then averages gradients a second time with torch's rank-local clipping. The first
thing DDP's constructor reads is the module's `_ddp_params_and_buffers_to_ignore`; on a
model `shard()` prepared, reading it raises the error below on every rank, before any
broadcast.
"""

from __future__ import annotations

from shardwise.errors import ShardwiseError


class RefuseDataParallel:
    """Stands in `model._ddp_params_and_buffers_to_ignore` (Note [no second wrapper])."""

    def __init__(self, strategy: str):
        self.strategy = strategy

    def __iter__(self):
        raise ShardwiseError(
            f"this model is already sharded by shardwise (strategy={self.strategy!r}), which synchronizes its "
            "gradients itself: wrapping it in DistributedDataParallel would overwrite every rank's rows with "
            "rank 0's and average the gradients twice. Train the model as sw.shard returned it (call "
            "sw.clip_grad_norm_(model, ...), not torch.nn.utils.clip_grad_norm_). With the transformers "
            "Trainer, use shardwise.integrations.transformers.ShardwiseTrainer in its place; with Accelerate, "
            "do not pass the sharded model to accelerator.prepare."
        )


class NoCopies:
    """Base of the engines: `copy.deepcopy(model)` (so torch's `AveragedModel`), `pickle` and
    `torch.save(model)` reach the engine through the model's hooks and would fail deep inside
    torch with "cannot pickle ProcessGroup"; they fail here instead, with what to use."""

    def __reduce_ex__(self, protocol):
        raise ShardwiseError(
            "copy.deepcopy / pickle / torch.save of a model after sw.shard(...): each rank holds only its rows "
            "and the engine holds process groups. For an averaged model (torch's AveragedModel, an EMA) use "
            "sw.EMA(model), which keeps the average sharded; for a whole copy, load "
            "sw.full_state_dict(model) into a fresh model; to save, sw.save or sw.export."
        )
