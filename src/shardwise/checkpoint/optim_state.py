"""An optimizer's state as a checkpoint holds it: row-shaped tensors by parameter name, JSON scalars."""

from __future__ import annotations

import torch
from torch import Tensor

from shardwise.checkpoint.names import clean_name
from shardwise.checkpoint.values import to_json
from shardwise.engine.info import ShardInfo
from shardwise.engine.whole_step import StepShape, sharded_params, step_shape
from shardwise.errors import ShardwiseError


def optimizer_names(optim: torch.optim.Optimizer, infos: dict[str, ShardInfo]) -> dict[int, str]:
    """id(param) -> the model's (cleaned) name, for every param the optimizer holds."""
    if sharded_params(optim) and step_shape(optim) is StepShape.WHOLE:
        # Note [whole-tensor step]: its state is whole-shaped on one owner rank per parameter,
        # which the row-sliced format cannot hold; refused on every rank, before any collective.
        raise ShardwiseError(
            f"sw.save/sw.load of a {type(optim).__name__}'s state on a sharded model is not supported yet: it "
            "steps whole tensors on one owner rank each (Note [whole-tensor step]), and checkpoints hold "
            "row-sliced state. Save the model alone (sw.save(path, model)) and rebuild the optimizer on "
            "resume, or use an elementwise optimizer (AdamW, Adam, SGD, ...) whose state shards by rows."
        )
    by_id = {id(info.param): clean_name(name) for name, info in infos.items()}
    names = {}
    for index, group in enumerate(optim.param_groups):
        for param in group["params"]:
            if id(param) not in by_id:
                raise ShardwiseError(
                    f"optimizer param group {index} holds a tensor of shape {list(param.shape)} that is not a "
                    "parameter of this model. Build the optimizer after sw.shard(...), from model.parameters()."
                )
            names[id(param)] = by_id[id(param)]
    return names


def scalar_state_keys(optim: torch.optim.Optimizer) -> set[str]:
    """State keys that are per-parameter scalars (AdamW's `step`), not per-element tensors.

    A 0-D tensor next to a parameter with rows is a scalar. For a 0-D parameter both look
    alike, so the keys found scalar elsewhere decide, and `step` always is."""
    keys = {"step"}
    for param, state in optim.state.items():
        if param.dim() > 0:
            keys.update(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() == 0)
    return keys


def split_state(name: str, param: Tensor, state: dict, scalar_keys: set[str]) -> tuple[dict, dict]:
    """One param's optimizer state as (row-shaped tensors, JSON scalars)."""
    rows, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, Tensor) and value.shape == param.shape and not (
                value.dim() == 0 and key in scalar_keys):
            rows[key] = value
        elif isinstance(value, Tensor) and value.dim() != 0:
            raise ShardwiseError(
                f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, neither the parameter's "
                f"shape {list(param.shape)} nor a scalar: shardwise checkpoints store element-wise and scalar "
                "optimizer state only (AdamW, Adam, SGD, RMSprop, Adagrad, ...)"
            )
        else:
            scalars[key] = to_json(value, f"optimizer state {key!r} of {name!r}")
    return rows, scalars
