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
whole model from rank 0). `save_state` / `load_state` would keep only rank 0's optimizer rows:
they are refused with the fix (`sw.save` / `sw.load`). `mixed_precision="bf16"` autocasts the
forward (outputs in fp32) as the plain Accelerator does; `"fp16"` is refused for shardwise's own
`precision="fp16"`, whose loss scaler agrees on inf/NaN across ranks (Accelerate's GradScaler
would check this rank's rows only). Unsharded models take Accelerate's own paths unchanged.
"""

from __future__ import annotations

import accelerate
import torch.distributed as dist

from shardwise.checkpoint.export import full_state_dict
from shardwise.engine.grads import clip_grad_norm_
from shardwise.engine.info import engine_of
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
        self._refuse_state("save_state", "sw.save(path, model, optim, scheduler, loader=...)")
        return super().save_state(output_dir, safe_serialization, **kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, **kwargs):
        self._refuse_state("load_state", "sw.load(sw.latest(dir), model, optim, scheduler, loader=...)")
        return super().load_state(input_dir, load_kwargs, **kwargs)

    def _sharded_models(self):
        return [model for model in self._models if engine_of(model) is not None]

    def _refuse_state(self, method: str, fix: str) -> None:
        if self._sharded_models():
            raise ShardwiseError(
                f"accelerator.{method} would keep only rank 0's rows of a sharded model's optimizer state. "
                f"Use {fix}: every rank writes its own rows, and any world size loads them.")
