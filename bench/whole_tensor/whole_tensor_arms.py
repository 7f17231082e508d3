"""The arms of bench/whole_tensor/whole_tensor.py, one rank's side: the optimizers, one arm's timed steps (wall time,
CPU seconds and bytes received, Note [owner traffic] in engine/optim/whole_step.py), the parity job.
"""

from __future__ import annotations

import resource
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

import shardwise as sw
from shardwise.models.gpt import GPT, Block, GPTConfig
from shardwise.testing import count_received

PARITY = ("adamw", "muon", "adafactor")  # each under the owner shape (shardwise zero2) and DTensor
PHASES = ("gather", "muon_compute", "broadcast_writeback", "adamw")  # MuonAdamW's clock


def cpu_seconds() -> float:
    """This process's CPU seconds, every thread (gloo's included), user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def build_model(args):
    torch.manual_seed(args.seed)  # every arm, rank and the reference start from the same weights
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model,
                         n_layers=args.layers, n_heads=args.heads))


def takes_muon(name: str, param, muon_on: str) -> bool:
    """Whether Muon steps this parameter: "hidden", the standard recipe (Keller Jordan's, Moonlight's, torch's
    docs): the blocks' 2-D matrices, AdamW for the embeddings, the head and every 1-D parameter; "all-2d":
    every 2-D parameter, the tied embedding/head and pos_emb too."""
    return param.dim() == 2 and (muon_on == "all-2d" or name.startswith("blocks."))


class MuonAdamW:
    """Muon for the parameters `takes_muon` picks, AdamW for the rest, with a clock on each phase.

    The whole-tensor step's gathers run in torch's global pre-hooks and its broadcasts in the global
    post-hooks; torch runs an instance's own pre-hooks after the global ones and its post-hooks before
    them, so the marks below split Muon's step into gather | compute | broadcast and write-back."""

    def __init__(self, params: dict, args):
        muon = {name: takes_muon(name, p, args.muon_on) for name, p in params.items()}
        self.muon = torch.optim.Muon([p for name, p in params.items() if muon[name]], lr=args.muon_lr,
                                     weight_decay=args.weight_decay)
        self.adamw = torch.optim.AdamW([p for name, p in params.items() if not muon[name]], lr=args.lr,
                                       weight_decay=args.weight_decay)
        self.marks: list[float] = []
        self.muon.register_step_pre_hook(lambda *_: self.marks.append(time.perf_counter()))
        self.muon.register_step_post_hook(lambda *_: self.marks.append(time.perf_counter()))
        self.phases: list[list[float]] = []  # per step: gather, compute, broadcast, adamw

    def step(self):
        self.marks = [time.perf_counter()]
        self.muon.step()
        self.marks.append(time.perf_counter())
        self.adamw.step()
        self.marks.append(time.perf_counter())
        self.phases.append([b - a for a, b in zip(self.marks, self.marks[1:])])

    def zero_grad(self, set_to_none=True):
        for optimizer in (self.muon, self.adamw):
            optimizer.zero_grad(set_to_none=set_to_none)


def make_optimizer(params: dict, kind: str, args):
    """`params`: name -> parameter (Muon picks by name)."""
    if kind == "muon":
        return MuonAdamW(params, args)
    if kind == "adafactor":
        return torch.optim.Adafactor(list(params.values()), lr=1e-2)
    return torch.optim.AdamW(list(params.values()), lr=args.lr, weight_decay=args.weight_decay)


def whole_grads(shapes: dict, args, step: int) -> dict[str, torch.Tensor]:
    """Fixed random gradients of the whole shapes, by name: the same on every rank and in every arm."""
    gen = torch.Generator().manual_seed(args.seed * 1_000 + step)
    return {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in shapes.items()}


def shard0(tensors: dict, mesh) -> dict:
    """Each tensor as a `Shard(0)` DTensor; every rank holds the same whole value, so no scatter."""
    return {name: distribute_tensor(t.detach(), mesh, [Shard(0)], src_data_rank=None) for name, t in tensors.items()}


def to_dtensors(model, mesh) -> dict:
    """The model's parameters as `Shard(0)` DTensor Parameters, by name (the tied weight once)."""
    return {name: torch.nn.Parameter(d) for name, d in shard0(dict(model.named_parameters()), mesh).items()}


def set_dtensor_grads(params: dict, grads: dict, mesh) -> None:
    for name, g in shard0(grads, mesh).items():
        params[name].grad = g


def time_arm(arm: str, args, world_size: int, rank: int, mesh) -> dict:
    """Per step of one arm on this rank: optimizer.step()'s wall time, its CPU seconds (this thread, and the
    process: gloo's threads too), the full step's wall time, the bytes this rank received in the full step
    and in optimizer.step() (torch.distributed's collectives: DDP's C++ reducer and DTensor are not seen),
    Muon's phases."""
    shape, kind = arm.split("_")
    model = build_model(args)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if shape == "ddp":
        sw.shard(model, strategy="ddp")
    elif shape in ("zero2", "zero3"):
        sw.shard(model, strategy=shape, units=Block)  # the optimizer is built after: it sees shards
    params = to_dtensors(model, mesh) if shape == "dtensor" else dict(model.named_parameters())
    optimizer = make_optimizer(params, kind, args)
    alone = shape == "one"  # rank 0 alone, on the whole global batch
    step_s, full_s, thread_s, process_s, bytes_full, bytes_step = [], [], [], [], [], []
    for step in range(args.warmup + args.steps):
        if shape == "dtensor":
            set_dtensor_grads(params, whole_grads(shapes, args, step), mesh)
        gen = torch.Generator().manual_seed(args.seed + step)
        tokens = torch.randint(args.vocab, (world_size * args.batch, args.seq + 1), generator=gen)
        if not alone:
            tokens = tokens[rank * args.batch:(rank + 1) * args.batch]
        dist.barrier()  # every rank starts the step together: the time is the step's, not a straggler's
        start = time.perf_counter()
        with count_received() as received:  # the barriers stay outside: they are the bench's, not the step's
            if shape != "dtensor" and (not alone or rank == 0):
                model(tokens[:, :-1], tokens[:, 1:]).backward()
        dist.barrier()
        stepping, thread0, process0 = time.perf_counter(), time.thread_time(), cpu_seconds()
        with count_received() as received_in_step:
            if not alone or rank == 0:
                optimizer.step()
        end = time.perf_counter()
        thread_s.append(time.thread_time() - thread0)
        process_s.append(cpu_seconds() - process0)
        optimizer.zero_grad(set_to_none=True)
        step_s.append(end - stepping)
        full_s.append(end - start)
        bytes_step.append(received_in_step.bytes)
        bytes_full.append(received.bytes + received_in_step.bytes)
    counted = shape in ("zero2", "zero3", "one")  # the others' traffic is in C++ (DDP) or DTensor's own ops
    return {"step_s": step_s, "full_s": full_s if shape != "dtensor" else None, "thread_s": thread_s,
            "process_s": process_s, "bytes_full": bytes_full if counted else None,
            "bytes_step": bytes_step if counted else None, "phases": getattr(optimizer, "phases", None)}


def three_steps(args, kind: str, shape: str, mesh) -> dict:
    """Full parameters after 3 steps of `kind` on fixed gradients, stepped on whole tensors in this
    process ("whole"), by shardwise zero2's owner step ("owner") or as Shard(0) DTensors ("dtensor")."""
    model = build_model(args)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    if shape == "owner":
        sw.shard(model, strategy="zero2", units=Block)
    params = to_dtensors(model, mesh) if shape == "dtensor" else dict(model.named_parameters())
    optimizer = make_optimizer(params, kind, args)
    for step in range(3):
        grads = whole_grads(shapes, args, step)
        if shape == "dtensor":
            set_dtensor_grads(params, grads, mesh)
        elif shape == "owner":  # this rank's rows of the same whole gradient, padding zero
            for name, info in sw.shard_info(model).items():
                info.param.grad = torch.zeros_like(info.param)
                info.param.grad[: info.row_end - info.row_start] = grads[name][info.row_start:info.row_end]
        else:
            for name, p in params.items():
                p.grad = grads[name]
        optimizer.step()
    if shape == "owner":
        return sw.full_parameters(model)
    return {name: p.detach().full_tensor() if shape == "dtensor" else p.detach() for name, p in params.items()}


def parity_job(args, rank: int, mesh) -> dict:
    """Each optimizer in PARITY under the owner and DTensor shapes, against one process (on rank 0)."""
    out = {}
    for kind in PARITY:
        reference = three_steps(args, kind, "whole", mesh) if rank == 0 else None
        dist.barrier()
        for shape in ("owner", "dtensor"):
            try:
                full = three_steps(args, kind, shape, mesh)
            except Exception as error:  # noqa: BLE001 — Adafactor on DTensor raises: record what
                out[f"{shape}_{kind}"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
                print(f"rank {rank}: {shape} {kind}: {out[f'{shape}_{kind}']['error']}", file=sys.stderr)
                full = None
            if rank == 0 and full is not None:
                diffs = {name: (full[name] - ref).abs().max().item() for name, ref in reference.items()}
                worst = max(diffs, key=diffs.get)
                out[f"{shape}_{kind}"] = {"max_abs_diff": diffs[worst], "worst_param": worst,
                                          "bitwise": all(torch.equal(full[n], r) for n, r in reference.items())}
            dist.barrier()
    return out
