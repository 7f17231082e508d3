"""Process-group set-up from torchrun's environment, and small rank helpers.

shardwise never opens its own sockets or runs its own launcher: `init()` reads the
variables torchrun sets and hands them to `torch.distributed`. With none of them set
it forms a one-rank group, so the same script runs as `python train.py` and under
`torchrun` (nanoGPT's habit) and every code path below is the distributed one.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError

# torchrun always sets all of these together; a subset means a hand-made launch went wrong.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init(
    *,
    backend: str | None = None,
    timeout: timedelta | float = timedelta(minutes=10),
) -> dist.ProcessGroup:
    """Join (or form) the default process group and return it.

    Reads torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.
    With none set, forms a one-rank group in this process. Picks gloo on CPU and NCCL
    when CUDA is available (and then sets this rank's device from `LOCAL_RANK`);
    `backend` overrides. `timeout` (seconds or a timedelta) bounds every collective,
    so a rank that dies makes the others fail instead of hang. Calling it again
    returns the existing group.
    """
    if dist.is_initialized():
        return dist.group.WORLD
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    env = _read_launch_env()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(env["local_rank"])
    if env["world_size"] == 1 and env["rank"] == 0 and "MASTER_ADDR" not in os.environ:
        # One process, no launcher: an in-memory store needs no port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        dist.init_process_group(
            backend, init_method="env://", rank=env["rank"], world_size=env["world_size"], timeout=timeout
        )
    return dist.group.WORLD


def _read_launch_env() -> dict[str, int]:
    present = [name for name in _LAUNCH_VARS if name in os.environ]
    if not present:
        return {"rank": 0, "world_size": 1, "local_rank": 0}
    missing = [name for name in _LAUNCH_VARS if name not in os.environ]
    if missing:
        raise ShardwiseError(
            f"the launch environment is incomplete: {', '.join(present)} set but "
            f"{', '.join(missing)} missing. Launch with `torchrun --nproc-per-node N script.py`, "
            f"or set all of {', '.join(_LAUNCH_VARS)}, or unset them all to run as one process."
        )
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        raw = os.environ.get(name, "0" if name == "LOCAL_RANK" else None)
        try:
            values[name.lower()] = int(raw)
        except ValueError:
            raise ShardwiseError(f"environment variable {name}={raw!r} is not an integer") from None
    if not 0 <= values["rank"] < values["world_size"]:
        raise ShardwiseError(
            f"RANK={values['rank']} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={values['world_size']})"
        )
    return values


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in `group` (0 when no group is initialized)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in `group` (1 when no group is initialized)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def is_main(group: dist.ProcessGroup | None = None) -> bool:
    """True on rank 0: the rank that prints, plots and shows progress."""
    return get_rank(group) == 0


def shutdown() -> None:
    """Leave the default process group (safe to call when none is initialized)."""
    if dist.is_initialized():
        dist.destroy_process_group()
