"""What zero3's gather tags cost the host thread per training step, in their two forms (Note [gather tags] and
Note [tags on the device], shardwise/engine/schedule/gather_tags.py), on the same model and ranks:

- host: gloo's form, the form every gloo run takes: each gather's tag is a small all-gather on a host group of
  its own, waited for (a host rendezvous) before the unit's values are used;
- device: the form NCCL runs take, forced here onto gloo: each tag an all-gather on the gathers' own group and
  stream, its rows copied to the host as its gather lands, compared once at the optimizer step.

Per step and rank: the host thread's wall time inside the tags' own methods (issue, check, settle; the waits
they make included), the host waits they count (`host_waits`), and the step's wall time. Each round runs both
forms in turn on fresh models (same seed); the report gives the median over rounds of each rank's median
step, and the per-round range. On gloo the device form still waits once a step, at the step; on NCCL its waits
are stream waits and the count is 0 (no host group).

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/overhead/tag_cost.py [--rounds 5 --steps 10]
    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/overhead/tag_cost.py --rounds 1 --steps 2 \\
        --d-model 32 --layers 2   # does it run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

FORMS = ("host", "device")
_TIMED = ("send", "check", "settle", "explain")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="timed steps per form and round (after one warm-up)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--out", type=Path, default=None, help="write rank 0's JSON here")
    return p.parse_args(argv)


def _timed(tags, spent: list[float]) -> None:
    """Add the wall time of each of `tags`' own methods to spent[0] (wrapped on the instance)."""
    for name in _TIMED:
        method = getattr(tags, name)

        def wrapper(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(tags, name, wrapper)


def run_form(form: str, args) -> dict:
    """`args.steps` AdamW steps of zero3 with the tags in `form`; per-step medians on this rank."""
    import shardwise as sw
    import shardwise.engine.schedule.gather_tags as gather_tags
    from shardwise.engine import engine_of
    from shardwise.models.gpt import GPT, Block, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 64))
    torch.manual_seed(0)
    model = GPT(cfg)
    original = gather_tags.tags_on_device
    gather_tags.tags_on_device = lambda group: form == "device"
    try:
        sw.shard(model, strategy="zero3", units=Block)
    finally:
        gather_tags.tags_on_device = original
    tags = engine_of(model).driver.gathers.tags
    spent = [0.0]
    _timed(tags, spent)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=generator)
    tag_seconds, waits, step_seconds = [], [], []
    for step in range(args.steps + 1):  # the first: set-up, not counted
        spent[0], before, start = 0.0, tags.host_waits, time.perf_counter()
        model(idx, idx).backward()
        optim.step()
        optim.zero_grad()
        if step:
            step_seconds.append(time.perf_counter() - start)
            tag_seconds.append(spent[0])
            waits.append(tags.host_waits - before)
    return {"tag_ms": 1e3 * statistics.median(tag_seconds), "host_waits": statistics.median(waits),
            "step_ms": 1e3 * statistics.median(step_seconds)}


def main(argv=None) -> None:
    import shardwise as sw

    args = parse_args(argv)
    torch.set_num_threads(1)
    sw.init()
    rounds = []
    for _ in range(args.rounds):
        rounds.append({form: run_form(form, args) for form in FORMS})
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rounds)
    if dist.get_rank() == 0:
        print(report(gathered, args))
        if args.out is not None:
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "ranks": gathered},
                                           indent=1))
    dist.destroy_process_group()


def report(by_rank: list, args) -> str:
    """A Markdown table: per form, the median over rounds (and the range) of the slowest rank's medians."""
    lines = [f"zero3 GPT d_model {args.d_model}, {args.layers} layers, {len(by_rank)} ranks, {args.rounds} rounds "
             f"x {args.steps} steps", "",
             "| tags | host ms in tags / step | host waits on tags / step | step ms |", "|---|---|---|---|"]
    for form in FORMS:
        per_round = [max(rank[r][form]["tag_ms"] for rank in by_rank) for r in range(args.rounds)]
        steps = [max(rank[r][form]["step_ms"] for rank in by_rank) for r in range(args.rounds)]
        waits = max(rank[r][form]["host_waits"] for rank in by_rank for r in range(args.rounds))
        lines.append(f"| {form} | {statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f}) | "
                     f"{waits:g} | {statistics.median(steps):.1f} ({min(steps):.1f}-{max(steps):.1f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
