"""Rank functions for the checkpoint tests (module level, so `ranks.run` can pickle them).

A "strategy" here is one of sw.STRATEGIES or "none": an unwrapped model. An unwrapped
model on N ranks is N identical replicas, each trained on the whole global batch, so
its checkpoint is written by all N ranks, each its share of the rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import forward_passes, global_batch, make_optimizer, rank_slice

GLOBAL_BATCH = 8


def build_model(name: str, strategy: str, seed: int = 0):
    """Zoo model `name` under `strategy`, and the two-group AdamW of the parity tests. "zero3@2x2" is zero3 on a
    2-D ("replicate", "shard") mesh of 2 x 2 ranks (hybrid sharding, Note [mesh info]); "zero1+host" is zero1 with
    offload="host"."""
    spec = ZOO[name]
    options = {}  # sw.shard's, beside the strategy
    if strategy.endswith("+host"):  # offload="host" (Note [host offload])
        strategy, options["offload"] = strategy[: -len("+host")], "host"
    if "@" in strategy:
        strategy, shape = strategy.split("@")
        options["mesh"] = init_device_mesh("cpu", tuple(int(n) for n in shape.split("x")),
                                        mesh_dim_names=("replicate", "shard"))
    model = build(name, seed)
    ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
    if strategy == "ddp":
        sw.shard(model, strategy="ddp", find_unused_parameters=spec.skips_params)
    elif strategy != "none":
        sw.shard(model, strategy=strategy, units=spec.unit_class, **options)
    return model, make_optimizer(model, ndim_by_name=ndim_by_name)


def run_steps(model, optim, name: str, strategy: str, start: int, end: int) -> list[float]:
    """Steps start..end-1 on this rank's slice of each global batch; the mean loss of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if strategy == "none":
        rank, world = 0, 1  # a replica trains on the whole batch
    losses = []
    for step in range(start, end):
        model.begin_step(step)
        model.zero_grad(set_to_none=True)
        optim.zero_grad(set_to_none=True)
        x, y = rank_slice(global_batch(ZOO[name], step, GLOBAL_BATCH), rank, world)
        loss = forward_passes(model, ZOO[name], x, y)
        loss.backward()
        optim.step()
        value = torch.tensor([loss.item()], dtype=torch.float64)
        if strategy != "none":
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses


def full_optimizer_state(model, optim) -> dict[str, dict]:
    """Every param's optimizer state with full tensors, by name (a collective)."""
    infos = sw.shard_info(model)
    by_id = {id(info.param): (name, info) for name, info in infos.items()}
    mine = {}
    for param, state in optim.state.items():
        name, info = by_id[id(param)]
        entry = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and not (
                    value.dim() == 0 and key == "step"):
                flat = value.reshape(-1) if len(info.full_shape) == 0 else value
                entry[key] = ("rows", info.row_start, flat[: info.row_end - info.row_start].clone())
            else:
                entry[key] = ("scalar", value.clone() if isinstance(value, torch.Tensor) else value)
        mine[name] = (entry, tuple(info.full_shape))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, dict] = {}
    for theirs in everyone:
        for name, (entry, shape) in theirs.items():
            target = out.setdefault(name, {})
            for key, value in entry.items():
                if value[0] == "scalar":
                    target.setdefault(key, value[1])
                    continue
                _, start, rows = value
                full = target.setdefault(key, torch.zeros((shape[0] if shape else 1, *shape[1:]), dtype=rows.dtype))
                full[start : start + rows.shape[0]] = rows
    for name, (_, shape) in mine.items():
        for key, value in out[name].items():
            if isinstance(value, torch.Tensor) and not shape and value.dim() == 1:
                out[name][key] = value.reshape(())
    return out


def save_then_continue(name: str, strategy: str, path: str, steps: int = 3, more: int = 3) -> dict:
    """Train `steps`, save to `path`, train `more`: what was saved and what came after."""
    model, optim = build_model(name, strategy)
    run_steps(model, optim, name, strategy, 0, steps)
    saved = {"params": sw.full_parameters(model), "optim": full_optimizer_state(model, optim)}
    sw.save(path, model, optim, step=steps)
    saved["losses"] = run_steps(model, optim, name, strategy, steps, steps + more)
    saved["final"] = sw.full_parameters(model)
    return saved


def load_then_continue(name: str, strategy: str, path: str, steps: int = 3, more: int = 3) -> dict:
    """A fresh model (another seed) under `strategy`: load `path`, report what was loaded, train `more`."""
    model, optim = build_model(name, strategy, seed=1)
    model.seed = 0  # the saving run's per-step choices (zoo models that draw a branch per step)
    report = sw.load(path, model, optim)
    assert report.ok, str(report)
    assert report.extra == {"step": steps}, report.extra
    loaded = {"params": sw.full_parameters(model), "optim": full_optimizer_state(model, optim)}
    loaded["losses"] = run_steps(model, optim, name, strategy, steps, steps + more)
    loaded["final"] = sw.full_parameters(model)
    return loaded
