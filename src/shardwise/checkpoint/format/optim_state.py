"""An optimizer's state as a checkpoint holds it, whatever its shapes and wherever it lives.

Note [optimizer records]: each parameter's state is split three ways (`split_state`):
- parameter-shaped tensors (AdamW's moments, Muon's momentum) are stored as rows of the full
  tensor, like the parameter itself, so any world size and strategy reads the rows it needs;
- other tensors (Adafactor's row and column factors, per-block scales of a quantized state, a
  preconditioner) are "whole" records: their own shape and dtype, stored once, checksummed like
  every slice, read whole by whichever rank holds the state on load;
- everything else is JSON (`step`, Adafactor's `RMS`).
Where the state lives (`Placement`): an elementwise optimizer on a sharded model holds each
parameter's state as this rank's rows; a whole-tensor optimizer (Note [whole-tensor step]) holds
it whole on the parameter's owner rank only; a replica (ddp, one process, a plain model) holds it
whole on every rank, so its rows are split between the ranks to write, and its whole records are
written by rank 0. On load the same question is asked of the *current* layout: the owner under
the new owner map gets the whole state, the other ranks none, a rows layout its own rows.

Note [recorded owners]: a whole-tensor optimizer's owner map (Note [kept owners], whole_step.py) is
recorded in the index, per parameter name, with the size of the shard group it was made for. On load
under a shard group of another size the map is new and each whole state goes to its new owner. Under
the same size an optimizer that has no owners yet (built for this load) takes the recorded map
(whole_step.adopt_owners), so the loaded run is the saved one whatever order assigned the owners then:
param groups built in another order, or each unit's step under sw.optimizer_in_backward, which assigns
them in backward's order where a fresh optimizer would in its groups' (a resume at the same world size
refused every such checkpoint before). One that already has owners (it stepped or loaded before) must
have the recorded ones: its states live there. `shardwise ckpt inspect` shows the map's load per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shardwise.checkpoint.format.names import clean_name
from shardwise.checkpoint.format.values import to_json
from shardwise.engine.layout.rows import num_rows
from shardwise.engine.memory.host_param import is_host_shared
from shardwise.engine.optim.lowbit import flatten_state
from shardwise.engine.optim.whole_step import owner_map, owners_layout, unwrapped
from shardwise.engine.unit.info import ShardInfo
from shardwise.errors import ShardwiseError

SEVERAL = ("sw.save(path, model, [muon, adamw], scheduler) or sw.save(path, model, {'muon': muon, "
           "'adamw': adamw}, scheduler), and the same on sw.load")


def class_name(optim) -> str:
    """The optimizer's class, inside Accelerate's or Lightning's wrapper, qualified by its module (what a
    checkpoint records: Note [optimizer class] in read/optim_plan.py)."""
    kind = type(unwrapped(optim))
    return f"{kind.__module__}.{kind.__qualname__}"


def named_optimizers(optim) -> tuple[list[tuple[str | None, object]], str]:
    """`optim` as [(name or None, optimizer)] and its form: "none", "one", "list" or "dict"."""
    if optim is None:
        return [], "none"
    if isinstance(optim, dict):
        if not optim or not all(isinstance(k, str) and k for k in optim):
            raise ShardwiseError(f"optimizers by name need a non-empty dict with non-empty string keys, not keys "
                                 f"{list(optim)[:4]}: {SEVERAL}")
        found = list(optim.items())
        form = "dict"
    elif isinstance(optim, (list, tuple)):
        if not optim:
            raise ShardwiseError(f"an empty list of optimizers was given: pass None, one optimizer, or {SEVERAL}")
        found = [(None, o) for o in optim]
        form = "list" if len(optim) > 1 else "one"
    else:
        found, form = [(None, optim)], "one"
    for name, one in found:
        if not hasattr(one, "param_groups") or not hasattr(one, "state"):
            where = f"optimizer {name!r}" if name else "an optimizer"
            raise ShardwiseError(f"{where} is a {type(one).__name__}, not a torch optimizer: {SEVERAL}")
    if len({id(o) for _, o in found}) != len(found):
        raise ShardwiseError("the same optimizer was given twice: pass each optimizer once")
    return found, form


def held_params(group: dict) -> list[Tensor]:
    """A param group's parameters that a checkpoint records: all but the host copy's (`frozen="host"`,
    Note [host copy]), which are read-only, never stepped, and outside every checkpoint. An optimizer
    built from `model.parameters()` holds them like any frozen parameter."""
    return [param for param in group["params"] if not is_host_shared(param)]


def optimizer_names(optim, infos: dict[str, ShardInfo]) -> dict[int, str]:
    """id(param) -> the model's (cleaned) name, for every param the optimizer holds (`held_params`)."""
    by_id = {id(info.param): clean_name(name) for name, info in infos.items()}
    names = {}
    for index, group in enumerate(optim.param_groups):
        for param in held_params(group):
            if id(param) not in by_id:
                raise ShardwiseError(
                    f"optimizer param group {index} holds a tensor of shape {list(param.shape)} that is not a "
                    "parameter of this model. Build the optimizer after sw.shard(...), from model.parameters()."
                )
            names[id(param)] = by_id[id(param)]
    return names


@dataclass(frozen=True)
class Placement:
    """Where one parameter's optimizer state lives on this rank (Note [optimizer records]).

    `owner` is None for a rows layout (the state is param-shaped like this rank's tensor: its shard,
    or a replica's whole tensor); else the rank (in the parameter's unit group) that holds it whole."""

    owner: int | None
    rank: int

    @property
    def mine(self) -> bool:
        """Whether this rank holds (and saves, and loads) this parameter's state."""
        return self.owner is None or self.owner == self.rank


def placements(optim, infos: dict[str, ShardInfo]) -> dict[int, Placement]:
    """id(param) -> its Placement, for every param the optimizer holds."""
    owners, layout = owner_map(optim), owners_layout(optim)
    out = {}
    for group in optim.param_groups:
        for param in held_params(group):
            owner = owners.get(id(param))
            out[id(param)] = Placement(owner, layout.shard_rank if owner is not None else 0)
    return out


def recorded_owners(optim, names: dict[int, str], where: dict[int, Placement]) -> dict | None:
    """Note [recorded owners]: the owner map of a whole-tensor optimizer as a checkpoint records it, by
    parameter name, with the shard group's size it was made for; None for any other optimizer."""
    owners = {names[id(p)]: where[id(p)].owner for group in optim.param_groups for p in group["params"]
              if where[id(p)].owner is not None}
    if not owners:
        return None
    return {"shard_world": owners_layout(optim).shard_world, "map": owners}


def full_info(info: ShardInfo) -> ShardInfo:
    """`info` for a tensor holding every row of the parameter (an owner's whole state)."""
    rows = num_rows(info.full_shape)
    return ShardInfo(info.param, info.full_shape, 0, rows, info.aliases)


def scalar_state_keys(optim) -> set[str]:
    """State keys that are per-parameter scalars (AdamW's `step`), not per-element tensors.

    A 0-D tensor next to a parameter with rows is a scalar. For a 0-D parameter both look
    alike, so the keys found scalar elsewhere decide, and `step` always is."""
    keys = {"step"}
    for param, state in optim.state.items():
        if param.dim() > 0:
            keys.update(k for k, v in state.items() if isinstance(v, Tensor) and v.dim() == 0)
    return keys


def split_state(name: str, shape: torch.Size, state: dict, scalar_keys: set[str], *,
                whole_allowed: bool = True) -> tuple[dict, dict, dict]:
    """One param's optimizer state as (param-shaped tensors, JSON scalars, whole tensors), where
    `shape` is the shape of the tensor its param-shaped state has on this rank (Note [optimizer records])."""
    rows, scalars, whole = {}, {}, {}
    for key, value in flatten_state(state, repr(name)).items():  # a quantized state as its parts (Note [low-bit state])
        if not isinstance(key, str):
            raise ShardwiseError(f"optimizer state of {name!r} has a non-string key {key!r}: checkpoints store JSON "
                                 "keys only")
        if isinstance(value, Tensor) and value.shape == shape and not (value.dim() == 0 and key in scalar_keys):
            rows[key] = value
        elif isinstance(value, Tensor) and value.dim() != 0:
            if not whole_allowed:
                raise ShardwiseError(
                    f"optimizer state {key!r} of {name!r} has shape {list(value.shape)}, neither the shape of this "
                    f"rank's rows {list(shape)} nor a scalar, and the optimizer steps rows: each rank's would differ. "
                    "Its class must step whole tensors (Note [whole-tensor step])")
            if type(value) is not Tensor and not isinstance(value, torch.nn.Parameter):
                raise ShardwiseError(f"optimizer state {key!r} of {name!r} is a {type(value).__name__}, a tensor "
                                     "subclass a checkpoint cannot store without pickle; store plain tensors")
            whole[key] = value
        else:
            scalars[key] = to_json(value, f"optimizer state {key!r} of {name!r}")
    return rows, scalars, whole
