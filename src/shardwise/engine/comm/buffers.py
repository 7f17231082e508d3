"""The buffers a collective writes or reads for one use only, reused across units and steps within a
stated bound. Uses: compat, streams.

Note [reused buffers]: on CPU a fresh large buffer costs its page faults on first touch (issue 33's
note: a copy into a fresh 48 MiB buffer 23 ms, into a reused one 7 ms), and every step made the same
fresh buffers again: each unit's packed reduce input and its receive buffer (zero2/zero3), zero1's
receive buffer, the packed gather of a unit's small parameters, and under compression the quantized
forms' uint8 wire buffers (sent and received, Note [quantized collectives], quantize.py). A `BufferPool`
lends them instead and takes them back when the collective that used them has landed (`Pending.wait`, collectives.py): a
buffer is never lent twice at once, so a reuse cannot read or write rows another collective still
sends or receives. On a GPU a buffer goes back with the event after which every stream that read it is
done, and its next taker's stream waits for that event before writing (Note [streams per collective],
streams.py): the host gives a buffer back when it has *queued* the last read, not when the read ran.

zero3 also frees each unit's full values after each use and allocated them again at the next gather
(twice a step per unit, the largest fresh buffers of all): its freed memory goes to the pool instead
(`keep_memory`: the storage's memory moves out, compat.swap_storage_memory, the storage object the
saved views hold stays), and the next gather of a unit of that size takes it back (`fill`).

The bound: the pool holds (lent + kept) at most `bound` bytes, `comm_buffer_bytes`: the reduce in flight
(its packed input and receive buffer), the wire buffers of one quantized gather and one quantized reduce
in flight (under compression: 1/4 of a unit's fp32 rows at int8, 1/8 at int4, plus one fp32 scale per
block), and under zero3 the full values of the units gathered at once, the rows the estimator counts
(Note [transient buffers], estimate/core.py). The reduce and the wire buffers are sized over the largest
unit, the root included: the root's reduce is issued every step like any other (last in backward), and
a GPT's root (its embedding) is often the largest unit of all (the bench GPT's: 4.2M elements against
3.2M a block), so a bound over the other units alone served the root's buffers fresh every step, and
making room for them released the blocks' (3 fresh allocations a step under zero1, 9 under zero2, 3
under zero3, at 2 ranks; none after the first step now under zero1/zero2, tests/test_comm.py). A request
past the bound is served by a fresh buffer as before, not kept; kept buffers are released smallest first
when a request needs room, and only when that makes room: releasing them for a request that cannot be
kept anyway would only allocate them again at their next use. Buffers under HEAP_BYTES (the packed gather
of a unit's few small parameters: 20 KiB a block of the bench GPT) are not lent at all: malloc's heap
reuses them without new pages, the bound does not count them, and pooled they took a large kept buffer
another collective needed next (zero3: one 12 MiB buffer fresh a step).

Note [lean tail]: what a pool keeps idle adds to the step's peak, and zero3's peak is in backward: kept
for the whole step, the bound cost flat zero3 5 of FSDP2's 133 blocks at 4 ranks and 2 GiB
(bench/memory/max_model.py; 128). Measured per phase (VmHWM reset at each, 4 ranks, 16 blocks of that GPT,
the second and third steps): the peak was the tail of backward, once its last gather was issued (the root's
embedding backward and reduce: 659 MiB), where the blocks' kept full values and the blocks' reduce buffers
sat idle beside the root's buffers and autograd's gradients of the tied embedding, 45 MiB over the same
engine with no pool (615) and 52 over FSDP2 (607). So when zero3's backward issues the step's last gather
(`trim`, from the step driver), the kept buffers are released and, until the next gather (`fill`: the
next forward), freed full values are not kept; a reduce buffer given back is still kept for the tail's next
reduce, and one that does not fit a request (the root's are larger) is released before the fresh one is
made. When the backward ends (`CommContext.end_backward`) what the tail kept goes too: nothing is kept
between steps, so the optimizer step and the next forward hold no idle pool memory either. Measured the same
way: the tail 616 MiB, the peak now the blocks' backward at 626 (44 blocks: 970 against 1004). The price
is fresh allocations: 9 of a step's 67 lends at 16 blocks (179 at 44), where the kept pool made none and
no pool all 32 of its buffers; a fixed count a step, so a deeper model loses less. zero1/zero2 (no
re-gathers in backward) never trim. `sw.describe` shows the bound, what is held, and the trims. Left over
FSDP2 at the blocks' backward then: prefetch=2 against its one unit ahead (now 1: Note [prefetch depth], stage.py)
and gloo's all-to-all receive buffer (a unit's full size, Note [gloo collectives]).

The trade is an option, `sw.shard(keep_comm_buffers=True)` (zero3; StagePolicy.trims_tail): measured both ways.
Memory: the released tail fits FSDP2's 132 blocks at 2 GiB and 4 ranks, kept 129 (bench/memory/max_model.py's
zero3 and zero3_kept rows, one run: bench/memory/results/max_model_verify.md). Time: on a CPU the released buffers
come back as fresh pages at the next forward (make demo's GPT at 2 ranks: 128 MiB faulted a step against 109 kept,
bench/overhead/step_counts.py); in interleaved rounds at 2 ranks (bench/overhead/results/kept_buffers.md) the
default's step is 3-5% over the kept pool's (the bench GPT 1.046 and 1.034, make demo's 1.034), and the kept pool
is back at d903ca1's 1.011 x DDP. The default releases: zero3 exists for the larger model, and on
a GPU the caching allocator keeps released memory for the next gather, so there it costs no time.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardwise.engine.comm.streams import HOST_ORDER
from shardwise.engine.compat import swap_storage_memory


def comm_buffer_bytes(policy, compute_bytes: int, reduce_bytes: int, root_full: int, biggest_full: int,
                      wire: int = 0) -> int:
    """The pool's bound for one engine (Note [reused buffers]), of padded element counts (`biggest_full`: the
    largest non-root unit): its stage's reduce in flight over its largest unit, the root included
    (StagePolicy.reduce_bytes: the packed input and the receive buffer; zero1's input is its kept gradients,
    so the receive buffer alone), under zero3 the full values a step holds at once
    (StagePolicy.gathered_bytes: the root and three units), which zero3 frees into the pool, and `wire`: the
    compressed forms' wire buffers in flight over the largest unit too (quantize.wire_buffer_bytes), bytes."""
    kept_full = policy.pooled_gathered_bytes(compute_bytes, root_full, biggest_full)
    return policy.reduce_bytes(reduce_bytes, max(root_full, biggest_full)) + kept_full + wire


# Buffers below this come from malloc's heap, which reuses its freed chunks without new pages (glibc maps
# blocks from 128 KiB by default, from 64 KiB in the estimator's environment, Note [allocator] in
# estimate/core.py): the pool lends only larger ones (Note [reused buffers]).
HEAP_BYTES = 64 * 1024


class BufferPool:
    """Flat byte buffers lent out by size and given back once their collective landed (Note [reused
    buffers]). One per engine and device: no global state."""

    def __init__(self, bound: int, smallest: int = HEAP_BYTES, api=HOST_ORDER) -> None:
        self.bound = bound  # most bytes lent + kept
        self.smallest = smallest  # smaller requests are malloc's (HEAP_BYTES)
        self.api = api  # the device's streams and events (Note [one device path], streams.py)
        self.kept: list[Tensor] = []  # free buffers (uint8), smallest first
        self.released: dict[int, list] = {}  # id(kept buffer) -> the events its last readers recorded
        self.lent: dict[int, Tensor] = {}  # data_ptr -> the lent buffer's backing storage
        self.lends = self.fresh = 0  # counts: every lend, and those served by a new allocation
        self.lean = False  # Note [lean tail]: from `trim()` to the next `fill`, freed full values are not kept
        self.trims = 0  # counts the trims that released something (sw.describe)

    @property
    def held(self) -> int:
        return sum(b.numel() for b in self.kept) + sum(b.numel() for b in self.lent.values())

    def lend(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer of `numel` elements of `dtype`, uninitialized: a kept one if one is large enough, else a
        new one (kept later if the bound allows)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes < self.smallest:  # malloc's heap reuses these: not lent, not counted (Note [reused buffers])
            return torch.empty(numel, dtype=dtype, device=device)
        self.lends += 1
        backing = self._take_kept(nbytes, device)
        if backing is None:
            self.fresh += 1
            if self.lean:  # Note [lean tail]: what the tail kept does not fit what it asks now
                self._release_kept()
            self._make_room(nbytes)
            backing = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if self.held + nbytes > self.bound:  # past the bound: served, never kept
                return backing.view(dtype)
        view = backing[:nbytes].view(dtype)
        self.lent[view.data_ptr()] = backing
        return view

    def give_back(self, buffer: Tensor, after=None) -> None:
        """`buffer` (a view `lend` returned) is free again once `after` has passed: the event of the collective
        that read it last (None: the current stream's, recorded now)."""
        backing = self.lent.pop(buffer.data_ptr(), None)
        if backing is not None:
            self._keep(backing, after)

    def _keep(self, backing: Tensor, after) -> None:
        if after is None:  # read last by the current stream, queued up to now
            after = self.api.new_event()
            after.record(self.api.current())
        self.released[id(backing)] = [after]
        self.kept.append(backing)
        self.kept.sort(key=Tensor.numel)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty `storage` `nbytes` of memory: a kept buffer's if one is large enough (it leaves the
        pool), else a new allocation (`resize_`)."""
        self.lean = False  # a gather: the next forward (or a late use), which the kept buffers serve again
        backing = self._take_kept(nbytes, storage.device)
        self.lends += 1
        if backing is None:
            self.fresh += 1
            storage.resize_(nbytes)
        else:
            swap_storage_memory(storage, backing.untyped_storage())

    def keep_memory(self, storage: torch.UntypedStorage) -> None:
        """`storage`'s memory (freed full values) into the pool if the bound has room, else freed; `storage`
        is left empty either way."""
        nbytes = storage.nbytes()
        self._make_room(nbytes)
        if self.lean or self.held + nbytes > self.bound:  # Note [lean tail]: no gather of this step needs it
            storage.resize_(0)
            return
        spare = torch.UntypedStorage(0, device=storage.device)
        swap_storage_memory(spare, storage)
        # Read by the compute stream's work queued so far (the unit's forward or backward): reused after it.
        self._keep(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(spare), None)

    def trim(self) -> None:
        """Release every kept buffer, and keep no freed full values until the next `fill` (Note [lean tail])."""
        self.trims += bool(self.kept)
        self._release_kept()
        self.lean = True

    def _release_kept(self) -> None:
        while self.kept:
            self._drop(self.kept.pop(0))

    def _drop(self, backing: Tensor) -> None:
        """Free a kept buffer. The caching allocator hands its memory to the next allocation of the stream that made
        it (the compute stream, which lends): that stream first waits for the events of its last readers, as a taker
        would (Note [streams per collective]); on CPU the host ran them already."""
        taker = self.api.current()
        for event in self.released.pop(id(backing), []):
            taker.wait_event(event)

    def is_lent(self, buffer: Tensor) -> bool:
        return buffer.data_ptr() in self.lent

    def _take_kept(self, nbytes: int, device: torch.device) -> Tensor | None:
        """The best-fitting kept buffer, if any, once the stream that takes it (the current one, which writes
        it first) waits for every event its last readers recorded (Note [streams per collective])."""
        for i, backing in enumerate(self.kept):  # smallest first: the best fit
            if backing.numel() >= nbytes and backing.device == torch.device(device):
                taker = self.api.current()
                for event in self.released.pop(id(backing), []):
                    taker.wait_event(event)
                return self.kept.pop(i)
        return None

    def _make_room(self, nbytes: int) -> None:
        """Release kept buffers, smallest first, until `nbytes` more fit within the bound; none where the lent
        buffers alone leave no room for them (Note [reused buffers])."""
        lent = sum(b.numel() for b in self.lent.values())
        while self.kept and self.held + nbytes > self.bound >= lent + nbytes:
            self._drop(self.kept.pop(0))

    def describe(self) -> str:
        mib = 2**20
        return (f"comm buffers: {self.held / mib:.2f} MiB held of a {self.bound / mib:.2f} MiB bound, "
                f"{self.lends - self.fresh} of {self.lends} lends reused, released at {self.trims} backward tails "
                "(Note [reused buffers], Note [lean tail])")
