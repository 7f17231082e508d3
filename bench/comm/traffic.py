"""Traffic you can read: the bytes each strategy's collectives move per step, in-node and across nodes,
counted at ws 4 and modelled over 1-64 nodes of 8 ranks (issue 34 point 5; issue 47: hpZ, qwZ, qgZ).

    python bench/comm/traffic.py                          # count at ws 4 (2 simulated nodes of 2), model, plot
    python bench/comm/traffic.py --steps 1 --vocab 256 --d-model 64 --layers 2     # smoke run

The counter wraps torch.distributed's collective functions (all_reduce, broadcast, all_gather*,
reduce_scatter*, all_to_all_single, gather, scatter) for the counted steps and records, for each call,
its group's ranks and its payload. DDP's C++ reducer calls its process group directly, so the DDP arm
registers torch's own `allreduce_hook` (default_hooks.py), which issues the same all-reduce of each
bucket through `dist.all_reduce`. The counted configs: torch DDP, shardwise flat zero3, shardwise zero3
on a 2 x 2 ("replicate", "shard") mesh, FSDP2's HSDP (`fully_shard(..., mesh=2-D)`, the builder
of bench/speed/strategies.py), which runs on gloo, and the compressed options the engine implements
(`shard(..., compression=...)`: zero3 with int8 gathers, with int4 reduces, with both), and hpZ
(`reshard_after_forward=2`: backward re-gathers inside each simulated node), alone and with both compressions.
qgZ's two-hop reduce is modelled only: the engine's reduce runs one hop over its flat group.

Note [ring bytes]: bytes are what NCCL's ring algorithms move for the same calls, summed over every
link of the ring (every rank's sends). A ring runs through the group's ranks in rank order; a link
between two ranks of different nodes is "across nodes" (node = rank // ranks-per-node: 2 here, a
simulated boundary, since every rank of this host talks over loopback). Per link, for a payload of S
bytes over P ranks: all-gather and reduce-scatter (P-1)/P S, all-reduce 2 (P-1)/P S; a broadcast
pipelines S along the P-1 links that leave its root; gather/scatter send each rank's part straight
to or from the root. On gloo the engine gathers by one broadcast per rank and reduce-scatters by an
all-to-all (Note [gloo collectives], engine/comm/collectives.py): the broadcasts are exactly a ring
all-gather's chunks, and the all-to-all is counted as the reduce-scatter it stands for (pairwise, gloo
itself sends 2/3 of it across nodes at 2 x 2 instead of a ring's 1/2).

The model is bench/comm/traffic_model.py's closed forms (Note [modelled arms] there).
Results: bench/comm/results/traffic.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.comm.traffic_model import (  # noqa: E402
    BLOCK,
    GATHER_BITS,
    LINK_ACROSS,
    LINK_IN_NODE,
    NODES,
    RANKS_PER_NODE,
    REDUCE_BITS,
    SCALED,
    Payload,
    model_step,
    scaling,
)
from bench.common.launch import main_of, publish, run_per_world_size  # noqa: E402
from bench.common.plot import panels, save  # noqa: E402
from shardwise.testing import watch_collectives

COUNTED_NODE = 2
CONFIGS = ("ddp", "zero3", "zero3_hsdp", "fsdp2_hsdp", "zero3_qwz", "zero3_qgz", "zero3_qwz_qgz", "zero3_hpz",
           "zero3_hpz_qwz_qgz")
LABELS = {"ddp": "torch DDP", "zero3": "shardwise zero3 (flat)", "zero3_hsdp": "shardwise zero3, HSDP N x G",
          "fsdp2_hsdp": "FSDP2 HSDP N x G", "zero3_qwz": "shardwise zero3 + qwZ int8",
          "zero3_qgz": "shardwise zero3 + qgZ int4 (one hop)", "zero3_qwz_qgz": "shardwise zero3 + qwZ + qgZ",
          "zero3_hpz": "shardwise zero3 + hpZ", "zero3_hpz_qwz_qgz": "shardwise zero3 + hpZ + qwZ + qgZ (one hop)"}
MODELLED = {"zero3_hsdp": "zero3_hsdp", "fsdp2_hsdp": "zero3_hsdp", "ddp": "ddp", "zero3": "zero3",
            "zero3_qwz": "zero3_qwz", "zero3_qgz": "zero3_qgz", "zero3_qwz_qgz": "zero3_qwz_qgz",
            "zero3_hpz": "zero3_hpz", "zero3_hpz_qwz_qgz": "zero3_hpz_qwz_qgz"}
COMPRESSION = {"zero3_qwz": {"gather": "int8"}, "zero3_qgz": {"reduce": "int4"},
               "zero3_qwz_qgz": {"gather": "int8", "reduce": "int4"},
               "zero3_hpz_qwz_qgz": {"gather": "int8", "reduce": "int4"}}
ENGINE_OPTIONS = (*COMPRESSION, "zero3_hpz")  # sharded here with the engine's options, not by apply_config
SHORT = {"ddp": "DDP", "zero3": "flat zero3", "zero3_hsdp": "HSDP zero3", "zero3_hpz": "zero3+hpZ",
         "zero3_qwz": "zero3+qwZ", "zero3_qgz": "zero3+qgZ", "zero3_hpz_qwz_qgz": "zero3+hpZ+qwZ+qgZ"}
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=2, help="counted steps (after one uncounted warm-up step)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--params", type=float, default=7e9, help="parameters of the modelled model (fp32 traffic)")
    p.add_argument("--kept-fraction", type=float, default=0.07,
                   help="share of the modelled parameters zero3 keeps from forward to backward (its root and last "
                        "unit): Llama-2-7B's untied embedding and head (0.26B) and one of its 32 blocks (0.2B)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)  # strategies.apply_config
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- the counter -------------------------------------------------------------------

def _ring_links(ranks: list[int]) -> list[tuple[int, int]]:
    return [(a, ranks[(i + 1) % len(ranks)]) for i, a in enumerate(ranks)] if len(ranks) > 1 else []


def link_bytes(kind: str, nbytes: int, ranks: list[int], node: int, root: int | None = None) -> tuple[float, float]:
    """(in-node, across-node) bytes that one call moves, summed over links (Note [ring bytes])."""
    P = len(ranks)
    if P < 2:
        return 0.0, 0.0
    if kind == "broadcast":
        start = ranks.index(root)
        chain = [ranks[(start + i) % P] for i in range(P)]
        links, per_link = list(zip(chain, chain[1:])), float(nbytes)
    elif kind in ("gather", "scatter"):  # each non-root rank's part, straight to or from the root
        links, per_link = [(r, root) for r in ranks if r != root], float(nbytes)
    else:
        factor = 2 * (P - 1) / P if kind == "all_reduce" else (P - 1) / P
        links, per_link = _ring_links(ranks), factor * nbytes
    across = sum(a // node != b // node for a, b in links)
    return (len(links) - across) * per_link, across * per_link


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _group_of(group) -> list[int]:
    import torch.distributed as dist

    return sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


# name -> (kind, payload bytes from the bound arguments, root from them)
_CALLS = {
    "all_reduce": ("all_reduce", lambda a: _nbytes(a["tensor"]), None),
    "broadcast": ("broadcast", lambda a: _nbytes(a["tensor"]), "src"),
    "all_gather": ("all_gather", lambda a: sum(_nbytes(t) for t in a["tensor_list"]), None),
    "all_gather_single": ("all_gather", lambda a: _nbytes(a["output_tensor"]), None),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a["output_tensor"]), None),
    "reduce_scatter_single": ("reduce_scatter", lambda a: _nbytes(a["input"]), None),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a["input"]), None),
    "reduce_scatter": ("reduce_scatter", lambda a: sum(_nbytes(t) for t in a["input_list"]), None),
    "all_to_all_single": ("reduce_scatter", lambda a: _nbytes(a["input"]), None),
    "gather": ("gather", lambda a: _nbytes(a["tensor"]), "dst"),
    "scatter": ("scatter", lambda a: _nbytes(a["tensor"]), "src"),
}


class Counter:
    """Bytes per call while installed. Each rank counts the calls of the groups whose lowest rank it is
    (every rank of a group makes the same calls): the ranks' totals add up to the job's. Only the
    outermost call counts (a torch collective that calls another is one call: watch_collectives)."""

    def __init__(self, node: int, rank: int):
        self.node, self.rank, self.calls = node, rank, []

    def _record(self, name: str, a: dict) -> None:
        kind, payload, root_name = _CALLS[name]
        ranks = _group_of(a.get("group"))
        if ranks[0] != self.rank:
            return
        root = a.get(root_name) if root_name else None
        if root_name and root is None:  # group_src / group_dst: a rank of the group
            root = ranks[a.get(f"group_{root_name}")]
        nbytes = payload(a)
        self.calls.append((kind, tuple(ranks), nbytes, *link_bytes(kind, nbytes, ranks, self.node, root)))

    @contextmanager
    def installed(self):
        with watch_collectives(self._record, tuple(_CALLS)):
            yield self

    def totals(self) -> dict:
        in_node = sum(c[3] for c in self.calls)
        across = sum(c[4] for c in self.calls)
        kinds: dict[str, int] = {}
        for kind, *_ in self.calls:
            kinds[kind] = kinds.get(kind, 0) + 1
        return {"in_node": in_node, "across": across, "kinds": kinds}


# ---- one rank: count each config ---------------------------------------------------

def run_worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import shardwise as sw
    from bench.speed.strategies import apply_config, build_model, global_batch

    torch.set_num_threads(1)
    sw.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * args.batch, (rank + 1) * args.batch)
    table = {}
    for config in args.configs.split(","):
        model = build_model(args)
        num_params = sum(p.numel() for p in model.parameters())
        root = num_params - sum(p.numel() for p in model.blocks.parameters())  # the root unit's (and FSDP2's root)
        last = sum(p.numel() for p in model.blocks[-1].parameters())
        try:
            if config in ENGINE_OPTIONS:
                module, optimizer = _with_options(model, config, args)
            else:
                module, optimizer = apply_config(model, config, args, world)
        except Exception as exc:  # noqa: BLE001 - an arm that does not run on gloo is reported, not fatal
            table[config] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        payload = _unit_payload(model, config, world) if config in ENGINE_OPTIONS else \
            Payload.of(4 * num_params, 4 * (root + (0 if config.startswith("fsdp2") else last)))
        if config == "ddp":
            module.register_comm_hook(None, allreduce_hook)  # the reducer's all-reduce, through dist.all_reduce
        counter = Counter(COUNTED_NODE, rank)
        for step in range(1 + args.steps):
            idx, targets = (t[rows] for t in global_batch(args, step, world))
            with counter.installed() if step else nullcontext():
                loss = module(idx, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        everyone = [None] * world
        dist.all_gather_object(everyone, counter.totals())
        kinds: dict[str, int] = {}
        for totals in everyone:
            for kind, n in totals["kinds"].items():
                kinds[kind] = kinds.get(kind, 0) + n / args.steps
        table[config] = {"in_node": sum(t["in_node"] for t in everyone) / args.steps,
                         "across": sum(t["across"] for t in everyone) / args.steps,
                         "calls_per_step": kinds, "num_params": num_params, "param_bytes": 4 * num_params,
                         "kept_bytes": 4 * (root + last), "kept_fsdp2_bytes": 4 * root,
                         "payload": vars(payload)}
    if rank == 0:
        args.out.write_text(json.dumps(table))
    dist.barrier()
    sw.shutdown()


def _with_options(model, config: str, args):
    """zero3 with the engine's quantized collectives (`shard(..., compression=...)`) and hpZ
    (`reshard_after_forward=` the simulated node's ranks), as apply_config shards."""
    import shardwise as sw
    from shardwise.models.gpt import Block

    compression = {**COMPRESSION[config], "block": BLOCK} if config in COMPRESSION else None
    sw.shard(model, strategy="zero3", units=Block, compression=compression,
             reshard_after_forward=COUNTED_NODE if "hpz" in config else True)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)


def _unit_payload(model, config: str, world: int) -> Payload:
    """The bytes the engine's collectives carry per step with its options, unit by unit: each unit's rows per
    rank padded to whole blocks (`wire_bytes`) where quantized, one copy per rank; backward re-gathers all but
    the root and the last block, unquantized under hpZ (Note [modelled arms], traffic_model.py)."""
    from shardwise.engine.comm.quantize import wire_bytes
    from shardwise.engine.protocol import engine_of

    options = COMPRESSION.get(config, {})
    gather_bits = GATHER_BITS if "gather" in options else None
    reduce_bits = REDUCE_BITS if "reduce" in options else None

    def carried(unit, bits):
        return world * (wire_bytes(unit.shard_total, bits, BLOCK) if bits else 4 * unit.shard_total)

    units = engine_of(model).units
    kept = {id(units[0]), *(id(u) for u in units if u.module is model.blocks[-1])}
    backward_bits = None if "hpz" in config else gather_bits  # Note [secondary shards]: forward's own values
    return Payload(sum(carried(u, gather_bits) for u in units),
                   sum(carried(u, backward_bits) for u in units if id(u) not in kept),
                   sum(carried(u, reduce_bits) for u in units), 4 * sum(world * u.shard_total for u in units))


# ---- the launcher ------------------------------------------------------------------

MB, GB = 1e6, 1e9


def _ratio(counted: float, modelled: float) -> str:
    return "—" if modelled == 0 and counted == 0 else (f"{counted / modelled:.3f}" if modelled else "∞")


def check_table(counted: dict) -> list[str]:
    lines = ["| config | counted in-node MB | model in-node MB | ratio | counted across MB | model across MB | ratio "
             "| calls per step (counted) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for config, row in counted.items():
        if "error" in row:
            lines.append(f"| {LABELS[config]} | did not run on gloo: {row['error']} ||||||")
            continue
        model = model_step(MODELLED[config], 2, COUNTED_NODE, Payload(**row["payload"]))
        calls = ", ".join(f"{kind} {n:g}" for kind, n in sorted(row["calls_per_step"].items()))
        lines.append(f"| {LABELS[config]} | {row['in_node'] / MB:.2f} | {model['in_node'] / MB:.2f} | "
                     f"{_ratio(row['in_node'], model['in_node'])} | {row['across'] / MB:.2f} | "
                     f"{model['across'] / MB:.2f} | {_ratio(row['across'], model['across'])} | {calls} |")
    return lines


def scaling_table(rows: dict) -> list[str]:
    head = " | ".join(f"{SHORT[s]} {unit}" for s in rows for unit in ("GB/node", "ms"))
    lines = [f"| nodes (x{RANKS_PER_NODE}) | {head} |", "|---:|" + "---:|" * (2 * len(rows))]
    for i, n in enumerate(NODES):
        cells = " | ".join(f"{rows[s][i]['across'] / n / GB:.1f} | {rows[s][i]['seconds'] * 1e3:.0f}" for s in rows)
        lines.append(f"| {n} | {cells} |")
    return lines


def target_lines(rows: dict) -> list[str]:
    """Issue 47's target at the largest node count: zero3+hpZ+qwZ+qgZ at most a quarter of flat zero3 across."""
    flat = rows["zero3"][-1]["across"]
    lines = [f"At {NODES[-1]} nodes, across nodes per node per step, against flat zero3's {flat / NODES[-1] / GB:.1f} "
             "GB:", ""]
    for strategy in SCALED:
        last = rows[strategy][-1]
        lines.append(f"- {SHORT[strategy]}: {last['across'] / NODES[-1] / GB:.1f} GB, {last['across'] / flat:.3f}x "
                     f"flat zero3, {last['seconds'] * 1e3:.0f} ms")
    ratio = rows["zero3_hpz_qwz_qgz"][-1]["across"] / flat
    lines += ["", f"Target (issue 47: zero3+hpZ+qwZ+qgZ at most 0.25x flat zero3): {ratio:.3f}x, "
              f"{'met' if ratio <= 0.25 else 'NOT met'}."]
    return lines


def plot(rows: dict, path: Path) -> None:
    fig, ((left, right),) = panels()
    for strategy in rows:
        label = SHORT[strategy] + (" (N x 8)" if strategy == "zero3_hsdp" else "")
        left.plot(NODES, [r["seconds"] * 1e3 for r in rows[strategy]], marker="o", label=label)
        right.plot(NODES, [r["across"] / r["nodes"] / GB for r in rows[strategy]], marker="o", label=label)
    for ax, ylabel in ((left, "communication ms per step (bandwidth only)"), (right, "GB per node across per step")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"nodes of {RANKS_PER_NODE} ranks")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    right.legend(fontsize=8)
    save(fig, path, f"Modelled traffic: {LINK_IN_NODE / GB:.0f} GB/s in a node, {LINK_ACROSS / GB:.0f} GB/s per "
                    f"node across, ring algorithms; qwZ int8, qgZ int4 (two hops), blocks of {BLOCK}")


def run_launcher(args) -> None:
    worker_args = ["--configs", args.configs, "--steps", str(args.steps)]
    for flag in ("vocab", "d_model", "layers", "heads", "seq", "batch", "seed"):
        worker_args += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    counted = run_per_world_size(__file__, [4], worker_args)[4]
    rows = scaling(4 * args.params, 4 * args.params * args.kept_fraction)
    num_params = next(row["num_params"] for row in counted.values() if "num_params" in row)
    text = "\n".join([
        "# Traffic per step: counted at ws 4, modelled to 64 nodes (issue 34 point 5, issue 47)",
        "",
        f"Reproduce: `python bench/comm/traffic.py {' '.join(worker_args)} --params {args.params:g} "
        f"--kept-fraction {args.kept_fraction:g}`. How bytes are "
        "counted and modelled: Note [ring bytes] in bench/comm/traffic.py, Note [modelled arms] in "
        "bench/comm/traffic_model.py. "
        "Counting bytes is not timing: these "
        "numbers do not depend on the machine's load.",
        "",
        f"## Counted vs model: GPT of {num_params / 1e6:.2f}M parameters (fp32), ws 4 = 2 simulated nodes of 2",
        "",
        "Bytes per step summed over every link of the rings (all ranks' sends); 'across' are the links between "
        "rank 1 and 2 and between 3 and 0 (node = rank // 2; on this host all are loopback). FSDP2 HSDP is "
        "compared with the same HSDP model, with its root (not the last block) kept from forward to backward. "
        "The small all-reduces and all-gathers the model leaves out (shardwise's rank agreement, its unused-"
        "parameter flags; FSDP2's own) are under 0.1% of the bytes here. The compressed rows are the engine's "
        f"`compression=` (int8 gathers, int4 reduces, blocks of {BLOCK}), modelled from each unit's rows padded "
        "to whole blocks; its reduce is one all-to-all over the flat group, counted as the reduce-scatter it "
        "stands for (Note [ring bytes]). The hpZ rows are the engine's `reshard_after_forward=2`: backward "
        "re-gathers each unit over its node's 2 ranks, from the secondary shards forward left there, unquantized.",
        "",
        *check_table(counted),
        "",
        f"## Model: {args.params / 1e9:g}B parameters, fp32 traffic, nodes of {RANKS_PER_NODE} ranks, "
        f"{args.kept_fraction:.0%} of the parameters not re-gathered for backward",
        "",
        "hpZ: backward's re-gather inside the node from a secondary shard that forward's gather left there, "
        "unquantized (the engine's `reshard_after_forward=`, counted above). qwZ: both gathers int8 + one fp32 "
        "scale per block of "
        f"{BLOCK}. qgZ: the reduce int4 + scales, in ZeRO++'s two hops (an all-to-all inside the node, then "
        "one across nodes of the node's partial sums; the kernel is engine/comm/quantize.py "
        "`quantized_reduce_scatter_avg_2hop`, the engine's flat reduce runs one hop).",
        "",
        f"Links: {LINK_IN_NODE / GB:.0f} GB/s per GPU inside a node (NVLink), {LINK_ACROSS / GB:.0f} GB/s per "
        "node across nodes (one 400 Gb/s NIC); ring algorithms' (P-1)/P factors; time is the bandwidth term "
        "only (no latency, no overlap with compute). 'across GB/node' is what each node sends to other nodes "
        "per step.",
        "",
        *scaling_table(rows),
        "",
        *target_lines(rows),
        "",
    ])
    plot(rows, RESULTS / "traffic.png")
    publish(RESULTS, "traffic", text, {"counted_ws4": counted, "model": rows, "links": {"in_node": LINK_IN_NODE,
                                                                                 "across": LINK_ACROSS}})


def main(argv=None) -> None:
    main_of(parse_args, run_worker, run_launcher, argv)


if __name__ == "__main__":
    main()
