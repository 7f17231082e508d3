"""What zero3's gather tags and the agreement's headers cost the host thread per training step, in their forms
(Note [gather tags] and Note [tags on the device], shardwise/engine/schedule/gather_tags.py; Note [agreement rides
the traffic] and Note [headers on the device], shardwise/engine/schedule/agreement.py and agreement_device.py), on
the same model and ranks:

- host: gloo's form, the form every gloo run takes: each gather's tag and each phase's header a small all-gather
  on a host group of its own, waited for (a host rendezvous) before the unit's values or the phase's collectives
  are used, and the step's header before the step;
- tags-device: the form NCCL runs took before Note [headers on the device], forced here onto gloo: the tags on the
  gathers' own group, compared at the optimizer step; the headers as in host;
- device: the form NCCL runs take now, forced onto gloo: the tags as in tags-device, the headers on a group and
  stream of their own, compared at the optimizer step with the tags.

Per step and rank: the host thread's wall time inside the tags' and the headers' own methods (issue, check,
settle; the waits they make included; a method called from another is counted once), the host waits each counts
(`host_waits`), and the step's wall time. Each round runs every form in turn on fresh models (same seed); the
report gives the median over rounds of each rank's median step, and the per-round range. On gloo the device forms
still wait once a step, at the step, for the tags and once for the headers; on NCCL those are reads of copies the
headers' and the gathers' streams made (no host group): tests/test_agreement_fake_gpu.py counts 0 there.

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

FORMS = ("host", "tags-device", "device")
_TIMED = {"tags": ("send", "check", "settle", "explain"), "headers": ("announce", "confirm", "settle", "agree_on_step")}


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


def _timed(owner, names, spent: list[float], depth: list[int]) -> None:
    """Add the wall time of each of `owner`'s methods `names` to spent[0] (wrapped on the instance); a call made
    inside another timed call (depth[0] > 0) is part of that one's time."""
    for name in names:
        method = getattr(owner, name)

        def wrapper(*args, _method=method, **kwargs):
            depth[0] += 1
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[0] += time.perf_counter() - start

        setattr(owner, name, wrapper)


def run_form(form: str, args) -> dict:
    """`args.steps` AdamW steps of zero3 with the tags and headers in `form`; per-step medians on this rank."""
    import shardwise as sw
    import shardwise.engine.schedule.agreement_device as agreement_device
    import shardwise.engine.schedule.gather_tags as gather_tags
    from shardwise.engine import engine_of
    from shardwise.models.gpt import GPT, Block, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers,
                    n_heads=max(1, args.d_model // 64))
    torch.manual_seed(0)
    model = GPT(cfg)
    originals = gather_tags.on_device, agreement_device.on_device
    gather_tags.on_device = lambda group: form != "host"
    agreement_device.on_device = lambda group: form == "device"
    try:
        sw.shard(model, strategy="zero3", units=Block)
    finally:
        gather_tags.on_device, agreement_device.on_device = originals
    tags, headers = engine_of(model).driver.gathers.tags, engine_of(model).agreement
    spent, depth = [0.0], [0]
    _timed(tags, _TIMED["tags"], spent, depth)
    _timed(headers, _TIMED["headers"], spent, depth)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), generator=generator)
    seconds, tag_waits, header_waits, step_seconds = [], [], [], []
    for step in range(args.steps + 1):  # the first: set-up, not counted
        spent[0], start = 0.0, time.perf_counter()
        before = tags.host_waits, headers.host_waits
        model(idx, idx).backward()
        optim.step()
        optim.zero_grad()
        if step:
            step_seconds.append(time.perf_counter() - start)
            seconds.append(spent[0])
            tag_waits.append(tags.host_waits - before[0])
            header_waits.append(headers.host_waits - before[1])
    return {"host_ms": 1e3 * statistics.median(seconds), "tag_waits": statistics.median(tag_waits),
            "header_waits": statistics.median(header_waits), "step_ms": 1e3 * statistics.median(step_seconds)}


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
             "| form | host ms in tags and headers / step | host waits on tags / step | on headers / step | step ms |",
             "|---|---|---|---|---|"]
    for form in FORMS:
        per_round = [max(rank[r][form]["host_ms"] for rank in by_rank) for r in range(args.rounds)]
        steps = [max(rank[r][form]["step_ms"] for rank in by_rank) for r in range(args.rounds)]
        tag_waits = max(rank[r][form]["tag_waits"] for rank in by_rank for r in range(args.rounds))
        header_waits = max(rank[r][form]["header_waits"] for rank in by_rank for r in range(args.rounds))
        lines.append(f"| {form} | {statistics.median(per_round):.2f} ({min(per_round):.2f}-{max(per_round):.2f}) | "
                     f"{tag_waits:g} | {header_waits:g} | {statistics.median(steps):.1f} "
                     f"({min(steps):.1f}-{max(steps):.1f}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
