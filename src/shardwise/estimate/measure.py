"""Counting the memory a training job holds: the bytes behind model state, per rank.

Counts distinct storages (so a tied weight, a gradient that aliases a bucket or a
shard that aliases a full buffer is counted once) reachable from the model's
parameters and gradients, the optimizer's state, and the sharding engine's own
buffers. This is the "model-state bytes" the ZeRO formulas predict.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.engine.protocol import engine_of


def _storages_of(tensors) -> dict[int, int]:
    found = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage.nbytes():
                found[storage.data_ptr()] = storage.nbytes()
    return found


def _model_state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list:
    tensors = []
    for param in model.parameters():
        tensors += [param, param.grad]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    engine = engine_of(model)
    for unit in engine.units if engine is not None else ():
        tensors += [unit.full_flat, unit.shard_flat, unit.grads.full]
    return tensors


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes this rank holds for parameters, gradients, optimizer state and engine buffers."""
    return sum(_storages_of(_model_state_tensors(model, optimizer)).values())


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
