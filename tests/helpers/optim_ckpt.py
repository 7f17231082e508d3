"""Rank functions for the checkpoints of optimizers whose state is not row-shaped (module level,
so `ranks.run` can pickle them): Muon + AdamW (two optimizers), Hugging Face's Adafactor (row and
column factors), and BlockQuant, a small block-quantized momentum (int8 codes, a scale per block).

A "strategy" is one of sw.STRATEGIES or "none" (an unwrapped model: each rank a replica trained
on the whole global batch).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import forward_passes, global_batch, rank_slice

MODEL = "reused_block"  # a block used 3 times per forward (2-D weights, 1-D biases), a head: as the whole-tensor tests
GLOBAL_BATCH = 8


class BlockQuant(torch.optim.Optimizer):
    """SGD with a momentum kept block-quantized, as 8-bit optimizers keep their moments: the
    flattened momentum in blocks of `block` elements, each an int8 code times its block's fp32
    scale. Its state: `codes` (parameter-shaped, int8), `scales` (one per block: another shape)."""

    def __init__(self, params, lr=1e-2, momentum=0.9, block=16):
        super().__init__(params, {"lr": lr, "momentum": momentum, "block": block})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            block = group["block"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                blocks = math.ceil(p.numel() / block)
                if not state:
                    state["step"] = 0
                    state["codes"] = torch.zeros_like(p, dtype=torch.int8)
                    state["scales"] = torch.zeros(blocks, dtype=torch.float32)
                flat = torch.zeros(blocks * block)
                flat[: p.numel()] = state["codes"].reshape(-1).float()
                momentum = (flat.view(blocks, block) * state["scales"][:, None]).reshape(-1)[: p.numel()]
                momentum = momentum * group["momentum"] + p.grad.reshape(-1)
                padded = torch.zeros(blocks * block)
                padded[: p.numel()] = momentum
                scales = padded.view(blocks, block).abs().amax(dim=1) / 127 + 1e-12
                codes = torch.round(padded.view(blocks, block) / scales[:, None]).clamp(-127, 127)
                state["codes"] = codes.reshape(-1)[: p.numel()].to(torch.int8).view(p.shape)
                state["scales"] = scales
                state["step"] += 1
                p.add_((codes * scales[:, None]).reshape(-1)[: p.numel()].view(p.shape), alpha=-group["lr"])


def make_optimizers(model, name: str, ndim: dict[str, int]):
    """`name`'s optimizers: one, or a dict of two (what sw.save and sw.load are given)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name in ("muon", "muon_swapped"):  # swapped: the first two matrices in the other order (other owners)
        matrices = [p for n, p in params if ndim[n] == 2]
        if name == "muon_swapped":
            matrices[:2] = matrices[1::-1]
        rest = [p for n, p in params if ndim[n] != 2]
        return {"muon": torch.optim.Muon(matrices, lr=0.02),
                "adamw": torch.optim.AdamW(rest, lr=1e-2, eps=1e-3)}
    if name == "hf_adafactor":  # what Trainer(optim="adafactor") builds
        from transformers.optimization import Adafactor
        return Adafactor([p for _, p in params], lr=1e-2, scale_parameter=False, relative_step=False)
    if name == "blockq":
        return BlockQuant([p for _, p in params])
    raise ValueError(name)


def build_run(name: str, strategy: str, seed: int = 0):
    """The zoo model under `strategy` and `name`'s optimizers, built after shard()."""
    spec = ZOO[MODEL]
    model = build(MODEL, seed)
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    if strategy == "ddp":
        sw.shard(model, strategy="ddp", find_unused_parameters=spec.skips_params)
    elif strategy != "none":
        sw.shard(model, strategy=strategy, units=spec.unit_class)
    return model, make_optimizers(model, name, ndim)


def _each(optim):
    return list(optim.values()) if isinstance(optim, dict) else [optim]


def run_steps(model, optim, strategy: str, start: int, end: int) -> list[float]:
    """Steps start..end-1 on this rank's slice of each global batch; the mean loss of each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if strategy == "none":
        rank, world = 0, 1
    losses = []
    for step in range(start, end):
        model.begin_step(step)
        for one in _each(optim):
            one.zero_grad(set_to_none=True)
        x, y = rank_slice(global_batch(ZOO[MODEL], step, GLOBAL_BATCH), rank, world)
        loss = forward_passes(model, ZOO[MODEL], x, y)
        loss.backward()
        for one in _each(optim):
            one.step()
        value = torch.tensor([loss.item()], dtype=torch.float64)
        if strategy != "none":
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
    return losses


def save_then_continue(name: str, strategy: str, path: str) -> dict:
    """3 steps, save, 3 more: the losses and parameters after the save (the uninterrupted run)."""
    model, optim = build_run(name, strategy)
    run_steps(model, optim, strategy, 0, 3)
    sw.save(path, model, optim, step=3)
    losses = run_steps(model, optim, strategy, 3, 6)
    return {"losses": losses, "final": sw.full_parameters(model)}


def load_then_continue(name: str, strategy: str, path: str) -> dict:
    """A fresh model (another seed) and fresh optimizers: load, then the 3 steps after the save."""
    model, optim = build_run(name, strategy, seed=1)
    model.seed = 0
    report = sw.load(path, model, optim)
    assert report.ok and report.extra == {"step": 3}, str(report)
    losses = run_steps(model, optim, strategy, 3, 6)
    return {"losses": losses, "final": sw.full_parameters(model)}


def load_into(path: str, strategy: str, optim_name: str, step_first: bool = False) -> str:
    """Load `path` into the optimizers `optim_name` builds (after one step of theirs with `step_first`: their
    whole-tensor owners then taken); the error's message, or "loaded"."""
    model, optim = build_run(optim_name, strategy, seed=1)
    if step_first:
        run_steps(model, optim, strategy, 0, 1)
    try:
        sw.load(path, model, optim)
    except sw.ShardwiseError as error:
        return str(error)
    return "loaded"
