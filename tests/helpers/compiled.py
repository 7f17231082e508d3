"""Rank functions for the compiled parity tests: a zoo model under `torch.compile`, sharded or not.

Two recipes, as users write them: "whole" compiles the sharded model (`torch.compile(model)`),
"blocks" compiles each unit in place (`block.compile()`, torchtitan's per-block recipe), before
or after `sw.shard`. The reference is one process running the same compiled model on the whole
global batch. Besides the run, each rank reports how often dynamo compiled: the graphs of the
first step, and the graphs added after it (a recompile; Note [compiled] in engine/compat.py).
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import RunResult, make_optimizer, train


def compile_model(model, name: str, recipe: str, backend: str):
    """`model` compiled by `recipe`; the module to call (the OptimizedModule for "whole").
    `backend=None`: not compiled (the eager run a compiled one is compared with)."""
    if backend is None:
        return model
    if recipe == "whole":
        return torch.compile(model, backend=backend)
    unit_class = ZOO[name].unit_class
    for module in model.modules():
        if isinstance(module, unit_class):
            module.compile(backend=backend)
    return model


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _average_over_ranks(value: float) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def compiled_run(strategy: str, name: str, backend: str, recipe: str = "whole", order: str = "after",
                 accum: int = 1, clip: float | None = None, steps: int = 4, global_batch_size: int = 8,
                 shard_kwargs: dict | None = None) -> dict:
    """Train zoo model `name` compiled under `strategy` ("none": one process, the whole batch) for
    `steps` steps; `order` "before" compiles the blocks before `sw.shard`. Returns the run and the
    graph counts: `first` (graphs compiled in step 1), `later` (compiled after it: recompiles)."""
    torch._dynamo.reset()
    counters.clear()
    spec = ZOO[name]
    model = build(name, 0)
    ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
    sharded = strategy != "none"
    kwargs = dict(shard_kwargs or {})
    if strategy == "ddp":
        kwargs.setdefault("find_unused_parameters", spec.skips_params)
    elif sharded:
        kwargs.setdefault("units", spec.unit_class)
    if recipe == "blocks" and order == "before" and backend is not None:
        compile_model(model, name, recipe, backend)
    if sharded:
        sw.shard(model, strategy=strategy, **kwargs)
    call = model if recipe == "blocks" and order == "before" else compile_model(model, name, recipe, backend)
    optimizer = make_optimizer(model, ndim_by_name=ndim_by_name)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    first_step: list[int] = []

    def step() -> None:
        optimizer.step()
        if not first_step:
            first_step.append(_graphs())

    result = train(
        call, spec, steps, global_batch_size, rank=rank, world_size=world_size, accum=accum, clip=clip,
        optimizer=optimizer, step_fn=step,
        no_sync=(lambda: sw.no_sync(model)) if sharded else None,
        clip_fn=(lambda m, c: sw.clip_grad_norm_(model, c)) if sharded else None,
        all_reduce_loss=_average_over_ranks if sharded else None,
        gather_params=(lambda: sw.full_parameters(model)) if sharded else None,
    )
    if not sharded:  # an OptimizedModule's names carry `_orig_mod.`
        result = RunResult(result.losses, result.grad_norms,
                           {n: p.detach().clone() for n, p in model.named_parameters()})
    return {"run": result, "first": first_step[0], "later": _graphs() - first_step[0],
            "breaks": sum(counters["graph_break"].values())}


def llama_run(strategy: str, backend: str, recipe: str, steps: int = 3) -> dict:
    """A tiny Hugging Face Llama built from a config, compiled by `recipe` ("whole", or "blocks": each
    decoder layer), under `strategy` ("none": one process, the whole batch); 3 AdamW steps."""
    import transformers

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    layer_class = type(model.model.layers[0])
    sharded = strategy != "none"
    if sharded:
        sw.shard(model, strategy=strategy, **({} if strategy == "ddp" else {"units": layer_class}))
    call = model
    if recipe == "whole":
        call = torch.compile(model, backend=backend)
    else:
        for module in model.modules():
            if isinstance(module, layer_class):
                module.compile(backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    generator = torch.Generator().manual_seed(1)
    first = None
    for _ in range(steps):
        ids = torch.randint(0, 128, (4, 16), generator=generator)
        mine = ids[rank * 4 // world_size:(rank + 1) * 4 // world_size]
        call(input_ids=mine, labels=mine).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        first = _graphs() if first is None else first
    params = sw.full_parameters(model) if sharded else {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "first": first, "later": _graphs() - first}
