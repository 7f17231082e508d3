"""The engine's unit: flat shards, full views, gather and free. Uses: collectives, compat,
parallel_layout, param_layout, phase, shard_param, stage, unit_grads, units.

A `FlatUnit` owns some parameters (see units.py). Each parameter is cut into dim-0
chunks of `c = ceil(rows / shard_world)` rows over the unit's shard group (a 0-D scalar counts
as one row; the last ranks hold zero padding; which rows are this rank's is its `mesh`'s answer,
Note [mesh info]), and after `shard()` the registered parameter is this rank's chunk, under its
original name. Its gradients are `unit.grads` (unit_grads.py). Two
memory layouts, one per stage (Note [stages], stage.py):

- full parameters kept (zero1, zero2): the full padded values stay allocated
  (`full_flat`, param-major) and each shard *is* a view of this rank's rows in it,
  so the optimizer updates the full buffer in place and no separate copy exists.
  The next forward re-gathers a unit whose rows changed.
- not kept (zero3): the shards live in one rank-major `shard_flat`, which
  is directly the all-gather's input; `full_flat` is allocated from the gather's start
  (the rows land in it) while the unit is in use, and released (resized to 0) afterwards.

Note [unit lifecycle]: a unit's full values are in one of three states, changed only by
`_move`, which refuses any other transition (a use-after-free becomes an error, not a
wrong number):

    SHARDED --start_gather--> GATHERING --finish_gather--> GATHERED --free (zero3)--> SHARDED
                                   ^-----------start_gather (rows changed, zero1/2)----'

zero1/zero2 start GATHERED and stay there (their full values are kept); zero3 starts
SHARDED. Gradients have their own phase (unit_grads.GradPhase).

Note [stepped parameters]: a zero1/zero2 unit re-gathers after a step only the parameters whose rows
an optimizer wrote: `mark_stepped` adds the ones it holds, and a whole-tensor owner's broadcast, which
writes the whole update into every rank's full view (Note [owner broadcast], owner_traffic.py), takes
its own out again (`mark_fresh`). A frozen parameter or a broadcast one is not re-gathered. Version
stamps cannot tell one parameter's rows from another's (the shards are views of one buffer), so the
set is trusted only while the stamp moved inside steps alone (`after_step` records it): a write outside
a step (a user's in-place write, `sw.load`) re-gathers every parameter and counts as a write in the
forward's header (`written`), which refuses a write only some ranks made. A gather clears the set.

Note [version counters]: autograd saves the full views for backward. Refilling their
storage after a free would bump the version counter and make autograd refuse the
saved tensors, although the values written back are identical; a gather therefore
writes under `compat.preserve_version_counter`, as FSDP2 does.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor, nn

import shardwise.engine.comm.collectives as coll
from shardwise.config import MixedPrecision
from shardwise.engine.compat import preserve_version_counter
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.layout.param_layout import ParamLayout, lay_out
from shardwise.engine.schedule.phase import Clock
from shardwise.engine.schedule.stage import Stage
from shardwise.engine.unit.shard_param import make_shard
from shardwise.engine.unit.unit_grads import UnitGrads
from shardwise.engine.unit.units import UnitPlan
from shardwise.errors import ShardwiseError


class Residency(enum.Enum):
    """Where a unit's full values are (Note [unit lifecycle])."""

    SHARDED = "sharded"  # only this rank's rows exist; full_flat has no storage
    GATHERING = "gathering"  # an all-gather into full_flat is in flight
    GATHERED = "gathered"  # full_flat holds every rank's rows


_TRANSITIONS = {
    Residency.SHARDED: {Residency.GATHERING},
    Residency.GATHERING: {Residency.GATHERED},
    Residency.GATHERED: {Residency.SHARDED, Residency.GATHERING},
}


class Residents:
    """How many of one engine's zero3 units, the root aside, hold their full values now, and the most
    at once (the memory check): counted where residency changes (`FlatUnit._move`), so no unit's
    entry scans the others. Every transition counts, set-up's too (each unit is built GATHERED and
    zero3's `take_shards` frees it: the peak is 1 right after `shard()`)."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def add(self, change: int) -> None:
        self.now += change
        self.peak = max(self.peak, self.now)


class FlatUnit:
    """One unit's parameters as flat shards (see module docstring)."""

    def __init__(self, plan: UnitPlan, *, mesh: ParallelLayout, stage: Stage, precision: MixedPrecision,
                 store=None, reduce_group=None, clock: Clock | None = None, residents: Residents | None = None):
        self.module, self.path = plan.module, plan.path
        self.mesh = mesh  # this rank's rows, its shard group and its replicas (Note [mesh info])
        self.stage = stage
        self.store = store  # offload: the master shards live in a memory-mapped file
        self.reduce_group = reduce_group or mesh.shard_group  # reduce-scatters may have a group of their own
        self.clock = clock or Clock()  # the engine's; read for errors that name where a rank waited
        self.layouts, self.shard_total = lay_out(plan.params, mesh)
        self.index_of = {id(layout): i for i, layout in enumerate(self.layouts)}  # id(layout) -> its index
        dtypes = {entry.param.dtype for entry in plan.params}
        if len(dtypes) > 1:
            raise ShardwiseError(
                f"unit {self.path or '<root>'} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                "cast the model to one dtype before shard() (mixed precision is a shard() option)"
            )
        reference = plan.params[0].param if plan.params else torch.empty(0)
        self.dtype, self.device = reference.dtype, reference.device  # the shards' (master) dtype
        if self.device.type == "meta":  # deferred init: the shards are born on the compute device
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        self.compute_dtype = precision.param_dtype if self.dtype.is_floating_point else self.dtype
        self.reduce_dtype = precision.reduce_dtype if self.dtype.is_floating_point else self.dtype
        # zero1/zero2 at full precision: a shard *is* its rows of the kept full buffer.
        # With a low param_dtype the fp32 master rows need their own storage.
        self.aliased = stage.aliases_shards(self.compute_dtype, self.dtype)
        self.full_flat = torch.empty(mesh.shard_world * self.shard_total, dtype=self.compute_dtype, device=self.device)
        self.full_views = [self._full_view(layout) for layout in self.layouts]
        self.shard_flat: Tensor | None = None
        self.shard_params: list[nn.Parameter] = []
        self.grads = UnitGrads(self)
        self.gathered_stamp = -1  # _master_stamp() right after the last gather (full params kept)
        self.stale = False  # an optimizer stepped these shards since the last gather (optim_hooks.py)
        self.current_at_step = False  # the full values matched every rank's rows when the last step began
        # Note [stepped parameters]: the layout indices an optimizer wrote since the last gather, the stamp after
        # the last step, and whether rows were written outside a step since the last gather.
        self.stepped: set[int] = set()
        self.step_stamp = -1
        self.written_outside = False
        self.residency = Residency.GATHERED  # full_flat is allocated above; zero3 frees it in take_shards
        # Counted in `residents` (the engine's): a zero3 unit other than the root.
        self.residents = residents if residents is not None and self.path and not stage.keeps_full_params \
            else Residents()
        self.residents.add(1)
        self.pending_gather: coll.Pending | None = None  # the all-gather in flight (GATHERING)
        self.pinned = False  # read by an input-gradient graph (create_graph): kept until the window closes
        self.stepped_in_backward = False  # sw.optimizer_in_backward steps it (step_in_backward.py)

    @property
    def where(self) -> str:
        return str(self.clock)

    def pin(self) -> None:
        """Keep the full values until the window closes (Note [gradients of inputs], window.py)."""
        self.pinned = True

    def mark_stepped(self, indices: set[int]) -> None:
        """An optimizer is about to write the shards `indices` (layout indices): re-gather before the next use
        (optim_hooks.py). Whether the kept full values still matched every rank's rows as this step began is
        kept for the owners (owner_traffic.can_copy_whole): the mark comes before the step, so `stale` no
        longer says it."""
        self.written_outside = self.written()  # since the last gather or step (Note [stepped parameters])
        if self.stage.keeps_full_params and not self.to_gather():
            self._now_current()  # so that the owners know the full values are current (can_copy_whole)
        self.current_at_step = not self.needs_gather()
        self.stepped |= indices
        self.stale, self.step_stamp = True, self._master_stamp()  # writes from here on are a step's

    def mark_fresh(self, layout: ParamLayout) -> None:
        """The owner's broadcast wrote this parameter's whole update into every rank's full view (Note [owner
        broadcast], owner_traffic.py): the next forward need not re-gather it (Note [stepped parameters])."""
        self.stepped.discard(self.index_of[id(layout)])

    def after_step(self) -> None:
        """An optimizer's step over this unit ended (or was undone): its writes are accounted for (Note
        [stepped parameters])."""
        self.step_stamp = self._master_stamp()

    def _now_current(self) -> None:
        """Every rank's full values equal every rank's rows: nothing to re-gather until the rows change."""
        self.gathered_stamp, self.stale = self._master_stamp(), False
        self.stepped, self.written_outside = set(), False

    def hand_steps_to_backward(self) -> None:
        """sw.optimizer_in_backward steps this unit during backward (Note [optimizer in backward])."""
        self.stepped_in_backward = True

    @property
    def label(self) -> str:
        return repr(self.path) if self.path else "<root>"

    def _move(self, to: Residency) -> None:
        """The one place a unit's residency changes (Note [unit lifecycle])."""
        if to not in _TRANSITIONS[self.residency]:
            raise RuntimeError(f"shardwise engine bug: unit {self.label} cannot go from "
                               f"{self.residency.value} to {to.value}")
        self.residents.add((to is Residency.GATHERED) - (self.residency is Residency.GATHERED))
        self.residency = to

    @property
    def resident(self) -> bool:
        """Whether the full values are usable now."""
        return self.residency is Residency.GATHERED

    # ---- set-up ------------------------------------------------------------------

    @property
    def numel_full(self) -> int:
        return self.full_flat.numel()

    def _padded_region(self, layout: ParamLayout, flat_by_param: Tensor | None = None) -> Tensor:
        """A parameter's padded region of full_flat (or of a param-major buffer shaped like it)."""
        flat_by_param = self.full_flat if flat_by_param is None else flat_by_param
        start = self.mesh.shard_world * layout.offset
        return flat_by_param[start : start + self.mesh.shard_world * layout.shard_numel]

    def _full_view(self, layout: ParamLayout) -> Tensor:
        real = self._padded_region(layout)[: layout.rows * layout.row_numel]
        return real.view(layout.shape)

    def own_rows(self, flat_by_param: Tensor, layout: ParamLayout) -> Tensor:
        region_start = self.mesh.shard_world * layout.offset + self.mesh.own_start(layout.shard_numel)
        return flat_by_param[region_start : region_start + layout.shard_numel]

    def take_shards(self, values: dict[int, Tensor] | None = None) -> None:
        """Keep this rank's rows of every owned parameter as the registered parameters and
        free what the policy frees. `values` (by layout index) replaces a parameter's own
        value: how deferred init hands over freshly initialized tensors."""
        values = values or {}
        with torch.no_grad():
            originals = [values.get(i, layout.owned.param) for i, layout in enumerate(self.layouts)]
            # A deferred (meta) parameter has no value yet: its rows stay zero until set_value.
            originals = [None if o.device.type == "meta" else o for o in originals]
            if self.aliased:
                self.full_flat.zero_()
                for view, original in zip(self.full_views, originals):
                    if original is not None:
                        view.copy_(original.detach())
                shard_tensors = [self.own_rows(self.full_flat, layout).view(layout.shard_shape)
                                 for layout in self.layouts]
            else:
                self.shard_flat = self.store.zeros(self.shard_total, self.dtype) if self.store is not None \
                    else torch.zeros(self.shard_total, dtype=self.dtype, device=self.device)
                for layout, original in zip(self.layouts, originals):
                    if original is not None:
                        self._shard_segment(layout).copy_(self.mesh.own_chunk(original, layout.shard_numel))
                shard_tensors = [self._shard_segment(layout).view(layout.shard_shape) for layout in self.layouts]
                if self.stage.keeps_full_params:  # low-precision zero1/zero2: the kept full values, cast once
                    self.full_flat.zero_()
                    for view, original in zip(self.full_views, originals):
                        if original is not None:
                            view.copy_(original.detach())
        for layout, tensor in zip(self.layouts, shard_tensors):
            self.shard_params.append(make_shard(layout.owned.param, tensor))  # Note [kept parameter objects]
        self.install_shards()
        for layout in self.layouts:
            # The original full tensor is no longer registered anywhere; dropping our last
            # reference is what actually frees it (4 bytes per parameter otherwise).
            layout.owned.param = None
        if self.stage.keeps_full_params:
            self.gathered_stamp = self._master_stamp()
        else:
            self.free()

    def set_value(self, index: int, value: Tensor) -> None:
        """Deferred init: parameter `index` now has its value; keep this rank's rows (and,
        for zero1/zero2, the kept full copy). Every rank receives every value."""
        layout = self.layouts[index]
        with torch.no_grad():
            if self.stage.keeps_full_params:
                self.full_views[index].copy_(value)
            if not self.aliased:
                self._shard_segment(layout).copy_(self.mesh.own_chunk(value, layout.shard_numel))
            if self.stage.keeps_full_params:
                self.gathered_stamp = self._master_stamp()  # the full copy is current

    def _shard_segment(self, layout: ParamLayout) -> Tensor:
        return self.shard_flat[layout.offset : layout.offset + layout.shard_numel]

    def _master_stamp(self) -> int:
        """Moves whenever this rank's master rows are written in place (Note [writes the engine
        must see]): the shards' own version counters plus their flat buffer's."""
        base = self.full_flat if self.aliased else self.shard_flat
        return base._version + sum(shard._version for shard in self.shard_params)

    # ---- registrations -----------------------------------------------------------

    def install_shards(self) -> None:
        """Register the shards under every original name (between steps)."""
        for layout, shard in zip(self.layouts, self.shard_params):
            for module, attribute in layout.owned.holders:
                module._parameters[attribute] = shard

    def install_full(self, tensors: list[Tensor]) -> None:
        """Register full values under every original name (inside a forward/backward window)."""
        for layout, tensor in zip(self.layouts, tensors):
            for module, attribute in layout.owned.holders:
                module._parameters[attribute] = tensor

    # ---- gather / free -----------------------------------------------------------

    def needs_gather(self) -> bool:
        if self.stage.keeps_full_params:  # the rows of a parameter changed since the last gather
            return bool(self.to_gather())
        return self.residency is Residency.SHARDED

    def to_gather(self) -> list[int]:
        """The layout indices the next gather carries: zero3 all of them; zero1/zero2 none while the full
        values are current, those an optimizer wrote after steps alone, all after any other write (Note
        [stepped parameters])."""
        if self.stage.keeps_full_params and not self.stale and self._master_stamp() == self.gathered_stamp:
            return []
        if self.stage.keeps_full_params and not self.written():
            return sorted(self.stepped)
        return list(range(len(self.layouts)))

    def current_in_step(self) -> bool:
        """zero1/zero2, inside an optimizer step: the full values were current when the step began (its
        pre-step mark has set `stale` since) and no rows were written since (an optimizer that stepped
        this unit earlier in the same step moved the stamp)."""
        return self.current_at_step and self._master_stamp() == self.gathered_stamp

    def written(self) -> bool:
        """zero1/zero2: rows changed by a write no optimizer step made (`p.data.mul_()`, `load_state_dict`,
        `sw.load`), which only the ranks that made it see (Note [agreement rides the traffic], agreement.py;
        Note [stepped parameters]): since the last gather, or since the last step after one."""
        if not self.stage.keeps_full_params:
            return False
        return self.written_outside or self._master_stamp() != (self.step_stamp if self.stale else self.gathered_stamp)

    def _own_parts(self, dtype: torch.dtype, indices: list[int] | None = None) -> list[Tensor]:
        """This rank's rows of each parameter (of `indices`, else all) in `dtype`, one tensor per parameter:
        the gather's input."""
        indices = range(len(self.layouts)) if indices is None else indices
        if self.aliased:  # the shards are views into full_flat: its own rows, in place
            return [self.own_rows(self.full_flat, self.layouts[i]).detach() for i in indices]
        flat = self.shard_flat.to(dtype).detach()  # a no-op at full precision, a cast to param_dtype otherwise
        parts = flat.split([layout.shard_numel for layout in self.layouts])
        return [parts[i] for i in indices]

    def _regions(self, target: Tensor, indices: list[int] | None = None) -> list[Tensor]:
        indices = range(len(self.layouts)) if indices is None else indices
        return [self._padded_region(self.layouts[i], target) for i in indices]

    def start_gather(self, async_op: bool) -> None:
        """Issue the all-gather of every rank's rows (SHARDED or stale GATHERED -> GATHERING). The rows
        land straight in full_flat (Note [gathered in place], collectives.py): zero3 allocates it here."""
        self._move(Residency.GATHERING)
        storage = self.full_flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.full_flat.numel() * self.full_flat.element_size())
        # An aliased unit's own rows of full_flat are its shards, which the gather sends: already in place.
        indices = self.to_gather()  # zero1/zero2: the stepped ones (Note [stepped parameters])
        with torch.no_grad(), preserve_version_counter(self.full_flat):  # Note [version counters]
            self.pending_gather = coll.gather_into(
                self._own_parts(self.compute_dtype, indices), self._regions(self.full_flat, indices),
                self.mesh.shard_world,
                self.mesh.shard_group,
                async_op, what=f"the all-gather of unit {self.label} ({self.where})", own_in_place=self.aliased)

    def finish_gather(self) -> None:
        """Wait for the all-gather's rows to land in full_flat (GATHERING -> GATHERED)."""
        pending, self.pending_gather = self.pending_gather, None
        with torch.no_grad(), preserve_version_counter(self.full_flat):  # Note [version counters]
            pending.wait()
        self._move(Residency.GATHERED)
        if self.store is not None:
            self.store.release(self.shard_flat)  # read for the gather; back to disk
        self._now_current()

    def free(self, *, unpin: bool = False) -> None:
        """Release the full values (zero3; zero1/zero2 keep them), unless pinned (Note [gradients of
        inputs], window.py) until the window closes (`unpin`); the shards are registered again."""
        self.pinned = self.pinned and not unpin
        if not self.stage.keeps_full_params and not self.pinned and self.residency is Residency.GATHERED:
            self.full_flat.untyped_storage().resize_(0)
            self._move(Residency.SHARDED)
            self.install_shards()

    def gather_copy(self) -> dict[str, Tensor]:
        """Fresh full values of every owned parameter, leaving the unit's own state alone."""
        target = torch.empty(self.full_flat.shape, dtype=self.dtype, device=self.device)
        with torch.no_grad():  # the fp32 masters, not the compute copy
            coll.gather_into(self._own_parts(self.dtype), self._regions(target), self.mesh.shard_world,
                             self.mesh.shard_group, async_op=False)
        out = {}
        for layout in self.layouts:
            start = self.mesh.shard_world * layout.offset
            out[layout.owned.name] = target[start : start + layout.rows * layout.row_numel].view(layout.shape).clone()
        return out

    def trainable(self) -> list[int]:
        """The indices of the parameters that require grad (the ones the reduce carries)."""
        return [i for i, shard in enumerate(self.shard_params) if shard.requires_grad]
