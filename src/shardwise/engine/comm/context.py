"""An engine's communication context: the strategy of each group, the buffers reused across steps, and the
streams its collectives run on. Units ask it for a handle and wait on the handle.
Uses: buffers, collectives, quantize, small, strategy, streams.

Note [comm context]: every collective a unit issues on the hot path (its gather, its gradient reduce, the
replica average of a hybrid mesh) goes through one `CommContext`, built by the engine (zero.py) and handed
to each unit: it picks the form (Note [comm strategies]), lends the buffers (Note [reused buffers]) and
returns a `Pending` the unit waits on. What the rest of a step exchanges (agreement headers, gather tags,
norms, overflow flags, the owners' traffic) goes through comm/small.py and comm/owner_traffic.py:
nothing outside comm/ calls torch.distributed's collectives (tests/test_comm.py greps for it).

Streams (Note [where the next capabilities land] (c)): the context owns one stream per kind of collective
(gather, reduce, replica average: Note [streams per collective], streams.py), through the device-generic
API (Note [one device path]): a collective is issued on its kind's stream after that stream waited for the
compute stream, the handle's copy-out runs there too, and `Pending.wait()` records the handle's own event
and makes the compute stream wait for that event, not the host and not the whole stream. On CPU the same
calls go to the host's order, where they do nothing. The pool lends on every device: a buffer goes back
with the event of its last reader, and its next taker's stream waits for it.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

import shardwise.engine.comm.collectives as coll
from shardwise.engine.comm.buffers import BufferPool
from shardwise.engine.comm.quantize import QuantizedForms
from shardwise.engine.comm.small import start_all_gather_rows
from shardwise.engine.comm.strategy import TorchForms, strategy_for
from shardwise.engine.comm.streams import GATHER, REDUCE, REPLICA, CommStreams, device_api
from shardwise.wire.backends import device_of


class CommContext:
    """One engine's collectives (Note [comm context])."""

    def __init__(self, device: torch.device, compression=None, api=None) -> None:
        """`api`: the device's streams and events (streams.device_api); a test may pass its own."""
        self.device = torch.device(device)
        self.api = api if api is not None else device_api(device)
        self.pool = BufferPool(0, api=self.api)  # its bound is set once the units are built (`bound_buffers`)
        self.streams = CommStreams(self.api)
        self._strategies: dict[tuple[int, bool], TorchForms] = {}
        self.compression = compression  # shard(compression=): the hot path's quantized forms (quantize.py)
        self.poison = os.environ.get("SHARDWISE_POISON_FREED") == "1"  # Note [poisoned memory]

    @classmethod
    def for_group(cls, group, compression=None) -> CommContext:
        """The context of an engine whose collectives run on `group` (its accelerator's tensors on NCCL: the
        current device, Note [group backends]); `compression`: the config.Compression the hot path's gathers and
        reduces use (Note [quantized collectives]), or None."""
        return cls(device_of(group), compression=compression)

    def bound_buffers(self, bound: int) -> None:
        """The most bytes the pool keeps (comm_buffer_bytes, Note [reused buffers])."""
        self.pool.bound = bound

    def strategy(self, group, exact: bool = False) -> TorchForms:
        """`group`'s strategy, decided once (Note [comm strategies]): with compression, its quantized forms
        unless `exact` (a copy of the fp32 masters: checkpoints, exports)."""
        key = (id(group), exact)
        if key not in self._strategies:
            base = strategy_for(group)
            self._strategies[key] = base if exact or self.compression is None else \
                QuantizedForms(base, self.compression)
        return self._strategies[key]

    def lend(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """A buffer for a collective's input (a packed reduce), given back when it lands; None without a pool."""
        return self.pool.lend(numel, dtype, device) if self.pool.bound else None

    def give_back(self, buffer: Tensor) -> None:
        """A buffer `lend` gave, no longer read by anything (not a collective's: those go back on landing)."""
        self.pool.give_back(buffer)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Memory for a freed unit's full values before its gather: reused where the pool keeps some
        (Note [reused buffers])."""
        if self.pool.bound:
            self.pool.fill(storage, nbytes)
        else:  # counted as a fresh lend, as the pool counts its own
            self.pool.lends += 1
            self.pool.fresh += 1
            storage.resize_(nbytes)
        if self.poison:
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).fill_(0xFF)

    def trim(self) -> None:
        """zero3's backward issued the step's last gather: the pool's kept buffers go (Note [lean tail])."""
        self.pool.trim()

    def end_backward(self) -> None:
        """A synced backward ended: what its tail kept goes too, where it trimmed (Note [lean tail])."""
        if self.pool.lean:
            self.pool.trim()

    # Note [poisoned memory]: with SHARDWISE_POISON_FREED=1 (a debugging switch, the test suite's default)
    # the memory a freed unit's gather is about to fill is set to all-ones bytes first: NaN in every float
    # dtype. A read of full values before their gather landed, or through a view the engine freed and
    # nothing re-gathered, then shows as NaN instead of as the values the reused memory happened to hold:
    # the comm pool (Note [reused buffers]) hands a unit back the very memory it freed, so such a read
    # passed unseen (a gradient penalty's graph reading a unit zero3 did not pin, tests/test_double_backward.py).

    def free(self, storage: torch.UntypedStorage) -> None:
        """A unit's full values released (zero3): their memory kept for the next gather, within the bound."""
        if self.pool.bound:
            self.pool.keep_memory(storage)
        else:
            storage.resize_(0)

    def _landed_on(self, pending: coll.Pending, stream) -> coll.Pending:
        """`pending` was issued on `stream`: its wait records its event there (Note [streams per collective])."""
        pending.api, pending.stream = self.api, stream
        return pending

    def gather_into(self, rows: list[Tensor], regions: list[Tensor], world_size: int, group, what: str,
                    own_in_place: bool = False, exact: bool = False) -> coll.Pending:
        """Issue the gather of every rank's `rows` into `regions` (collectives.gather_into): the handle. `exact`:
        never quantized, whatever the compression: the masters' full values, and hpZ's in-node re-gather of the
        values forward used (backward computes with exactly the weights forward did)."""
        with self.streams.issue(GATHER) as stream:
            return self._landed_on(self.strategy(group, exact).gather_into(rows, regions, world_size, group, True,
                                                                           what, own_in_place, self._pool()), stream)

    def reduce_scatter_avg(self, packed: Tensor, world_size: int, group, what: str,
                           out: Tensor | None = None) -> coll.Pending:
        """Issue the average of the rank-major `packed` over `group`: the handle of this rank's rows."""
        with self.streams.issue(REDUCE) as stream:
            return self._landed_on(self.strategy(group).reduce_scatter_avg(packed, world_size, group, True, what, out,
                                                                           self._pool()), stream)

    def all_reduce_avg(self, tensor: Tensor, group, what: str) -> coll.Pending:
        """Issue the in-place average of `tensor` over `group` (a hybrid mesh's replicas): the handle."""
        with self.streams.issue(REPLICA) as stream:
            return self._landed_on(self.strategy(group).all_reduce_avg(tensor, group, what), stream)

    def gather_rows(self, sent: Tensor, world_size: int, group, what: str) -> coll.Pending:
        """Issue the gather of every rank's small `sent` (zero3's tags on a device: Note [tags on the device],
        gather_tags.py) on the gathers' stream, after the gather it describes: the handle of the rank-major rows."""
        received = torch.empty(world_size * sent.numel(), dtype=sent.dtype, device=sent.device)
        with self.streams.issue(GATHER) as stream:
            with coll.named_failure(what):
                work = start_all_gather_rows(received, sent, group)
            return self._landed_on(coll.Pending([work], received, what, sent=sent), stream)

    def _pool(self) -> BufferPool | None:
        return self.pool if self.pool.bound else None

    def describe(self) -> str:
        """A line for sw.describe: the strategies, the buffers held against their bound, the streams."""
        forms = sorted({strategy.name for strategy in self._strategies.values()}) or ["none yet"]
        return f"{self.pool.describe()}; forms: {', '.join(forms)}; {self.api.name}"
