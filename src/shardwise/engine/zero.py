"""`strategy="zero1" | "zero2" | "zero3"`: three policies over one mechanism (flat_unit.py).

| stage | full params                    | full grads                          |
|-------|--------------------------------|-------------------------------------|
| zero1 | kept                           | kept until the step (reduced as ready) |
| zero2 | kept                           | reduce-scattered per unit, freed    |
| zero3 | gathered per window, freed     | as zero2                            |

Optimizer state is always sharded: the optimizer only ever sees shards.

The hooks, in FSDP2's verbs (a unit's states are flat_unit.py's Note [unit lifecycle]):

- pre_forward: `_make_pre_forward` → `_open_window`: unshard (gather the unit, or wait for
  its prefetch) and install the full views.
- post_forward: `_make_post_forward` → `_end_forward`: reshard idle zero3 units; register
  the unit's pre-backward hook on its outputs.
- pre_backward: `_pre_backward`: unshard again for backward (zero3); prefetch the next unit.
- post_backward: `post_backward` (from `_GatherUnit.backward`): reshard (zero3), then
  reduce-scatter or accumulate the unit's gradients.
- finalize_backward: `_finalize_backward`: reduce what is left in the fixed order, wait for
  every reduce, reinstall the shards.

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
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from shardwise.config import ShardConfig
from shardwise.engine.consistency import broadcast_from_rank0, check_same_model_on_every_rank
from shardwise.engine.deferred import is_deferred, record, replay
from shardwise.engine.flat_unit import FlatUnit
from shardwise.engine.info import ShardInfo
from shardwise.engine.offload import open_store, register_offloaded
from shardwise.engine.precision import cast_floating_inputs
from shardwise.engine.recompute import checkpoint_forward
from shardwise.engine.units import UnitSpec, build_units

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
        ctx.state.post_backward(ctx.unit, list(grads))
        return (None, None) + (None,) * ctx.num_shards


@dataclass
class StepState:
    """What the engine tracks within one forward/backward window; a fresh one every step."""

    windowed: set[int] = field(default_factory=set)  # units whose _GatherUnit ran in this forward
    open_units: list[FlatUnit] = field(default_factory=list)  # units whose forward is running
    prefetching: dict[int, FlatUnit] = field(default_factory=dict)  # gathers in flight, in issue order
    gather_queue: list[FlatUnit] = field(default_factory=list)  # forward: units to gather, fixed order
    backward_queue: list[FlatUnit] = field(default_factory=list)  # zero3 backward: the same, reversed
    reduced: set[int] = field(default_factory=set)  # units whose reduce was issued
    ready_grads: dict[int, list] = field(default_factory=dict)  # units whose grads wait for their turn
    next_reduce: int = 0  # position in ZeroEngine.reduce_order
    pending_reduces: collections.deque = field(default_factory=collections.deque)
    callback_queued: bool = False  # _finalize_backward is queued on autograd's engine
    in_window: bool = False  # a forward ran and its backward has not finished


class ZeroEngine:
    """What `shard(..., strategy="zero*")` attaches to the model as `model._shardwise`."""

    def __init__(self, model: nn.Module, config: ShardConfig, units: UnitSpec, group, init_fn=None):
        self.config = config
        self.strategy = config.strategy
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        plans = build_units(model, units)
        self.module_names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        check_same_model_on_every_rank(model, group)
        keep_full = config.keeps_full_params
        self.precision = precision = config.precision
        self.store = open_store(config.offload, self.rank)
        # Deferred: meta aliases of the parameters, by name, for the init replay below.
        deferred = {n: p.detach() for n, p in model.named_parameters()} if is_deferred(model) else None
        extra_log = record(lambda: init_fn(model)) if deferred is not None and init_fn is not None else None
        self.units = []
        for plan in plans:  # one unit at a time: zero3's peak is one unit's full values
            unit = FlatUnit(plan, rank=self.rank, world_size=self.world_size, group=group,
                            keep_full=keep_full, keep_full_grad=config.keeps_full_grads, precision=precision,
                            store=self.store)
            if deferred is None:
                broadcast_from_rank0(unit, group)
            unit.take_shards()
            self.units.append(unit)
        if deferred is not None:
            # Every rank replays the same recorded init from the same RNG state, so the values
            # agree without a broadcast; each keeps its rows as each parameter is finished.
            where = {layout.owned.name: (u, i) for u in self.units for i, layout in enumerate(u.layouts)}
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
            self.root.module.register_forward_pre_hook(cast_floating_inputs(precision.param_dtype), with_kwargs=True)
        if config.checkpoint_activations:
            for unit in self.units[1:]:
                checkpoint_forward(unit.module)
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
            unit.module.register_forward_hook(self._make_post_forward(unit))

    # ---- per-step bookkeeping ----------------------------------------------------

    def _reset_step(self) -> None:
        self.step = StepState()

    def _make_pre_forward(self, unit: FlatUnit):
        def hook(module, args):
            if unit is self.root:
                self._begin_forward()
            self.step.open_units.append(unit)
            if id(unit) not in self.step.windowed:
                self._open_window(unit)
        return hook

    def _make_post_forward(self, unit: FlatUnit):
        def hook(module, args, output):
            self.step.open_units.pop()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
            if unit is self.root:
                self._end_forward()
            return output
        return hook

    def _begin_forward(self) -> None:
        if self.step.in_window:  # the previous forward never ran backward (evaluation, a dropped loss)
            self._close_window()
        self._reset_step()
        self.step.in_window = True
        # The same list on every rank (zero3: every unit; zero1/2: units the step changed).
        self.step.gather_queue = [u for u in self.units if u.needs_gather()]

    def _open_window(self, unit: FlatUnit) -> None:
        self._ensure_gathered(unit)
        trainable = [unit.shard_params[i] for i in unit.trainable()]
        if trainable:
            fulls = _GatherUnit.apply(self, unit, *trainable)
        else:  # nothing to differentiate (frozen unit): plain fresh views, no backward hook
            fulls = [view.view(view.shape) for view in unit.full_views]
        unit.install_full(list(fulls))
        self.step.windowed.add(id(unit))
        if not unit.keep_full:
            self._free_idle(keep={id(unit)})
        self._issue_queued(self.step.gather_queue, up_to=None)

    def _end_forward(self) -> None:
        self._drain(self.step.gather_queue)  # units this rank did not run still take their gather
        if not self.root.keep_full:
            # The last unit is usually the first one backward needs: keep it (as FSDP2 keeps
            # its root), one gather fewer per step. "Last" by registration, not by this
            # rank's forward, so every rank keeps the same one (Note [collective order]).
            last = {id(self.units[-1])} if torch.is_grad_enabled() else set()
            self._free_idle(keep={id(self.root)} | last)
            self.step.backward_queue = [u for u in reversed(self.units) if not u.resident]
        if not torch.is_grad_enabled():
            self._close_window()

    def _drain(self, queue: list[FlatUnit]) -> None:
        while queue or self.step.prefetching:
            self._issue_queued(queue, up_to=None)
            for unit in list(self.step.prefetching.values()):
                del self.step.prefetching[id(unit)]
                unit.finish_gather()  # freed (or kept) by the caller, the same on every rank

    # ---- gathering ---------------------------------------------------------------

    def _issue_queued(self, queue: list[FlatUnit], up_to: FlatUnit | None) -> None:
        """Issue queued gathers in their fixed order, through `up_to` if given, else just
        enough to keep the policy's number in flight (Note [collective order])."""
        while queue:
            if up_to is None and len(self.step.prefetching) >= self._max_in_flight:
                return
            unit = queue.pop(0)
            unit.start_gather(async_op=True)
            self.step.prefetching[id(unit)] = unit
            if unit is up_to:
                return

    def _ensure_gathered(self, unit: FlatUnit, queue: list[FlatUnit] | None = None) -> None:
        queue = self.step.gather_queue if queue is None else queue
        if unit in queue:
            self._issue_queued(queue, up_to=unit)
        if id(unit) in self.step.prefetching:
            # Gathers land in issue order: those queued before this unit first. A zero3 unit
            # among them that is not running is one this rank skipped: drop it again.
            for other in list(self.step.prefetching.values()):
                del self.step.prefetching[id(other)]
                other.finish_gather()
                if other is unit:
                    break
                if not other.keep_full and not any(other is u for u in self.step.open_units):
                    other.free()
        elif unit.needs_gather():
            unit.start_gather(async_op=False)
            unit.finish_gather()
        if not unit.keep_full:
            resident = sum(1 for u in self.units if u is not self.root and u.resident)
            self.peak_resident_units = max(self.peak_resident_units, resident)

    def _free_idle(self, keep: set[int]) -> None:
        busy = keep | {id(u) for u in self.step.open_units} | set(self.step.prefetching)
        for unit in self.units:
            if id(unit) not in busy:
                unit.free()

    # ---- backward ----------------------------------------------------------------

    def _pre_backward(self, unit: FlatUnit) -> None:
        if not self.step.callback_queued:
            self.step.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        if id(unit) in self.step.reduced:
            return
        self._ensure_gathered(unit, self.step.backward_queue)
        self._issue_queued(self.step.backward_queue, up_to=None)  # prefetch the next one

    def post_backward(self, unit: FlatUnit, grads: list) -> None:
        """All uses of `unit` in this step have their gradients: reduce or accumulate them."""
        if not self.step.callback_queued:  # a graph that reached no unit output hook
            self.step.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
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
            self.step.ready_grads[id(unit)] = grads
            self._launch_ready_reduces()

    def _launch_ready_reduces(self) -> None:
        """Reduce ready units in the fixed order, stopping at the first not ready yet."""
        while self.step.next_reduce < len(self.reduce_order):
            unit = self.reduce_order[self.step.next_reduce]
            if id(unit) not in self.step.ready_grads:
                return
            self._launch_reduce(unit, self.step.ready_grads.pop(id(unit)))
            self.step.next_reduce += 1

    def _launch_reduce(self, unit: FlatUnit, grads: list) -> None:
        self.step.reduced.add(id(unit))
        if not unit.trainable():
            return
        while len(self.step.pending_reduces) >= _MAX_PENDING_REDUCES:
            self._finish_oldest_reduce()
        pending, indices = unit.start_reduce(grads, async_op=True)
        self.step.pending_reduces.append((unit, pending, indices))

    def _finish_oldest_reduce(self) -> None:
        unit, pending, indices = self.step.pending_reduces.popleft()
        unit.finish_reduce(pending, indices)
        unit.end_accumulation()

    def _finalize_backward(self) -> None:
        self._drain(self.step.backward_queue)  # units this rank's backward never reached
        if self.sync_grads:
            # Units not reduced yet: zero1's kept grads, and units unused this step on this
            # rank (zeros). Same fixed order as during backward (Note [collective order]).
            for unit in self.reduce_order[self.step.next_reduce :]:
                grads = self.step.ready_grads.pop(id(unit), None)
                if grads is None:
                    grads = unit.full_grad_list()
                self._launch_reduce(unit, grads)
            while self.step.pending_reduces:
                self._finish_oldest_reduce()
        self._close_window()

    def _close_window(self) -> None:
        for unit in self.step.prefetching.values():
            unit.finish_gather()  # a gather in flight must land before its buffers go
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

    def shard_info(self) -> dict[str, ShardInfo]:
        info = {}
        for unit in self.units:
            for layout, shard in zip(unit.layouts, unit.shard_params):
                start = min(self.rank * layout.rows_per_rank, layout.rows)
                end = min(start + layout.rows_per_rank, layout.rows)
                names = [f"{_prefix_of(module, self.module_names)}{attribute}"
                         for module, attribute in layout.owned.holders]
                info[layout.owned.name] = ShardInfo(shard, layout.shape, start, end,
                                                    tuple(n for n in names if n != layout.owned.name))
        return info

    def full_parameters(self) -> dict[str, torch.Tensor]:
        values: dict[str, torch.Tensor] = {}
        for unit in self.units:
            values.update(unit.gather_copy())
        return values


def _prefix_of(module: nn.Module, module_names: dict[int, str]) -> str:
    name = module_names[id(module)]
    return f"{name}." if name else ""


def apply_zero(model: nn.Module, config: ShardConfig, units: UnitSpec, group: dist.ProcessGroup,
               init_fn=None) -> ZeroEngine:
    """Shard `model` in place under `config.strategy` and return its engine."""
    return ZeroEngine(model, config, units, group, init_fn)
