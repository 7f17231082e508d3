"""What a checkpoint records besides tensor rows: JSON scalars and each rank's RNG states.

No pickle: every value is JSON or a tensor in a safetensors file.
"""

from __future__ import annotations

import base64
import math
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


def from_json(value, device: torch.device | str = "cpu", where: str = "a saved value"):
    """Inverse of `to_json` (lists stay lists); a tagged tensor that does not decode (an unknown
    dtype, bad base64, bytes that do not fill its shape) is a ShardwiseError naming `where`."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype, number = _dtype(value, where), value["__tensor__"]
            if type(number) not in (bool, int, float):
                raise ShardwiseError(f"{where}: a saved scalar tensor holds {number!r}, not a number")
            try:
                return torch.tensor(number, dtype=dtype, device=device)
            except (RuntimeError, OverflowError, TypeError) as error:
                raise ShardwiseError(f"{where}: {number!r} is not a {dtype} ({error})") from None
        if "__tensor_bytes__" in value:
            return _tensor_from_bytes(value, _dtype(value, where), where).to(device)
        return {key: from_json(item, device, f"{where}[{key!r}]") for key, item in value.items()}
    if isinstance(value, list):
        return [from_json(item, device, f"{where}[{i}]") for i, item in enumerate(value)]
    return value


def number_from_json(value, where: str):
    """`from_json` of a saved number (a per-parameter optimizer scalar, AdamW's `step`): a number or a one-element
    tensor, anything else refused as an edited or damaged checkpoint."""
    decoded = from_json(value, where=where)
    if type(decoded) in (bool, int, float) or decoded is None or isinstance(decoded, torch.Tensor) \
            and decoded.numel() == 1:
        return decoded
    raise ShardwiseError(f"{where} is {str(decoded)[:60]!r} in the checkpoint, not a number: the checkpoint was "
                         "edited or damaged. Load an earlier checkpoint.")


def _dtype(value: dict, where: str) -> torch.dtype:
    name = value.get("dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise ShardwiseError(f"{where}: unknown dtype {name!r} in the checkpoint")
    return dtype


def _tensor_from_bytes(value: dict, dtype: torch.dtype, where: str) -> Tensor:
    text, shape = value["__tensor_bytes__"], value.get("shape")
    try:
        data = bytearray(base64.b64decode(text, validate=True))
    except (TypeError, ValueError) as error:  # binascii.Error is a ValueError
        raise ShardwiseError(f"{where}: a saved tensor's bytes are not base64 ({error})") from None
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**40 for d in shape) or \
            math.prod(shape) * dtype.itemsize != len(data):
        raise ShardwiseError(f"{where}: a saved tensor's {len(data)} bytes do not make shape {shape!r} of {dtype}")
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def check_like(saved, current, where: str) -> None:
    """Refuse a saved value that cannot stand where the current one does: of another type (a string
    for a learning rate, `"yes please"` for `foreach`, a list of 1 for Adam's 2 betas) or out of its
    range (NaN or an infinity for a finite number, a negative one for a non-negative one). Where the
    current value is None (`foreach=None`) the saved one must be None, true/false or a finite number;
    other types accept anything."""
    def fail(what):
        raise ShardwiseError(f"{where} is {_show(saved)} in the checkpoint, {what}: the checkpoint was edited or "
                             "damaged, or saved by other code. Load an earlier checkpoint.")

    if current is None:
        if saved is not None and type(saved) is not bool and not _finite(saved):
            fail("not null, true/false or a finite number")
        return
    if not isinstance(current, (bool, int, float, str, Tensor, tuple, list, dict)):
        return
    if isinstance(current, bool):
        if type(saved) is not bool:
            fail("not true or false")
    elif isinstance(current, (int, float)):
        if type(saved) not in (int, float) and not (isinstance(saved, Tensor) and saved.numel() == 1):
            fail("not a number")
        if math.isfinite(current) and not _finite(saved):
            fail("not a finite number")
        if current >= 0 and _number(saved) < 0:
            fail("negative where the current value is not")
    elif isinstance(current, str):
        if not isinstance(saved, str):
            fail("not a string")
    elif isinstance(current, Tensor):
        if not (type(saved) in (bool, int, float) or isinstance(saved, Tensor) and saved.shape == current.shape):
            fail(f"not a number or a tensor of shape {list(current.shape)}")
        if current.is_floating_point() and bool(torch.isfinite(current).all()) and not _finite(saved):
            fail("not finite")
    elif isinstance(current, (tuple, list)):
        if not isinstance(saved, (tuple, list)) or isinstance(current, tuple) and len(saved) != len(current):
            fail(f"not a list of {len(current)}")
        if len(saved) == len(current):
            for i, (a, b) in enumerate(zip(saved, current)):
                check_like(a, b, f"{where}[{i}]")
    elif isinstance(current, dict):
        if not isinstance(saved, dict):
            fail("not an object")
        for key in saved.keys() & current.keys():
            check_like(saved[key], current[key], f"{where}[{key!r}]")


def _finite(value) -> bool:
    """A number (or a numeric tensor) whose every value is finite; False for anything else."""
    if type(value) in (int, float):
        return math.isfinite(value)
    if isinstance(value, Tensor) and not value.is_complex() and value.dtype != torch.bool:
        return bool(torch.isfinite(value).all()) if value.is_floating_point() else True
    return False


def _number(value) -> float:
    return float(value) if type(value) in (int, float) else float(value.min()) if value.numel() else 0.0


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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


def check_rng(tensors: dict[str, Tensor], scalars: dict, where: str) -> None:
    """Refuse RNG states that `restore_rng` could not set, by setting them on throwaway generators
    (Note [validate, then apply] in load.py): nothing of this process's RNGs changes."""
    try:
        torch.Generator().set_state(tensors["rng/torch"].to(torch.uint8))
        numpy = scalars["numpy"]
        np.random.RandomState().set_state((numpy["kind"], tensors["rng/numpy"].numpy().astype(np.uint32),
                                           numpy["pos"], numpy["has_gauss"], numpy["cached"]))
        python = scalars["python"]
        random.Random().setstate((python["version"], tuple(int(x) for x in tensors["rng/python"].tolist()),
                                  python["gauss_next"]))
        for index in range(scalars.get("cuda") or 0):
            state = tensors[f"rng/cuda{index}"]
            if state.dim() != 1:
                raise ValueError(f"rng/cuda{index} has shape {list(state.shape)}")
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as error:
        raise ShardwiseError(f"{where}: the saved RNG states cannot be restored ({type(error).__name__}: {error}): "
                             "the checkpoint is damaged. Load an earlier one, or pass restore_rng=False.") from None


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
