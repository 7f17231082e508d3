"""The buffers a collective writes or reads for one use only, reused across units and steps within a
stated bound. Uses: nothing of the engine.

Note [reused buffers]: on CPU a fresh large buffer costs its page faults on first touch (issue 33's
note: a copy into a fresh 48 MiB buffer 23 ms, into a reused one 7 ms), and every step made the same
fresh buffers again: each unit's packed reduce input and its receive buffer (zero2/zero3), zero1's
receive buffer, the packed gather of a unit's small parameters. A `BufferPool` lends them instead and
takes them back when the collective that used them has landed (`Pending.wait`, collectives.py): a
buffer is never lent twice at once, so a reuse cannot read or write rows another collective still
sends or receives. CUDA's caching allocator already does this on a GPU; there the pool changes no
bytes, only who keeps them.

The bound: the pool holds (lent + kept) at most `bound` bytes, `comm_buffer_bytes`, the reduce in flight
that the estimator counts (Note [transient buffers], estimate/core.py): a request past it is served
by a fresh buffer as before, not kept. Kept buffers are released largest-last when a request needs
room. `sw.describe` shows the bound and what is held.
"""

from __future__ import annotations

import torch
from torch import Tensor


def comm_buffer_bytes(policy, reduce_bytes: int, biggest_full: int) -> int:
    """The pool's bound for one engine: its stage's reduce in flight over its largest unit of
    `biggest_full` padded elements in `reduce_bytes`-byte gradients (StagePolicy.reduce_bytes: the packed
    input and the receive buffer; zero1's input is its kept gradients, so the receive buffer alone)."""
    return policy.reduce_bytes(reduce_bytes, biggest_full)


class BufferPool:
    """Flat byte buffers lent out by size and given back once their collective landed (Note [reused
    buffers]). One per engine and device: no global state."""

    def __init__(self, bound: int) -> None:
        self.bound = bound  # most bytes lent + kept
        self.kept: list[Tensor] = []  # free buffers (uint8), smallest first
        self.lent: dict[int, Tensor] = {}  # data_ptr -> the lent buffer's backing storage
        self.lends = self.fresh = 0  # counts: every lend, and those served by a new allocation

    @property
    def held(self) -> int:
        return sum(b.numel() for b in self.kept) + sum(b.numel() for b in self.lent.values())

    def lend(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer of `numel` elements of `dtype`, uninitialized: a kept one if one is large enough, else a
        new one (kept later if the bound allows)."""
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        self.lends += 1
        backing = self._take_kept(nbytes, device)
        if backing is None:
            self.fresh += 1
            self._make_room(nbytes)
            backing = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if self.held + nbytes > self.bound:  # past the bound: served, never kept
                return backing.view(dtype)
        view = backing[:nbytes].view(dtype)
        self.lent[view.data_ptr()] = backing
        return view

    def give_back(self, buffer: Tensor) -> None:
        """`buffer` (a view `lend` returned) is free again: its collective has landed."""
        backing = self.lent.pop(buffer.data_ptr(), None)
        if backing is not None:
            self.kept.append(backing)
            self.kept.sort(key=Tensor.numel)

    def is_lent(self, buffer: Tensor) -> bool:
        return buffer.data_ptr() in self.lent

    def _take_kept(self, nbytes: int, device: torch.device) -> Tensor | None:
        for i, backing in enumerate(self.kept):  # smallest first: the best fit
            if backing.numel() >= nbytes and backing.device == torch.device(device):
                return self.kept.pop(i)
        return None

    def _make_room(self, nbytes: int) -> None:
        """Release kept buffers, smallest first, until `nbytes` more fit within the bound."""
        while self.kept and self.held + nbytes > self.bound:
            self.kept.pop(0)

    def describe(self) -> str:
        mib = 2**20
        return (f"comm buffers: {self.held / mib:.2f} MiB held of a {self.bound / mib:.2f} MiB bound, "
                f"{self.lends - self.fresh} of {self.lends} lends reused (Note [reused buffers])")
