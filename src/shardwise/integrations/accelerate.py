"""Accelerate on a sharded model: `ShardwiseAccelerator`, a drop-in subclass of `Accelerator`.

    sw.init()
    sw.shard(model, strategy="zero3")                     # 1. shard before Accelerate sees it
    accelerator = ShardwiseAccelerator(...)               # 2. instead of Accelerator(...)
    model, optim, loader = accelerator.prepare(model, optim, loader)
    ...                                                   # the loop stays as Accelerate's docs write it

Note [accelerate integration]: `Accelerator.prepare` wraps a model in DistributedDataParallel
under torchrun (refused on a sharded model: Note [no second wrapper]), `clip_grad_norm_`
clips with torch's rank-local norm (refused: Note [rank-local clipping]), and
`get_state_dict` / `save_model` would read this rank's rows. `ShardwiseAccelerator` leaves a
sharded model as shardwise returned it (Accelerate's `accumulate()` then finds its
`no_sync()`), clips by the global norm (`sw.clip_grad_norm_`) when given all of its
parameters, and gives `sw.full_state_dict` to `get_state_dict` (so `save_model` writes the
whole model from rank 0). `save_state(dir)` / `load_state(dir)` of a sharded model are `sw.save` /
`sw.load` of a shardwise checkpoint directory (Note [accelerate state]). `mixed_precision="bf16"`
autocasts the forward (outputs in fp32) as the plain Accelerator does; `"fp16"` is refused for
shardwise's own `precision="fp16"`, whose loss scaler agrees on inf/NaN across ranks (Accelerate's
GradScaler would check this rank's rows only). Unsharded models take Accelerate's own paths unchanged.

Note [accelerate state]: Accelerate's own `save_state` would write each optimizer's
`state_dict()` from rank 0, i.e. rank 0's rows, and for a whole-tensor optimizer (Muon) the state
of the matrices rank 0 owns only. On a sharded model it writes instead one shardwise checkpoint
directory: every rank its rows, every optimizer (several as a list, Muon + AdamW), the one
scheduler, the objects given to `register_for_checkpointing`, each rank's RNG states and the
accelerator's step; `load_state` reads it back into the prepared ones at any world size (at the
same one, bitwise). Not carried: the data loaders' positions (pass `sw.ResumableSampler` or skip
batches yourself) and save/load hooks; several models or schedulers are refused.
"""

from __future__ import annotations

import accelerate
import torch.distributed as dist

from shardwise.checkpoint.interop.export import full_state_dict
from shardwise.checkpoint.read.load import load
from shardwise.checkpoint.write.save import save
from shardwise.engine.optim.grads import clip_grad_norm_
from shardwise.engine.unit.info import engine_of
from shardwise.errors import ShardwiseError
from shardwise.integrations.prepared import FP16_FIX, autocast_forward, mark_prepared


class ShardwiseAccelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` that trains models `sw.shard` sharded (Note [accelerate integration])."""

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if engine_of(model) is None:
            return super().prepare_model(model, device_placement, evaluation_mode)
        if self.mixed_precision == "fp16":
            raise ShardwiseError(f"ShardwiseAccelerator(mixed_precision=\"fp16\"): {FP16_FIX}")
        if self.mixed_precision not in ("no", "bf16"):
            raise ShardwiseError(
                f"ShardwiseAccelerator(mixed_precision={self.mixed_precision!r}) is not supported on a sharded "
                "model: use mixed_precision=\"bf16\" (autocast) or sw.shard(..., precision=\"bf16\")")
        ranks = dist.get_world_size(engine_of(model).group)
        if self.num_processes != ranks:
            # Accelerate then deals every rank the same batches: a wrong model without a word.
            raise ShardwiseError(
                f"Accelerate sees {self.num_processes} process(es) but the model is sharded over {ranks} ranks. "
                "Under torchrun on CPU pass ShardwiseAccelerator(cpu=True) so Accelerate reads torchrun's "
                "environment; launch with torchrun (not `accelerate launch` without a distributed config).")
        mark_prepared(model)
        if self.native_amp:  # bf16: Accelerate skips a prepared model's autocast, so it is applied here
            autocast_forward(model, self)
        return super().prepare_model(model, device_placement=False, evaluation_mode=evaluation_mode)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        parameters = list(parameters)
        given = {id(p) for p in parameters}
        for model in self._sharded_models():
            owned = {id(p) for p in model.parameters()}
            if given == owned:
                return clip_grad_norm_(model, max_norm, norm_type)
            if given & owned:
                raise ShardwiseError(
                    "accelerator.clip_grad_norm_ got some of a sharded model's parameters: shardwise clips a "
                    "sharded model as a whole (its global norm). Pass model.parameters().")
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    def get_state_dict(self, model, unwrap=True):
        if engine_of(model) is not None:
            return full_state_dict(model)  # plain full tensors on rank 0, {} elsewhere: a collective
        return super().get_state_dict(model, unwrap)

    def save_state(self, output_dir=None, safe_serialization=True, **kwargs):
        if not self._sharded_models():
            return super().save_state(output_dir, safe_serialization, **kwargs)
        model, optim, scheduler, objects = self._state_parts("save_state", output_dir)
        return str(save(output_dir, model, optim, scheduler, accelerator_step=self.step, **objects))

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        if not self._sharded_models():
            return super().load_state(input_dir, load_kwargs, **kwargs)
        model, optim, scheduler, objects = self._state_parts("load_state", input_dir)
        report = load(input_dir, model, optim, scheduler, **objects)
        self.step = report.extra.get("accelerator_step", self.step)

    def _sharded_models(self):
        return [model for model in self._models if engine_of(model) is not None]

    def _state_parts(self, method: str, directory):
        """What save_state / load_state carry (Note [accelerate state]): the model, its optimizers (one, or
        a list), the scheduler, the registered objects by keyword."""
        fix = "sw.save(path, model, [optimizers], scheduler) / sw.load(...) for the parts you choose"
        if directory is None:
            raise ShardwiseError(f"accelerator.{method}() of a sharded model needs the directory: "
                                 f"accelerator.{method}(path) (or {fix})")
        if len(self._models) != 1 or len(self._schedulers) > 1:
            raise ShardwiseError(f"accelerator.{method} of a sharded model carries one model and at most one "
                                 f"scheduler; this accelerator prepared {len(self._models)} models and "
                                 f"{len(self._schedulers)} schedulers: use {fix}")
        optimizers = [getattr(o, "optimizer", o) for o in self._optimizers]
        optim = None if not optimizers else optimizers[0] if len(optimizers) == 1 else optimizers
        scheduler = getattr(self._schedulers[0], "scheduler", self._schedulers[0]) if self._schedulers else None
        objects = {f"custom_{i}": obj for i, obj in enumerate(self._custom_objects)}
        return self._models[0], optim, scheduler, objects
