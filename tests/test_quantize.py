"""The quantized collectives' kernels and their gloo collectives (engine/comm/quantize.py, Note [quantized
collectives]): per-block error bounds, the wire format, and the gather / reduce-scatter at ws 1, 2 and 4
against the exact result with a bound derived from the block scales."""

import pytest
import torch
import torch.distributed as dist

from shardwise.engine.comm.quantize import (
    QMAX,
    check_options,
    dequantize_blocks,
    from_wire,
    quantize_blocks,
    quantized_all_gather,
    quantized_reduce_scatter_avg,
    quantized_reduce_scatter_avg_2hop,
    to_wire,
    wire_bytes,
)
from shardwise.errors import ShardwiseError


def _spread(numel: int, seed: int = 0) -> torch.Tensor:
    """Values whose magnitude spans six decades along the buffer: every block has its own scale."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator) * torch.logspace(-3, 3, numel)


def _block_bound(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """Per element: half its block's step (absmax / qmax / 2), plus float rounding of the product."""
    padded = torch.zeros(-(-x.numel() // block) * block)
    padded[: x.numel()] = x
    step = padded.view(-1, block).abs().amax(dim=1) / QMAX[bits]
    return (step[:, None] * (0.5 + 1e-5)).expand(-1, block).reshape(-1)[: x.numel()]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel, block", [(1000, 64), (256, 256), (7, 4), (1, 2)])
def test_round_trip_within_half_a_step_of_each_block(bits, numel, block):
    """Catches a scale applied to the wrong block (values of a small block come back scaled by a large
    block's step, or are flattened to 0), a wrong code range (int4 wrapping), padding leaking into the
    values: every element comes back within half its own block's step, and the input is not written."""
    x = _spread(numel)
    before = x.clone()
    q = quantize_blocks(x, bits, block)
    y = dequantize_blocks(q)
    assert torch.equal(x, before)  # the masters are read, never quantized in place
    assert y.shape == x.shape
    assert ((x - y).abs() <= _block_bound(x, bits, block)).all()
    # the relative error of the smallest-magnitude block stays bounded: a per-tensor scale would make it 0
    small = slice(0, min(block, numel))
    assert torch.allclose(y[small], x[small], rtol=0, atol=float(x[small].abs().max()) / QMAX[bits])


@pytest.mark.parametrize("bits", [8, 4])
def test_wire_round_trip_and_size(bits):
    """Catches codes and scales written over each other on the wire, or a wire size the traffic model and
    the counted bytes disagree with."""
    x = _spread(300)
    q = quantize_blocks(x, bits, 32)
    wire = to_wire(q)
    assert wire.dtype == torch.uint8 and wire.numel() == wire_bytes(300, bits, 32)
    assert torch.equal(dequantize_blocks(from_wire(wire, 300, bits, 32)), dequantize_blocks(q))


def test_zero_and_nonfinite_blocks():
    """Catches an all-zero block dividing by a zero scale (NaN), and an inf hidden by the quantization
    (a loss scaler must still see it)."""
    x = torch.zeros(8)
    assert torch.equal(dequantize_blocks(quantize_blocks(x, 8, 4)), x)
    x[5] = float("inf")
    y = dequantize_blocks(quantize_blocks(x, 8, 4))
    assert torch.equal(y[:4], x[:4]) and not torch.isfinite(y[4:]).all()


def test_bad_options_are_refused():
    """Catches an unsupported width or an odd block reaching the kernels (a half byte of int4 lost)."""
    for bits, block in ((2, 256), (8, 3), (4, 0)):
        with pytest.raises(ShardwiseError, match="bits|block"):
            check_options(bits, block)


# ---- the collectives on real gloo ranks -----------------------------------------------------------

def _rank_major(world_size: int, rows: int, seed: int) -> torch.Tensor:
    """Rank r's buffer in a reduce: every rank's own (different) values."""
    return _spread(world_size * rows, seed)


def _gather_on_rank(rows: int, bits: int, block: int) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    shards = [_spread(rows, seed=r) for r in range(world_size)]
    mine = shards[rank].clone()
    full = quantized_all_gather(mine, world_size, None, bits=bits, block=block)
    assert torch.equal(mine, shards[rank])  # the master shard is not written
    return {"full": full, "exact": torch.cat(shards)}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_all_gather(ranks, world_size, bits):
    """Catches a rank's rows dequantized with another rank's scales, rows landing in the wrong rank's
    place, or a rank keeping its own exact rows (the ranks' full values would differ): every rank gets
    the same full buffer, each element within half its block's step of the exact one."""
    rows, block = 200, 32
    results = ranks.run(_gather_on_rank, world_size, rows, bits, block)
    exact = results[0]["exact"]
    bound = torch.cat([_block_bound(exact[r * rows:(r + 1) * rows], bits, block) for r in range(world_size)])
    for result in results:
        assert torch.equal(result["full"], results[0]["full"])
        assert ((result["full"] - exact).abs() <= bound).all()


def _reduce_on_rank(rows: int, bits: int, block: int, two_hop: bool) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    packed = [_rank_major(world_size, rows, seed=r) for r in range(world_size)]
    if two_hop:  # 2 nodes of 2: every rank makes every group, in the same order
        per_node, num_nodes = 2, world_size // 2
        nodes = [dist.new_group([n * per_node + p for p in range(per_node)]) for n in range(num_nodes)]
        places = [dist.new_group([n * per_node + p for n in range(num_nodes)]) for p in range(per_node)]
        mine = quantized_reduce_scatter_avg_2hop(packed[rank], per_node, nodes[rank // per_node], num_nodes,
                                                 places[rank % per_node], bits=bits, block=block)
    else:
        mine = quantized_reduce_scatter_avg(packed[rank], world_size, None, bits=bits, block=block)
    exact = torch.stack(packed).view(world_size, world_size, rows)[:, rank].mean(dim=0)
    # Each copy is off by at most half its block's step; the mean by the mean of those (one hop). Blocks of 16
    # in rows of 96 line up with every hop's blocks. The second hop re-quantizes each node's partial sum, whose
    # block maximum is at most the sum of its copies' (each grown by hop 1's half step, 1 / (2 qmax)): its
    # error at most the same mean again, times (1 + 1 / (2 qmax)).
    bound = torch.stack([_block_bound(p.view(world_size, rows)[rank], bits, block) for p in packed]).mean(dim=0)
    if two_hop:
        bound = bound * (2 + 1 / (2 * QMAX[bits]))
    return {"error": (mine - exact).abs(), "bound": bound, "dtype": mine.dtype}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reduce_scatter(ranks, world_size, bits):
    """Catches a destination's rows quantized with another's blocks, copies summed out of place or not
    averaged: this rank's average is within the quantization bound of the exact one, in fp32."""
    for result in ranks.run(_reduce_on_rank, world_size, 96, bits, 16, False):
        assert result["dtype"] == torch.float32
        assert (result["error"] <= result["bound"]).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_reduce_scatter_two_hops(ranks, bits):
    """Catches the two-hop reduce (ZeRO++'s qgZ across nodes) sending a node's partial sums to the wrong
    node or summing the wrong place's rows: at ws 4 as 2 nodes of 2, within its bound of the exact mean."""
    for result in ranks.run(_reduce_on_rank, 4, 96, bits, 16, True):
        assert (result["error"] <= result["bound"]).all()
