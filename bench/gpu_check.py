"""The checks only a GPU can make, for the day one is lent (issue 21): `bench/gpu_check.sh` runs it.

Per strategy (ddp, zero1, zero2, zero3) at every GPU's rank (NCCL): the zoo GPT trained 3 steps on
CUDA against one process on the same GPU (same seed, same global batch), parameters compared; then
one more step of each zero strategy under `torch.cuda.set_sync_debug_mode("error")`, which raises
at any host-device synchronisation the engine makes (Note [host values], collectives.py). Prints
one line per check and exits 1 when any fails.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice

STEPS, BATCH, MODEL = 3, 8, "gpt"


def _step(model, optim, spec, step: int, rank: int, world: int, device) -> float:
    x, y = (t.to(device) for t in rank_slice(global_batch(spec, step, BATCH), rank, world))
    loss = model(x, y)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return loss.detach()


def _reference(device) -> dict[str, torch.Tensor]:
    model = build(MODEL).to(device)
    optim = make_optimizer(model)
    for step in range(STEPS):
        _step(model, optim, ZOO[MODEL], step, 0, 1, device)
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def main() -> int:
    sw.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    reference = _reference(device)
    failures = 0
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        try:
            model = build(MODEL).to(device)
            sw.shard(model, strategy=strategy)
            optim = make_optimizer(model)
            for step in range(STEPS):
                _step(model, optim, ZOO[MODEL], step, rank, world, device)
            full = {name: value.cpu() for name, value in sw.full_parameters(model).items()}
            worst = max((full[name] - value).abs().max().item() for name, value in reference.items())
            verdict = "ok" if worst <= 1e-4 else "FAILED"
            failures += verdict != "ok"
            if rank == 0:
                print(f"parity {strategy:<6} ws {world}: max |diff| vs one process {worst:.2e} {verdict}", flush=True)
            if strategy != "ddp":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    _step(model, optim, ZOO[MODEL], STEPS, rank, world, device)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                if rank == 0:
                    print(f"no host sync in a {strategy} step: ok", flush=True)
        except Exception:  # noqa: BLE001 - each check reports and the script goes on
            failures += 1
            print(f"rank {rank}: {strategy} FAILED\n{traceback.format_exc()}", flush=True)
    sw.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
