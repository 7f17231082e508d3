"""SIGKILL during checkpoint saves: does `sw.latest` always name a whole checkpoint, and does the
next save leave no leftovers? (Note [atomic publish], Note [leftovers].)

    python bench/faults/kill_saves.py                       # 10 trials of each mode: 30 kills
    python bench/faults/kill_saves.py --trials 4 --seed 1

Each trial starts 2 ranks (gloo, zero3, a 4 MB model whose every value is the step) that save in
a loop, one mode per trial: `save` (sw.save to step-N, keep_last=2), `async` (sw.save_async to
step-N, keep_last=2, training between saves) or `same` (sw.save to `last`, over itself). Once
the first save has completed, after a random 0-1.5 s, rank 0, rank 1 or both get SIGKILL (the
survivor too, 0.3 s later). Then, in this process: `sw.latest(dir)` must name a checkpoint that
loads, whose step is at least the last step a rank logged as complete and whose values are all
that step ("bad latest" otherwise); then one more `sw.save` into the directory, after which no
hidden `.NAME.partial` / `.NAME.old` may remain ("leftovers after").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import shardwise as sw

MODES = ("save", "async", "same")


def model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(256, 512) for _ in range(8)])  # 4.2 MB of float32


def child(mode: str, directory: Path) -> None:
    sw.init()
    net = model()
    sw.shard(net, strategy="zero3")
    log = directory / "completed.log"
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for param in net.parameters():
                param.fill_(step)
        name = "last" if mode == "same" else f"step-{step}"
        if mode == "async":
            pending = sw.save_async(directory / name, net, step=step, keep_last=2)
            for _ in range(20):  # training goes on while the files are written
                torch.randn(128, 128) @ torch.randn(128, 128)
            pending.wait()
        else:
            sw.save(directory / name, net, step=step, keep_last=None if mode == "same" else 2)
        if sw.get_rank() == 0:
            with open(log, "a") as f:
                f.write(f"{step}\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, port: int, mode: str, directory: str) -> None:
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # a survivor's broken collective is expected: not shown
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    child(mode, Path(directory))


def trial(mode: str, rng: random.Random, directory: Path) -> dict:
    # Forked from this process (torch already imported, one thread): a trial costs its saves, not imports.
    port, fork = free_port(), multiprocessing.get_context("fork")
    ranks = [fork.Process(target=rank_main, args=(rank, port, mode, str(directory)), daemon=True) for rank in range(2)]
    for process in ranks:
        process.start()
    log = directory / "completed.log"
    deadline = time.time() + 120
    while not (log.exists() and log.read_text().strip()) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(rng.uniform(0, 1.5))
    victims = rng.choice([[0], [1], [0, 1]])
    for rank in victims:
        os.kill(ranks[rank].pid, signal.SIGKILL)
    time.sleep(0.3)
    for process in ranks:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join()
    completed = [int(x) for x in log.read_text().split()] if log.exists() else []
    left_by_kill = hidden(directory)
    bad, why = False, ""
    try:
        latest = sw.latest(directory)
        if latest is None:
            bad, why = bool(completed), "no latest"
        else:
            net = model()
            step = sw.load(latest, net).extra["step"]
            if completed and step < completed[-1]:
                bad, why = True, f"latest is step {step}, step {completed[-1]} had completed"
            elif any(not torch.all(p == step) for p in net.parameters()):
                bad, why = True, f"{latest.name} holds other values than step {step}"
    except sw.ShardwiseError as error:
        bad, why = True, str(error)[:200]
    sw.save(directory / "after", model(), step=0)
    return {"mode": mode, "killed": victims, "completed": completed[-1] if completed else 0, "bad_latest": bad,
            "why": why, "leftovers_by_kill": left_by_kill, "leftovers_after_next_save": hidden(directory)}


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".") and p.is_dir())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials per mode")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # no thread pool in the process the ranks are forked from
    rng = random.Random(args.seed)
    rows = []
    for mode in MODES:
        for index in range(args.trials):
            with tempfile.TemporaryDirectory() as tmp:
                row = trial(mode, rng, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        print(f"{mode:6s} kills {len(mine):3d}  bad latest {sum(r['bad_latest'] for r in mine):3d}  "
              f"trials with leftovers: after the kill {sum(bool(r['leftovers_by_kill']) for r in mine):3d}, "
              f"after the next save {sum(bool(r['leftovers_after_next_save']) for r in mine):3d}")
    return 1 if any(r["bad_latest"] or r["leftovers_after_next_save"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
