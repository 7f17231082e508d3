"""Jobs that share a host or a directory with another (tests/test_checkpoint_neighbours.py): a save
held mid-write in its own process, so a second job can act while the first one's save runs."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

import shardwise as sw


def model(value: float) -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    with torch.no_grad():
        for param in net.parameters():
            param.fill_(value)
    return net


def held_save(path: str, step: int, started: str, release: str) -> str:
    """sw.save(path) in this process, holding its first write until `release` exists (after touching
    `started`); returns "ok" or the error."""
    from shardwise.checkpoint.write import writer as files

    write = files._write_chunk

    def held(file, data):
        if not Path(started).exists():
            Path(started).touch()
            deadline = time.monotonic() + 60
            while not Path(release).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        write(file, data)

    files._write_chunk = held
    try:
        sw.save(path, model(step), step=step)
        return "ok"
    except Exception as error:  # noqa: BLE001 - reported to the test
        return f"{type(error).__name__}: {error}"


def step_of(path) -> int:
    """The step a checkpoint of `model()` holds, checked against its values."""
    net = model(-1)
    step = sw.load(path, net).extra["step"]
    assert all(torch.all(p == step) for p in net.parameters()), path
    return step
