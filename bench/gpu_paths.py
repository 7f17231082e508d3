"""Every engine path of issue 58 point 5, run by bench/gpu_check.py on the device it was given: a few AdamW steps of
each path against one process on the same device (the same seed, the whole batch), the counted steps under
`torch.cuda.set_sync_debug_mode("error")` on CUDA (any host-device synchronisation raises), and the step time of
ddp, zero3 and FSDP2's `fully_shard` per block at the same settings. Never run on a GPU yet (written on a
CPU-only host, where `python bench/gpu_check.py --dry-run` lists them and the CPU pass runs what applies).

The paths (PATHS: name -> what sw.shard and the step take; tests/test_gpu_check.py holds the list to point 5's):
zero1, zero2, zero3 (streams per collective, prefetch 1 and 2), hybrid (2 x N/2 mesh), hpZ, compressed gathers and
reduces, bf16, fp16 with sw.LossScaler, clipping with sw.grad_norms / sw.param_norms, optimizer in backward, a
whole-tensor optimizer (Muon), host offload (zero1/2/3 on a "cpu:gloo,cuda:nccl" group: Note [group backends]),
the device-form gather tags (zero3 on NCCL: Note [tags on the device]), torch.compile, a pipeline stage (the
whole model as one ShardedStage under torch's ScheduleGPipe, two micro-batches, each rank its own pipe).
sw.save / sw.save_async / sw.load are gpu_check.py's own check (check_save_load).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.wire.backends import on_device

# name: (sw.shard's options, the step's options, the least world size where the path does something)
PATHS = {
    "zero1": ({"strategy": "zero1"}, {"clip": 0.5}, 1),
    "zero2": ({"strategy": "zero2"}, {"clip": 0.5}, 1),
    "zero3 streams prefetch 1": ({"strategy": "zero3", "prefetch": 1}, {"clip": 0.5}, 1),
    "zero3 streams prefetch 2": ({"strategy": "zero3", "prefetch": 2}, {"clip": 0.5}, 1),
    "zero3 device-form tags": ({"strategy": "zero3"}, {"tags": True}, 2),
    "zero2 hybrid": ({"strategy": "zero2", "mesh": "hybrid"}, {}, 4),
    "zero3 hpZ": ({"strategy": "zero3", "reshard_after_forward": 2}, {}, 4),
    "zero3 compressed": ({"strategy": "zero3", "compression": {"gather": "int8", "reduce": "int8"}},
                         {"loose": 5e-2}, 2),
    "zero3 bf16": ({"strategy": "zero3", "precision": "bf16"}, {"loose": 5e-3}, 1),
    "zero2 fp16 scaler": ({"strategy": "zero2", "precision": "fp16"}, {"scaler": True, "loose": 5e-3}, 1),
    "zero3 clip norms": ({"strategy": "zero3"}, {"clip": 0.5, "norms": True}, 1),
    "zero3 optimizer in backward": ({"strategy": "zero3"}, {"in_backward": True}, 1),
    "zero1 whole-tensor Muon": ({"strategy": "zero1"}, {"muon": True, "loose": 5e-3}, 1),
    "zero1 host offload": ({"strategy": "zero1", "offload": "host"}, {"clip": 0.5, "mixed": True}, 1),
    "zero2 host offload": ({"strategy": "zero2", "offload": "host"}, {"clip": 0.5, "mixed": True}, 1),
    "zero3 host offload": ({"strategy": "zero3", "offload": "host"}, {"clip": 0.5, "mixed": True}, 1),
    "zero2 compiled": ({"strategy": "zero2"}, {"compile": True}, 1),
    "zero3 pipeline stage": ({"strategy": "zero3"}, {"stage": True}, 1),
}
SAVE_LOAD = ("sw.save", "sw.save_async", "sw.load")  # gpu_check.check_save_load


@contextmanager
def no_host_sync(device: torch.device):
    """CUDA: any host-device synchronisation inside raises (torch's sync debug mode); elsewhere nothing."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _group(step_options: dict, device: torch.device, world: int):
    """The group a path shards over: host offload's takes host tensors too (Note [group backends])."""
    if step_options.get("mixed") and device.type == "cuda":
        return dist.new_group(list(range(world)), backend="cpu:gloo,cuda:nccl")
    return None


def _shard_kwargs(options: dict, device: torch.device, world: int) -> dict:
    kwargs = dict(options)
    if kwargs.pop("mesh", None) == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh
        kwargs["mesh"] = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return kwargs


def _optimizer(model, step_options: dict, ndim: dict):
    from shardwise.testing import Optimizers, make_optimizer
    if not step_options.get("muon"):
        return make_optimizer(model, ndim_by_name=ndim)
    named = list(model.named_parameters())
    matrices = [p for name, p in named if ndim[name] == 2 and "blocks" in name]
    rest = [p for name, p in named if not (ndim[name] == 2 and "blocks" in name)]
    return Optimizers([torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)])


def run_path(name: str, check, device: torch.device, rank: int, world: int, report, steps: int = 3) -> None:
    """One path: `steps` steps against one process (gpu_check's `build`/`train`/`full`/`worst`, handed in as
    `check`), every step after the first under no_host_sync."""
    options, step_options, least = PATHS[name]
    if world < least:
        report.say(f"path {name:<28} ws {world}: skipped (needs ws >= {least})")
        return
    if step_options.get("tags") and not on_device(dist.group.WORLD):
        report.say(f"path {name:<28} ws {world}: skipped (device-form tags run on NCCL only)")
        return
    want = _reference(name, check, device, rank, world, steps)
    group = _group(step_options, device, world)
    model, optim = check.build(device, process_group=group, **_shard_kwargs(options, device, world))
    if step_options.get("muon"):
        optim = _optimizer(model, step_options, check.full_ndim())
    if step_options.get("in_backward"):
        sw.optimizer_in_backward(model, optim)
    runner = torch.compile(model, backend="inductor" if device.type == "cuda" else "eager") \
        if step_options.get("compile") else model
    scaler = sw.LossScaler(model) if step_options.get("scaler") else None
    kwargs = {"clip": step_options.get("clip"), "sharded_model": model, "scaler": scaler}
    train = _StageCheck(check, model, device).train if step_options.get("stage") else check.train
    train(runner, optim, range(1), device, rank, world, **kwargs)
    # the scaler's overflow verdict is its one host read per step (as GradScaler's), and host offload's step
    # waits for its copies (Note [host offload]): both run their counted steps outside the error mode
    quiet = not (scaler is not None or options.get("offload") == "host")
    with no_host_sync(device) if quiet else nullcontext():
        train(runner, optim, range(1, steps), device, rank, world, **kwargs)
    if step_options.get("tags"):  # zero3 on NCCL: each gather's tag rides the device (Note [tags on the device])
        report.check("path zero3 tags on the device", 0.0 if on_device(dist.group.WORLD) else 1.0, 0.0)
    if step_options.get("norms"):
        sw.grad_norms(model), sw.param_norms(model)
    bound = step_options.get("loose", check.tolerance(device))
    report.check(f"path {name}", check.worst(check.full(model), want), bound)


class _StageCheck:
    """`train` as gpu_check's, stepping `model` as one ShardedStage under ScheduleGPipe."""

    def __init__(self, check, model, device: torch.device):
        from torch.distributed.pipelining import ScheduleGPipe

        from shardwise.pipeline.sharded import ShardedStage

        self.check = check
        pipe = dist.new_group([dist.get_rank()], use_local_synchronization=True)  # this rank's pipe: one stage
        stage = ShardedStage(model, 0, 1, device, group=pipe)
        loss = lambda logits, target: torch.nn.functional.cross_entropy(  # noqa: E731
            logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        self.schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss)

    def train(self, model, optim, steps, device, rank=0, world=1, **_):
        for step in steps:
            x, y = (t.chunk(world)[rank] for t in self.check.global_batch(step, device))
            self.schedule.step(x, target=y)
            optim.step()
            optim.zero_grad(set_to_none=True)
        return []


def _reference(name: str, check, device: torch.device, rank: int, world: int, steps: int) -> dict:
    """The one-process run a path is held to: the plain model, or, for a path whose arithmetic is not fp32's
    (a low precision, Muon's bf16 Newton-Schulz, quantized collectives: `loose`), the same options on a one-rank
    group of this rank with the whole batch (gpu_check's bf16 check does the same)."""
    options, step_options, _ = PATHS[name]
    if "loose" not in step_options:
        reference, optim = check.build(device)
        check.train(reference, optim, range(steps), device, clip=step_options.get("clip"), sharded=False)
        return check.full(reference, sharded=False)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    options = {key: value for key, value in options.items() if key != "compression"}  # one rank moves no bytes
    reference, optim = check.build(device, process_group=solo, **options)
    if step_options.get("muon"):
        optim = _optimizer(reference, step_options, check.full_ndim())
    scaler = sw.LossScaler(reference) if step_options.get("scaler") else None
    check.train(reference, optim, range(steps), device, 0, 1, clip=step_options.get("clip"), scaler=scaler)
    return check.full(reference)


def time_arms(check, device: torch.device, rank: int, world: int, report, steps: int = 5) -> None:
    """Median step of ddp, zero3 and FSDP2's fully_shard per block, same model, batch and device (not judged)."""
    from torch.distributed.fsdp import fully_shard

    from shardwise.models.gpt import Block

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for arm in ("ddp", "zero3", "fsdp2"):
        if arm == "fsdp2":
            model, optim = check.build(device)
            for module in model.modules():
                if isinstance(module, Block):
                    fully_shard(module)
            fully_shard(model)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            model, optim = check.build(device, strategy=arm)
        times = []
        for step in range(steps):
            sync()
            start = time.perf_counter()
            check.train(model, optim, range(step, step + 1), device, rank, world, sharded=arm != "fsdp2")
            sync()
            times.append(time.perf_counter() - start)
        report.say(f"step time {arm:<14} ws {world}: {sorted(times[1:])[len(times[1:]) // 2] * 1e3:.1f} ms "
                   "(median after one warm-up; not judged)")
