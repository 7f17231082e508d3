"""Each torch internal in engine/compat.py still has the shape the engine relies on: a torch
upgrade that changes one fails here, loudly, instead of switching a guard off in silence."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch.autograd.graph import get_gradient_edge

from shardwise.engine.compat import Reach, reach


def _probe(mode: str) -> list[Reach]:
    seen = []
    leaf, other = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    node = get_gradient_edge(leaf).node

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(reach(node))
            return grad * 2

    loss = Probe.apply(leaf * other).sum()
    if mode == "grad":
        torch.autograd.grad(loss, [leaf])
    elif mode == "grad_of_other":
        torch.autograd.grad(loss, [other])
    else:
        loss.backward()
    return seen


def test_reach_tells_backward_from_autograd_grad():
    """Catches a torch release where `_will_engine_execute_node` changes what it answers: the engine
    would then run the step's reduce for a gradient penalty's autograd.grad (zero3 freed what its
    graph reads), or miss autograd.grad over the parameters."""
    assert _probe("backward") == [Reach.RUNS]
    assert _probe("grad") == [Reach.CAPTURES]
    assert _probe("grad_of_other") == [Reach.SKIPS]


def test_ddp_reads_the_ignore_attribute_first():
    """Catches a torch release whose DistributedDataParallel no longer reads the attribute the
    engine puts on a sharded model (its refusal of a second wrapper would switch off silently)."""
    import torch.distributed as dist
    from torch import nn

    from shardwise.engine.compat import DDP_IGNORE_ATTRIBUTE

    class Read(Exception):
        pass

    class Refuse:
        def __iter__(self):
            raise Read

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.Linear(2, 2)
        setattr(model, DDP_IGNORE_ATTRIBUTE, Refuse())
        with pytest.raises(Read):
            torch.nn.parallel.DistributedDataParallel(model)
    finally:
        dist.destroy_process_group()


def test_reentrant_checkpoint_runs_its_backward_in_the_known_code_object():
    """Catches a torch release that moves the reentrant checkpoint's nested backward elsewhere (the
    engine would no longer see it and would lose its gradients: Note [one backward at a time])."""
    import sys

    from shardwise.engine.compat import REENTRANT_BACKWARD

    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 3

        @staticmethod
        def backward(ctx, grad):
            frame = sys._getframe()
            while frame is not None:
                seen.append(frame.f_code is REENTRANT_BACKWARD)
                frame = frame.f_back
            return grad * 3

    x = torch.randn(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(Spy.apply, x, use_reentrant=True).sum().backward()
    assert any(seen)


def test_graph_task_id_and_the_undecorated_step():
    """Catches a torch release that changes the graph task id outside backward (-1) or drops the
    `__wrapped__` of an optimizer's step (offload would re-enter the step hooks)."""
    from shardwise.engine.compat import graph_task_id, undecorated_step

    assert graph_task_id() == -1
    inside = []
    x = torch.randn(2, requires_grad=True)
    x.register_hook(lambda g: inside.append(graph_task_id()))
    (x * 2).sum().backward()
    assert inside and inside[0] != -1
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert undecorated_step(optimizer) is not type(optimizer).step


def test_preserve_version_counter_keeps_the_counter():
    """Catches a torch release where refilling a tensor under the preserved counter bumps it (autograd
    would then refuse the full views it saved: Note [version counters])."""
    from shardwise.engine.compat import preserve_version_counter

    tensor = torch.zeros(4)
    before = tensor._version
    with preserve_version_counter(tensor):
        tensor.copy_(torch.ones(4))
    assert tensor._version == before and torch.equal(tensor, torch.ones(4))


def test_chunk_cat_lays_gradients_out_rank_major_with_padding(monkeypatch):
    """Catches a torch release that changes `_chunk_cat`'s layout (the reduce-scatter would hand
    each rank another rank's rows): the engine's own per-parameter packing is the reference."""
    import shardwise.engine.comm.collectives as coll
    from shardwise.engine.compat import chunk_cat as compat_chunk_cat

    grads = [torch.randn(5, 3), torch.randn(4), torch.randn(()), torch.randn(1, 2), torch.randn(0, 3),
             torch.randn(3, 2, 2)]
    rows = [5, 4, 1, 1, 0, 3]
    calls = []
    monkeypatch.setattr(coll, "chunk_cat", lambda *a, **k: calls.append(1) or compat_chunk_cat(*a, **k))
    for world in (1, 2, 3, 4):
        per_rank = [-(-r // world) * (g[0].numel() if g.dim() and r else 1) for g, r in zip(grads, rows)]
        segments = [(sum(per_rank[:i]), n) for i, n in enumerate(per_rank)]
        like, total = torch.empty(0), sum(per_rank)
        # chunk_cat's path takes non-empty gradients only: the empty one goes through the copies' path
        full = [i for i, g in enumerate(grads) if g.numel()]
        fast = coll.pack([grads[i] for i in full], [rows[i] for i in full], world, [segments[i] for i in full],
                         total, like)
        flat = coll.pack([grads[i].reshape(-1) for i in full], [rows[i] for i in full], world,
                         [segments[i] for i in full], total, like)  # a 0-D scalar flattened is still one row
        slow = coll.pack(grads + [None], rows + [1], world, segments + [(total, 0)], total, like)
        assert torch.equal(fast, slow) and torch.equal(flat, slow), world
        for with_none in (False, True):  # into zero1's kept buffer, through either path, stale values overwritten
            out = torch.full((world * total,), float("nan"))
            picked = [grads[i] for i in full] + [None] * with_none
            into = coll.pack(picked, [rows[i] for i in full] + [1] * with_none, world,
                             [segments[i] for i in full] + [(total, 0)] * with_none, total, like, out=out)
            assert into.data_ptr() == out.data_ptr() and torch.equal(out, slow), (world, with_none)
    assert len(calls) == 4 * 3, calls  # fast, flat and the out= without None, at each world size


def test_shard_parameters_take_the_optimizers_foreach_kernels(monkeypatch):
    """Catches a torch release that moves or renames the lists of types its optimizers run foreach
    kernels for (compat.allow_foreach): a sharded model would then step in the per-tensor loop on
    CUDA while DDP's plain parameters take the foreach kernels. torch picks foreach only for CUDA-like
    devices, so the device list is widened to the CPU here to ask the very function AdamW asks."""
    import torch.optim.optimizer as optimizer_module

    from shardwise.engine.unit.shard_param import ShardParameter

    shard = torch.nn.Parameter(torch.zeros(3))
    shard.__class__ = ShardParameter
    monkeypatch.setattr(optimizer_module, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    assert optimizer_module._default_to_fused_or_foreach([shard], differentiable=False) == (False, True)
    # and the step itself is the foreach one: it names its tensor lists, which the per-tensor loop never does
    calls = []
    real = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *a, **k: calls.append(1) or real(*a, **k))
    shard.grad = torch.ones(3)
    torch.optim.AdamW([shard], lr=0.1).step()
    assert calls and torch.all(shard.detach() < 0)


def test_step_error_hooks_see_a_raising_step_of_classes_made_before_and_after():
    """Catches a torch release that stops wrapping each optimizer class's step through
    `Optimizer.profile_hook_step` (compat.on_step_error, Note [raising step]): a whole-tensor step
    that raises on one rank would then leave its peers waiting in the broadcast."""
    from torch.optim.optimizer import Optimizer

    from shardwise.engine import compat

    class Before(Optimizer):
        def step(self, closure=None):
            raise ValueError("before")

    Before([torch.nn.Parameter(torch.zeros(1))], {})  # torch wraps its step now, before the hook exists
    seen = []
    compat.on_step_error(lambda optimizer, error: seen.append((type(optimizer).__name__, str(error))))
    try:
        class After(Optimizer):
            def step(self, closure=None):
                raise ValueError("after")

        for kind in (Before, After):
            optimizer = kind([torch.nn.Parameter(torch.zeros(1))], {})
            compat.guard_step(optimizer)
            with pytest.raises(ValueError):
                optimizer.step()
            assert not hasattr(compat.undecorated_step(optimizer), "__wrapped__")  # the step under both wrappers
    finally:
        compat._STEP_ERROR_HOOKS.pop()
    assert seen == [("Before", "before"), ("After", "after")]


def test_no_torch_distributed_call_is_a_deprecated_one():
    """Catches a call of a torch.distributed function that this torch marks deprecated (2.13:
    `all_gather_into_tensor`, `reduce_scatter_tensor`): its FutureWarning reaches every user's
    output, and the next torch removes the function. Every `dist.NAME(` in the library, the benches
    and the examples is looked up on this torch."""
    import re
    from pathlib import Path

    import torch.distributed as dist

    root = Path(__file__).resolve().parents[1]
    called = {}
    for folder in ("src", "bench", "examples"):
        for path in (root / folder).rglob("*.py"):
            for name in re.findall(r"\b(?:dist|torch\.distributed)\.([a-z_]+)\(", path.read_text()):
                called.setdefault(name, path.relative_to(root))
    assert "all_gather_single" in called, "the scan found none of the engine's calls"
    deprecated = {name: str(where) for name, where in called.items()
                  if getattr(getattr(dist, name, None), "__deprecated__", None)}
    assert deprecated == {}, f"deprecated torch.distributed calls (use the *_single forms): {deprecated}"


def test_unwrap_compiled_finds_the_module_torch_compile_wrapped():
    """Catches a torch release that renames OptimizedModule or its module, or stops keeping the module as
    `_orig_mod`: every sw.* function would then take the compiled handle for an unsharded model."""
    from torch import nn

    from shardwise.engine.compat import unwrap_compiled

    module = nn.Linear(2, 2)
    assert unwrap_compiled(torch.compile(module, backend="eager")) is module
    assert unwrap_compiled(module) is module
    lookalike = nn.Module()
    lookalike._orig_mod = module  # a user attribute of that name is not a compiled handle
    assert unwrap_compiled(lookalike) is lookalike


def test_swap_storage_memory_moves_memory_between_storage_objects():
    """Catches torch changing UntypedStorage._swap_data_ptr_ (the comm pool's way to keep a zero3 unit's freed
    memory for its next gather, Note [reused buffers]): a view of the storage sees the memory swapped back in,
    and the storage is empty while the pool holds it."""
    from shardwise.engine.compat import swap_storage_memory

    full = torch.arange(8, dtype=torch.float32)
    view = full[2:6].view(2, 2)
    spare = torch.UntypedStorage(0)
    swap_storage_memory(spare, full.untyped_storage())
    assert full.untyped_storage().nbytes() == 0 and spare.nbytes() == 32
    swap_storage_memory(full.untyped_storage(), spare)
    assert spare.nbytes() == 0 and view.tolist() == [[2.0, 3.0], [4.0, 5.0]]
