"""`shardwise plan MODEL --max-model [KEY]`: the largest model of MODEL's family each configuration trains.

    shardwise plan gpt d_model=512 vocab_size=8192 seq_len=32 --memory 2GiB --world-size 4 --batch 1 --max-model
    shardwise plan path/to/config.json --memory 24GiB --world-size 8 --max-model          # num_hidden_layers free
    shardwise plan llama num_hidden_layers=16 --memory 8GiB --world-size 4 --max-model hidden_size --step 256

MODEL's other sizes are its KEY=VALUE; the one left free (the depth unless KEY names another) is searched
from --step by --step with sw.max_model (estimate/largest.py, Note [largest search]), each size built on
the meta device: nothing is allocated, whatever the size.
"""

from __future__ import annotations

import json
import sys

from shardwise.cli.estimate import MIB, as_json, parse_bytes, parse_margin, prepare
from shardwise.cli.models import build_model, depth_key
from shardwise.errors import ShardwiseError
from shardwise.estimate.largest import max_model


def run(args) -> int:
    """Run `shardwise plan ... --max-model`; exit status 1 when no configuration trains even the smallest."""
    try:
        if args.max_model is None:
            raise ShardwiseError("--step and --limit go with --max-model: add --max-model (the depth) or "
                                 "--max-model KEY")
        if args.pipelines:
            raise ShardwiseError("--pipelines weighs one model's pipe x shard layouts: run `shardwise plan` "
                                 "without --max-model for them")
        memory, margin = parse_bytes(args.memory), parse_margin(args.margin)
        spec, model, extra, _ = prepare(args)
        key = depth_key(spec, model) if args.max_model == "depth" else args.max_model
        overrides = [item for item in args.overrides if item.partition("=")[0] != key]

        def family(size: int):
            return build_model(spec, [*overrides, f"{key}={size}"])[0]

        rows = max_model(family, memory, args.world_size, start=args.step, step=args.step, limit=args.limit,
                         optimizer=args.optimizer, batch=args.batch, seq=args.seq, offload_dir=args.offload_dir,
                         checkpoint_activations=args.checkpoint_activations,
                         optimizer_in_backward=args.optimizer_in_backward, margin=margin, **extra)
    except ShardwiseError as error:
        print(f"shardwise plan: {error}", file=sys.stderr)
        return 2
    name = " ".join([spec, *overrides])
    if args.json:
        print(json.dumps([dict(label=r.label, key=key, size=r.size, planned=r.planned, capped=r.capped,
                               num_params=r.num_params, estimate=as_json(r.estimate)) for r in rows]))
    else:
        _print(rows, name, key, memory, margin, args)
    return 0 if any(r.size is not None for r in rows) else 1


def _print(rows, name: str, key: str, memory: int, margin: float, args) -> None:
    batch = f", batch {args.batch}" + (f" x seq {args.seq}" if args.seq else "") if args.batch else \
        ", no activations (pass --batch)"
    recompute = ", activations checkpointed" if args.checkpoint_activations else ""
    recompute += ", optimizer in backward" if args.optimizer_in_backward else ""
    print(f"{name}: the largest {key} each configuration trains in {memory / 2**30:.2f} GiB per rank, "
          f"{args.world_size} ranks, {args.optimizer}{batch}{recompute} (sw.estimate)")
    width = max(len(r.label) for r in rows) + 2
    head = f"with {margin:.0%} kept"
    print(f"  {'':<{width}}{key:>14}{'parameters':>12}{'estimated MiB':>15}{head:>16}")
    for row in rows:
        if row.size is None:
            print(f"  {row.label:<{width}}{'none':>14}{'':>12}{row.estimate.total / MIB:>15,.0f}   "
                  f"({key}={args.step} is over the budget already)")
            continue
        size = f"{'>= ' if row.capped else ''}{row.size}"
        planned = "none" if row.planned is None else row.planned
        print(f"  {row.label:<{width}}{size:>14}{row.num_params / 1e6:>11,.1f}M{row.estimate.total / MIB:>15,.0f}"
              f"{planned:>16}")
    print(f"{key}: the largest whose estimate is within the budget; \"with {margin:.0%} kept\": the largest "
          f"`shardwise plan` accepts (--margin, Note [plan margin]); >=: the search stopped at --limit")
    optimizer = f" --optimizer {args.optimizer}" if args.optimizer != "adamw" else ""
    print(f"next: `shardwise plan {name} {key}=N --memory {args.memory} --world-size {args.world_size}{optimizer}` for "
          "the advice at the size you choose")
