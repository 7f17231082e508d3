"""What a checkpoint records besides parameter rows: names, JSON scalars, RNG states,
optimizer state layout, and the process group a model's collectives use."""

from __future__ import annotations

import random
import re
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.errors import ShardwiseError
from shardwise.strategies import ShardInfo, state_of

# ---- names -----------------------------------------------------------------------

# Note [wrapper prefixes]: wrappers add path components that are not part of the
# model: DDP's `module.` (leading), torch.compile's `_orig_mod.`, FSDP1's
# `_fsdp_wrapped_module.` and activation checkpointing's `_checkpoint_wrapped_module.`
# (anywhere). Both the checkpoint's names and the model's are cleaned the same way,
# so a checkpoint saved from any wrapping loads into any other.
_DROPPED_PARTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def clean_name(name: str) -> str:
    """`name` without wrapper components (Note [wrapper prefixes])."""
    parts = [part for part in name.split(".") if part not in _DROPPED_PARTS]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


Rename = Mapping[str, str] | Sequence[tuple[str, str]] | None


def make_renamer(rename: Rename) -> Callable[[str], str]:
    """`rename` as a function on (cleaned) checkpoint names: a mapping of exact names, or
    `(pattern, replacement)` regex pairs applied in order with `re.sub`."""
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        table = {clean_name(k): clean_name(v) for k, v in rename.items()}
        return lambda name: table.get(name, name)
    try:
        pairs = [(re.compile(pattern), replacement) for pattern, replacement in rename]
    except (TypeError, ValueError, re.error) as error:
        raise ShardwiseError(
            f"rename={rename!r} is not understood ({error}): pass a dict of exact names "
            "{'old.name': 'new.name'} or a list of (regex, replacement) pairs"
        ) from None

    def apply(name: str) -> str:
        for pattern, replacement in pairs:
            name = pattern.sub(replacement, name)
        return name

    return apply


def persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers `state_dict()` holds (not the non-persistent ones), by cleaned name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            out.setdefault(clean_name(full), buffer)
    return out


# ---- process group -----------------------------------------------------------------


def group_of(model: nn.Module):
    """(group, rank, world_size) of the model's collectives; (None, 0, 1) without a process group."""
    if not dist.is_initialized():
        return None, 0, 1
    state = state_of(model)
    group = getattr(state, "group", None) or getattr(state, "process_group", None) or dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def is_sharded(model: nn.Module) -> bool:
    """True when each rank holds only its own rows (zero strategies); ddp and plain models replicate."""
    state = state_of(model)
    return state is not None and getattr(state, "strategy", "ddp") != "ddp"


def gather_object(obj, group, rank: int, world: int) -> list | None:
    """Every rank's `obj` on rank 0 (None elsewhere); no collective when alone."""
    if group is None or world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def broadcast_object(obj, group, rank: int, world: int):
    """Rank 0's `obj` on every rank."""
    if group is None or world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def all_gather_object(obj, group, world: int) -> list:
    if group is None or world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def rows_to_write(info: ShardInfo, rank: int, world: int, sharded: bool) -> tuple[int, int]:
    """Rows of the full tensor this rank writes: its own shard, or an equal split of a replica."""
    if sharded:
        return info.row_start, info.row_end
    rows = info.full_shape[0] if len(info.full_shape) else 1
    per_rank = -(-rows // world)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def row_view(tensor: Tensor, info: ShardInfo, lo: int, hi: int) -> Tensor:
    """Rows lo:hi of the full tensor, as a view of `tensor` (the registered param or a state
    tensor shaped like it); a 0-D tensor counts as one row and comes back 1-D."""
    local = lo - info.row_start
    flat = tensor.detach()
    if len(info.full_shape) == 0:
        flat = flat.reshape(-1)
    return flat[local : local + (hi - lo)]


# ---- JSON scalars ------------------------------------------------------------------


def to_json(value, where: str):
    """`value` as JSON (tuples become lists; a 0-D tensor becomes a tagged scalar), or a
    ShardwiseError naming `where` and the value's type."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ShardwiseError(f"{where} has a non-string key {key!r}: checkpoints store JSON only")
            out[key] = to_json(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, Tensor) and value.numel() == 1 and value.dim() == 0:
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    raise ShardwiseError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store without pickle "
        "(only JSON values, 0-D tensors and parameter-shaped tensors are stored)"
    )


def from_json(value, device: torch.device | str = "cpu"):
    """Inverse of `to_json` (lists stay lists)."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ShardwiseError(f"unknown dtype {value['dtype']!r} in the checkpoint")
            return torch.tensor(value["__tensor__"], dtype=dtype, device=device)
        return {key: from_json(item, device) for key, item in value.items()}
    if isinstance(value, list):
        return [from_json(item, device) for item in value]
    return value


def like_current(saved, current):
    """A saved JSON value shaped like the current one (tuples back from lists, tensors filled)."""
    if isinstance(current, tuple) and isinstance(saved, list):
        return tuple(saved)
    if isinstance(current, Tensor) and not isinstance(saved, Tensor):
        return torch.full_like(current, saved)
    return saved


# ---- RNG ---------------------------------------------------------------------------


def capture_rng() -> tuple[dict[str, Tensor], dict]:
    """This process's RNG states: tensors for the rank's file, JSON scalars for the index."""
    tensors = {"rng/torch": torch.get_rng_state()}
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, gauss_next = random.getstate()
    tensors["rng/python"] = torch.tensor(internal, dtype=torch.int64)
    scalars = {"numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
               "python": {"version": version, "gauss_next": gauss_next}, "cuda": 0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states = torch.cuda.get_rng_state_all()
        scalars["cuda"] = len(states)
        for index, state in enumerate(states):
            tensors[f"rng/cuda{index}"] = state
    return tensors, scalars


def restore_rng(tensors: dict[str, Tensor], scalars: dict) -> None:
    """Set this process's RNGs to what `capture_rng` returned on the same rank."""
    torch.set_rng_state(tensors["rng/torch"].to(torch.uint8))
    numpy = scalars["numpy"]
    np.random.set_state((numpy["kind"], tensors["rng/numpy"].numpy().astype(np.uint32), numpy["pos"],
                         numpy["has_gauss"], numpy["cached"]))
    python = scalars["python"]
    random.setstate((python["version"], tuple(int(x) for x in tensors["rng/python"].tolist()),
                     python["gauss_next"]))
    if scalars.get("cuda") and torch.cuda.is_available():
        states = [tensors[f"rng/cuda{i}"].to(torch.uint8) for i in range(scalars["cuda"])]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


# ---- optimizer state ---------------------------------------------------------------


def optimizer_names(optim: torch.optim.Optimizer, infos: dict[str, ShardInfo]) -> dict[int, str]:
    """id(param) -> the model's (cleaned) name, for every param the optimizer holds."""
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
