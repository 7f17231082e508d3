"""What a checkpoint records besides tensor rows: JSON scalars and each rank's RNG states.

No pickle: every value is JSON or a tensor in a safetensors file.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch
from torch import Tensor

from shardwise.errors import ShardwiseError

_MAX_STATE_TENSOR_BYTES = 1 << 20  # larger tensors belong in the model or the optimizer, not in an object's state


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
    if isinstance(value, Tensor) and value.nbytes <= _MAX_STATE_TENSOR_BYTES:
        # A small state tensor (a torch.Generator's state in a data loader's): its bytes, base64.
        data = value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        return {"__tensor_bytes__": base64.b64encode(data).decode("ascii"), "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    raise ShardwiseError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store without pickle "
        f"(only JSON values, tensors of at most {_MAX_STATE_TENSOR_BYTES >> 10} KiB and parameter-shaped "
        "tensors are stored)"
    )


def from_json(value, device: torch.device | str = "cpu"):
    """Inverse of `to_json` (lists stay lists)."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ShardwiseError(f"unknown dtype {value['dtype']!r} in the checkpoint")
            return torch.tensor(value["__tensor__"], dtype=dtype, device=device)
        if "__tensor_bytes__" in value:
            dtype = getattr(torch, value["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ShardwiseError(f"unknown dtype {value['dtype']!r} in the checkpoint")
            data = bytearray(base64.b64decode(value["__tensor_bytes__"]))
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(value["shape"]).to(device)
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
