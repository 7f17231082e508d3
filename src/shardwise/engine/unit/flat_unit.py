"""The engine's unit: flat shards, full views, gather and free. Uses: compat, context,
parallel_layout, param_layout, phase, residency, shard_param, stage, unit_grads, units.

A `FlatUnit` owns some parameters (see units.py). Each parameter is cut into dim-0
chunks of `c = ceil(rows / shard_world)` rows over the unit's shard group (a 0-D scalar counts
as one row; the last ranks hold zero padding; which rows are this rank's is its `mesh`'s answer,
Note [mesh info]), and after `shard()` the registered parameter is this rank's chunk, under its
original name. Its gradients are `unit.grads` (unit_grads.py), its residency `unit.residence`
(residency.py: Note [unit lifecycle]), whether its kept full values are current `unit.freshness`
(freshness.py: Note [stepped parameters]), where its master rows live `unit.storage` (shard_storage.py),
all three chosen by its stage's policy `unit.policy` (stage.py). Two memory layouts, one per stage
(Note [stages], stage.py):

- full parameters kept (zero1, zero2): the full padded values stay allocated
  (`full_flat`, param-major) and each shard *is* a view of this rank's rows in it,
  so the optimizer updates the full buffer in place and no separate copy exists.
  The next forward re-gathers a unit whose rows changed.
- not kept (zero3): the shards live in one rank-major `shard_flat`, which
  is directly the all-gather's input; `full_flat` is allocated from the gather's start
  (the rows land in it) while the unit is in use, and released (resized to 0) afterwards.

Note [version counters]: autograd saves the full views for backward. Refilling their
storage after a free would bump the version counter and make autograd refuse the
saved tensors, although the values written back are identical; a gather therefore
writes under `compat.preserve_version_counter`, as FSDP2 does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardwise.config import MixedPrecision
from shardwise.engine.comm.context import CommContext
from shardwise.engine.compat import compute_device, plain_tensors, preserve_version_counter
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.phase import Clock, Phase
from shardwise.engine.unit.param_layout import ParamLayout, lay_out
from shardwise.engine.unit.residency import Residence, Residency, Residents
from shardwise.engine.unit.shard_param import make_shard
from shardwise.engine.unit.stage import StagePolicy
from shardwise.engine.unit.unit_grads import UnitGrads
from shardwise.engine.unit.units import UnitPlan
from shardwise.errors import ShardwiseError


class FlatUnit:
    """One unit's parameters as flat shards (see module docstring)."""

    def __init__(self, plan: UnitPlan, *, mesh: ParallelLayout, policy: StagePolicy, precision: MixedPrecision,
                 store=None, reduce_group=None, clock: Clock | None = None, residents: Residents | None = None,
                 comm: CommContext | None = None, host=None):
        self.module, self.path = plan.module, plan.path
        self.mesh = mesh  # this rank's rows, its shard group and its replicas (Note [mesh info])
        self.policy = policy  # the stage's answers (Note [stages])
        self.store = store  # disk offload: the master shards live in a memory-mapped file
        self.reduce_group = reduce_group or mesh.shard_group  # reduce-scatters may have a group of their own
        self.clock = clock or Clock()  # the engine's; read for errors that name where a rank waited
        self.comm = comm  # the engine's collectives (Note [comm context]); set below when None
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
            self.device = compute_device()
        self.comm = self.comm or CommContext(self.device)
        self.compute_dtype = precision.param_dtype if self.dtype.is_floating_point else self.dtype
        self.reduce_dtype = precision.reduce_dtype if self.dtype.is_floating_point else self.dtype
        # zero1/zero2 at full precision: a shard *is* its rows of the kept full buffer.
        # With a low param_dtype the fp32 master rows need their own storage.
        # offload="host": the master rows in host memory (`host`: the engine's HostCopies, Note [host offload]).
        self.storage = policy.storage(self.compute_dtype, self.dtype, host)
        # hpZ: cut into node_world equal chunks (Note [secondary shards]): padded to a multiple of it
        full_numel = -(-mesh.shard_world * self.shard_total // mesh.node_world) * mesh.node_world
        self.full_flat = torch.empty(full_numel, dtype=self.compute_dtype, device=self.device)
        self.secondary = policy.secondary_shard(mesh)
        self.full_views = [self._full_view(layout) for layout in self.layouts]
        # Each parameter's padded region of full_flat, made once like full_views: views stay valid while zero3
        # frees and refills the storage (Note [reused buffers]); every gather reads them.
        self.full_regions = [self._padded_region(layout) for layout in self.layouts]
        self.shard_sizes = [layout.shard_numel for layout in self.layouts]  # each parameter's rows per rank
        self.shard_flat: Tensor | None = None
        self.shard_params: list[nn.Parameter] = []
        self.grads = UnitGrads(self)
        self.freshness = policy.freshness(self._master_stamp, len(self.layouts))  # Note [stepped parameters]
        # GATHERED: full_flat is allocated above; zero3 frees it in take_shards. Counted in `residents` (the
        # engine's, StagePolicy.counted_in): a unit that goes after a use (zero3), other than the root.
        self.residence = Residence(self.label, policy.counted_in(residents) if residents is not None and self.path
                                   else Residents())
        self.stepped_in_backward = False  # sw.optimizer_in_backward steps it (step_in_backward.py)

    @property
    def where(self) -> str:
        return str(self.clock)

    def pin(self) -> None:
        """Keep the full values until the window closes (Note [gradients of inputs], window.py)."""
        self.residence.pinned = True

    def mark_stepped(self, indices: set[int]) -> None:
        """An optimizer is about to write the shards `indices` (layout indices): re-gather before the next use
        (optim_hooks.py; Note [stepped parameters])."""
        self.freshness.mark_stepped(indices)
        self.drop_secondary()  # its values are the rows before this step (Note [secondary shards])

    def mark_fresh(self, layout: ParamLayout) -> None:
        """The owner's broadcast wrote this parameter's whole update into every rank's full view (Note [owner
        broadcast], owner_traffic.py): the next forward need not re-gather it (Note [stepped parameters])."""
        self.freshness.mark_fresh(self.index_of[id(layout)])

    def after_step(self) -> None:
        """An optimizer's step over this unit ended (or was undone): its writes are accounted for (Note
        [stepped parameters])."""
        self.freshness.after_step()

    def hand_steps_to_backward(self) -> None:
        """sw.optimizer_in_backward steps this unit during backward (Note [optimizer in backward])."""
        self.stepped_in_backward = True

    @property
    def label(self) -> str:
        return repr(self.path) if self.path else "<root>"

    @property
    def resident(self) -> bool:
        """Whether the full values are usable now (Note [unit lifecycle])."""
        return self.residence.resident

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
            shard_tensors = self.storage.take(self, originals)
        for layout, tensor in zip(self.layouts, shard_tensors):
            self.shard_params.append(make_shard(layout.owned.param, tensor))  # Note [kept parameter objects]
        self.install_shards()
        for layout in self.layouts:
            # The original full tensor is no longer registered anywhere; dropping our last
            # reference is what actually frees it (4 bytes per parameter otherwise).
            layout.owned.param = None
        self.freshness.gathered()  # zero1/zero2: the kept full values are current
        self.free()  # zero3: only the shards stay

    def set_value(self, index: int, value: Tensor) -> None:
        """Deferred init: parameter `index` now has its value; keep this rank's rows (and,
        for zero1/zero2, the kept full copy). Every rank receives every value."""
        with torch.no_grad():
            self.storage.set_value(self, index, value)
        self.freshness.gathered()  # zero1/zero2: the full copy is current

    def shard_segment(self, layout: ParamLayout) -> Tensor:
        return self.shard_flat[layout.offset : layout.offset + layout.shard_numel]

    def _master_stamp(self) -> int:
        """Moves whenever this rank's master rows are written in place (Note [writes the engine
        must see]): the shards' own version counters plus their flat buffer's."""
        with plain_tensors():  # Note [engine reads]
            return self.storage.master_base(self)._version + sum(shard._version for shard in self.shard_params)

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
        """Whether the full values must be gathered before the next use (the stage's answer)."""
        return self.policy.needs_gather(self)

    def to_gather(self) -> list[int]:
        """The layout indices the next gather carries: zero3 all of them; zero1/zero2 none while the full
        values are current, those an optimizer wrote after steps alone, all after any other write (Note
        [stepped parameters])."""
        return self.freshness.to_gather()

    def current_in_step(self) -> bool:
        """zero1/zero2, inside an optimizer step: the full values were current when the step began and no
        rows were written since (freshness.StepFreshness.current_in_step)."""
        return self.freshness.current_in_step()

    def written(self) -> bool:
        """Rows changed by a write no optimizer step made, which only the ranks that made it see (Note
        [agreement rides the traffic], agreement.py; Note [stepped parameters]; zero3: while the unit stays
        gathered, Note [kept while gathered])."""
        return self.freshness.written()

    def _own_parts(self, dtype: torch.dtype, indices: list[int] | None = None) -> list[Tensor]:
        """This rank's rows of each parameter (of `indices`, else all) in `dtype`, one tensor per parameter:
        the gather's input."""
        indices = range(len(self.layouts)) if indices is None else indices
        return self.storage.own_parts(self, dtype, indices)

    def _regions(self, target: Tensor, indices: list[int] | None = None) -> list[Tensor]:
        if target is self.full_flat:
            return self.full_regions if indices is None else [self.full_regions[i] for i in indices]
        indices = range(len(self.layouts)) if indices is None else indices
        return [self._padded_region(self.layouts[i], target) for i in indices]

    def start_gather(self, async_op: bool) -> None:
        """Issue the all-gather of every rank's rows (SHARDED or stale GATHERED -> GATHERING). The rows
        land straight in full_flat (Note [gathered in place], collectives.py): zero3 allocates it here."""
        self.residence.move(Residency.GATHERING)
        storage = self.full_flat.untyped_storage()
        if storage.nbytes() == 0:  # zero3: memory the comm pool kept from a freed unit, or new (Note [reused buffers])
            self.comm.fill(storage, self.full_flat.numel() * self.full_flat.element_size())
        # An aliased unit's own rows of full_flat are its shards, which the gather sends: already in place.
        indices = self.to_gather()  # zero1/zero2: the stepped ones (Note [stepped parameters])
        with torch.no_grad(), preserve_version_counter(self.full_flat):  # Note [version counters]
            if self.secondary is not None and self.secondary.held:  # hpZ: inside the node (Note [secondary shards])
                self.residence.pending = self.secondary.gather_into(
                    self.comm, self.full_flat, f"the in-node all-gather of unit {self.label} ({self.where})")
            else:
                self.residence.pending = self.comm.gather_into(
                    self._own_parts(self.compute_dtype, indices), self._regions(self.full_flat, indices),
                    self.mesh.shard_world, self.mesh.shard_group,
                    f"the all-gather of unit {self.label} ({self.where})", own_in_place=self.storage.own_in_place)
            if not async_op:
                self.residence.pending.wait()

    def finish_gather(self) -> None:
        """Wait for the all-gather's rows to land in full_flat (GATHERING -> GATHERED)."""
        pending, self.residence.pending = self.residence.pending, None
        with torch.no_grad(), preserve_version_counter(self.full_flat):  # Note [version counters]
            pending.wait()
        self.residence.move(Residency.GATHERED)
        if self.store is not None:
            self.store.release(self.shard_flat)  # read for the gather; back to disk
        self.freshness.now_current()

    def free(self, *, unpin: bool = False) -> None:
        """After a use: the stage's policy releases the full values (zero3; zero1/zero2 keep them), unless
        pinned (Note [gradients of inputs], window.py) until the window closes (`unpin`)."""
        self.residence.pinned = self.residence.pinned and not unpin
        self.policy.free(self)

    def release(self) -> None:
        """zero3's free: drop the full values unless pinned or not gathered; the shards are registered again."""
        if not self.residence.pinned and self.residence.resident:
            if self.secondary is not None and self.clock.phase is Phase.FORWARD and torch.is_grad_enabled():
                self.secondary.cut(self.full_flat)  # hpZ: backward re-gathers in the node (Note [secondary shards])
            self.comm.free(self.full_flat.untyped_storage())  # kept by the comm pool for the next gather
            self.residence.move(Residency.SHARDED)
            self.install_shards()
            self.freshness.released()  # no values held: nothing a write could leave stale (Note [kept while gathered])

    def drop_secondary(self) -> None:
        """hpZ: forget the secondary shard (the window closed, or the rows are about to change)."""
        if self.secondary is not None:
            self.secondary.drop()

    def gather_copy(self) -> dict[str, Tensor]:
        """Fresh full values of every owned parameter, leaving the unit's own state alone."""
        target = torch.empty(self.full_flat.shape, dtype=self.dtype, device=self.device)
        with torch.no_grad():  # the fp32 masters, not the compute copy
            self.comm.gather_into(self._own_parts(self.dtype), self._regions(target), self.mesh.shard_world,
                                  self.mesh.shard_group, f"the gather of unit {self.label}'s full values",
                                  exact=True).wait()  # never quantized (Note [quantized collectives])
        out = {}
        for layout in self.layouts:
            start = self.mesh.shard_world * layout.offset
            out[layout.owned.name] = target[start : start + layout.rows * layout.row_numel].view(layout.shape).clone()
        return out

    def trainable(self) -> list[int]:
        """The indices of the parameters that require grad (the ones the reduce carries)."""
        with plain_tensors():  # Note [engine reads]
            return [i for i, shard in enumerate(self.shard_params) if shard.requires_grad]
