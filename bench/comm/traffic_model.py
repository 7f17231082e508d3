"""The closed forms of bench/comm/traffic.py: bytes per step, in-node and across nodes, and the bandwidth time, of
each strategy's collectives over N nodes of G ranks (Note [ring bytes] in traffic.py says how a call's bytes
are summed over links; this file applies it to whole steps).

Note [modelled arms]: S is the parameters' bytes in fp32, K the bytes zero3 keeps from forward to backward
(its root and last unit). A step's payloads (`Payload`) are what each collective carries, already quantized
where an option quantizes it:
- DDP: one all-reduce of S over all P = N G ranks. Flat zero3: an all-gather for forward (S), one for
  backward (S - K) and a reduce-scatter (S), each a ring over all P ranks (N of its links cross nodes).
- HSDP zero3: the same three inside each node's G ranks, then an all-reduce of each rank's S/G rows over the
  N replicas (fp32).
- hpZ (ZeRO++): the forward gather over all P ranks also leaves each rank a secondary shard of the unit
  inside its node (its 1/G of the full values: no extra traffic), so backward's re-gather (S - K) is a ring
  over the node's G ranks: it never leaves the node. It re-gathers the values forward used, unquantized.
- qwZ: both gathers carry int8 codes plus one fp32 scale per block: (1 + 4/B)/4 of S's bytes.
- qgZ: the reduce carries int4 (or int8) codes and scales, (b/8 + 4/B)/4 of S's bytes. The engine sends them
  over one all-to-all of its flat group (`reduce_hops=1`, counted as the reduce-scatter it stands for, Note
  [ring bytes]); ZeRO++ reduces in two hops (`reduce_hops=2`, engine/comm/quantize.py
  `quantized_reduce_scatter_avg_2hop`): an all-to-all inside each node, each rank summing its node's copies
  of the rows bound for one place in every node, then an all-to-all of those partial sums across the N ranks
  of that place: (N-1)/N of one quantized copy of S leaves each node, however many ranks it has. Counted as
  rings, an all-to-all between ranks of different nodes moves the same bytes across as the pairwise
  exchange: the two-hop model does not depend on the convention.
Time is the bandwidth term only (no latency, no overlap with compute, collectives one after another): a ring
moves at its slowest link, LINK_IN_NODE (NVLink, 900 GB/s per GPU) inside a node and LINK_ACROSS (50 GB/s
per node, one 400 Gb/s NIC) between nodes; the replicas' all-reduces (and the second hop's all-to-alls) of
one node's G ranks share its LINK_ACROSS.
"""

from __future__ import annotations

from dataclasses import dataclass

LINK_IN_NODE = 900e9  # bytes/s per GPU, NVLink (H100/H200 SXM)
LINK_ACROSS = 50e9  # bytes/s per node, one 400 Gb/s NIC
RANKS_PER_NODE = 8  # the modelled machines; the counted run uses 2 (a simulated boundary)
SCALE_BYTES = 4  # one fp32 scale per quantization block (engine/comm/quantize.py)
NODES = (1, 2, 4, 8, 16, 32, 64)
# The compressed arms: gathers int8, reduces int4, blocks of 256 (the engine's Compression default block).
GATHER_BITS, REDUCE_BITS, BLOCK = 8, 4, 256
# The scaling table's arms: issue 34's, then issue 47's (qgZ there in ZeRO++'s two hops).
SCALED = ("ddp", "zero3", "zero3_hsdp", "zero3_hpz", "zero3_qwz", "zero3_qgz", "zero3_hpz_qwz_qgz")


def wire_factor(bits: int | None, block: int) -> float:
    """Bytes on the wire per fp32 byte: 1 exact, else `bits`-bit codes plus one fp32 scale per block."""
    return 1.0 if bits is None else (bits / 8 + SCALE_BYTES / block) / 4


@dataclass(frozen=True)
class Payload:
    """What one step's collectives carry (bytes, Note [modelled arms]): the forward gather, the backward
    re-gather, the gradient reduce, and the fp32 parameter bytes (DDP's and the replicas' all-reduce)."""

    forward: float
    backward: float
    reduce: float
    param: float

    @classmethod
    def of(cls, param_bytes: float, kept_bytes: float, gather_bits: int | None = None,
           reduce_bits: int | None = None, block: int = 256, hpz: bool = False) -> Payload:
        """`hpz`: backward re-gathers forward's own values from the node, unquantized (Note [secondary shards])."""
        gather = wire_factor(gather_bits, block)
        return cls(param_bytes * gather, (param_bytes - kept_bytes) * (1.0 if hpz else gather),
                   param_bytes * wire_factor(reduce_bits, block), param_bytes)


def _flat_ring(payload: float, N: int, G: int) -> tuple[float, float, float]:
    """(in-node, across, seconds) of one ring collective of `payload` over all N G ranks, nodes contiguous."""
    P = N * G
    per_link = payload * (P - 1) / P
    crossing = N if N > 1 else 0
    return (P - crossing) * per_link, crossing * per_link, per_link / (LINK_ACROSS if N > 1 else LINK_IN_NODE)


def _node_rings(payload: float, N: int, G: int) -> tuple[float, float, float]:
    """One ring of `payload` inside each of the N nodes (G ranks each)."""
    per_link = payload * (G - 1) / G
    return N * G * per_link if G > 1 else 0.0, 0.0, per_link / LINK_IN_NODE


def _two_hop_reduce(payload: float, N: int, G: int) -> tuple[float, float, float]:
    """qgZ's two all-to-alls (Note [modelled arms]): `payload` per rank inside the node, then each rank's 1/G of
    it across the N ranks of its place (one per node)."""
    in_node, _, seconds = _node_rings(payload, N, G)
    across_per_node = (N - 1) / N * payload if N > 1 else 0.0  # G ranks x (N-1)/N x payload / G
    return in_node, N * across_per_node, seconds + across_per_node / LINK_ACROSS


def _replica_all_reduce(param: float, N: int, G: int) -> tuple[float, float, float]:
    """HSDP: each rank's S/G rows all-reduced over the N replicas; one node's G rings share its NIC."""
    if N == 1:
        return 0.0, 0.0, 0.0
    across_per_node = G * 2 * (N - 1) / N * param / G
    return 0.0, N * across_per_node, across_per_node / LINK_ACROSS


def model_step(strategy: str, nodes: int, per_node: int, payload: Payload, reduce_hops: int = 1) -> dict:
    """Per-step bytes (summed over links) and bandwidth time of `strategy` over `nodes` nodes of `per_node`
    ranks: "ddp", "zero3_hsdp", or "zero3" with any of "_hpz" (backward re-gather inside the node), "_qwz"
    and "_qgz" (which `payload` carries quantized; `reduce_hops` 2: qgZ's two-hop reduce). Note [modelled
    arms]."""
    N, G = nodes, per_node
    if strategy == "ddp":
        parts = [_flat_ring(2 * payload.param, N, G)]  # one all-reduce: twice a reduce-scatter's bytes
    elif strategy == "zero3_hsdp":
        parts = [_node_rings(payload.forward + payload.backward + payload.reduce, N, G),
                 _replica_all_reduce(payload.param, N, G)]
    elif strategy.split("_")[0] == "zero3" and set(strategy.split("_")[1:]) <= {"hpz", "qwz", "qgz"}:
        options = set(strategy.split("_")[1:])
        backward = _node_rings if "hpz" in options else _flat_ring
        reduce = _two_hop_reduce if "qgz" in options and reduce_hops == 2 else _flat_ring
        parts = [_flat_ring(payload.forward, N, G), backward(payload.backward, N, G), reduce(payload.reduce, N, G)]
    else:
        raise ValueError(f"no model for {strategy!r}")
    return {"in_node": sum(p[0] for p in parts), "across": sum(p[1] for p in parts),
            "seconds": sum(p[2] for p in parts)}


def scaling(param_bytes: float, kept_bytes: float) -> dict:
    """Every arm of SCALED over NODES (nodes of RANKS_PER_NODE): gathers int8, reduces int4 in two hops."""
    rows = {}
    for strategy in SCALED:
        options = set(strategy.split("_"))
        payload = Payload.of(param_bytes, kept_bytes, GATHER_BITS if "qwz" in options else None,
                             REDUCE_BITS if "qgz" in options else None, BLOCK, hpz="hpz" in options)
        rows[strategy] = [{"nodes": n, **model_step(strategy, n, RANKS_PER_NODE, payload, reduce_hops=2)}
                          for n in NODES]
    return rows
