"""One unit's gradient side: accumulate full gradients, pack them for the reduce-scatter, hand
each shard its averaged rows. Uses: collectives.

A unit's gradients have their own phase (`GradPhase`): IDLE until a backward hands the unit
gradients to keep (zero1, or any stage under no_sync: ACCUMULATING), back to IDLE once the
reduce has landed (averaged over the shard group, then over the replicas: Note [mesh info]) and its
rows were handed out (`land`, `settle`).

Note [unused params]: a parameter no rank used this step must keep `grad=None`, as in a single
process (AdamW then leaves it alone: no decay, no moment update), while one used by some ranks
gets the average with zeros from the others. Which parameters a rank used is host knowledge (a
gradient is None or not: `used_here`, per reduced parameter), so the hot path reads no device value
of the gradients to decide it (a read per parameter, then per unit, stalled a GPU's stream at every
unit boundary); the ranks OR their flags (schedule/used_flags.py): on gloo one small all-reduce of
host values a step over the host group (collectives.any_rank) once every reduce has landed, where the
host waits for the reduces anyway; on a device (NCCL) a device all-reduce sent right after the last
reduce, which only a rank that did not use every parameter reads (a rank that used all of them knows
the OR is all True): no host rendezvous in a step that uses the whole model (Note [used flags on the
device]). `hand_out` gives the rows of the parameters this rank used at once, `settle` the others'
once the OR is known.

Note [kept gradients rank-major]: zero1 keeps every full gradient until the step (and any
stage does under no_sync) in `full`, laid out exactly as the reduce sends it: rank-major, rank
r's rows of every parameter back to back (collectives.pack). The first backward of a window
packs its gradients straight over the buffer (one `chunk_cat` where every parameter has a
non-empty gradient in the reduce dtype: no zeroing, no add; otherwise a zero fill and a copy
per parameter), a later one adds a packed copy; the reduce then sends `full` itself, and
on gloo's all-to-all form averages the copies it receives into this rank's own rows of `full`,
of which each shard's gradient is a view. So zero1 reduces as zero2 does: half the bytes of the
in-place all-reduce it used before (bench/comm/results/collectives.md), no pack, no copy of its rows.
The receive buffer (one unit, while the reduce is in flight) is what it costs on gloo; the
estimator counts it. Where it reduces with torch's reduce-scatter (NCCL, small units) it now
packs nothing and holds no packed copy (a unit with frozen parameters still packs its trainable
ones apart). Measured (29.5M GPT, 2 ranks on 2 cores, 3 interleaved
rounds): step x DDP 1.03 before and after, within the machine's noise; alone (1 rank), backward
750-810 ms against 780-815 ms.

Note [async replica reduce]: on a hybrid mesh a unit's rows, once averaged over its shard group, are
averaged over the replicas too (Note [mesh info]). That all-reduce is issued as the reduce-scatter lands
(`land`) and waited only where the rows are needed (`hand_out`): once MAX_PENDING_REPLICAS later units'
reduce-scatters have landed (reducer.py: a bound on the rows held), by the reducer's `finish` for the last
ones, or at once for a unit stepped in backward (Note [optimizer in backward]); so the replica traffic of
one unit overlaps the next units' backward and reduce-scatters instead of stalling the unit's landing.
Every rank issues them in the same order (the reducer's), on the replicate group, where nothing else runs.
"""

from __future__ import annotations

import enum

import torch
from torch import Tensor

import shardwise.engine.comm.collectives as coll


class GradPhase(enum.Enum):
    """Whether a unit holds full gradients waiting for their reduce."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"  # full gradients summing in `full` (zero1; no_sync)


class UnitGrads:
    """The gradients of one unit (flat_unit.FlatUnit): read its layout, write only its own fields."""

    def __init__(self, unit) -> None:
        self.unit = unit
        self.full: Tensor | None = None  # accumulated full gradients, rank-major (zero1; no_sync)
        self.phase = GradPhase.IDLE
        self.carried: dict[int, Tensor] = {}  # zero1: reduced grads the user did not zero
        self.used: set[int] = set()  # parameters that got a gradient in this accumulation window
        self.pending: coll.Pending | None = None  # the reduce-scatter in flight
        self.replicas: coll.Pending | None = None  # hybrid: the replica average in flight (Note [async replica reduce])
        self.landed_in_full = False  # the landed rows are zero1's own rows of `full`
        self.indices: list[int] = []  # the trainable parameters it reduces, in packing order
        self.used_here: list[bool] = []  # per reduced parameter: did this rank have a gradient
        self.waiting: dict[int, Tensor] = {}  # landed rows of parameters this rank did not use, by column
        self.into_full: Tensor | None = None  # where the last reduce averaged into `full`'s own rows, if so

    # ---- accumulation (zero1, no_sync) --------------------------------------------------

    def _pack(self, grads: list[Tensor | None], indices: list[int], out: Tensor | None = None) -> Tensor:
        """The gradients of `indices` (None: zeros), packed rank-major (collectives.pack), into `out`, else
        into a buffer the comm context lends (Note [reused buffers]; given back when its reduce lands)."""
        layouts = [self.unit.layouts[i] for i in indices]
        segments, offset = [], 0
        for layout in layouts:
            segments.append((offset, layout.shard_numel))
            offset += layout.shard_numel
        world = self.unit.mesh.shard_world
        if out is None and world > 1:  # one rank reduces nothing: its packed rows are its gradients
            out = self.unit.comm.lend(world * offset, self.unit.reduce_dtype, self.unit.device)
        return coll.pack([grads[i] for i in indices], [layout.rows for layout in layouts], self.unit.mesh.shard_world,
                         segments, offset, torch.empty(0, dtype=self.unit.reduce_dtype, device=self.unit.device),
                         out=out)

    def _every_index(self) -> list[int]:
        return list(range(len(self.unit.layouts)))

    def _begin_accumulation(self, grads: list[Tensor | None]) -> None:
        """Note [kept gradients rank-major]: the first backward of a window writes its gradients
        (zeros where None) over `full`, packed as the reduce sends them: no add."""
        unit = self.unit
        if self.full is None:
            self.full = torch.empty(unit.mesh.shard_world * unit.shard_total, dtype=unit.reduce_dtype,
                                    device=unit.device)
        else:
            # zero1 keeps `full` allocated across steps, and its shards' grads are views of their
            # own rows in it: set aside any the user kept (accumulating across steps) first.
            for i, shard in enumerate(unit.shard_params):
                if shard.grad is not None:
                    self.carried[i] = shard.grad.clone()
                    shard.grad = None
        self._pack(grads, self._every_index(), out=self.full)

    def accumulate(self, grads: list[Tensor | None]) -> None:
        """Add this backward's full gradients into `full` (zero1, or under no_sync)."""
        self.used.update(i for i, grad in enumerate(grads) if grad is not None)
        with torch.no_grad():
            if self.phase is GradPhase.IDLE:
                self._begin_accumulation(grads)
                self.phase = GradPhase.ACCUMULATING
            elif any(grad is not None for grad in grads):  # a later micro-batch: rare, one packed temporary
                packed = self._pack(grads, self._every_index())
                self.full.add_(packed)
                self.unit.comm.give_back(packed)

    def holds_full(self) -> bool:
        """Whether accumulated full gradients exist (zero1 always; zero2/zero3 after no_sync)."""
        return self.full is not None

    def _by_rank(self) -> Tensor:
        """`full` as (world_size, S): row r holds rank r's rows of every parameter, in shard order."""
        return self.full.view(self.unit.mesh.shard_world, -1)

    def _own_rows(self, layout) -> Tensor:
        """This rank's rows of one parameter in `full` (rank-major: contiguous)."""
        return self._by_rank()[self.unit.mesh.shard_rank, layout.offset : layout.offset + layout.shard_numel]

    # ---- the reduce ------------------------------------------------------------------------

    def start_reduce(self, grads: list[Tensor | None] | None, async_op: bool) -> None:
        """Reduce-scatter (average) the full gradients of the trainable parameters: `grads`, or
        with None the kept ones (`full`; zeros where this rank kept none). A None gradient is zeros
        here and "unused" in `used_here` (Note [unused params])."""
        unit = self.unit
        self.indices = unit.trainable()
        what = f"the gradient reduce of unit {unit.label} ({unit.where})"
        self.into_full = None
        if grads is None and self.full is not None:  # Note [kept gradients rank-major]
            if self.phase is GradPhase.IDLE:  # this rank added nothing in this window: it sends zeros
                self._begin_accumulation([None] * len(unit.layouts))  # (not an earlier step's sums)
            self.used_here = [i in self.used for i in self.indices]
            if self.indices == self._every_index():
                packed = self.full  # already the reduce's input
                if unit.policy.kept_grads(packed) is not None:  # zero1: the average lands in its kept rows;
                    # zero2/zero3 get fresh rows, so `full` goes once the reduce lands (no_sync's 4 bytes/param)
                    self.into_full = self._by_rank()[unit.mesh.shard_rank]
            else:  # frozen parameters in the unit: their rows stay home
                by_rank = self._by_rank()
                packed = torch.cat([by_rank[:, unit.layouts[i].offset : unit.layouts[i].offset
                                            + unit.layouts[i].shard_numel] for i in self.indices], dim=1).view(-1)
        else:
            grads = [None] * len(unit.layouts) if grads is None else grads
            self.used_here = [grads[i] is not None for i in self.indices]
            packed = self._pack(grads, self.indices)
        self.pending = unit.comm.reduce_scatter_avg(packed, unit.mesh.shard_world, unit.reduce_group, what,
                                                    out=self.into_full)
        if not async_op:
            self.pending.wait()

    def land(self) -> None:
        """Wait for the reduce over the shard group; on a hybrid mesh issue, without waiting, the average of
        its rows over the replicas (Note [async replica reduce]), which `hand_out` waits for."""
        unit, pending, self.pending = self.unit, self.pending, None
        reduced = pending.wait()  # the average over the shard group; then over the replicas (Note [mesh info])
        self.landed_in_full = self.into_full is not None and reduced.data_ptr() == self.into_full.data_ptr()
        self.into_full = None
        self.replicas = unit.comm.all_reduce_avg(
            reduced, unit.mesh.replicate_group,
            f"the gradient average across replicas of unit {unit.label} ({unit.where})") if unit.mesh.hybrid \
            else coll.Pending([], reduced, "a landed reduce")

    def hand_out(self) -> None:
        """Once the rows are averaged everywhere (the replica average waited for here): hand out at once the
        rows of every parameter this rank used (some rank used it, so it gets its average); keep the others'
        rows for `settle`, which the agreement on which parameters any rank used decides (Note [unused params])."""
        unit, replicas, self.replicas = self.unit, self.replicas, None
        reduced, in_full = replicas.wait(), self.landed_in_full
        offset = 0
        for column, i in enumerate(self.indices):
            layout = unit.layouts[i]
            rows = reduced[offset : offset + layout.shard_numel].view(layout.shard_shape).to(unit.dtype)
            offset += layout.shard_numel
            if self.used_here[column]:
                self._give(i, rows)
            else:  # a copy: the reduced buffer is released now, as when every row is handed out
                self.waiting[column] = rows if in_full else rows.clone()
        self.phase = GradPhase.IDLE
        self.used.clear()
        self.full = unit.policy.kept_grads(self.full)

    def settle(self, used_by_any: list[bool]) -> None:
        """The rows kept by `land`: a gradient where some rank used the parameter; where none did,
        the shard keeps the gradient it had (None, as in one process). `used_by_any[k]` is about
        the k-th reduced parameter."""
        for column, rows in self.waiting.items():
            i = self.indices[column]
            if used_by_any[column]:
                self._give(i, rows)
                continue
            carried = self.carried.pop(i, None)
            if carried is not None:
                self.unit.shard_params[i].grad = carried  # nobody added to it this time
        self.waiting = {}
        self.carried.clear()

    def _give(self, i: int, rows: Tensor) -> None:
        """Shard i's averaged rows: added to its gradient, or its gradient (plus what it carried)."""
        unit, shard = self.unit, self.unit.shard_params[i]
        carried = self.carried.pop(i, None)  # zero1: this shard's gradient from earlier backwards
        kept = unit.policy.kept_grads(self.full)
        grad = shard.grad  # read once: a property (shard_param.py)
        # Where the master rows live (offload="host": copied to the host, at once where the host adds it next)
        rows = unit.storage.grad_rows(unit, rows, blocking=grad is not None or carried is not None)
        if grad is not None:
            grad.add_(rows)
        elif kept is not None and kept.dtype == unit.dtype and unit.storage.grads_in_kept:
            # zero1: the shard's grad is a view of its own rows of the kept full grads, so the
            # gradients are stored once, not twice (the all-to-all averaged them there already).
            own = self._own_rows(unit.layouts[i]).view(unit.layouts[i].shard_shape)
            if own.data_ptr() != rows.data_ptr():
                own.copy_(rows)
            shard.grad = own if carried is None else own.add_(carried)
        else:
            shard.grad = rows if carried is None else rows + carried

    def end_accumulation(self) -> None:
        """After the synced reduce: zero2/zero3 drop the no_sync full grads; zero1 keeps its buffer."""
        self.phase = GradPhase.IDLE
        self.carried.clear()
        self.used.clear()
        self.full = self.unit.policy.kept_grads(self.full)

    def drop(self) -> None:
        """A backward that raised midway (Note [aborted backward]): forget this step's gradients."""
        self.waiting = {}
        self.end_accumulation()
        for shard in self.unit.shard_params:
            shard.grad = None
