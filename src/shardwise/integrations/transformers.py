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
micro-batch, as DDP's does. The Trainer's checkpoints stay where it puts them
(`checkpoint-N/`): the model is gathered on every rank and written whole by rank 0 (the
Trainer's own `_save` had rank 0 gather alone and the ranks' collectives mismatched), and the
optimizer and scheduler go to `checkpoint-N/shardwise/` through `sw.save` (the Trainer's
`optimizer.pt` would hold rank 0's rows only), from which `resume_from_checkpoint` loads them
at any world size. Data loading, the optimizer, schedulers and logging stay the Trainer's own.
"""

from __future__ import annotations

import os

import transformers

from shardwise.checkpoint.export import full_state_dict
from shardwise.checkpoint.load import load
from shardwise.checkpoint.save import save
from shardwise.engine.grads import clip_grad_norm_
from shardwise.engine.protocol import engine_of
from shardwise.engine.step_in_backward import steps_in_backward
from shardwise.errors import ShardwiseError
from shardwise.integrations.prepared import mark_prepared


class ShardwiseTrainer(transformers.Trainer):
    """`transformers.Trainer` for a model `sw.shard` already sharded (Note [trainer integration])."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        model = self.model
        if engine_of(model) is None:
            raise ShardwiseError("ShardwiseTrainer trains a sharded model: call sw.shard(model, strategy=...) "
                                 "before building the trainer (or use transformers.Trainer for an unsharded one)")
        mark_prepared(model)

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and steps_in_backward(self.model):
            return None  # each unit was stepped in backward: no gradient left to measure (none logged)
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model, float("inf"))  # the norm, nothing clipped
        return super()._get_grad_norm(model, grad_norm)

    # ---- checkpoints (Note [trainer integration]) -------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        state_dict = full_state_dict(self.model)  # a collective: every rank gathers, rank 0 keeps it
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save(os.path.join(output_dir, "shardwise"), self.model, self.optimizer, self.lr_scheduler)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load(os.path.join(resume_from_checkpoint, "shardwise"), self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None:
            load(os.path.join(checkpoint, "shardwise"), self.model, self.optimizer, self.lr_scheduler)
