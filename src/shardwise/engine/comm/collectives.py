"""The two collectives of the engine, and the layout changes around them.
Uses: buffers, compat, streams.

A unit's shards travel as one flat, rank-major buffer: rank r's rows of every
parameter, one parameter after another (`S` elements per rank). Full values live
param-major: each parameter's padded rows of all ranks, contiguous, so a parameter's
full tensor is a plain view. Going between the two is one strided copy per parameter
("copy-out" after an all-gather, "pack" before a reduce-scatter), except where a gloo gather
broadcasts a large parameter's rows straight into place (Note [gathered in place]).

Every call names its process group: nothing here reads global state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.engine.comm.buffers import BufferPool
from shardwise.engine.comm.streams import HOST_ORDER
from shardwise.engine.compat import chunk_cat
from shardwise.errors import ShardwiseError


@dataclass
class Pending:
    """In-flight collectives and what to do with their result once they land.

    `what` names the collective, the unit and the step, so that a rank which died or stopped
    calling collectives surfaces on the others as an error saying where they were waiting.
    `finish` turns the landed buffer into the result (Note [gloo collectives]). `sent` keeps the
    input alive until the collective has landed: the caller drops its own reference at once, and
    a buffer freed (and its memory reused) while a backend thread still reads it would send
    whatever was written there next."""

    works: list  # dist.Work handles still to wait for ([] when they already completed)
    output: Tensor
    what: str = "a collective"
    finish: Callable[[Tensor], Tensor] | None = None
    sent: Tensor | list[Tensor] | None = None
    lent: list[Tensor] = field(default_factory=list)  # buffers of `pool` this collective reads or writes
    pool: BufferPool | None = None
    # Where it was issued (Note [streams per collective], streams.py): the device's API and the stream of its
    # kind; the host's order for a collective issued outside a comm context. `event`: recorded when it landed.
    api: object = HOST_ORDER
    stream: object = HOST_ORDER.current()
    event: object = None

    def wait(self) -> Tensor:
        """Land it: the consumer (the current stream) can read `output` once this collective's own event has
        passed, and waits for that event alone, not for the stream it ran on."""
        works, self.works = self.works, []
        with self.stream:
            with named_failure(self.what):
                for work in works:
                    work.wait()
            if self.finish is not None:  # the copy-out, on the collective's own stream
                self.output, self.finish = self.finish(self.output), None
            if self.event is None:
                self.event = self.api.new_event()
                self.event.record(self.stream)
        consumer = self.api.current()
        consumer.wait_event(self.event)
        self.api.keep_for(self.output, consumer)
        self.sent = None
        self._give_back()  # Note [reused buffers]: only now, every work landed and the copy-out queued
        return self.output

    def lend_to(self, pool: BufferPool | None, *buffers: Tensor) -> Pending:
        """`buffers` were lent by `pool` for this collective: given back once it has landed."""
        if pool is not None:
            self.pool = pool
            self.lent.extend(b for b in buffers if pool.is_lent(b))
        return self

    def _give_back(self) -> None:
        lent, self.lent = self.lent, []
        for buffer in lent:
            self.pool.give_back(buffer, after=self.event)  # reused once this collective's stream passed it


class named_failure:
    """Re-raise a collective's failure (a timeout, a peer gone) as an error naming `what`. A class, not a
    generator context: it wraps every collective and every wait (200 a step of make demo's zero3 at 2 ranks),
    and contextlib's form cost 5 Python calls each where this costs 2 (bench/overhead/step_counts.py)."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is None or isinstance(error, ShardwiseError) or \
                not isinstance(error, (RuntimeError, dist.DistBackendError)):
            return False  # nothing raised, or not a collective's failure: as it is
        raise ShardwiseError(
            f"{self.what} failed on this rank: {str(error).splitlines()[0]}. Another rank most likely died, hangs, "
            "or ran a different sequence of steps (a forward or backward this rank did not run); its own error, "
            "if any, says why. The wait is bounded by sw.init(timeout=...)."
        ) from error


def any_rank(flags: list[bool], host_group) -> list[bool]:
    """Each flag OR-ed over the ranks of `host_group` (a CPU group: Note [host values])."""
    if not flags or dist.get_world_size(host_group) == 1:
        return flags
    values = torch.tensor(flags, dtype=torch.int32)
    with named_failure("the agreement on which parameters have gradients"):
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=host_group)
    return [bool(v) for v in values.tolist()]


# Note [gloo collectives]: gloo's all-gather and reduce-scatter are slow next to its broadcast,
# all-reduce and all-to-all (one thread per rank, loopback, interleaved rounds, ms;
# `python bench/comm/collectives.py --sizes-mib 0.002 0.008 0.03 0.125 0.5 1 4 16 64`,
# bench/comm/results/collectives.md, median of 7 on a quiet machine):
#
#   ranks  MiB    all-gather  w broadcasts  |  reduce-scatter  all-reduce + own rows  all-to-all + sum
#     2    0.002     0.3         0.3        |       0.4              0.3                  0.3
#     2    1         0.8         0.5        |       1.3              0.8                  0.8
#     2   64        67.0        22.2        |      82.5             46.6                 31.3
#     4    0.002     1.4         1.2        |       4.9              6.4                  1.3
#     4    1         5.7         1.5        |       4.6              5.0                  3.0
#     4   64       128.1        41.2        |     217.8            102.1                 57.0
#
# So on gloo a gather is one asynchronous broadcast per rank, each from the rank whose rows it
# carries (per large parameter: Note [gathered in place]), and a reduce-scatter whose rows per
# rank reach GLOO_FORMS_FROM_BYTES an all-to-all:
# each rank receives every rank's copy of its own rows (the same bytes a ring reduce-scatter
# moves, half an all-reduce's) and sums them itself, in rank order, so the ranks' rows agree as
# before. It needs a receive buffer the size of the packed one while the reduce is in flight,
# which an all-reduce summed in place would not; the estimator counts it. NCCL's own
# all-gather and reduce-scatter are the fast ones there. Both forms keep Note [collective order]:
# one group, the same sequence of calls on every rank. zero1 reduces the same way, its kept
# gradients being the packed input (Note [kept gradients rank-major], unit_grads.py).

# Per rank's rows. The all-to-all beats torch's reduce-scatter at every size measured, from 1 KiB per
# rank: 1.4-2.6x at 2 ranks, 1.6-6.6x at 4 (the table's "reduce ÷"; a second run of the small sizes,
# 9-15 rounds, gave 1.5-5x and 3.6-7x). It was 512 KiB, set when an all-reduce was the form; on a
# GPT of d_model 128 (4 layers, units of 0.4 MiB per rank at 2 ranks) the old threshold stepped at
# 1.10 / 1.04 / 1.15 x this one's for zero1 / zero2 / zero3 at 2 ranks and 1.05 / 1.05 / 1.08 at 4
# (5 interleaved rounds: `python bench/overhead/phases.py --configs zero1,zero2,zero3 --against OLD/src
# --model-args='--d-model 128 --layers 4 --vocab 1024 --heads 4'`). Units under 1 KiB per rank (a
# few norms; not measured) keep torch's form, NCCL's, which test_zero_parity.py also runs for every
# unit (tests/helpers/forms.py).
GLOO_FORMS_FROM_BYTES = 1024


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_gather(shard_flat: Tensor | list[Tensor], world_size: int, group, async_op: bool,
               what: str = "an all-gather", *, gloo: bool | None = None, pool: BufferPool | None = None) -> Pending:
    """Gather every rank's flat shard into one rank-major buffer of `world_size * S` (lent by `pool` when
    given: Note [reused buffers]). The shard may come in parts (a zero1/zero2 unit's rows of each
    parameter), concatenated in order straight into this rank's place of the buffer on gloo: one copy,
    not a concatenation and then a copy. `gloo`: the form, as the caller's strategy decided (None: ask)."""
    parts = [shard_flat] if isinstance(shard_flat, Tensor) else shard_flat
    like = parts[0]
    numel = world_size * sum(part.numel() for part in parts)
    gathered = pool.lend(numel, like.dtype, like.device) if pool is not None else \
        torch.empty(numel, dtype=like.dtype, device=like.device)
    with named_failure(what):
        if _is_gloo(group) if gloo is None else gloo:  # Note [gloo collectives]
            by_rank = gathered.view(world_size, -1)
            torch.cat(parts, out=by_rank[dist.get_rank(group)])
            shard_flat = None  # nothing else is sent: the buffer holds it
            works = [dist.broadcast(rows, group=group, async_op=True, group_src=rank)  # Note [group ranks]
                     for rank, rows in enumerate(by_rank)]
        else:
            shard_flat = torch.cat(parts) if len(parts) > 1 else like
            works = [dist.all_gather_single(gathered, shard_flat, group=group, async_op=True)]
    pending = Pending(works, gathered, what, sent=shard_flat).lend_to(pool, gathered)
    if not async_op:
        pending.wait()
    return pending


# Note [gathered in place]: on gloo a parameter whose rows per rank reach GLOO_IN_PLACE_FROM_BYTES is
# gathered by broadcasts straight into its full region, one per rank, each from that rank's rows: no
# send buffer to concatenate this rank's rows into, no rank-major buffer to allocate and then copy
# out. Smaller parameters travel together through `all_gather` and a copy-out (one broadcast per
# rank for all of them: a broadcast of a few KiB costs its latency, not its bytes). Measured on a
# GPT block's 12 parameters (4 matrices, 8 vectors), 9 units, in interleaved rounds
# (`python bench/comm/gather_in_place.py`, bench/comm/results/gather_in_place.md): in isolation, where the
# packed buffer comes back from the allocator's cache, the gather takes 0.86x the packed time at 2
# ranks (0.78-1.22 over 7 rounds) and 1.14x at 4 (more broadcasts to issue); every parameter in
# place is 1.8-2x (the vectors' latency). In a training step (3 interleaved rounds, 2 ranks) zero2
# is unchanged and zero3, whose copy-out wrote every rank's rows twice a step into freshly
# allocated storage, about 1% faster; and no unit holds a receive buffer beside its full values.
# NCCL's all-gather is one call into a rank-major buffer: there everything travels packed.
GLOO_IN_PLACE_FROM_BYTES = 64 * 1024

# Note [group ranks]: a gather's broadcasts name their source by its rank in the group (`group_src`), which
# torch's broadcast takes as it is; a global `src` made each broadcast translate twice (ours to global, torch's
# back to the group's), 10 Python calls per broadcast, 114 broadcasts a step of make demo's zero3 at 2 ranks
# (bench/overhead/step_counts.py).


def gather_into(rows: list[Tensor], regions: list[Tensor], world_size: int, group, async_op: bool,
                what: str = "an all-gather", own_in_place: bool = False, *, gloo: bool | None = None,
                pool: BufferPool | None = None) -> Pending:
    """Every rank's rows of each parameter into its padded full region (param-major), the other ranks'
    by the time the result is waited for. `rows[i]` is this rank's rows of parameter i, contiguous, in
    the regions' dtype; `regions[i]` holds `world_size * rows[i].numel()` elements; `own_in_place`: each
    `rows[i]` already is its region's own chunk (a zero1/zero2 shard), so it is not copied there."""
    rank = dist.get_rank(group)
    chunks = [region.view(world_size, -1) for region in regions]
    gloo = _is_gloo(group) if gloo is None else gloo  # asked once per gather at most, not once per parameter
    in_place = [gloo and part.nbytes >= GLOO_IN_PLACE_FROM_BYTES for part in rows]
    works = []
    with named_failure(what):
        for part, by_rank, direct in zip(rows, chunks, in_place):
            if not direct:
                continue
            for src in range(world_size):  # Note [gathered in place]
                target = part if src == rank else by_rank[src]
                works.append(dist.broadcast(target, group=group, async_op=True, group_src=src))  # Note [group ranks]
            if not own_in_place:
                by_rank[rank].copy_(part)
    packed = [i for i, direct in enumerate(in_place) if not direct]
    small = all_gather([rows[i] for i in packed], world_size, group, async_op=True, what=what, gloo=gloo,
                       pool=pool) if packed else None

    def finish(output: Tensor) -> Tensor:
        if small is not None:
            sizes = [rows[i].numel() for i in packed]
            segments = list(zip(itertools.accumulate(sizes, initial=0), sizes))
            copy_out(small.wait(), world_size, segments, [regions[i] for i in packed],
                     skip_rank=rank if own_in_place else None)
        return output

    pending = Pending(works, regions[0] if regions else torch.empty(0), what, finish=finish, sent=rows)
    if small is not None:  # its buffer is read by this handle's copy-out: given back with this handle's event
        small.lent, adopted = [], small.lent
        pending.lend_to(pool, *adopted)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_avg(packed: Tensor, world_size: int, group, async_op: bool,
                       what: str = "a reduce-scatter", out: Tensor | None = None, *, gloo: bool | None = None,
                       pool: BufferPool | None = None) -> Pending:
    """Average a rank-major `world_size * S` buffer across ranks; this rank gets its `S` rows, in
    `out` where the form allows it (gloo's all-to-all; zero1 passes its own rows of `packed`). A `packed`
    that `pool` lent goes back to it once the reduce landed, and so does the receive buffer it lends."""
    if world_size == 1:  # the mean of one copy: no collective, no copy (zero1's rows are in place already)
        return Pending([], packed, what)
    gloo = _is_gloo(group) if gloo is None else gloo
    with named_failure(what):
        if gloo and packed.nbytes // world_size >= GLOO_FORMS_FROM_BYTES:
            # Note [gloo collectives]: every rank's copy of this rank's rows, summed here
            received = pool.lend(packed.numel(), packed.dtype, packed.device) if pool is not None else \
                torch.empty_like(packed)
            work = dist.all_to_all_single(received, packed, group=group, async_op=True)
            pending = Pending([work], received, what, sent=packed,
                              finish=lambda copies: _average_copies(copies, world_size, out))
            pending.lend_to(pool, packed, received)
        else:
            shard = torch.empty(packed.numel() // world_size, dtype=packed.dtype, device=packed.device)
            work = dist.reduce_scatter_single(shard, packed, op=dist.ReduceOp.AVG, group=group, async_op=True)
            pending = Pending([work], shard, what, sent=packed).lend_to(pool, packed)
    if not async_op:
        pending.wait()
    return pending


def all_reduce_avg_async(tensor: Tensor, group, what: str = "an all-reduce") -> Pending:
    """Average `tensor` in place over `group`'s ranks, issued async: `wait()` on the handle lands it
    (Note [async replica reduce], unit_grads.py)."""
    with named_failure(what):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group, async_op=True)
    return Pending([work], tensor, what)


def _average_copies(copies: Tensor, world_size: int, out: Tensor | None = None) -> Tensor:
    """The mean of the `world_size` copies of this rank's rows that an all-to-all received, added in rank
    order into one tensor (new, or `out`): half the time of `sum(dim=0)` on CPU, which writes a temporary first."""
    by_rank = copies.view(world_size, -1)
    mean = torch.add(by_rank[0], by_rank[1], out=out)
    for rows in by_rank[2:]:
        mean.add_(rows)
    return mean.div_(world_size)


def copy_out(gathered: Tensor, world_size: int, segments: list[tuple[int, int]], full_regions: list[Tensor],
             skip_rank: int | None = None) -> None:
    """Rank-major gathered rows -> each parameter's param-major padded region.

    `segments[i]` is (offset, numel) of parameter i inside one rank's shard, back to back from 0
    (param_layout.lay_out); `full_regions[i]` is its padded full region (`world_size * numel`
    elements). One `split_with_sizes_copy` for the unit, as FSDP2 copies out, not a copy per parameter;
    two when `skip_rank`'s rows are left alone (they are in place already: a zero1/zero2 shard is its
    rows of the regions), which saves 1/world_size of the copy.
    """
    if not segments:
        return
    by_rank = gathered.view(world_size, -1)
    sizes = [numel for _, numel in segments]
    regions = [region.view(world_size, numel) for region, numel in zip(full_regions, sizes)]
    spans = [(0, world_size)] if skip_rank is None else [(0, skip_rank), (skip_rank + 1, world_size)]
    for start, stop in spans:
        if start < stop:
            torch.split_with_sizes_copy(by_rank[start:stop], sizes, dim=1,
                                        out=[region[start:stop] for region in regions])


def pack(grads: list[Tensor | None], rows: list[int], world_size: int, segments: list[tuple[int, int]],
         total: int, like: Tensor, out: Tensor | None = None) -> Tensor:
    """Full gradients (None = unused this step: zeros) -> one rank-major buffer for reduce-scatter
    (written into `out`, of `world_size * total` elements, when given: zero1's kept gradients).

    Rank r's segment of parameter i is its rows r*c:(r+1)*c (c = ceil(rows / world_size)), the last
    ranks' padded with zeros: exactly what chunking every gradient along dim 0 into `world_size`
    padded chunks and concatenating chunk-wise gives, so it is one `chunk_cat` kernel (FSDP2's
    reduce-scatter input is built the same way) where every gradient is present, non-empty and in
    `like`'s dtype; a copy per parameter otherwise. (`chunk_cat`, torch's `_chunk_cat`, also converts
    bf16 gradients into an fp32 buffer, bitwise as the copies do, but on CPU it is no faster: 0.51-0.88
    against 0.45-0.71 ms per GPT block of d_model 512 at 2 ranks, median of 20-30 calls in 2-3 runs;
    so mixed dtypes keep the copies until a GPU measures it.)"""
    by_rank = None if out is None else out.view(world_size, total)
    if grads and all(g is not None and g.numel() and g.dtype == like.dtype for g in grads):
        # By rows: a 0-D scalar is one row.
        return chunk_cat([g.reshape(num_rows, -1) for g, num_rows in zip(grads, rows)], world_size,
                         out=by_rank).view(-1)
    if by_rank is None:
        packed = torch.zeros(world_size, total, dtype=like.dtype, device=like.device)
    else:
        packed = by_rank.zero_()
    for grad, num_rows, (offset, numel) in zip(grads, rows, segments):
        if grad is None or numel == 0:
            continue
        target = packed[:, offset : offset + numel]
        flat = grad.reshape(-1)
        if flat.numel() == world_size * numel:
            target.copy_(flat.view(world_size, numel))
        else:  # the last rank's rows are padding: copy the real rows through a padded view
            padded = torch.zeros(world_size * numel, dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            target.copy_(padded.view(world_size, numel))
    return packed.view(-1)
