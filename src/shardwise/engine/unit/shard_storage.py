"""Where a unit's master rows live beside its full values, which the stage and the precision decide
together (the stage policy picks one, stage.py): `AliasedShards` (zero1/zero2 at full precision: a shard
*is* its rows of the kept full buffer), `OwnShards` (zero3: a rank-major `shard_flat`, the all-gather's
input) and `OwnShardsKeptFull` (zero1/zero2 with a lower compute dtype: the fp32 master rows need
storage of their own, and the kept full values are their cast). Each is asked by its unit
(flat_unit.FlatUnit), never tested for; offload="host" adds two more, `HostRows` and `HostRowsKeptFull`,
whose rows live in host memory and move through the engine's HostCopies (memory/host_offload.py, Note [host
offload]). Uses: nothing of the engine.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _fill_full(unit, originals: list[Tensor | None]) -> None:
    """The kept full values from each parameter's value (None: zeros)."""
    unit.full_flat.zero_()
    for view, original in zip(unit.full_views, originals):
        if original is not None:
            view.copy_(original.detach())


class MasterStorage:
    """What every storage answers beside its rows: the gradients' home and the host's copies (none here)."""

    # zero1: a shard's gradient may be a view of its rows of the kept full gradients (unit_grads.py)
    grads_in_kept = True
    host = None  # offload="host": the engine's HostCopies (Note [host offload])

    def grad_rows(self, unit, rows: Tensor, blocking: bool) -> Tensor:
        """A parameter's averaged gradient rows where its master rows live: here, where they landed."""
        return rows

    def synchronize(self) -> None:
        """Before the host reads the gradient rows: nothing is in flight here."""


class AliasedShards(MasterStorage):
    """The shards are views of this rank's rows of `full_flat`: the optimizer updates the full buffer in
    place and no separate copy exists."""

    # The all-gather sends this rank's rows from where they land (Note [gathered in place], collectives.py).
    own_in_place = True
    # The owner's whole update can go straight into every rank's full view (Note [owner broadcast]).
    whole_in_full_view = True

    def take(self, unit, originals: list[Tensor | None]) -> list[Tensor]:
        """Write each parameter's value (None: zeros) and return the shard tensors."""
        _fill_full(unit, originals)
        return [unit.own_rows(unit.full_flat, layout).view(layout.shard_shape) for layout in unit.layouts]

    def set_value(self, unit, index: int, value: Tensor) -> None:
        unit.full_views[index].copy_(value)

    def master_base(self, unit) -> Tensor:
        """The flat buffer holding the master rows (its version counter is part of the unit's stamp)."""
        return unit.full_flat

    def own_parts(self, unit, dtype: torch.dtype, indices) -> list[Tensor]:
        """This rank's rows of each parameter of `indices`: views of full_flat, in place."""
        return [unit.own_rows(unit.full_flat, unit.layouts[i]).detach() for i in indices]


class OwnShards(MasterStorage):
    """The shards live in one rank-major `shard_flat` (memory-mapped under disk offload)."""

    own_in_place = False
    whole_in_full_view = False

    def new_flat(self, unit) -> Tensor:
        """Zeroed memory for this rank's rows of every parameter."""
        return unit.store.zeros(unit.shard_total, unit.dtype) if unit.store is not None \
            else torch.zeros(unit.shard_total, dtype=unit.dtype, device=unit.device)

    def take(self, unit, originals: list[Tensor | None]) -> list[Tensor]:
        unit.shard_flat = self.new_flat(unit)
        for layout, original in zip(unit.layouts, originals):
            if original is not None:
                unit.shard_segment(layout).copy_(unit.mesh.own_chunk(original, layout.shard_numel))
        return [unit.shard_segment(layout).view(layout.shard_shape) for layout in unit.layouts]

    def set_value(self, unit, index: int, value: Tensor) -> None:
        layout = unit.layouts[index]
        unit.shard_segment(layout).copy_(unit.mesh.own_chunk(value, layout.shard_numel))

    def master_base(self, unit) -> Tensor:
        return unit.shard_flat

    def own_parts(self, unit, dtype: torch.dtype, indices) -> list[Tensor]:
        flat = unit.shard_flat.to(dtype).detach()  # a no-op at full precision, a cast to param_dtype otherwise
        parts = flat.split(unit.shard_sizes)
        return [parts[i] for i in indices]


class OwnShardsKeptFull(OwnShards):
    """Low-precision zero1/zero2: the master rows in `shard_flat`, and the kept full values, cast once."""

    def take(self, unit, originals: list[Tensor | None]) -> list[Tensor]:
        shard_tensors = super().take(unit, originals)
        _fill_full(unit, originals)
        return shard_tensors

    def set_value(self, unit, index: int, value: Tensor) -> None:
        unit.full_views[index].copy_(value)
        super().set_value(unit, index, value)


class HostRows(OwnShards):
    """zero3 under offload="host": the rank-major master rows in host memory (Note [host offload])."""

    grads_in_kept = False  # gradients live beside the host rows, never in the device's kept full gradients

    def __init__(self, copies) -> None:  # the engine's HostCopies (memory/host_offload.py)
        self.copies = self.host = copies

    def new_flat(self, unit) -> Tensor:
        self.copies.check_group(unit.mesh.norm_group)  # the host gradients' norms meet there (Note [host offload])
        return self.copies.host_empty(unit.shard_total, unit.dtype, unit.device).zero_()

    def own_parts(self, unit, dtype: torch.dtype, indices) -> list[Tensor]:
        parts = self.copies.to_device(unit, unit.shard_flat.detach(), dtype).split(unit.shard_sizes)
        return [parts[i] for i in indices]

    def grad_rows(self, unit, rows: Tensor, blocking: bool) -> Tensor:
        return self.copies.to_host(unit, rows, blocking)

    def synchronize(self) -> None:
        self.copies.synchronize()


class HostRowsKeptFull(HostRows, OwnShardsKeptFull):
    """zero1/zero2 under offload="host": the master rows in host memory, the kept full values on the device
    (their cast, re-gathered from the host rows after each step)."""
