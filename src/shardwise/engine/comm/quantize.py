"""Compressed collectives: block-quantized all-gather (qwZ) and quantized reduce-scatter (qgZ), on flat rows.
Uses: collectives.

Opt-in and not exact by design (Note [quantized collectives]). The kernels are pure functions of flat
tensors; the collectives take the process group(s) they run over and nothing else; `QuantizedForms` is
the strategy (Note [comm strategies], strategy.py) the engine's comm context picks for a group when
`shard(..., compression=...)` asks for it.

Note [quantized collectives]: a flat buffer is cut into blocks of `block` elements; each block travels
as one fp32 scale (its largest magnitude / qmax) and one signed integer code per element
(round(x / scale), qmax = 127 for int8, 7 for int4, two int4 codes per byte). A value comes back within
scale / 2 of what was sent, so every block keeps its own relative precision: a block of small values
next to one of large values is not flattened to zero (a scale per tensor would be). On the wire a
rank's rows are one uint8 buffer, the codes then the scales' bytes (`wire_bytes`), so each
quantized collective is one call of plain bytes, which gloo and NCCL carry alike.
- The gather's input is the fp32 master shard (or its compute-dtype copy): it is read, never
  written; the masters are never quantized in place. Every rank, its own rows included, takes the
  dequantized values, so that the full parameters agree bitwise on every rank (a rank keeping its own
  exact rows would compute with other values than its peers: the replicas would drift apart).
- The reduce-scatter (qgZ) quantizes each destination's rows separately (blocks never straddle two
  ranks' rows), exchanges them with one all-to-all, and sums the received copies in fp32, in rank
  order, so that the ranks agree on their rows' sums as the exact reduce does (Note [gloo
  collectives], collectives.py). Across nodes it runs in two hops, as ZeRO++ does
  (`quantized_reduce_scatter_avg_2hop`): an all-to-all inside the node, each rank summing the node's
  copies of the rows bound for its peers in other nodes (fp32), then an all-to-all of those partial
  sums, quantized again, across nodes: the bytes that leave a node are one quantized copy of the
  gradients, not one per rank of the node.
- Non-finite values: a block holding an inf or NaN gets a non-finite scale and comes back NaN: a loss
  scaler's check still sees it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.engine.comm.collectives import Pending, copy_out, named_failure
from shardwise.errors import ShardwiseError

QMAX = {8: 127, 4: 7}  # symmetric codes: -qmax..qmax, so 0 is exact and the range is the same both ways
SCALE_BYTES = 4  # one fp32 scale per block


@dataclass(frozen=True)
class Quantized:
    """A flat buffer's blocks: `codes` (int8, one per element; int4: two per uint8 byte) and one fp32 scale
    per block. `numel` is the unpadded length; the last block is padded with zeros."""

    codes: Tensor
    scales: Tensor
    numel: int
    bits: int
    block: int


def check_options(bits: int, block: int) -> None:
    """Refuse a code width or block size the kernels do not have, naming the fix."""
    if bits not in QMAX:
        raise ShardwiseError(f"quantized collectives take bits=8 or bits=4, not {bits!r}")
    if not isinstance(block, int) or block < 2 or block % 2:
        raise ShardwiseError(f"quantization block={block!r}: use an even number of elements >= 2 (e.g. 256)")


def padded_numel(numel: int, block: int) -> int:
    """`numel` rounded up to whole blocks."""
    return -(-numel // block) * block


def wire_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes on the wire for `numel` elements: the codes, then one fp32 scale per block."""
    padded = padded_numel(numel, block)
    return padded * bits // 8 + padded // block * SCALE_BYTES


def quantize_blocks(flat: Tensor, bits: int = 8, block: int = 256) -> Quantized:
    """Per-block symmetric quantization of a flat tensor (any float dtype); `flat` is not written."""
    check_options(bits, block)
    numel = flat.numel()
    padded = torch.zeros(padded_numel(numel, block), dtype=torch.float32, device=flat.device)
    padded[:numel].copy_(flat.reshape(-1))
    blocks = padded.view(-1, block)
    absmax = blocks.abs().amax(dim=1)
    # An all-zero block: any scale gives zero codes; 1 keeps the division finite.
    scales = torch.where(absmax > 0, absmax / QMAX[bits], torch.ones_like(absmax))
    codes = torch.round(blocks / scales[:, None]).clamp_(-QMAX[bits], QMAX[bits]).to(torch.int8).view(-1)
    if bits == 4:  # two codes per byte, offset to 1..15
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return Quantized(codes, scales, numel, bits, block)


def dequantize_blocks(q: Quantized, dtype: torch.dtype = torch.float32, out: Tensor | None = None) -> Tensor:
    """The values `q` stands for: each block's codes times that block's scale, the padding dropped."""
    codes = q.codes
    if q.bits == 4:
        low = (codes & 0x0F).to(torch.int8) - 8
        high = (codes >> 4).to(torch.int8) - 8
        codes = torch.stack([low, high], dim=1).view(-1)
    values = codes.view(-1, q.block).to(torch.float32) * q.scales[:, None]  # Note [quantized collectives]
    values = values.view(-1)[: q.numel]
    if out is None:
        return values.to(dtype)
    return out.copy_(values.view(out.shape))


def to_wire(q: Quantized, out: Tensor | None = None) -> Tensor:
    """One uint8 buffer: the codes' bytes, then the scales' bytes (Note [quantized collectives])."""
    wire = out if out is not None else torch.empty(wire_bytes(q.numel, q.bits, q.block), dtype=torch.uint8,
                                                   device=q.codes.device)
    num_code_bytes = q.codes.numel()
    wire[:num_code_bytes].copy_(q.codes.view(torch.uint8))
    wire[num_code_bytes:].copy_(q.scales.view(torch.uint8))
    return wire


def from_wire(wire: Tensor, numel: int, bits: int, block: int) -> Quantized:
    """`to_wire`'s inverse (views into `wire`, no copy)."""
    padded = padded_numel(numel, block)
    num_code_bytes = padded * bits // 8
    codes = wire[:num_code_bytes]
    codes = codes.view(torch.int8) if bits == 8 else codes
    scales = wire[num_code_bytes:].view(torch.float32)
    return Quantized(codes, scales, numel, bits, block)


def _wire(pool, shape: tuple[int, ...], device) -> Tensor:
    """A uint8 wire buffer of `shape`: lent by the comm pool when there is one (Note [reused buffers]; given
    back when the collective's Pending lands), else new."""
    numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
    buffer = pool.lend(numel, torch.uint8, device) if pool is not None else None
    return buffer.view(shape) if buffer is not None else torch.empty(shape, dtype=torch.uint8, device=device)


def wire_buffer_bytes(compression, world_size: int, biggest_full: int) -> int:
    """The quantized forms' wire buffers in flight, for the comm pool's bound (Note [reused buffers]): one
    gather of the largest unit (this rank's wire rows and every rank's) and one reduce (its sent and received
    all-to-all buffers), each rank's rows `ceil(biggest_full / world_size)` elements; 0 without compression or
    on one rank, where nothing is quantized."""
    if compression is None or world_size == 1:
        return 0
    rows = -(-biggest_full // world_size)
    total = 0
    if compression.gather_bits:
        total += (world_size + 1) * wire_bytes(rows, compression.gather_bits, compression.block)
    if compression.reduce_bits:
        total += 2 * world_size * wire_bytes(rows, compression.reduce_bits, compression.block)
    return total


def _start_gather(shard_flat: Tensor, world_size: int, group, bits: int, block: int, what: str, pool=None):
    """Quantize this rank's rows and start gathering every rank's wire buffer: (works, received, sent)."""
    size = wire_bytes(shard_flat.numel(), bits, block)
    sent = to_wire(quantize_blocks(shard_flat, bits, block), out=_wire(pool, (size,), shard_flat.device))
    received = _wire(pool, (world_size, size), shard_flat.device)
    if world_size == 1:
        received[0].copy_(sent)
        return [], received, sent
    with named_failure(what):
        return [dist.all_gather_single(received.view(-1), sent, group=group, async_op=True)], received, sent


def _dequantize_ranks(received: Tensor, numel: int, bits: int, block: int, dtype: torch.dtype) -> Tensor:
    """Every rank's gathered wire buffer (a row of `received`) as values: rank-major (world_size, numel)."""
    full = torch.empty(received.shape[0], numel, dtype=dtype, device=received.device)
    for rank in range(received.shape[0]):
        dequantize_blocks(from_wire(received[rank], numel, bits, block), out=full[rank])
    return full


def _start_exchange(by_destination: Tensor, group, bits: int, block: int, what: str, pool=None):
    """Quantize each destination's rows (a row of `by_destination`, (P, R): blocks never straddle two
    destinations) and start the all-to-all over `group`: (works, received, sent)."""
    num_ranks, numel = by_destination.shape
    shape = (num_ranks, wire_bytes(numel, bits, block))
    sent = _wire(pool, shape, by_destination.device)
    for rank in range(num_ranks):
        to_wire(quantize_blocks(by_destination[rank], bits, block), out=sent[rank])
    received = _wire(pool, shape, by_destination.device)
    if num_ranks == 1:
        received.copy_(sent)
        return [], received, sent
    with named_failure(what):
        return [dist.all_to_all_single(received, sent, group=group, async_op=True)], received, sent


def _sum_copies(received: Tensor, numel: int, bits: int, block: int) -> Tensor:
    """The fp32 sum of the received copies of this rank's rows, added in rank order (every rank alike)."""
    total = dequantize_blocks(from_wire(received[0], numel, bits, block))
    for rank in range(1, received.shape[0]):
        total.add_(dequantize_blocks(from_wire(received[rank], numel, bits, block)))
    return total


def _exchange_and_sum(by_destination: Tensor, group, bits: int, block: int, what: str) -> Tensor:
    works, received, _ = _start_exchange(by_destination, group, bits, block, what)
    with named_failure(what):
        for work in works:
            work.wait()
    return _sum_copies(received, by_destination.shape[1], bits, block)


def quantized_all_gather(shard_flat: Tensor, world_size: int, group, *, bits: int = 8, block: int = 256,
                         dtype: torch.dtype | None = None, what: str = "a quantized all-gather") -> Tensor:
    """qwZ: every rank's `S` rows, block-quantized, gathered into one rank-major `world_size * S` buffer of
    `dtype` (the shard's by default), dequantized, this rank's rows too (Note [quantized collectives])."""
    check_options(bits, block)
    works, received, _ = _start_gather(shard_flat, world_size, group, bits, block, what)
    with named_failure(what):
        for work in works:
            work.wait()
    dtype = shard_flat.dtype if dtype is None else dtype
    return _dequantize_ranks(received, shard_flat.numel(), bits, block, dtype).view(-1)


def quantized_reduce_scatter_avg(packed: Tensor, world_size: int, group, *, bits: int = 8, block: int = 256,
                                 what: str = "a quantized reduce-scatter") -> Tensor:
    """qgZ over one group: the average over ranks of a rank-major `world_size * S` buffer; this rank gets its
    `S` rows in fp32. Every copy travels quantized, the sum is fp32 (Note [quantized collectives])."""
    check_options(bits, block)
    total = _exchange_and_sum(packed.view(world_size, -1), group, bits, block, what)
    return total.div_(world_size)


def quantized_reduce_scatter_avg_2hop(packed: Tensor, per_node: int, node_group, num_nodes: int, across_group, *,
                                      bits: int = 4, block: int = 256,
                                      what: str = "a quantized reduce-scatter") -> Tensor:
    """qgZ in two hops (Note [quantized collectives]) over `num_nodes * per_node` ranks, rank r being rank
    r % per_node of node r // per_node: `node_group` holds this rank's node (in rank order), `across_group`
    the ranks of the same place in every node (in node order). `packed` is rank-major over all ranks; this
    rank gets the average of its `S` rows, in fp32."""
    check_options(bits, block)
    world_size = num_nodes * per_node
    rows = packed.numel() // world_size
    by_place = packed.view(num_nodes, per_node, rows).transpose(0, 1)  # (place in node, node, S)
    # Hop 1, inside the node: the rows of every node's rank at place p go to this node's rank at place p.
    node_sums = _exchange_and_sum(by_place.reshape(per_node, num_nodes * rows), node_group, bits, block,
                                  f"{what} (inside the node)")
    # Hop 2, across nodes: each node's partial sum of node n's rows goes to node n.
    total = _exchange_and_sum(node_sums.view(num_nodes, rows), across_group, bits, block,
                              f"{what} (across nodes)")
    return total.div_(world_size)


# ---- the engine's forms: the same calls as collectives.gather_into / reduce_scatter_avg, returning a Pending --

def gather_into_quantized(rows: list[Tensor], regions: list[Tensor], world_size: int, group, async_op: bool, *,
                          bits: int, block: int, what: str = "a quantized all-gather", pool=None) -> Pending:
    """qwZ for a zero3 unit: this rank's rows of each parameter (concatenated: blocks run across parameters, as
    the flat shard does) travel block-quantized, and every rank's dequantized rows land in each parameter's
    padded full region (param-major, `collectives.copy_out`). The regions must not hold the master rows
    (zero3's full values are a buffer of their own): every rank's rows are overwritten, its own too."""
    shard_flat = torch.cat(rows) if len(rows) > 1 else rows[0]
    numel, dtype = shard_flat.numel(), regions[0].dtype
    works, received, sent = _start_gather(shard_flat, world_size, group, bits, block, what, pool)

    def finish(landed: Tensor) -> Tensor:
        full = _dequantize_ranks(landed, numel, bits, block, dtype)
        sizes = [part.numel() for part in rows]
        copy_out(full.view(-1), world_size, list(zip(itertools.accumulate(sizes, initial=0), sizes)), regions)
        return regions[0]

    pending = Pending(works, received, what, finish=finish, sent=sent).lend_to(pool, sent, received)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_avg_quantized(packed: Tensor, world_size: int, group, async_op: bool, *, bits: int, block: int,
                                 what: str = "a quantized reduce-scatter", out: Tensor | None = None,
                                 pool=None) -> Pending:
    """qgZ for a unit's gradients: `collectives.reduce_scatter_avg`'s contract (the average of a rank-major
    `world_size * S` buffer, this rank's `S` rows, in `out` when given), each copy sent quantized over one
    all-to-all and summed in fp32 in rank order. One rank sends nothing: its rows are the average, unchanged."""
    if world_size == 1:
        return Pending([], packed, what)
    by_destination = packed.view(world_size, -1)
    works, received, sent = _start_exchange(by_destination, group, bits, block, what, pool)

    def finish(landed: Tensor) -> Tensor:
        total = _sum_copies(landed, by_destination.shape[1], bits, block).div_(world_size)
        return total.to(packed.dtype) if out is None else out.copy_(total)

    pending = Pending(works, received, what, finish=finish, sent=sent).lend_to(pool, sent, received)
    if not async_op:
        pending.wait()
    return pending


class QuantizedForms:
    """A group's strategy (Note [comm strategies], strategy.py) with `compression`'s quantized forms: zero3's
    gather (qwZ) where the regions are not the master rows, the gradient reduce (qgZ); the replicas' average
    and every form it does not quantize are `base`'s. One rank sends nothing, so nothing is quantized there."""

    def __init__(self, base, compression) -> None:
        self.base, self.compression = base, compression
        self.name = f"{base.name} + {compression.label}"

    def gather_into(self, rows: list[Tensor], regions: list[Tensor], world_size: int, group, async_op: bool, what: str,
                    own_in_place: bool, pool) -> Pending:
        bits = self.compression.gather_bits
        if not bits or own_in_place or not rows or world_size == 1:  # own_in_place: the rows are the masters
            return self.base.gather_into(rows, regions, world_size, group, async_op, what, own_in_place, pool)
        return gather_into_quantized(rows, regions, world_size, group, async_op, bits=bits,
                                     block=self.compression.block, what=what, pool=pool)

    def reduce_scatter_avg(self, packed: Tensor, world_size: int, group, async_op: bool, what: str,
                           out: Tensor | None, pool) -> Pending:
        bits = self.compression.reduce_bits
        if not bits or world_size == 1:
            return self.base.reduce_scatter_avg(packed, world_size, group, async_op, what, out, pool)
        pending = reduce_scatter_avg_quantized(packed, world_size, group, True, bits=bits,
                                               block=self.compression.block, what=what, out=out, pool=pool)
        pending.lend_to(pool, packed)  # a lent `packed` goes back once the all-to-all has landed
        if not async_op:
            pending.wait()
        return pending

    def all_reduce_avg(self, tensor: Tensor, group, what: str) -> Pending:
        return self.base.all_reduce_avg(tensor, group, what)  # the replicas' average stays exact (fp32)
