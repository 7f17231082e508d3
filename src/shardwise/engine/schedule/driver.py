"""The step driver: the hooks that run a zero engine's forward and backward, in FSDP2's verbs, over the
units (unit/), their stage policy (stage.py), the gather schedule, the reducer and the agreement, which it
owns. Built and installed by zero.py's ZeroEngine. Uses: agreement, agreement_device, compat, flat_unit,
gather_schedule, gather_tags, phase, recompute, reducer, units, used_flags, window.

The hooks, in FSDP2's verbs (a unit's states are residency.py's Note [unit lifecycle]):

- pre_forward: `pre_forward` → `_begin_forward` (outermost) and `_enter_unit`: unshard
  (gather the unit, or wait for its prefetch) and install the full views (on every use:
  a use under no_grad and one with grad may alternate).
- post_forward: `post_forward` → `_end_forward` (outermost): reshard idle zero3 units;
  register the unit's pre-backward hook on its outputs.
- pre_backward: `_pre_backward`: unshard again for backward (zero3); prefetch the next unit.
- post_backward: `post_backward` (from `GatherUnit.backward`): reshard (zero3), then
  reduce-scatter or accumulate the unit's gradients (reducer.py).
- finalize_backward: `_finalize_backward`: reduce what is left in the fixed order, wait for
  every reduce, reinstall the shards.

Notes [unit window], [window states], [aborted backward], [one backward at a time], [gradients of inputs]:
window.py (the window's states and their transitions are there, in `Window.move`).
Note [outer calls]: a unit, or a module of the root unit (an embedding, a final norm, T5's
encoder that `generate()` calls by itself), may be called outside the model's forward. The
outermost hooked module called then opens a pass as the model's forward would: the same header
and (zero1/2) re-gathers, the root unit's full values in place, the same window, so such a
call joins a pending backward exactly; it closes the pass when it returns. [recompute]: recompute.py.

Note [micro-batches keep their gathers]: a pipeline stage runs M micro-batches' forwards and backwards
in one step (GPipe: all forwards, then all backwards; 1F1B: interleaved), every backward but the last
under no_sync. zero3 frees a unit after each use, so each micro-batch gathers every unit again in
forward and in backward: about 2M gathers per unit per step. Inside `keep_gathered()` a unit, once
gathered, is pinned (residency.py) and stays whole across the step's micro-batches, one gather per unit
per step, for zero2's parameter memory during the step (torchtitan keeps FSDP2 units unsharded under
pipelining for the same reason). The pin goes when the synced backward's window closes (the optimizer
step that follows changes the rows: a kept full value would then be stale) or when the block ends.
Inside the block nothing may write the rows between micro-batches (an optimizer step, a `p.data` write):
zero3 tracks no writes (freshness.NoKeptValues). pipeline.ShardedStage opens the block at a step's first
forward and closes it after the step's reduce, before the user's optimizer step.

Note [frozen units]: a unit with no trainable parameter has no `GatherUnit`, so zero3
frees it after its backward from a hook on its inputs' gradients instead.

A unit no rank used this step still takes part in the reduce, with zeros, at the end of
backward, in a fixed order, so nobody waits on a collective that never comes.

zero1/zero2 re-gather a unit before a forward when its rows changed (Note [writes the engine
must see] in shard_param.py). Which units, how many forwards ran and which parameters are trainable
the ranks agree on in a small header that each phase with collectives sends first and checks where
it waits anyway; a forward with nothing to gather sends nothing (Note [agreement rides the traffic],
agreement.py).

Note [collective order]: gloo and NCCL pair collectives by their order of issue, so
every rank must issue the same sequence even when ranks take different branches.
zero1/zero2 therefore issue their re-gathers, and all stages their reduce-scatters,
in one fixed unit order (forward: registration order; backward: its reverse); a unit
whose turn comes before it is ready holds back the ones after it, never reorders
them. Reduce-scatters run on a group of their own, so they never interleave with
gathers. zero3's forward gathers follow the forward itself (prefetched in the last
forward's unit order once every rank's header agrees, else registration order), so zero3
requires every rank to run the same units in each step (as FSDP does; a rank that does not is
refused on every rank at the first gather that differs: Note [gather tags]); parameters
unused by every rank and branches inside a unit may still differ.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten

from shardwise.engine.compat import outside_graph, queue_backward_callback
from shardwise.engine.phase import Clock, Phase
from shardwise.engine.schedule.agreement import (
    BACKWARD,
    BACKWARD_NO_SYNC,
    FORWARD_NO_GRAD,
    FORWARD_WITH_GRAD,
)
from shardwise.engine.schedule.agreement_device import make_agreement
from shardwise.engine.schedule.gather_schedule import GatherScheduler
from shardwise.engine.schedule.gather_tags import make_tags
from shardwise.engine.schedule.recompute import checkpoint_forward
from shardwise.engine.schedule.reducer import Reducer
from shardwise.engine.schedule.used_flags import make_used_flags
from shardwise.engine.schedule.window import Window, WindowState, in_backward, in_grad_call, refuse_nested_backward
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.engine.unit.units import root_scope_modules


class StepDriver:
    """One engine's forward and backward: owns the window (`step`), the agreement, the gather schedule and
    the reducer, and asks the stage policy what each stage does."""

    def __init__(self, units: list[FlatUnit], policy, group, flags_group, clock: Clock) -> None:
        self.units, self.root, self.policy, self.clock = units, units[0], policy, clock
        self.agreement = make_agreement(units, group)  # Note [agreement rides the traffic], [headers on the device]
        # zero3's gathers follow each rank's own forward: tagged, so a rank that ran other units is refused
        # before a gathered value is used (Note [gather tags]); zero1/zero2 re-gather in a fixed order.
        tags = policy.gather_tags(lambda: make_tags(units, units[0].mesh.shard_group, self._where_now,
                                                    self.agreement)) if len(units) > 1 else None  # one: no order
        self.gathers = GatherScheduler(units, policy.gathers_in_flight, self.agreement.confirm, tags)
        # Note [collective order]; the used flags on the host group, or on the device (Note [used flags on the device])
        self.reducer = Reducer(list(reversed(units)), make_used_flags(units, group, flags_group))
        self.sync_grads = True
        self.holding = False  # inside keep_gathered(): zero3 keeps each unit's full values until the step's reduce
        self.num_forwards = 0  # root forwards, counted in every header
        self.forward_order: list[int] = []  # units in the order the last forward used them
        self.prefetch_order: list[FlatUnit] = list(units)  # alike on every rank (_begin_forward)
        self.window = Window(clock)  # Note [window states]

    def _where_now(self) -> tuple[int, int, list[int]]:
        """For zero3's gather tags (Note [gather tags]): forwards so far, forward (0) or backward (1), units run."""
        return self.num_forwards, int(self.clock.phase is Phase.BACKWARD), self.window.order

    def install(self, model: nn.Module, checkpoint_activations: bool) -> None:
        """Register the hooks on the units' modules and on the root unit's own modules (Note [outer calls])."""
        if checkpoint_activations:
            for unit in self.units[1:]:
                checkpoint_forward(unit.module, partial(self.prepare_recompute, unit))
        for unit in self.units:
            unit.module.register_forward_pre_hook(outside_graph(partial(self.pre_forward, unit)))
            unit.module.register_forward_hook(outside_graph(partial(self.post_forward, unit)))
        for module in root_scope_modules(model, [unit.module for unit in self.units[1:]]):
            module.register_forward_pre_hook(outside_graph(self.root_scope_pre_forward))
            module.register_forward_hook(outside_graph(self.root_scope_post_forward))

    # ---- forward -----------------------------------------------------------------

    def pre_forward(self, unit: FlatUnit, module, args) -> None:
        """A unit's forward pre-hook (bound to its unit with functools.partial in `install`)."""
        if in_backward():  # Note [recompute] (recompute.py)
            self.prepare_recompute(unit)
            return
        if not self.window.open_units:  # the outermost call: the root's forward, or Note [outer calls]
            self._begin_forward()
            if unit is not self.root:
                self._open_outer_call(module)
        self._open_unit(unit)

    def post_forward(self, unit: FlatUnit, module, args, output):
        """A unit's forward hook."""
        if in_backward():  # a recompute: the forward's own hooks already did this
            return output
        self._close_unit(unit, args, output)
        if self.window.outer_call is module:
            self._close_unit(self.root, args, output)
        return output

    def root_scope_pre_forward(self, module, args) -> None:
        """A module of the root unit called outside the model's forward (Note [outer calls])."""
        if not self.window.open_units and not in_backward():
            self._begin_forward()
            self._open_outer_call(module)

    def root_scope_post_forward(self, module, args, output):
        if self.window.outer_call is module and not in_backward():
            self._close_unit(self.root, args, output)
        return output

    def _open_outer_call(self, module: nn.Module) -> None:
        self.window.outer_call = module
        self._open_unit(self.root)

    def _open_unit(self, unit: FlatUnit) -> None:
        self.window.open_units.append(unit)
        self._enter_unit(unit)

    def _close_unit(self, unit: FlatUnit, args, output) -> None:
        self.window.open_units.pop()
        if torch.is_grad_enabled():
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                register_multi_grad_hook(tensors, lambda grads: self._pre_backward(unit), mode="any")
            if self.policy.frees_after_frozen_backward(unit, self.root):
                # Note [frozen units]: no GatherUnit, so no post_backward frees it; its inputs'
                # gradients are computed once its backward is done.
                inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                if inputs:
                    register_multi_grad_hook(inputs, lambda grads: self._frozen_backward_done(unit), mode="all")
        if unit is self.root:
            self.window.outer_call = None
            self._end_forward()

    def prepare_recompute(self, unit: FlatUnit) -> None:
        """Note [recompute]: the unit's full values present and registered, nothing else."""
        refuse_nested_backward(self.window, recompute=True)
        self._ensure_gathered(unit, self.gathers.backward_queue)
        if self.holding:  # Note [micro-batches keep their gathers]
            unit.pin()
        fulls = self.window.fulls.get(id(unit))
        if fulls is None:  # the window closed after an earlier backward: leaves that, like the
            # forward's views, require grad, so the recompute saves what the forward saved
            fulls = [view.detach().requires_grad_(shard.requires_grad)
                     for view, shard in zip(unit.full_views, unit.shard_params)]
        unit.install_full(list(fulls))

    def _begin_forward(self) -> None:
        if self.window.state is WindowState.BACKWARD:
            # Note [aborted backward]: a backward started and raised before its end; its partial
            # gradients are dropped (the user skips such a step), and the reduce order restarts.
            self.reducer.abandon()
            self._close_window()
        for unit in self.units:  # hpZ: a chunk serves only the forward that cut it (Note [secondary shards])
            unit.drop_secondary()
        self.window.open_or_join(self.units)  # Note [window states]
        self.num_forwards += 1
        # zero3 prefetches in the last forward's order once every rank's header reported it (registration
        # order otherwise): forward gathers in that order, backward gathers in its reverse.
        self.prefetch_order = self.policy.prefetch_order(self.units, self.agreement.agreed_order)
        position = {id(u): i for i, u in enumerate(self.prefetch_order)}
        # zero3: the units not gathered; zero1/2: those whose rows changed. The same on every rank, or the
        # header says otherwise before any of them is used (Note [agreement rides the traffic]).
        queue = sorted((unit for unit in self.units if unit.needs_gather()), key=lambda u: position[id(u)])
        self.gathers.forward_queue = queue
        if queue:  # this forward communicates: its header goes first, checked where the gathers land
            phase = FORWARD_WITH_GRAD if torch.is_grad_enabled() else FORWARD_NO_GRAD
            self.agreement.announce(phase, self.num_forwards, self.forward_order, queue)
            if any(unit.written() for unit in queue):  # only the writers know: agreed before re-gathering
                self.agreement.confirm()

    def _enter_unit(self, unit: FlatUnit) -> None:
        self._ensure_gathered(unit)
        if self.holding:  # Note [micro-batches keep their gathers]
            unit.pin()
        if id(unit) not in self.window.order:
            self.window.order.append(id(unit))
        trainable = unit.trainable()
        # Installed on every use: a use under no_grad and one with grad may alternate in one pass.
        if trainable and torch.is_grad_enabled():
            unit.install_full(list(self.window.gather_unit(self, unit, trainable)))
        elif id(unit) in self.window.fulls:
            unit.install_full(list(self.window.fulls[id(unit)]))
        else:  # nothing to differentiate (frozen, or no grad): plain fresh views
            unit.install_full([view.view(view.shape) for view in unit.full_views])
        self.policy.after_use(self.gathers, unit, self.window.open_units)
        self.gathers.issue(self.gathers.forward_queue)

    def _end_forward(self) -> None:
        self.gathers.drain(self.gathers.forward_queue)  # units this rank did not run still take their gather
        self.agreement.confirm()
        for unit in self.units:  # the window's views, not plain ones a use under no_grad left (Note [unit window])
            if id(unit) in self.window.fulls and self.policy.holds_full(unit):
                unit.install_full(list(self.window.fulls[id(unit)]))
        if self.window.order:
            self.forward_order = self.window.order
        self.policy.after_forward(self.gathers, self.units, self.prefetch_order, self.window.open_units)
        if self.window.fulls:  # a graph holds the window's views: a backward may come (Note [window states])
            self.window.move(WindowState.OPEN)
        else:  # every use under no_grad or frozen: nothing to backward
            self._close_window()

    def _ensure_gathered(self, unit: FlatUnit, queue: list[FlatUnit] | None = None) -> None:
        queue = self.gathers.forward_queue if queue is None else queue
        self.gathers.ensure_gathered(unit, queue, self.window.open_units)

    # ---- backward ----------------------------------------------------------------

    def _queue_finalize(self) -> None:
        if self.window.enter_backward():  # the backward's first hook (Note [window states])
            if self._backward_communicates():  # a header first
                phase = BACKWARD if self.sync_grads else BACKWARD_NO_SYNC  # Note [uneven work] (agreement.py)
                self.agreement.announce(phase, self.num_forwards, self.forward_order, [])
            queue_backward_callback(self._finalize_backward)

    def _backward_communicates(self) -> bool:
        """Whether this backward issues collectives (Note [agreement rides the traffic]). One that reduces
        nothing (no_sync) inside keep_gathered, with every unit of the last forward still whole, issues none:
        zero3's micro-batches but the last (Note [micro-batches keep their gathers])."""
        if not self.policy.backward_communicates(self.sync_grads):
            return False
        if self.sync_grads or not self.holding:
            return True
        by_id = {id(unit): unit for unit in self.units}
        return any(by_id[key].needs_gather() for key in self.window.order)

    def _pre_backward(self, unit: FlatUnit) -> None:
        if in_grad_call(unit):  # Note [gradients of inputs] (window.py): not the step's backward
            unit.pin()
            return self._ensure_gathered(unit, [])
        self._queue_finalize()
        self._ensure_gathered(unit, self.gathers.backward_queue)
        if self.holding:  # Note [micro-batches keep their gathers]
            unit.pin()
        if id(unit) in self.window.fulls:  # free() registered the shards; a recompute inside reads these
            unit.install_full(list(self.window.fulls[id(unit)]))
        queued = bool(self.gathers.backward_queue)
        self.gathers.issue(self.gathers.backward_queue)  # prefetch the next one
        if queued and not self.gathers.backward_queue and self.policy.trims_tail:  # the step's last gather:
            unit.comm.trim()  # Note [lean tail] (buffers.py)

    def _frozen_backward_done(self, unit: FlatUnit) -> None:
        """Note [frozen units]: a frozen zero3 unit's backward is done; free it like post_backward."""
        if not any(unit is u for u in self.window.open_units):
            unit.free()

    def post_backward(self, unit: FlatUnit, grads: list) -> None:
        """All uses of `unit` in this backward have their gradients: reduce or accumulate them."""
        self._queue_finalize()  # also for a graph that reached no unit output hook
        self.window.reduce_once(unit)  # two windows' graphs in one backward: refused (Note [window states])
        if unit is not self.root:
            # Every use's backward has run: the full values are no longer needed. Freed before
            # the reduce packs the gradients, so the two are never held together (one unit's
            # worth less at the backward peak; bench/memory/max_model.py). zero1/zero2 keep theirs (policy.free).
            unit.free()
        self.agreement.confirm()  # before the first reduce: a rank that froze a parameter reduces another size
        if not self.sync_grads:
            unit.grads.accumulate(grads)
            return
        # zero1 keeps its full grads; zero2/zero3 have some only after no_sync micro-batches.
        # Either way the reduce starts now, overlapping the rest of backward.
        if self.policy.reduces_kept_grads(unit):
            unit.grads.accumulate(grads)
            grads = None  # the kept ones
        self.reducer.add(unit, grads)

    def _finalize_backward(self) -> None:
        self.gathers.drain(self.gathers.backward_queue)  # units this rank's backward never reached
        self.agreement.confirm()
        if self.sync_grads:
            # Units not reduced yet: zero1's kept grads, and units unused this step on this
            # rank (zeros). Same fixed order as during backward (Note [collective order]).
            self.reducer.finish()
        self.reducer.reset()
        self.clock.step_done()
        self._close_window(release=self.sync_grads)

    def _close_window(self, release: bool = True) -> None:
        """`release`: the full values go (zero3) even inside keep_gathered(): the step's reduce is done, its
        optimizer step will change the rows (Note [micro-batches keep their gathers])."""
        self.agreement.confirm()
        self.gathers.land_all()  # a gather in flight must land before its buffers go
        for unit in self.units:
            unit.install_shards()
            unit.free(unpin=release or not self.holding)
            unit.drop_secondary()  # hpZ: never read across a step (Note [secondary shards])
        self.window.move(WindowState.CLOSED)
        self.gathers.reset()
        if release:
            self.units[0].comm.end_backward()  # the tail's buffers are not the next forward's (Note [lean tail])

    @contextmanager
    def keep_gathered(self):
        """zero3: a unit gathered inside this block keeps its full values until the block ends or a synced
        backward ends (Note [micro-batches keep their gathers]); zero1/zero2 keep them anyway."""
        previous, self.holding = self.holding, True
        try:
            yield
        finally:
            self.holding = previous
            if not previous and self.window.state is WindowState.CLOSED:  # else the window's end releases them
                for unit in self.units:
                    unit.free(unpin=True)

    @contextmanager
    def no_sync(self):
        """Skip the reduce: full gradients accumulate locally (zero2/zero3 then hold full
        gradients, 4 bytes per parameter, until the synced backward; zero1 always does)."""
        previous, self.sync_grads = self.sync_grads, False
        try:
            yield
        finally:
            self.sync_grads = previous
