"""Process-group set-up from torchrun's environment, and small rank helpers.

shardwise never opens its own sockets or runs its own launcher: `init()` reads the
variables torchrun sets and hands them to `torch.distributed`. With none of them set
it forms a one-rank group, so the same script runs as `python train.py` and under
`torchrun` (nanoGPT's habit) and every code path below is the distributed one.

Note [restart keys]: under torchrun every restart of the workers (`--max-restarts`, an
elastic membership change) talks to the *same* TCPStore server: the agent creates it
once (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, `next_rendezvous`:
"_shared_tcp_store_server" is only built on the first round) and hands its port to
every round as MASTER_PORT, and the workers join it as clients with no per-attempt
prefix (torch/distributed/rendezvous.py, `_create_c10d_store`: "We create a new
TCPStore for every retry so no need to add prefix for each attempt"). gloo's
`connectFullMesh` publishes each rank's listening address under `default_pg/0//cpu//0/<rank>`
and reads its peers' from the same keys; a restarted rank finds the dead attempt's
addresses already there, connects to a port nobody listens on ("Connection refused"),
or waits on a half-dead peer (a hang). So `init()` puts the group under a prefix no
earlier attempt used: rank 0 draws a fresh token and hands it to every other rank
through keys named after a nonce each of them just drew (`_agree_token`), which no
earlier attempt can have written. The same exchange bounds the join: when a rank does
not show up within `timeout`, every rank raises an error naming the ranks that did not.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.teardown import close_all, close_group_at_exit

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
    `backend` overrides. `timeout` (seconds or a timedelta) bounds joining the group
    and every collective, so a rank that dies or never starts makes the others fail
    with an error instead of hang. Safe under torchrun's restarts: each attempt's group
    reads nothing an earlier attempt wrote (Note [restart keys]). Calling it again
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
        store = _attempt_store(env["rank"], env["world_size"], timeout)
        dist.init_process_group(backend, store=store, rank=env["rank"], world_size=env["world_size"],
                                timeout=timeout)
    # Registered first, so closed last: after every group shardwise makes on top of it.
    return close_group_at_exit(dist.group.WORLD, "the default process group (sw.init)")  # Note [exit teardown]


# How often a rank looks at the store while ranks join; joining costs at most a few of these.
_POLL_S = 0.01
# Rank 0 decides at the deadline whether everyone joined; the others wait this much longer for its word.
_VERDICT_GRACE_S = 5.0


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The launcher's store, under a prefix that only this attempt's ranks know (Note [restart keys])."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # As torch's env:// does: torchrun's agent hosts the store, else rank 0 hosts it.
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        # wait_for_workers=False: the join below waits, and names the ranks that did not come.
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0 and not hosted_by_agent,
                              timeout=timeout, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, dist.DistStoreError) as error:
        raise ShardwiseError(
            f"rank {rank} could not reach the rendezvous store at {host}:{port} within "
            f"{timeout.total_seconds():.0f} s: {str(error).splitlines()[0]}. Check MASTER_ADDR/MASTER_PORT "
            "(torchrun sets them) and that rank 0's host is reachable."
        ) from None
    token = _agree_token(store, rank, world_size, time.monotonic() + timeout.total_seconds())
    return dist.PrefixStore(f"shardwise/{token}", store)


def _agree_token(store: dist.Store, rank: int, world_size: int, deadline: float) -> str:
    """Rank 0 draws a token; every rank receives it; all wait until all have. Raises naming absent ranks.

    Rank r > 0 announces a fresh nonce under `hello/r` and waits for `welcome/<nonce>`: a
    key no earlier attempt can have written. Rank 0 answers every nonce it sees under
    `hello/r` (a stale one from an earlier attempt too: nobody waits for that answer),
    until every rank has confirmed under `<token>/joined/r`, then says `<token>/go`.
    """
    if rank == 0:
        token = uuid.uuid4().hex
        welcomed: dict[int, bytes] = {}
        missing = list(range(1, world_size))
        while missing:
            for r in missing:
                key = f"shardwise/hello/{r}"
                if store.check([key]):
                    nonce = store.get(key)
                    if welcomed.get(r) != nonce:
                        store.set(f"shardwise/welcome/{nonce.decode()}", token)
                        welcomed[r] = nonce
            missing = [r for r in missing if not store.check([f"shardwise/{token}/joined/{r}"])]
            if missing and time.monotonic() > deadline:
                store.set(f"shardwise/{token}/abort", ",".join(map(str, missing)))
                raise ShardwiseError(_absent_message(missing, world_size))
            if missing:
                time.sleep(_POLL_S)
        store.set(f"shardwise/{token}/go", "go")
        return token
    nonce = uuid.uuid4().hex
    store.set(f"shardwise/hello/{rank}", nonce)
    token = _poll(store, [f"shardwise/welcome/{nonce}"], deadline)
    if token is None:
        raise ShardwiseError(_absent_message([0], world_size))
    token = token.decode()
    store.set(f"shardwise/{token}/joined/{rank}", "1")
    outcome = _poll(store, [f"shardwise/{token}/go", f"shardwise/{token}/abort"], deadline + _VERDICT_GRACE_S)
    if outcome is None:
        raise ShardwiseError(_absent_message([0], world_size))
    if outcome != b"go":
        raise ShardwiseError(_absent_message([int(r) for r in outcome.decode().split(",")], world_size))
    return token


def _poll(store: dist.Store, keys: list[str], deadline: float) -> bytes | None:
    """The value of the first of `keys` that exists, or None once `deadline` passes."""
    while True:
        for key in keys:
            if store.check([key]):
                return store.get(key)
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)


def _absent_message(missing: list[int], world_size: int) -> str:
    names = ", ".join(map(str, missing))
    return (f"rank{'s' if len(missing) > 1 else ''} {names} of {world_size} did not join the process group "
            "within sw.init(timeout=...): they did not start, crashed before sw.init(), or cannot reach the "
            "rendezvous store. Their own logs say why; raise the timeout if they start slowly.")


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
    """Close what shardwise opened (Note [exit teardown]) and leave the default process group
    (safe to call when none is initialized). A script that ends without it is closed the same
    way at exit."""
    close_all()
    if dist.is_initialized():
        dist.destroy_process_group()
