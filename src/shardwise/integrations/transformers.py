"""transformers' `Trainer` on a sharded model: `ShardwiseTrainer`, a drop-in subclass.

    sw.init()
    sw.shard(model, strategy="zero3")                       # 1. shard before the Trainer sees it
    trainer = ShardwiseTrainer(model=model, args=args, ...)  # 2. instead of Trainer(...)
    trainer.train()

Note [trainer integration]: the Trainer hands the model to Accelerate, which wraps it in
DistributedDataParallel under torchrun (refused on a sharded model: Note [no second
wrapper]) and clips with torch's rank-local `clip_grad_norm_` (refused: Note [rank-local
clipping]). `ShardwiseTrainer` tells Accelerate the model is already prepared, so it is
trained as shardwise returned it; clips and measures the gradient norm with
`sw.clip_grad_norm_` (the global norm, the number a single process logs); and gives the
model a `no_sync()` so gradient accumulation skips the reduce on all but the last
micro-batch, as DDP's does. Data loading, the optimizer, schedulers and logging stay the
Trainer's own.
"""

from __future__ import annotations

import transformers

from shardwise.engine.grads import clip_grad_norm_
from shardwise.errors import ShardwiseError
from shardwise.integrations.prepared import mark_prepared


class ShardwiseTrainer(transformers.Trainer):
    """`transformers.Trainer` for a model `sw.shard` already sharded (Note [trainer integration])."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.model
        if getattr(model, "_shardwise", None) is None:
            raise ShardwiseError("ShardwiseTrainer trains a sharded model: call sw.shard(model, strategy=...) "
                                 "before building the trainer (or use transformers.Trainer for an unsharded one)")
        mark_prepared(model)

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model, float("inf"))  # the norm, nothing clipped
        return super()._get_grad_norm(model, grad_norm)
