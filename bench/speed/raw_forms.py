"""Note [raw forms]: what the collectives of one training step cost with no engine around them, in the form
each side uses on gloo, for the engine-free bounds of bench/speed/strategies.py and bench/overhead/paired_steps.py (Note
[engine-free bound]). Over the model's fp32 values, into buffers allocated once, at this world size:

- all_reduce: DDP's gradient all-reduce, in DDP's buckets (a first one of 1 MiB, then 25 MiB: torch's defaults),
  all issued, then waited;
- reduce: the engine's gloo reduce-scatter (an all-to-all of the rank-major gradients, then this rank's copies
  summed in rank order: Note [gloo collectives] in shardwise/engine/comm/collectives.py), without the division
  by the world size (DDP folds its own into the copy into a bucket);
- gather: the engine's gloo all-gather of the values (a broadcast from each rank, in place).

zero1 and zero2 move `reduce` and `gather` where DDP moves `all_reduce`; zero3 one `gather` more. Each is the
median over `repeats` rounds after one warm-up, the three taking turns in each round, wall seconds on this rank.

    python -m torch.distributed.run --standalone --nproc-per-node=2 bench/speed/raw_forms.py   # the bench GPT's size
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's bucket_cap_mb=25
FORMS = ("all_reduce", "reduce", "gather")  # the keys of raw_forms_seconds, everywhere they are read


def _buckets(flat: torch.Tensor) -> list[torch.Tensor]:
    sizes, left, cap = [], flat.numel(), FIRST_BUCKET_BYTES // flat.element_size()
    while left:
        sizes.append(min(cap, left))
        left -= sizes[-1]
        cap = BUCKET_BYTES // flat.element_size()
    return list(flat.split(sizes))


def raw_forms_seconds(num_params: int, world_size: int, repeats: int = 5) -> dict[str, float]:
    """{form: seconds} for each of FORMS over `num_params` fp32 values (Note [raw forms])."""
    import torch.distributed as dist

    if world_size == 1:  # no collective at all: every form is free
        return dict.fromkeys(FORMS, 0.0)
    per_rank = -(-num_params // world_size)
    full = torch.zeros(world_size * per_rank)
    received = torch.empty_like(full)
    mine = torch.empty(per_rank)
    buckets = _buckets(full)

    def all_reduce():
        for work in [dist.all_reduce(bucket, async_op=True) for bucket in buckets]:
            work.wait()

    def reduce():
        dist.all_to_all_single(received, full, async_op=True).wait()
        copies = received.view(world_size, -1)
        torch.add(copies[0], copies[1], out=mine)
        for rows in copies[2:]:
            mine.add_(rows)

    def gather():
        by_rank = full.view(world_size, -1)
        for work in [dist.broadcast(by_rank[src], src=src, async_op=True) for src in range(world_size)]:
            work.wait()

    forms = dict(zip(FORMS, (all_reduce, reduce, gather)))
    seconds = {name: [] for name in FORMS}
    for turn in range(repeats + 1):
        for name in FORMS[turn % 3:] + FORMS[:turn % 3]:  # each form first in its turn: no form always warm
            dist.barrier()
            start = time.perf_counter()
            forms[name]()
            if turn:
                seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 29_500_000
    measured = raw_forms_seconds(size, dist.get_world_size(), repeats=9)
    if dist.get_rank() == 0 and dist.get_world_size() == 1:
        print("one rank: no collective to time (every form costs nothing); run it with --nproc-per-node=2 or more")
    elif dist.get_rank() == 0:
        ratio = (measured["reduce"] + measured["gather"]) / measured["all_reduce"]
        print({name: round(value * 1e3, 1) for name, value in measured.items()}, "ms;",
              f"reduce + gather over all_reduce {ratio:.2f}")
    dist.destroy_process_group()
