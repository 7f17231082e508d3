"""The engine-free zero3 route: make demo's GPT sharded per block with plain torch.distributed and minimal Python,
the arms "manual_zero3" and "manual_zero3_gloo" of bench/overhead/demo_gpt.py (Note [engine-free route]).

Note [engine-free route]: what the per-block zero3 route itself costs over DDP on this host, apart from the engine.
Each block, and the root (the embeddings, the tied head, ln_f), is one unit: its parameters flattened into one
buffer, padded to a multiple of the world size, each rank keeping its contiguous 1/N of it (a flat shard, as FSDP1;
the engine keeps every parameter's own dim-0 rows so names and shapes stay). A block's full buffer is gathered
before its forward and again before its backward (a hook on the block's output gradient); the root once, before the
forward. The parameters the modules read are `torch.split` views of the full buffer, a leaf that requires grad, so
autograd's split backward leaves each unit's whole gradient in one flat `full.grad`; its post-accumulate hook issues
the unit's reduce-scatter (averaging) asynchronously, and the clip waits for all of them. Clipping is the global
norm of the shards' gradients (one all-reduce), and AdamW steps the flat shards (7 tensors where DDP and the engine
step 70). Its bound is from below in one respect: each unit's full buffer stays allocated (a perfect buffer pool),
so no gather pays for fresh pages, nor the all-to-all's receive buffer; its traffic, copies and collectives are the
route's. Forms: "torch" gathers with `all_gather_single` and reduces with `reduce_scatter_single` (NCCL's
forms; on gloo the slow ones, Note [gloo collectives] in engine/comm/collectives.py); "gloo" with what the engine
uses on gloo: one broadcast per rank straight into the full buffer, and an all-to-all whose copies this rank sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn


class FlatUnit:
    """One unit of the engine-free route: its parameters as one flat full buffer and this rank's flat shard."""

    def __init__(self, modules: list[nn.Module], forms: str) -> None:
        self.world, self.rank, self.forms = dist.get_world_size(), dist.get_rank(), forms
        params, self.holders = {}, {}  # id -> parameter; id -> [(module, attribute)]: a tied weight once
        for module in modules:
            for name, param in module.named_parameters(recurse=False):
                params.setdefault(id(param), param)
                self.holders.setdefault(id(param), []).append((module, name))
        self.shapes = [p.shape for p in params.values()]
        self.holders = list(self.holders.values())
        numel = sum(p.numel() for p in params.values())
        self.rows = -(-numel // self.world)  # this rank's elements
        self.sizes = [p.numel() for p in params.values()] + [self.world * self.rows - numel]  # padding last
        self.full = torch.zeros(self.world * self.rows)
        with torch.no_grad():
            torch.cat([p.reshape(-1) for p in params.values()], out=self.full[:numel])
        self.shard = nn.Parameter(self.full[self.rank * self.rows:(self.rank + 1) * self.rows].clone())
        self.full.requires_grad_(True)
        self.full.register_post_accumulate_grad_hook(self._reduce)
        self.received = torch.empty(self.world * self.rows) if forms == "gloo" else None  # kept, as `full` is
        self.pending = None

    def gather(self, *_unused) -> None:
        """Every rank's shard into the full buffer; autograd's saved views of it see the values (not a write)."""
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            if self.forms == "torch":
                dist.all_gather_single(self.full, self.shard.detach())
                return
            by_rank = self.full.view(self.world, self.rows)
            by_rank[self.rank].copy_(self.shard)
            works = [dist.broadcast(by_rank[r], src=r, async_op=True) for r in range(self.world)]
            for work in works:
                work.wait()

    def install(self) -> None:
        """The modules' parameters become views of the gathered full buffer (their gradients flow into it)."""
        for view, shape, holders in zip(torch.split(self.full, self.sizes), self.shapes, self.holders):
            view = view.view(shape)
            for module, attribute in holders:
                module._parameters[attribute] = view

    def _reduce(self, full: Tensor) -> None:
        grad, full.grad = full.grad, None
        out = torch.empty(self.rows)
        if self.forms == "torch":
            self.pending = (dist.reduce_scatter_single(out, grad, op=dist.ReduceOp.AVG, async_op=True), out, None)
        else:
            self.pending = (dist.all_to_all_single(self.received, grad, async_op=True), out, self.received)

    def land(self) -> None:
        """Wait for the reduce; the averaged rows are the shard's gradient."""
        work, out, received = self.pending
        self.pending = None
        work.wait()
        if received is not None:  # gloo's form: every rank's copy of this rank's rows, summed here
            torch.sum(received.view(self.world, self.rows), dim=0, out=out).div_(self.world)
        self.shard.grad = out if self.shard.grad is None else self.shard.grad.add_(out)


class ManualZero3:
    """The demo's GPT under the engine-free route: the blocks and the root as FlatUnits, with hooks."""

    def __init__(self, model: nn.Module, forms: str) -> None:
        inside = {id(m) for block in model.blocks for m in block.modules()}
        rest = [m for m in model.modules() if id(m) not in inside]
        self.root = FlatUnit(rest, forms)
        self.blocks = [FlatUnit(list(block.modules()), forms) for block in model.blocks]
        self.units = [self.root, *self.blocks]
        model.register_forward_pre_hook(lambda *_: self._use(self.root))
        for block, unit in zip(model.blocks, self.blocks):
            block.register_forward_pre_hook(lambda *_, unit=unit: self._use(unit))
            block.register_forward_hook(lambda _m, _i, out, unit=unit: self._before_backward(unit, out))

    def shards(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    @staticmethod
    def _use(unit: FlatUnit) -> None:
        unit.gather()
        unit.install()

    @staticmethod
    def _before_backward(unit: FlatUnit, out: Tensor) -> None:
        if out.requires_grad:
            out.register_hook(unit.gather)  # the block's backward runs once its output's gradient is in

    def clip(self, max_norm: float) -> Tensor:
        """Wait for every reduce, then scale the shards' gradients by the global norm (one all-reduce)."""
        for unit in self.units:
            unit.land()
        grads = [unit.shard.grad for unit in self.units]
        total = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        dist.all_reduce(total)
        norm = total.sqrt()
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        return norm


def build(model: nn.Module, forms: str, lr: float):
    """(module, optimizer, clip) for bench/overhead/demo_gpt.py's arm: AdamW with the demo's settings on the shards."""
    route = ManualZero3(model, forms)
    return model, torch.optim.AdamW(route.shards(), lr=lr, weight_decay=0.1), lambda: route.clip(1.0)
