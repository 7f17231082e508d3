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
at any world size; a checkpoint appears whole or not at all (Note [whole trainer checkpoints] in
trainer_checkpoints.py). Data loading, the optimizer, schedulers and logging stay the Trainer's
own. Every TrainingArguments field that changes the arithmetic or the data is honoured as the
plain Trainer honours it (`bf16=True`: the forward runs under Accelerate's autocast, as the plain
Trainer's does) or refused when the trainer is built (Note [trainer arguments] in trainer_args.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import transformers

from shardwise.checkpoint.format.ranks import group_of
from shardwise.checkpoint.format.schema import read_index
from shardwise.checkpoint.interop.export import full_state_dict
from shardwise.checkpoint.read.load import load
from shardwise.checkpoint.write.save import save
from shardwise.engine.optim.grads import clip_grad_norm_
from shardwise.engine.optim.step_in_backward import steps_in_backward
from shardwise.engine.protocol import engine_of
from shardwise.errors import ShardwiseError
from shardwise.integrations import trainer_checkpoints
from shardwise.integrations.prepared import autocast_forward, mark_prepared
from shardwise.integrations.trainer_args import check_training_args


class ShardwiseTrainer(transformers.Trainer):
    """`transformers.Trainer` for a model `sw.shard` already sharded (Note [trainer integration])."""

    def __init__(self, *args, **kwargs):
        check_training_args(kwargs["args"] if "args" in kwargs else args[1] if len(args) > 1 else None)
        super().__init__(*args, **kwargs)
        model = self.model
        if engine_of(model) is None:
            raise ShardwiseError("ShardwiseTrainer trains a sharded model: call sw.shard(model, strategy=...) "
                                 "before building the trainer (or use transformers.Trainer for an unsharded one)")
        mark_prepared(model)
        self._staging = None  # Note [whole trainer checkpoints]: where a save in progress writes
        if self.accelerator.native_amp:
            autocast_forward(model, self.accelerator)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:  # the newest whole checkpoint (Note [whole trainer checkpoints])
            resume_from_checkpoint = trainer_checkpoints.last_whole(
                self.args.output_dir, report=group_of(self.model)[1] == 0, weights_only_ok=self.args.save_only_model)
            if resume_from_checkpoint is None:
                raise ShardwiseError(f"resume_from_checkpoint=True: no whole checkpoint-N in {self.args.output_dir} "
                                     "to resume from (see the log for the ones skipped)")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and steps_in_backward(self.model):
            return None  # each unit was stepped in backward: no gradient left to measure (none logged)
        if grad_norm is None:
            grad_norm = clip_grad_norm_(self.model, float("inf"))  # the norm, nothing clipped
        return super()._get_grad_norm(model, grad_norm)

    # ---- checkpoints (Note [trainer integration]) -------------------------------------

    def _get_output_dir(self, trial) -> str:
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's own save, into a hidden directory renamed once whole (Note [whole trainer checkpoints])."""
        run_dir, step, group = self._get_output_dir(trial), self.state.global_step, group_of(self.model)[0]
        staging = trainer_checkpoints.staging_dir(run_dir, step)
        trainer_checkpoints.start(staging, group)
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
        except BaseException:
            trainer_checkpoints.abandon(staging, group)
            raise
        finally:
            self._staging = None
        final = trainer_checkpoints.publish(staging, run_dir, step, group)
        best = self.state.best_model_checkpoint
        if best is not None and best.startswith(staging + os.sep):  # this checkpoint, found in the hidden directory
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            if self.args.should_save:
                self.state.save_to_json(os.path.join(final, trainer_checkpoints.STATE))
        if self.args.should_save:  # the Trainer rotated inside the hidden directory, where nothing else is
            transformers.trainer_utils.rotate_checkpoints(
                output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        state_dict = full_state_dict(self.model)  # a collective: every rank gathers, rank 0 keeps it
        if self.args.should_save:
            self._save(output_dir or self.args.output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # the user's, not AcceleratedOptimizer
        try:
            save(os.path.join(output_dir, "shardwise"), self.model, optimizer, self.lr_scheduler)
        except ShardwiseError as error:
            raise ShardwiseError(
                f"ShardwiseTrainer could not save the {type(optimizer).__name__} optimizer's state: {error}. Inside "
                "a Trainer: TrainingArguments(save_only_model=True) saves the weights alone (a resume then starts "
                "the optimizer afresh), or choose an optimizer whose state shards by rows (optim=\"adamw_torch\"). "
                "No checkpoint was written; earlier ones are untouched.") from None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if trainer_checkpoints.weights_only(Path(resume_from_checkpoint)):  # Note [weights-only checkpoints]
            load(os.path.join(resume_from_checkpoint, trainer_checkpoints.MODEL), self.model)
            return
        load(os.path.join(resume_from_checkpoint, "shardwise"), self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if trainer_checkpoints.weights_only(Path(checkpoint)):  # Note [weights-only checkpoints]
            if group_of(self.model)[1] == 0:
                trainer_checkpoints.log.warning(
                    "ShardwiseTrainer: %s holds the model alone (saved with save_only_model=True): its weights are "
                    "loaded, the optimizer and scheduler start afresh, as the Trainer does", checkpoint)
            return
        path = os.path.join(checkpoint, "shardwise")
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # saved under the user's class
        saved = next(iter(read_index(path).optimizers), None)
        if saved is not None and saved.class_name == type(self.optimizer).__name__:  # a bare name
            optimizer = self.optimizer  # saved before shardwise named the user's class (AcceleratedOptimizer)
        load(path, self.model, optimizer, self.lr_scheduler)

