"""Counting the memory a training job holds: the bytes behind model state, per rank.

Counts distinct storages (so a tied weight, a gradient that aliases a bucket or a
shard that aliases a full buffer is counted once) reachable from the model's
parameters and gradients, the optimizer's state, and the sharding engine's own
buffers. This is the "model-state bytes" the ZeRO formulas predict.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.optim.lowbit import is_composite
from shardwise.engine.protocol import engine_of


def _storages_of(tensors) -> dict[int, int]:
    found = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _state_tensors(state: dict) -> list:
    """One parameter's optimizer state as plain tensors: a quantized state (torchao's codes, scales and code map,
    Note [low-bit state]) by its parts, which hold its storage (the wrapper itself has none)."""
    tensors = []
    for value in state.values():
        if is_composite(value):
            tensors += [getattr(value, name) for name in value.__tensor_flatten__()[0]]
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
    return tensors


def _model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list:
    tensors = []
    for param in model.parameters():
        tensors += [param, param.grad]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += _state_tensors(state)
    engine = engine_of(model)
    for unit in engine.units if engine is not None else ():
        tensors += [unit.full_flat, unit.shard_flat, unit.grads.full]
    return tensors


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds for parameters, gradients, optimizer state and engine buffers."""
    return sum(_storages_of(_model_state_tensors(model, optimizer)).values())


# Note [placement count]: offload="host" keeps master rows, their gradients and the optimizer state in host memory
# (Note [host offload]); `model_state_by_place` counts each distinct storage of the model state once, as the host's
# or the device's. Where the compute device is not the host (a GPU) the storage's own device says which. Where it
# is (a CPU run: the same memory), the role says: an offloaded unit's parameter rows, their gradients and their
# optimizer state are the host's, everything else (full values, kept full gradients) the device's; the CPU tests
# hold `sw.estimate`'s split to this count.
def model_state_by_place(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"device": bytes, "host": bytes} of the model state `model_state_bytes` counts (Note [placement count])."""
    engine = engine_of(model)
    units = engine.units if engine is not None and engine.shards_rows else []
    on_device = any(unit.device.type != "cpu" for unit in units)
    offloaded = {id(shard) for unit in units if unit.storage.host is not None for shard in unit.shard_params}
    host_roles = [t for p in model.parameters() if id(p) in offloaded for t in (p, p.grad)]
    if optimizer is not None:
        host_roles += [value for p, state in optimizer.state.items() if id(p) in offloaded
                       for value in _state_tensors(state)]
    every = _storages_of(_model_state_tensors(model, optimizer))
    if on_device:
        host = _storages_of(t for t in _model_state_tensors(model, optimizer)
                            if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    else:
        host = _storages_of(host_roles)
    return {"device": sum(n for ptr, n in every.items() if ptr not in host), "host": sum(host.values())}


def resident_model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Like `model_state_bytes`, but offloaded (memory-mapped) state counts only for the
    pages of it this process has resident right now."""
    engine = engine_of(model)
    store = engine.store if engine is not None else None
    tensors = _model_state_tensors(model, optimizer)
    if store is None:
        return sum(_storages_of(tensors).values())
    in_memory = [t for t in tensors if isinstance(t, torch.Tensor) and not store.holds(t)]
    return sum(_storages_of(in_memory).values()) + store.resident_bytes()


def process_rss(field: str = "VmRSS") -> int:
    """This process's resident bytes (`field` of /proc/self/status: VmRSS, or VmHWM for the
    peak); 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
