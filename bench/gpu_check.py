"""The checks only a GPU can make, for the day one is lent (issues 21 and 34): `bench/gpu_check.sh` runs it.

    torchrun --standalone --nproc-per-node NUM_GPUS bench/gpu_check.py            # NCCL, a rank per GPU
    torchrun --standalone --nproc-per-node 2 bench/gpu_check.py --device cpu      # the same checks on gloo

Each check runs against one process on the same device (same seed, same global batch, built on the
device: no host-to-device copy of the inputs), and prints one line, "ok" or "FAILED"; the script exits 1
when any failed:
  parity S       ddp, zero1, zero2, zero3: 3 AdamW steps in fp32, parameters vs a plain model
  no_sync+clip   zero2, zero3: 2 micro-batches under sw.no_sync, then sw.clip_grad_norm_(0.5): parameters
                 and each step's norm vs torch's clip on the plain model
  bf16           zero3 precision="bf16" vs the same on a one-rank group of this rank (one process)
  save/load      zero3: sw.save after 2 steps, a fresh model sw.load's it, one more step on both: equal
  no host sync   (CUDA) one zero step under torch.cuda.set_sync_debug_mode("error"), which raises at any
                 host-device synchronisation (Note [host values], collectives.py)
  overlap        (CUDA, ws >= 2) zero3 on a larger GPT: one step under torch.profiler, whose kernel trace
                 gives each kernel's stream and time span: the all-gathers (NCCL kernels on the comm
                 context's side stream, Note [comm context]) must run while compute kernels run on the
                 compute stream for some time (unit k+1 gathered while unit k computes), printed as ms
                 overlapped of the gathers' ms; and one step under set_sync_debug_mode("warn") must warn 0
                 times (host syncs per step, counted). On CPU, or at ws 1 (nothing gathered), it says it
                 skipped and why.
  timed step     zero3, one step after a warm-up (synchronized): printed, not judged
  path NAME      every engine path of issue 58 point 5 (bench/gpu_paths.py PATHS: streams per collective and
                 prefetch, device-form tags, hybrid, hpZ, compression, bf16, fp16 + scaler, clipping and norms,
                 optimizer in backward, Muon, host offload on a "cpu:gloo,cuda:nccl" group, a pipeline stage,
                 compile) against one process, the steps after the first under set_sync_debug_mode("error")
  step time      ddp, zero3 and FSDP2 fully_shard per block, median step (printed, not judged)
`--dry-run` prints every check this device would run and exits (no process group, no device: a CPU host runs it).
At ws 1 nothing crosses a link (a one-rank group moves no bytes, the reduce-scatter is skipped), so one
GPU checks the device code, not the communication. Two NCCL ranks cannot share one GPU (NCCL refuses
a duplicate device), so gpu_check.sh runs a second pass on one GPU with `--backend gloo` at 2 ranks,
reported apart: gloo implements only some collectives for CUDA tensors. It has never run on a GPU: written on a CPU-only
machine, where `--device cpu` runs (tests/test_gpu_check.py); the overlap check, added by issue 47, was
written by reading torch's profiler and sync-debug documentation and has never run either.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.gpt import GPT, Block, GPTConfig
from shardwise.testing import make_optimizer
from shardwise.wire.backends import on_device

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, for gpu_paths beside this script
import gpu_paths  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
STEPS, BATCH = 3, 8


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="nccl on cuda, gloo on cpu unless given")
    p.add_argument("--dry-run", action="store_true", help="print every check this device would run, then exit")
    return p.parse_args(argv)


def plan(device: str) -> list[str]:
    """Every check's name, in the order run_checks runs them (`--dry-run`)."""
    checks = [f"parity {s}" for s in ("ddp", "zero1", "zero2", "zero3")] + ["no_sync+clip zero2", "no_sync+clip zero3",
                                                                            "bf16 zero3"]
    checks += [f"save/load zero3 {how}" for how in ("sw.save", "sw.save_async")] + ["save/load zero3 host offload"]
    checks += ["overlap zero3", "host syncs per step zero3"] + (["no host sync zero2", "no host sync zero3"]
                                                                  if device == "cuda" else [])
    checks += ["timed step zero3"] + [f"path {name}" for name in gpu_paths.PATHS]
    return checks + [f"step time {arm}" for arm in ("ddp", "zero3", "fsdp2")]


def global_batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, drawn on the device by a generator of that device."""
    generator = torch.Generator(device=device).manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.seq_len + 1), device=device, generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def build(device: torch.device, process_group=None, **shard_kwargs) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The GPT (seed 0) on the device, sharded when `strategy` is given (over `process_group`, else the world), and
    its AdamW."""
    torch.manual_seed(0)
    model = GPT(CONFIG).to(device)
    if shard_kwargs:
        sw.shard(model, units=Block, **shard_kwargs, **({"process_group": process_group} if process_group else {}))
    return model, make_optimizer(model, ndim_by_name=full_ndim())


def full_ndim() -> dict[str, int]:
    """Each parameter's full ndim by name (shards are 1-D: the optimizer's groups go by the full one)."""
    with torch.device("meta"):
        return {name: p.ndim for name, p in GPT(CONFIG).named_parameters()}


def train(model, optim, steps: range, device, rank: int = 0, world: int = 1, accum: int = 1,
          clip: float | None = None, sharded: bool = True, sharded_model=None, scaler=None) -> list[float]:
    """Steps of this rank's slice of each global batch (the whole batch when unsharded); returns the norms.
    `sharded_model`: the sharded model where `model` is its compiled handle; `scaler`: an sw.LossScaler."""
    norms, owner = [], sharded_model if sharded_model is not None else model
    for step in steps:
        x, y = (t.chunk(world)[rank] for t in global_batch(step, device))
        for i, (mx, my) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with sw.no_sync(owner) if sharded and i < accum - 1 else nullcontext():
                loss = model(mx, my) / accum
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optim)
        if clip is not None:
            norm = sw.clip_grad_norm_(owner, clip) if sharded else torch.nn.utils.clip_grad_norm_(
                model.parameters(), clip)
            norms.append(norm)
        if scaler is not None:
            scaler.step(optim)
            scaler.update()
        else:
            optim.step()
        optim.zero_grad(set_to_none=True)
    return [float(norm) for norm in norms]  # read once the steps are done: no host sync inside them


def full(model, sharded: bool = True) -> dict[str, torch.Tensor]:
    params = sw.full_parameters(model) if sharded else dict(model.named_parameters())
    return {name: value.detach().float().cpu() for name, value in params.items()}


def worst(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in b)


class Report:
    def __init__(self, rank: int, world: int):
        self.rank, self.world, self.failures = rank, world, 0

    def check(self, name: str, diff: float, bound: float) -> None:
        verdict = "ok" if diff <= bound else "FAILED"
        self.failures += verdict != "ok"
        if self.rank == 0:
            print(f"{name:<24} ws {self.world}: max |diff| {diff:.2e} (bound {bound:.0e}) {verdict}", flush=True)

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)


def tolerance(device: torch.device) -> float:
    return 1e-5 if device.type == "cpu" else 1e-4  # CUDA: kernels pick their own reduction orders


def run_checks(device: torch.device, rank: int, world: int, report: Report) -> None:
    tolerance = globals()["tolerance"](device)
    reference, ref_optim = build(device)
    train(reference, ref_optim, range(STEPS), device, sharded=False)
    want = full(reference, sharded=False)
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        model, optim = build(device, strategy=strategy)
        train(model, optim, range(STEPS), device, rank, world)
        report.check(f"parity {strategy}", worst(full(model), want), tolerance)

    reference, ref_optim = build(device)
    want_norms = train(reference, ref_optim, range(STEPS), device, clip=0.5, sharded=False)
    want = full(reference, sharded=False)
    for strategy in ("zero2", "zero3"):
        model, optim = build(device, strategy=strategy)
        norms = train(model, optim, range(STEPS), device, rank, world, accum=2, clip=0.5)
        diff = max(worst(full(model), want), max(abs(a - b) / b for a, b in zip(norms, want_norms)))
        report.check(f"no_sync+clip {strategy}", diff, tolerance)

    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    model, optim = build(device, strategy="zero3", precision="bf16", process_group=solo)
    train(model, optim, range(STEPS), device, 0, 1)  # one process: the whole batch
    want = full(model)
    model, optim = build(device, strategy="zero3", precision="bf16")
    train(model, optim, range(STEPS), device, rank, world)
    # bf16 compute: the ranks' gradients differ from one process's in bf16 rounding, which AdamW's
    # normalized step can turn into lr-sized moves (1e-2) on near-zero entries; measured 7e-4 at ws 2 on CPU
    report.check("bf16 zero3", worst(full(model), want), 5e-3)

    check_save_load(device, rank, world, report)
    check_overlap(device, rank, world, report)
    if device.type == "cuda":
        for strategy in ("zero2", "zero3"):
            model, optim = build(device, strategy=strategy)
            train(model, optim, range(1), device, rank, world)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                train(model, optim, range(1, 2), device, rank, world)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            report.say(f"no host sync {strategy:<11} ws {world}: ok")
    model, optim = build(device, strategy="zero3")
    train(model, optim, range(1), device, rank, world)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    dist.barrier()
    start = time.perf_counter()
    train(model, optim, range(1, 2), device, rank, world)
    sync()
    report.say(f"timed step zero3        ws {world}: {(time.perf_counter() - start) * 1e3:.1f} ms (not judged)")
    this = sys.modules[__name__]
    for name in gpu_paths.PATHS:
        gpu_paths.run_path(name, this, device, rank, world, report)
    gpu_paths.time_arms(this, device, rank, world, report)


def check_save_load(device, rank: int, world: int, report: Report) -> None:
    """sw.save and sw.save_async after 2 steps, sw.load into a fresh model, one more step on both: equal; and a
    host-offloaded run's checkpoint loaded by a run without offload (Note [host offload])."""
    path = [tempfile.mkdtemp(prefix="sw-gpu-check-") if rank == 0 else None]
    dist.broadcast_object_list(path)  # one directory for every rank (one host)
    mixed = dist.new_group(list(range(world)), backend="cpu:gloo,cuda:nccl") if device.type == "cuda" else None
    for how, saved_by, options in (("sw.save", "zero3", {}), ("sw.save_async", "zero3", {}),
                                   ("host offload", "zero3", {"offload": "host", "process_group": mixed})):
        where = os.path.join(path[0], how.replace(" ", "-"))
        model, optim = build(device, strategy=saved_by, **options)
        train(model, optim, range(2), device, rank, world)
        if how == "sw.save_async":
            sw.save_async(where, model, optim).wait()
        else:
            sw.save(where, model, optim)
        loaded, loaded_optim = build(device, strategy="zero3")
        sw.load(where, loaded, loaded_optim)
        train(model, optim, range(2, 3), device, rank, world)
        train(loaded, loaded_optim, range(2, 3), device, rank, world)
        report.check(f"save/load zero3 {how}", worst(full(loaded), full(model)), 0.0)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path[0], ignore_errors=True)


OVERLAP_CONFIG = GPTConfig(vocab_size=1024, seq_len=128, d_model=512, n_layers=6, n_heads=8)  # gathers that take time


def check_overlap(device, rank: int, world: int, report: Report) -> None:
    """The overlap check (module docstring): zero3's gathers beside compute, seen as time; 0 host syncs per
    step. CUDA at ws >= 2 only: on CPU the comm context has no streams (Note [comm context]) and at ws 1 no
    gather is issued, so there is nothing to see."""
    if device.type != "cuda":
        report.say("overlap                  skipped on cpu: no streams, so nothing runs beside compute "
                   "(Note [comm context]); checked on a GPU only")
        return
    if world == 1:
        report.say("overlap                  skipped at ws 1: a one-rank group issues no gather")
        return
    if not on_device(dist.group.WORLD):  # NCCL alone or beside gloo (Note [group backends])
        report.say("overlap                  skipped on gloo: its collectives run on host threads, not as kernels "
                   "in the trace")
        return
    torch.manual_seed(0)
    model = GPT(OVERLAP_CONFIG).to(device)
    sw.shard(model, strategy="zero3", units=Block)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator(device=device).manual_seed(rank)
    tokens = torch.randint(0, OVERLAP_CONFIG.vocab_size, (8, OVERLAP_CONFIG.seq_len + 1), device=device,
                           generator=generator)

    def step() -> None:
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: NCCL communicators, cuBLAS handles, the allocator's pools
        step()
    torch.cuda.synchronize()
    syncs = count_host_syncs(step)
    report.check("host syncs per step zero3", float(syncs), 0.0)
    torch.cuda.synchronize()
    dist.barrier()
    gathers_ms, overlapped_ms = overlapped_gather_ms(step)
    verdict = "ok" if overlapped_ms > 0 else "FAILED"  # none overlapped, or no all-gather kernel seen at all
    report.failures += verdict != "ok"
    report.say(f"overlap zero3            ws {world}: {overlapped_ms:.2f} ms of {gathers_ms:.2f} ms of all-gather "
               f"kernels ran beside compute kernels on another stream {verdict}")


def count_host_syncs(step) -> int:
    """How many host-device synchronisations `step` makes: torch warns once per sync in "warn" mode."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()  # outside the counted window: a stream synchronize is itself a counted sync
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def overlapped_gather_ms(step) -> tuple[float, float]:
    """One profiled `step`: (ms of NCCL all-gather kernels, ms of them during which a compute kernel ran on
    another stream), from the profiler's kernel trace (each kernel's stream and span)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [(e["name"], e.get("args", {}).get("stream", e.get("tid")), e["ts"], e["ts"] + e["dur"])
               for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    gathers = [k for k in kernels if "nccl" in k[0].lower() and "allgather" in k[0].lower()]
    compute = [k for k in kernels if "nccl" not in k[0].lower()]
    overlapped = sum(_covered(start, end, [(c[2], c[3]) for c in compute if c[1] != stream])
                     for _, stream, start, end in gathers)
    return sum(end - start for *_, start, end in gathers) / 1e3, overlapped / 1e3


def _covered(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """How much of [start, end) the union of `spans` covers (microseconds)."""
    covered, reach = 0.0, start
    for lo, hi in sorted((max(lo, start), min(hi, end)) for lo, hi in spans if hi > start and lo < end):
        if hi > reach:
            covered += hi - max(lo, reach)
            reach = hi
    return covered


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print("\n".join(plan(args.device)))
        return 0
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    sw.init(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 parity
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    report = Report(rank, world)
    solo = ": one rank, nothing crosses a link (a one-rank group moves no bytes; the reduce-scatter is skipped)"
    report.say(f"gpu_check on {device.type} ({backend}), ws {world}" + (solo if world == 1 else ""))
    try:
        run_checks(device, rank, world, report)
    except Exception:  # noqa: BLE001 - a check that raised is a failure, reported with its traceback
        report.failures += 1
        print(f"rank {rank}: FAILED\n{traceback.format_exc()}", flush=True)
    failed = torch.tensor([report.failures], device=device if backend == "nccl" else "cpu")
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    report.say(f"gpu_check ws {world}: {'all ok' if not failed.item() else 'FAILED'}")
    sw.shutdown()
    return 1 if failed.item() else 0


if __name__ == "__main__":
    sys.exit(main())
