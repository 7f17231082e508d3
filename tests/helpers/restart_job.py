"""A small zero3 training job for restart trials: run under torchrun, resumes from `sw.latest()`.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/helpers/restart_job.py \
        --ckpt DIR --out DIR [--steps 12 --save-every 3] [--fault '{"kind": "kill", "rank": 1, "step": 8}']
        [--mesh 2x2] [--frozen host [--host-name NAME]]

Each attempt loads the newest complete checkpoint in `--ckpt` (if any) and trains to
`--steps`, saving every `--save-every` steps. The global batch (8 samples, dealt by
`sw.ResumableSampler`) is the same at any world size, so a run that is killed and
resumed must end with the uninterrupted run's parameters: bitwise at the same world
size, within float rounding at another. Rank 0 appends one JSON line per event to
`--out/events.jsonl` (attempt start, resume, each step's loss, each save) and writes
`--out/final.pt` (full parameters) and `--out/result.json` at the end.

`--fault` (JSON: one spec, or a list of them for several attempts) makes one rank fail on
purpose, in the attempt given by "attempt" (default 0, i.e. the first;
`TORCHELASTIC_RESTART_COUNT` counts attempts):
  kill / stop   SIGKILL / SIGSTOP itself at the start of step "step"
  save          SIGKILL itself inside the first `sw.save` at or after "step": while writing
                tensor number "at" of its file, or (rank 0, "at": -1) after index.json is
                written and before the directory is renamed into place
  load          SIGKILL itself inside `sw.load`, before reading tensor number "at"
  first_step    SIGKILL itself in the first step after resuming (after its forward)
`--mesh RxS` shards over a ("replicate", "shard") DeviceMesh (HSDP) instead of the flat world;
`--frozen host` freezes block 0 and keeps it as the host's shared copy (`frozen="host"`), each
rank then writes the host-copy files it maps (from /proc/self/maps) to `--out/maps-RANK.json`;
`--host-name` makes `socket.gethostname()` answer NAME in this process, so that two agents on one
machine act as two hosts (tests/test_nodes.py).
This file is a script, not part of the library: tests and bench/faults/faults.py launch it.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.gpt import GPT, Block, GPTConfig

GLOBAL_BATCH = 8
NUM_SAMPLES = 1024


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint directory (resumes from its newest checkpoint)")
    p.add_argument("--out", required=True, help="where events.jsonl, final.pt and result.json go")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--timeout", type=float, default=30.0, help="sw.init(timeout=...) in seconds")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep per step (slows the job)")
    p.add_argument("--fault", default=None, help="JSON fault spec (see the module docstring)")
    p.add_argument("--strategy", default="zero3", choices=["zero1", "zero2", "zero3"])
    p.add_argument("--keep-last", type=int, default=None, help="sw.save(..., keep_last=N)")
    p.add_argument("--end", default="shutdown", choices=["shutdown", "exit", "return", "raise"],
                   help="how the script ends: sw.shutdown(), sys.exit(0) after the last save without it, "
                        "falling off the end without it, or an uncaught exception (exit code 1) without it")
    p.add_argument("--stagger", type=float, default=0.0,
                   help="after a restart, rank r waits r times this many seconds before sw.init(), so that "
                        "rank 0 surely looks for its peers' addresses before they publish new ones")
    p.add_argument("--adam-eps", type=float, default=1e-8,
                   help="AdamW's eps (1e-3, as the parity tests, when comparing with another world size)")
    p.add_argument("--mesh", default=None, help="RxS: shard over a (replicate, shard) mesh of that shape")
    p.add_argument("--frozen", default=None, choices=["host"], help="freeze block 0 as the host copy")
    p.add_argument("--host-name", default=None, help="the host name this process reports (a simulated host)")
    return p.parse_args(argv)


def host_copy_maps() -> list[str]:
    """The host-copy files this process maps (their directory names carry the writer's pid)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return sorted({line.split(None, 5)[-1] for line in lines if "shardwise-host-" in line})


def shard_kwargs(args, world: int) -> dict:
    """sw.shard's keywords for --mesh and --frozen."""
    kwargs = {}
    if args.mesh:
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(int(n) for n in args.mesh.split("x"))
        if shape[0] * shape[1] != world:
            raise SystemExit(f"mesh {args.mesh} needs {shape[0] * shape[1]} ranks, the world has {world}")
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    if args.frozen:
        kwargs["frozen"] = args.frozen
    return kwargs


def log_event(out: Path, **fields) -> None:
    """Append one line to events.jsonl (O_APPEND: lines from several ranks do not interleave)."""
    fields["t"] = time.time()
    fields["attempt"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fields["pid"] = os.getpid()
    line = (json.dumps(fields) + "\n").encode()
    fd = os.open(out / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


class Fault:
    """The one failure this rank injects in this attempt, if any."""

    def __init__(self, spec: str | None, rank: int, out: Path):
        specs = json.loads(spec) if spec else []
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        mine = [s for s in (specs if isinstance(specs, list) else [specs])
                if s.get("rank", 0) == rank and s.get("attempt", 0) == attempt]
        self.spec = mine[0] if mine else {}
        self.out = out
        self.armed = bool(mine)
        self.kind = self.spec.get("kind")

    def fire(self, where: str, sig: int = signal.SIGKILL) -> None:
        log_event(self.out, event="fault", kind=self.kind, where=where, rank=sw.get_rank(),
                  signal=signal.Signals(sig).name)
        self.armed = False
        os.kill(os.getpid(), sig)

    def install(self, state: dict) -> None:
        """Patch the checkpoint code so that the fault fires inside sw.save / sw.load."""
        if self.kind == "save":
            # the package's `save` is the function
            save_module = importlib.import_module("shardwise.checkpoint.write.save")

            count = {"n": 0}
            writer_class = save_module.FileWriter
            fault = self

            class KillingWriter(writer_class):
                def write_next(self, tensor):
                    if fault.armed and state["step"] >= fault.spec["step"]:  # count this save's tensors only
                        if count["n"] == fault.spec.get("at", 0):
                            fault.fire(f"sw.save at step {state['step']}, writing tensor {count['n']}")
                        count["n"] += 1
                    return super().write_next(tensor)

            save_module.FileWriter = KillingWriter
            if self.spec.get("at") == -1:
                commit_module = importlib.import_module("shardwise.checkpoint.write.commit")  # the partial directory
                fsync_dir = commit_module.fsync_dir

                def killing_fsync_dir(path, durable):
                    fsync_dir(path, durable)
                    if fault.armed and state["step"] >= fault.spec["step"] and path.name.endswith(".partial"):
                        fault.fire(f"sw.save at step {state['step']}, index written, before the rename")

                commit_module.fsync_dir = killing_fsync_dir
        elif self.kind == "load":
            load_module = importlib.import_module("shardwise.checkpoint.read.load")

            count = {"n": 0}
            read_into = load_module._read_into
            fault = self

            def killing_read_into(tensor, lo, hi, dest):
                if fault.armed and count["n"] == fault.spec.get("at", 0):
                    fault.fire(f"sw.load, before tensor {count['n']}")
                count["n"] += 1
                return read_into(tensor, lo, hi, dest)

            load_module._read_into = killing_read_into


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    config = GPTConfig()
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (NUM_SAMPLES, config.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> None:
    args = parse_args(argv)
    # SIGUSR1 prints every thread's stack to stderr: how a launcher learns where a hung rank was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.host_name:
        import socket

        socket.gethostname = lambda: args.host_name
    torch.set_num_threads(1)
    out, ckpt = Path(args.out), Path(args.ckpt)
    out.mkdir(parents=True, exist_ok=True)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(int(os.environ.get("RANK", "0")) * args.stagger)
    sw.init(timeout=args.timeout)
    rank, world = sw.get_rank(), sw.get_world_size()
    state = {"step": 0}
    fault = Fault(args.fault, rank, out)
    fault.install(state)
    if rank == 0:
        log_event(out, event="start", world_size=world)
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} does not divide the global batch {GLOBAL_BATCH}")

    torch.manual_seed(0)
    model = GPT(GPTConfig())
    if args.frozen:
        model.blocks[0].requires_grad_(False)
    sw.shard(model, strategy=args.strategy, units=Block, **shard_kwargs(args, world))
    if args.frozen:
        (out / f"maps-{rank}.json").write_text(json.dumps(host_copy_maps()))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=args.adam_eps)
    sampler = sw.ResumableSampler(NUM_SAMPLES, seed=3, drop_last=True)
    inputs, targets = dataset()

    resumed_from = None
    newest = sw.latest(ckpt)
    if newest is not None:
        report = sw.load(newest, model, optim, sampler=sampler)
        state["step"] = resumed_from = report.extra["step"]
        if rank == 0:
            log_event(out, event="resumed", step=resumed_from, checkpoint=newest.name, world_size=world)

    per_rank = GLOBAL_BATCH // world
    indices = iter(sampler)
    while state["step"] < args.steps:
        step = state["step"]
        if fault.kind in ("kill", "stop") and fault.armed and step == fault.spec["step"]:
            fault.fire(f"start of step {step}", signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        batch = torch.tensor([next(indices) for _ in range(per_rank)])
        loss = model(inputs[batch], targets[batch])
        if fault.kind == "first_step" and fault.armed and resumed_from is not None:
            fault.fire(f"first step after resuming (step {step}), after its forward")
        loss.backward()
        sw.clip_grad_norm_(model, 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        state["step"] = step + 1
        if rank == 0:
            log_event(out, event="step", step=step, loss=mean_loss.item(), world_size=world)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if state["step"] % args.save_every == 0:
            sw.save(ckpt / f"step-{state['step']:05d}", model, optim, sampler=sampler, step=state["step"],
                    keep_last=args.keep_last)
            if rank == 0:
                log_event(out, event="saved", step=state["step"])

    full = sw.full_state_dict(model)
    if rank == 0:
        torch.save(full, out / "final.pt")
        (out / "result.json").write_text(json.dumps(
            {"steps": args.steps, "world_size": world, "resumed_from": resumed_from, "digest": digest(full)}))
        log_event(out, event="done", world_size=world)
    if args.end == "exit":
        sys.exit(0)  # no sw.shutdown(): what the process's exit does with shardwise's groups and threads
    if args.end == "raise":
        raise RuntimeError("the script's own error, uncaught")
    if args.end == "shutdown":
        sw.shutdown()


if __name__ == "__main__":
    main()
