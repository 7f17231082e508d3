"""`strategy="zero1" | "zero2" | "zero3"`: three policies over one mechanism (flat_unit.py).

| stage | full params                    | full grads                          |
|-------|--------------------------------|-------------------------------------|
| zero1 | kept                           | kept until the step (reduced as ready) |
| zero2 | kept                           | reduce-scattered per unit, freed    |
| zero3 | gathered per window, freed     | as zero2                            |

Optimizer state is always sharded: the optimizer only ever sees shards.

Per step, per unit (Note [unit window]): the unit's first forward call gathers it if
needed and runs `_GatherUnit`, an autograd function whose outputs are the full
parameter views. Every later use of the unit in the same forward (a block reused N
times, a shared module called from two branches) uses those same tensors, so
autograd sums every use's gradient and runs `_GatherUnit.backward` exactly once, after
the last use: that is where the unit's gradients are reduced. A unit no rank used this
step still takes part in the reduce, with zeros, at the end of backward, in a fixed
order, so nobody waits on a collective that never comes.

zero1/zero2 re-gather a unit lazily, at its next forward, when the optimizer has
changed its rows (the full buffer's version counter moved): no call to remember.

Note [collective order]: gloo and NCCL pair collectives by their order of issue, so
every rank must issue the same sequence even when ranks take different branches.
zero1/zero2 therefore issue their re-gathers, and all stages their reduce-scatters,
in one fixed unit order (forward: registration order; backward: its reverse); a unit
whose turn comes before it is ready holds back the ones after it, never reorders
them. zero3's forward gathers follow the forward itself, so zero3 requires every rank
to run the same units in each step (as FSDP does); parameters unused by every rank
and branches inside a unit may still differ.
"""

from __future__ import annotations

import collections
import hashlib
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from shardwise import _collectives as coll
from shardwise.errors import ShardwiseError
from shardwise.flat_unit import FlatUnit
from shardwise.offload import parse_offload, register_offloaded
from shardwise.deferred import is_deferred, record, replay
from shardwise.precision import MixedPrecision, resolve_precision
from shardwise.units import UnitSpec, build_units

# Reduce-scatters allowed in flight during backward. One overlaps the previous unit's
# reduce with this unit's backward compute, as FSDP2 does; a second kept one more packed
# unit-sized gradient buffer alive at the backward peak (bench/max_model.py: zero3's peak
# 815-825 MiB with 2, 805 with 1, FSDP2 803) for no step-time gain we could measure.
_MAX_PENDING_REDUCES = 1


class _GatherUnit(torch.autograd.Function):
    """Forward: hand out the unit's full views. Backward: give the full grads to the engine."""

    @staticmethod
    def forward(ctx, state, unit, *trainable_shards):
        ctx.state, ctx.unit, ctx.num_shards = state, unit, len(trainable_shards)
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not zeros
        # Fresh view objects every window: autograd attaches this window's graph to them,
        # and a view reused from an earlier window would carry that window's history.
        outputs = tuple(view.view(view.shape) for view in unit.full_views)
        frozen = [out for out, shard in zip(outputs, unit.shard_params) if not shard.requires_grad]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.on_unit_grads(ctx.unit, list(grads))
        return (None, None) + (None,) * ctx.num_shards


class ZeroState:
    """What `shard(..., strategy="zero*")` attaches to the model as `model._shardwise`."""

    def __init__(self, model: nn.Module, strategy: str, units: UnitSpec, group, precision: MixedPrecision,
                 init_fn=None, checkpoint_activations: bool = False, offload: str | None = None):
        self.strategy = strategy
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        plans = build_units(model, units)
        self.module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        _check_same_model_on_every_rank(model, group)
        keep_full = strategy in ("zero1", "zero2")
        self.precision = precision
        if offload is not None and strategy != "zero3":
            raise ShardwiseError(f"offload needs strategy='zero3' ({strategy} keeps full parameters in memory, "
                                 "which is most of what offload would move)")
        self.store = parse_offload(offload, self.rank)
        # Deferred: meta aliases of the parameters, by name, for the init replay below.
        deferred = {n: p.detach() for n, p in model.named_parameters()} if is_deferred(model) else None
        extra_log = record(lambda: init_fn(model)) if deferred is not None and init_fn is not None else None
        self.units = []
        for plan in plans:  # one unit at a time: zero3's peak is one unit's full values
            unit = FlatUnit(plan, rank=self.rank, world_size=self.world_size, group=group,
                            keep_full=keep_full, keep_full_grad=strategy == "zero1", precision=precision,
                            store=self.store)
            if deferred is None:
                _broadcast_from_rank0(unit, group)
            unit.take_shards()
            self.units.append(unit)
        if deferred is not None:
            # Every rank replays the same recorded init from the same RNG state, so the values
            # agree without a broadcast; each keeps its rows as each parameter is finished.
            where = {l.owned.name: (u, i) for u in self.units for i, l in enumerate(u.layouts)}
            replay(deferred, lambda name, value: where[name][0].set_value(where[name][1], value),
                   device=self.units[0].device, extra_log=extra_log)
        if self.store is not None:
            for unit in self.units:
                self.store.release(unit.shard_flat)  # written once; the step pages it back in
            register_offloaded(self.store, [unit.shard_params for unit in self.units])
        if precision.buffer_dtype is not None:
            for buffer in model.buffers():
                if buffer.is_floating_point():
                    buffer.data = buffer.data.to(precision.buffer_dtype)
        self.root = self.units[0]
        # Note [collective order]: reduce-scatters get their own group, so their sequence
        # never interleaves with zero3's backward gathers in a rank-dependent way. (A new
        # group needs every rank of the default group, so a user's subgroup is reused.)
        reduce_group = dist.new_group(backend=dist.get_backend(group)) if group == dist.group.WORLD else group
        for unit in self.units:
            unit.reduce_group = reduce_group
        self._max_in_flight = 2 if keep_full else 1  # zero3: current + one prefetched
        self.reduce_order = list(reversed(self.units))  # Note [collective order]
        self.sync_grads = True
        self.peak_resident_units = 0  # most non-root units gathered at once (zero3 memory check)
        self._reset_step()
        if precision.param_dtype != torch.float32:
            self.root.module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)
        if checkpoint_activations:
            for unit in self.units[1:]:
                _checkpoint_forward(unit.module)
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
            unit.module.register_forward_hook(self._make_post_forward(unit))

    # ---- per-step bookkeeping ----------------------------------------------------

    def _reset_step(self) -> None:
        self.windowed: set[int] = set()  # units whose _GatherUnit ran in this forward
        self.open_units: list[FlatUnit] = []
        self.prefetching: dict[int, tuple[FlatUnit, coll.Pending]] = {}  # in-flight gathers
        self.gather_queue: list[FlatUnit] = []  # forward: units to gather, in fixed order, not yet issued
        self.backward_queue: list[FlatUnit] = []  # zero3 backward: the same, in reverse order
        self.reduced: set[int] = set()
        self.ready_grads: dict[int, list] = {}  # units whose grads wait for their turn to reduce
        self.next_reduce = 0  # position in self.reduce_order
        self.pending_reduces: collections.deque = collections.deque()
        self.callback_queued = False
        self.in_window = False

    def _cast_inputs(self, module, args, kwargs):
        """Floating inputs follow the compute dtype (as FSDP2 casts forward inputs); integer
        inputs such as token ids are left alone."""
        def cast(value):
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(self.precision.param_dtype)
            return value
        from torch.utils._pytree import tree_map
        return tree_map(cast, args), tree_map(cast, kwargs)

    def _make_pre_forward(self, unit: FlatUnit):
        def hook(module, args):
            if unit is self.root:
                self._begin_forward()
            self.open_units.append(unit)
            if id(unit) not in self.windowed:
                self._open_window(unit)
        return hook

    def _make_post_forward(self, unit: FlatUnit):
        def hook(module, args, output):
            self.open_units.pop()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
            if unit is self.root:
                self._end_forward()
            return output
        return hook

    def _begin_forward(self) -> None:
        if self.in_window:  # the previous forward never ran backward (evaluation, a dropped loss)
            self._close_window()
        self._reset_step()
        self.in_window = True
        # The same list on every rank (zero3: every unit; zero1/2: units the step changed).
        self.gather_queue = [u for u in self.units if u.needs_gather()]

    def _open_window(self, unit: FlatUnit) -> None:
        self._ensure_gathered(unit)
        trainable = [unit.shard_params[i] for i in unit.trainable()]
        if trainable:
            fulls = _GatherUnit.apply(self, unit, *trainable)
        else:  # nothing to differentiate (frozen unit): plain fresh views, no backward hook
            fulls = [view.view(view.shape) for view in unit.full_views]
        unit.install_full(list(fulls))
        self.windowed.add(id(unit))
        if not unit.keep_full:
            self._free_idle(keep={id(unit)})
        self._issue_queued(self.gather_queue, up_to=None)

    def _end_forward(self) -> None:
        self._drain(self.gather_queue)  # units this rank did not run still take their gather
        if not self.root.keep_full:
            # The last unit is usually the first one backward needs: keep it (as FSDP2 keeps
            # its root), one gather fewer per step. "Last" by registration, not by this
            # rank's forward, so every rank keeps the same one (Note [collective order]).
            last = {id(self.units[-1])} if torch.is_grad_enabled() else set()
            self._free_idle(keep={id(self.root)} | last)
            self.backward_queue = [u for u in reversed(self.units) if not u.resident]
        if not torch.is_grad_enabled():
            self._close_window()

    def _drain(self, queue: list[FlatUnit]) -> None:
        while queue or self.prefetching:
            self._issue_queued(queue, up_to=None)
            for unit, handle in list(self.prefetching.values()):
                del self.prefetching[id(unit)]
                unit.finish_gather(handle)  # freed (or kept) by the caller, the same on every rank

    # ---- gathering ---------------------------------------------------------------

    def _issue_queued(self, queue: list[FlatUnit], up_to: FlatUnit | None) -> None:
        """Issue queued gathers in their fixed order, through `up_to` if given, else just
        enough to keep the policy's number in flight (Note [collective order])."""
        while queue:
            if up_to is None and len(self.prefetching) >= self._max_in_flight:
                return
            unit = queue.pop(0)
            self.prefetching[id(unit)] = (unit, unit.start_gather(async_op=True))
            if unit is up_to:
                return

    def _ensure_gathered(self, unit: FlatUnit, queue: list[FlatUnit] | None = None) -> None:
        queue = self.gather_queue if queue is None else queue
        if unit in queue:
            self._issue_queued(queue, up_to=unit)
        if id(unit) in self.prefetching:
            # Gathers land in issue order: those queued before this unit first. A zero3 unit
            # among them that is not running is one this rank skipped: drop it again.
            for other, handle in list(self.prefetching.values()):
                del self.prefetching[id(other)]
                other.finish_gather(handle)
                if other is unit:
                    break
                if not other.keep_full and not any(other is u for u in self.open_units):
                    other.free()
        elif unit.needs_gather():
            unit.finish_gather(unit.start_gather(async_op=False))
        if not unit.keep_full:
            resident = sum(1 for u in self.units if u is not self.root and u.resident)
            self.peak_resident_units = max(self.peak_resident_units, resident)

    def _free_idle(self, keep: set[int]) -> None:
        busy = keep | {id(u) for u in self.open_units} | set(self.prefetching)
        for unit in self.units:
            if id(unit) not in busy:
                unit.free()

    # ---- backward ----------------------------------------------------------------

    def _pre_backward(self, unit: FlatUnit) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if id(unit) in self.reduced:
            return
        self._ensure_gathered(unit, self.backward_queue)
        self._issue_queued(self.backward_queue, up_to=None)  # prefetch the next one

    def on_unit_grads(self, unit: FlatUnit, grads: list) -> None:
        """All uses of `unit` in this step have their gradients: reduce or accumulate them."""
        if not self.callback_queued:  # a graph that reached no unit output hook
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if not unit.keep_full and unit is not self.root:
            # Every use's backward has run: the full values are no longer needed. Freed before
            # the reduce packs the gradients, so the two are never held together (one unit's
            # worth less at the backward peak; bench/max_model.py).
            unit.free()
        if not self.sync_grads:
            unit.accumulate(grads)
        else:
            # zero1 keeps its full grads; zero2/zero3 have some only after no_sync micro-batches.
            # Either way the reduce starts now, overlapping the rest of backward.
            if unit.keep_full_grad or unit.full_grad is not None:
                unit.accumulate(grads)
                grads = unit.full_grad_list()
            self.ready_grads[id(unit)] = grads
            self._launch_ready_reduces()

    def _launch_ready_reduces(self) -> None:
        """Reduce ready units in the fixed order, stopping at the first not ready yet."""
        while self.next_reduce < len(self.reduce_order):
            unit = self.reduce_order[self.next_reduce]
            if id(unit) not in self.ready_grads:
                return
            self._launch_reduce(unit, self.ready_grads.pop(id(unit)))
            self.next_reduce += 1

    def _launch_reduce(self, unit: FlatUnit, grads: list) -> None:
        self.reduced.add(id(unit))
        if not unit.trainable():
            return
        while len(self.pending_reduces) >= _MAX_PENDING_REDUCES:
            self._finish_oldest_reduce()
        pending, indices = unit.start_reduce(grads, async_op=True)
        self.pending_reduces.append((unit, pending, indices))

    def _finish_oldest_reduce(self) -> None:
        unit, pending, indices = self.pending_reduces.popleft()
        unit.finish_reduce(pending, indices)
        unit.end_accumulation()

    def _end_backward(self) -> None:
        self._drain(self.backward_queue)  # units this rank's backward never reached
        if self.sync_grads:
            # Units not reduced yet: zero1's kept grads, and units unused this step on this
            # rank (zeros). Same fixed order as during backward (Note [collective order]).
            for unit in self.reduce_order[self.next_reduce :]:
                grads = self.ready_grads.pop(id(unit), None)
                if grads is None:
                    grads = unit.full_grad_list()
                self._launch_reduce(unit, grads)
            while self.pending_reduces:
                self._finish_oldest_reduce()
        self._close_window()

    def _close_window(self) -> None:
        for unit, handle in self.prefetching.values():
            unit.finish_gather(handle)  # a gather in flight must land before its buffers go
        for unit in self.units:
            unit.install_shards()
            unit.free()
        self._reset_step()

    # ---- user-facing helpers -----------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Skip the reduce: full gradients accumulate locally (zero2/zero3 then hold full
        gradients, 4 bytes per parameter, until the synced backward; zero1 always does)."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Global gradient norm over every rank's shards (padding rows are zero), then scale."""
        grads = [s.grad for u in self.units for s in u.shard_params if s.grad is not None]
        norm_type = float(norm_type)
        if norm_type == float("inf"):
            local = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).clone().float()
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            total = local
        else:
            local = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0, dtype=torch.float64))
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.group)
            total = local.pow(1.0 / norm_type).float()
        # The same coefficient torch.nn.utils.clip_grad_norm_ computes, so results match it.
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    def shard_info(self) -> dict:
        from shardwise.strategies import ShardInfo

        info = {}
        for unit in self.units:
            for layout, shard in zip(unit.layouts, unit.shard_params):
                start = min(self.rank * layout.rows_per_rank, layout.rows)
                end = min(start + layout.rows_per_rank, layout.rows)
                names = [f"{_prefix_of(module, self.module_names)}{attribute}" for module, attribute in layout.owned.holders]
                info[layout.owned.name] = ShardInfo(shard, layout.shape, start, end,
                                                    tuple(n for n in names if n != layout.owned.name))
        return info

    def full_parameters(self) -> dict[str, torch.Tensor]:
        values: dict[str, torch.Tensor] = {}
        for unit in self.units:
            values.update(unit.gather_copy())
        return values


def _checkpoint_forward(module: nn.Module) -> None:
    """Keep only the unit's inputs in forward and recompute it in backward.

    The unit's own hooks stay outside the checkpoint: the recompute calls the original
    forward directly, after the unit's pre-backward hook has gathered it again, and its
    uses of the full views feed the same `_GatherUnit` node as the first forward's."""
    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def _prefix_of(module: nn.Module, module_names: dict[int, str]) -> str:
    name = module_names[id(module)]
    return f"{name}." if name else ""


def _check_same_model_on_every_rank(model: nn.Module, group) -> None:
    """Fail at shard() — not with a hang mid-step — when ranks built different models.

    Ranks first compare a hash of (name, shape, dtype) of every parameter: one small
    all-gather. Only when the hashes differ are the full lists exchanged, to name the
    first differing parameter (all_gather_object costs ~4 MB of RSS on first use)."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]
    digest = hashlib.sha256(repr(mine).encode()).digest()
    signature = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64)
    signatures = [torch.zeros_like(signature) for _ in range(dist.get_world_size(group))]
    dist.all_gather(signatures, signature, group=group)
    if all(torch.equal(s, signatures[0]) for s in signatures):
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for index in range(max(len(theirs), len(reference))):
            a = reference[index] if index < len(reference) else None
            b = theirs[index] if index < len(theirs) else None
            if a != b:
                raise ShardwiseError(
                    f"ranks 0 and {rank} built different models: parameter #{index} is "
                    f"{_describe(a)} on rank 0 but {_describe(b)} on rank {rank}. Build the model "
                    "from the same code and config on every rank (only the data should differ)."
                )


def _describe(entry) -> str:
    if entry is None:
        return "absent"
    name, shape, dtype = entry
    return f"{name!r} shape {list(shape)} {dtype}"


def _broadcast_from_rank0(unit: FlatUnit, group) -> None:
    """Every rank starts from rank 0's values (as DDP does), one unit at a time."""
    with torch.no_grad():
        for layout in unit.layouts:
            dist.broadcast(layout.owned.param.data, src=dist.get_global_rank(group, 0), group=group)


def apply_zero(model: nn.Module, strategy: str, units: UnitSpec, process_group, precision,
               init_fn=None, checkpoint_activations: bool = False, offload: str | None = None) -> ZeroState:
    """Shard `model` in place under `strategy` and return its state."""
    group = process_group or dist.group.WORLD
    return ZeroState(model, strategy, units, group, resolve_precision(precision), init_fn,
                     checkpoint_activations, offload)
