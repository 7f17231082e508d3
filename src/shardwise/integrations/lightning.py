"""Lightning on a sharded model: `ShardwiseStrategy`, picked as `Trainer(strategy=...)`.

    trainer = L.Trainer(strategy=ShardwiseStrategy("zero3"), accelerator="cpu", devices=2, ...)
    trainer.fit(lit_module)                                 # launch with torchrun, or let Lightning spawn

Note [lightning integration]: the strategy is Lightning's DDPStrategy (process group, launch,
data sampler, `reduce` for logging) with its one DDP-specific act replaced: where DDP would
wrap the LightningModule, `sw.shard` shards it in place, before Lightning builds the
optimizers from its parameters. Lightning then calls `training_step` on the module itself;
the submodules it calls (`self.model(batch)`) gather their units as any call does (Note
[outer calls] in engine/zero.py). Gradient accumulation skips the reduce on all but the last
micro-batch (`sw.no_sync`); `gradient_clip_val` clips by the global norm (`sw.clip_grad_norm_`,
not torch's rank-local one). Checkpoints (`ModelCheckpoint`, `trainer.save_checkpoint`,
`fit(ckpt_path=...)`) are shardwise checkpoint directories written by every rank
(`sw.save`: each rank its rows and optimizer rows, any world size loads them), with Lightning's
own loop and callback state inside index.json as JSON (Note [lightning state]). Several optimizers
(Lightning takes them with manual optimization: `self.automatic_optimization = False`, e.g. Muon for
the matrices and AdamW for the rest) are saved together, as `sw.save(path, module, [muon, adamw])`.

Note [lightning state]: Lightning's own state (loops, callbacks, hyper-parameters, schedulers)
is stored as the checkpoint's JSON extra value `lightning` (small tensors tagged, as object
states are), so it is covered by the index's digest and loading it runs no code: no pickle
anywhere. A value that JSON cannot hold (an object among the hyper-parameters) is refused when
saving, naming it. A `lightning.pt` beside the index (written by shardwise 0.1 with torch.save)
is still read, with `torch.load(weights_only=...)` as the caller passes it (True unless the
caller says False: torch's restricted unpickler runs no code).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy

from shardwise.checkpoint.format.schema import read_index
from shardwise.checkpoint.format.values import from_json, to_json
from shardwise.checkpoint.read.load import load
from shardwise.checkpoint.write.save import save
from shardwise.engine.api import shard
from shardwise.engine.optim.grads import clip_grad_norm_, no_sync
from shardwise.errors import ShardwiseError

# Note [pinned pair]: lightning 2.x's pytree helper builds torch's LeafSpec, which torch 2.13 deprecates,
# so every fit printed the deprecation once per rank: nothing a user can change (constraints.txt pins
# the pair). Dropped here for that message from lightning's own modules only.
for _category in (FutureWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=_category, module=r"lightning\.")

_STATE = "lightning"  # the extra value holding Lightning's own state (Note [lightning state])
_LEGACY = "lightning.pt"  # where shardwise 0.1 wrote it, with torch.save


class ShardwiseStrategy(DDPStrategy):
    """Lightning strategy that shards the LightningModule with `sw.shard` (Note [lightning integration]).

    `strategy` and `shard_kwargs` (`units=`, `precision=`, `offload=`, ...) are `sw.shard`'s;
    `process_group_backend`, `timeout` and `start_method` are DDPStrategy's."""

    strategy_name = "shardwise"

    def __init__(self, strategy: str = "zero3", *, process_group_backend: str | None = None, timeout=None,
                 start_method: str = "popen", **shard_kwargs):
        options = {"timeout": timeout} if timeout is not None else {}
        super().__init__(process_group_backend=process_group_backend, start_method=start_method, **options)
        self.shard_strategy, self.shard_kwargs = strategy, shard_kwargs

    def configure_ddp(self) -> None:
        shard(self.model, strategy=self.shard_strategy, **self.shard_kwargs)
        module = self.model
        # Lightning's precision plugin clips with torch's rank-local clip_grad_norm_ (refused on shards).
        self.precision_plugin.clip_grad_by_norm = lambda optimizer, clip_val: clip_grad_norm_(module, clip_val)

    @contextmanager
    def block_backward_sync(self):
        with no_sync(self.lightning_module):
            yield None

    # ---- checkpoints: shardwise directories ---------------------------------------

    def lightning_module_state_dict(self) -> dict:
        return {}  # the weights are written by save_checkpoint, each rank its own rows

    def optimizer_state(self, optimizer) -> dict:
        return {}  # likewise

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if storage_options is not None:
            raise ShardwiseError("ShardwiseStrategy writes shardwise checkpoint directories; storage_options "
                                 "are not supported")
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        try:
            state = to_json(meta, "Lightning's checkpoint")
        except ShardwiseError as error:
            raise ShardwiseError(f"{error}. ShardwiseStrategy stores Lightning's state as JSON (no pickle): leave "
                                 "such values out (save_hyperparameters(ignore=[...])) or make them JSON "
                                 "values") from None
        save(filepath, self.lightning_module, self._optimizers_to_save(), **{_STATE: state})

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        path = Path(checkpoint_path)
        extra = read_index(path).extra
        if _STATE in extra:
            meta = from_json(extra[_STATE])
        elif (path / _LEGACY).is_file():
            meta = _load_legacy(path / _LEGACY, weights_only)
        else:
            raise ShardwiseError(f"{path} holds no Lightning state: it was saved by sw.save, not by "
                                 "ShardwiseStrategy. Load its weights with sw.load(path, module) instead.")
        return {**meta, "state_dict": {}, "optimizer_states": [], "_shardwise_path": str(checkpoint_path)}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        load(checkpoint["_shardwise_path"], self.lightning_module, strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        load(checkpoint["_shardwise_path"], self.lightning_module, self._optimizers_to_save())

    def _optimizers_to_save(self):
        """One optimizer as itself; several (manual optimization: Muon + AdamW) as a list, in the order
        configure_optimizers returns them (Note [lightning integration])."""
        optimizers = list(self.optimizers)
        return None if not optimizers else optimizers[0] if len(optimizers) == 1 else optimizers


def _load_legacy(file: Path, weights_only: bool | None) -> dict:
    """Lightning's state from a `lightning.pt` (Note [lightning state]): torch.load with the caller's
    `weights_only`, True unless the caller trusts the file and says False."""
    weights_only = True if weights_only is None else weights_only
    try:
        meta = torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as error:  # noqa: BLE001 - torch raises many types for a refused or bad file
        raise ShardwiseError(
            f"{file} could not be read with torch.load(weights_only={weights_only}) ({error}). It was written "
            "by shardwise 0.1 with torch.save; pass weights_only=False (trainer.fit(..., weights_only=False)) "
            "only if you trust where it came from, or re-save the checkpoint.") from None
    if not isinstance(meta, dict):
        raise ShardwiseError(f"{file} holds a {type(meta).__name__}, not Lightning's checkpoint dict")
    return meta
