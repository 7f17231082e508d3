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

Note [what a job trusts]: a job trusts its store and every process that can reach it. The store
is unauthenticated (torch's TCPStore has no secret, and torchrun gives its workers none that
an outsider could not read): any local process that can connect to MASTER_ADDR:MASTER_PORT
can read the run id and the nonces below, answer as rank 0 before the real one, and join or
feed the group. The run-id check below keeps two honest jobs apart; it is no authentication
and does not stop a hostile local user. So shardwise never unpickles what comes over the store
or a collective (Note [no pickle on the wire] in wire/messages.py: reports are JSON, store
values are parsed as text), which takes away running code in a rank; a process that joins can
still send wrong numbers. Run jobs where the users who can reach the port are trusted, as with
torch.distributed itself. So the store a hand launch makes (rank 0 hosts it) listens on the `MASTER_ADDR` given
(`127.0.0.1` keeps it on this machine) rather than every interface, and every rank says which
job it belongs to when it joins: `SHARDWISE_RUN_ID` if set, else torchrun's `TORCHELASTIC_RUN_ID`
(the same on every worker of one torchrun, new per job). Rank 0 refuses a rank of another
job pointed at the same store, and a second process claiming a rank that has joined is refused
too, so two jobs never form one group from ranks of each. Rank 0 also writes its job's run id
under `shardwise/owner` before it answers anyone, and a joining rank that reads another run id
there is refused at once: rank 0 answers hellos only until its group has formed, so a rank of
another job that came later would otherwise wait out its timeout and blame a rank 0 that never
joined. So the outcome does not depend on timing while the store lives: each job forms its own
group, and a rank pointed at another job's store fails naming both run ids. Only a store that
is gone (its host, rank 0 or torchrun's agent, exited: the other job ended) cannot say whose it
was; the rank then fails naming the store's address. A hand launch without a run id cannot tell
two copies of itself apart: which rank 1 came first wins, the other is refused.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from shardwise.allocator import MMAP_THRESHOLD_BYTES, set_mmap_threshold
from shardwise.errors import ShardwiseError
from shardwise.teardown import close_all, close_group_at_exit
from shardwise.wire.backends import has_device_backend

# torchrun always sets all of these together; a subset means a hand-made launch went wrong.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
log = logging.getLogger("shardwise")


def init(
    *,
    backend: str | None = None,
    timeout: timedelta | float = timedelta(minutes=10),
    malloc_mmap_threshold: int | None = MMAP_THRESHOLD_BYTES,
) -> dist.ProcessGroup:
    """Join (or form) the default process group and return it.

    Reads torchrun's `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.
    With none set, forms a one-rank group in this process and logs that it did (logger
    "shardwise"). A hand launch (no torchrun) has rank 0 host the store on `MASTER_ADDR` only;
    give its ranks one `SHARDWISE_RUN_ID` so that a rank of another job pointed at the same
    store is refused (Note [what a job trusts]). Picks gloo on CPU and NCCL
    when CUDA is available (and then sets this rank's device from `LOCAL_RANK`);
    `backend` overrides. `timeout` (seconds or a timedelta) bounds joining the group
    and every collective, so a rank that dies or never starts makes the others fail
    with an error instead of hang. Safe under torchrun's restarts: each attempt's group
    reads nothing an earlier attempt wrote (Note [restart keys]). Calling it again
    returns the existing group. On CPU (gloo) it fixes glibc's mmap threshold at
    `malloc_mmap_threshold` bytes, the allocator the memory planner's figures hold in, unless
    `MALLOC_MMAP_THRESHOLD_` is set (None: glibc's default; Note [allocator at init]).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        set_mmap_threshold(malloc_mmap_threshold)  # Note [allocator at init]
    if dist.is_initialized():
        return dist.group.WORLD
    if isinstance(timeout, (int, float)):
        timeout = timedelta(seconds=timeout)
    env = _read_launch_env()
    if has_device_backend(backend):
        torch.accelerator.set_device_index(env["local_rank"])  # each rank its own device
    if env["world_size"] == 1 and env["rank"] == 0 and "MASTER_ADDR" not in os.environ:
        # One process, no launcher: an in-memory store needs no port.
        # Said once per group formed (a second init() returns above), through logging: a script run
        # without torchrun by mistake otherwise trains on one process without a word.
        log.warning("shardwise: no launch environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT unset), so "
                    "sw.init() runs this script as one process; launch it with `torchrun --nproc-per-node N` "
                    "for more")
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
    hosts = rank == 0 and not hosted_by_agent
    listen_fd = _listening_socket(host, port) if hosts else None  # Note [what a job trusts]
    try:
        # wait_for_workers=False: the join below waits, and names the ranks that did not come.
        store = dist.TCPStore(host, port, world_size, is_master=hosts, timeout=timeout, wait_for_workers=False,
                              multi_tenant=True, master_listen_fd=listen_fd)
    except (RuntimeError, dist.DistStoreError) as error:
        raise ShardwiseError(
            f"rank {rank} could not reach the rendezvous store at {host}:{port} within "
            f"{timeout.total_seconds():.0f} s: {str(error).splitlines()[0]}. Check MASTER_ADDR/MASTER_PORT "
            "(torchrun sets them) and that rank 0's host is reachable."
        ) from None
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        token = _agree_token(store, rank, world_size, deadline, run_id=_run_id())
    except ShardwiseError:
        raise
    except (RuntimeError, dist.DistError) as error:  # the store went away mid-join: its host exited
        raise ShardwiseError(
            f"rank {rank} lost the rendezvous store at {host}:{port} while joining: {str(error).splitlines()[0]}. "
            "The process hosting it (rank 0, or torchrun's agent) exited: its own log says why; a rank of "
            "another job pointed at this store sees this once that job ends."
        ) from None
    return dist.PrefixStore(f"shardwise/{token}", store)


def _listening_socket(host: str, port: int) -> int:
    """A socket bound to `host` (MASTER_ADDR) only, for rank 0's store: torch's own binds every
    interface (Note [what a job trusts]). Its descriptor passes to the store, which owns it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(256)
    except OSError as error:
        raise ShardwiseError(
            f"rank 0 cannot host the rendezvous store on MASTER_ADDR={host} MASTER_PORT={port}: {error}. Set "
            "MASTER_ADDR to an address of rank 0's own host (127.0.0.1 for one machine) and MASTER_PORT to a free "
            "port (another job may hold this one)."
        ) from None
    return listener.detach()


def _run_id() -> str:
    """What every rank of one job shares and another job does not (Note [what a job trusts])."""
    return os.environ.get("SHARDWISE_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or ""


def _agree_token(store: dist.Store, rank: int, world_size: int, deadline: float, run_id: str = "") -> str:
    """Rank 0 draws a token; every rank of its job receives it; all wait until all have. Raises
    naming absent ranks, a rank of another job, or a second claimant of a rank.

    Rank r > 0 announces its run id and a fresh nonce as the next of its numbered `hello/r/<i>`
    keys (numbered, so that a second process claiming rank r cannot overwrite the first's) and
    waits for `welcome/<nonce>`: a key no earlier attempt can have written. Rank 0 answers every
    hello it sees (a stale one from an earlier attempt too: nobody waits for that answer): the
    token for its own job's run id, a refusal for another's (Note [what a job trusts]); a rank that
    finds another job's run id under `shardwise/owner` (rank 0 writes it first) takes that as the
    refusal without waiting for an answer, which comes only until rank 0's group formed. A welcomed
    rank counts itself in under `<token>/joined/r`; the second to count in is refused. Once every
    rank has, rank 0 says `<token>/go`, or `<token>/abort` when a rank is missing or claimed twice.
    """
    if rank == 0:
        return _host_join(store, world_size, deadline, run_id)
    nonce = uuid.uuid4().hex
    index = store.add(f"shardwise/hello/{rank}/count", 1)
    store.set(f"shardwise/hello/{rank}/{index}", f"{run_id}\n{nonce}")
    answer = _await_welcome(store, nonce, run_id, deadline)
    if answer is None:
        raise ShardwiseError(_absent_message([0], world_size))
    verdict, _, value = _text(answer).partition("\n")
    if verdict == "refused":
        raise ShardwiseError(_other_job_message(run_id, value))
    token = value
    store.add(f"shardwise/{token}/joins", 1)  # all ranks' count-ins: rank 0 reads one key per poll
    if store.add(f"shardwise/{token}/joined/{rank}", 1) > 1:
        raise ShardwiseError(_claimed_twice_message([rank]))
    outcome = _poll(store, [f"shardwise/{token}/go", f"shardwise/{token}/abort"], deadline + _VERDICT_GRACE_S)
    if outcome is None:
        raise ShardwiseError(_absent_message([0], world_size))
    if outcome != b"go":
        kind, _, ranks = _text(outcome).partition(":")
        ranks = [int(r) for r in ranks.split(",") if r.isdigit()]
        raise ShardwiseError(_claimed_twice_message(ranks) if kind == "twice" else _absent_message(ranks, world_size))
    return token


# The run id of the job whose rank 0 uses the store, written before it answers any hello (Note [what a job trusts]).
_OWNER = "shardwise/owner"


def _await_welcome(store: dist.Store, nonce: str, run_id: str, deadline: float) -> bytes | None:
    """Rank 0's answer to the hello under `nonce`, a refusal when the store is another job's
    (Note [what a job trusts]), or None once `deadline` passes."""
    welcome = f"shardwise/welcome/{nonce}"
    while True:
        if store.check([welcome]):
            return store.get(welcome)
        if store.check([_OWNER]) and (owner := _text(store.get(_OWNER))) != run_id:
            return f"refused\n{owner}".encode()
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)


def _host_join(store: dist.Store, world_size: int, deadline: float, run_id: str) -> str:
    """Rank 0's side of `_agree_token`."""
    store.set(_OWNER, run_id)
    token = uuid.uuid4().hex
    answered = dict.fromkeys(range(1, world_size), 0)  # the hellos of each rank answered so far
    missing = list(range(1, world_size))
    while True:
        for r in answered:  # a rank that joined too: a second claimant must hear the token, and be counted
            answered[r] = _answer_hellos(store, r, answered[r], token, run_id)
        missing = [r for r in missing if not store.check([f"shardwise/{token}/joined/{r}"])]
        twice = []
        if store.add(f"shardwise/{token}/joins", 0) > world_size - 1 - len(missing):
            # Only the ranks that counted in, read with `get`: `add(key, 0)` would create the key of a rank
            # that has not, and the next poll would take it for joined (go without it: a hang in gloo).
            twice = [r for r in answered if r not in missing and int(store.get(f"shardwise/{token}/joined/{r}")) > 1]
        if twice or (missing and time.monotonic() > deadline):
            kind, ranks = ("twice", twice) if twice else ("absent", missing)
            store.set(f"shardwise/{token}/abort", f"{kind}:{','.join(map(str, ranks))}")
            raise ShardwiseError(_claimed_twice_message(ranks) if twice else _absent_message(ranks, world_size))
        if not missing:
            store.set(f"shardwise/{token}/go", "go")
            return token
        time.sleep(_POLL_S)


def _answer_hellos(store: dist.Store, rank: int, answered: int, token: str, run_id: str) -> int:
    """Welcome each new hello of `rank` of this job (refuse another job's); return how many are answered."""
    count = store.add(f"shardwise/hello/{rank}/count", 0)
    while answered < count:
        key = f"shardwise/hello/{rank}/{answered + 1}"
        if not store.check([key]):  # counted but not yet written: its turn comes at the next poll
            break
        their_run_id, _, nonce = _text(store.get(key)).partition("\n")
        if their_run_id == run_id:
            store.set(f"shardwise/welcome/{nonce}", f"token\n{token}")
        else:
            store.set(f"shardwise/welcome/{nonce}", f"refused\n{run_id}")
            log.warning("shardwise: refused a process of another job (run id %r, this job's is %r) that tried to "
                        "join as rank %d through this job's store", their_run_id, run_id, rank)
        answered += 1
    return answered


def _text(value: bytes) -> str:
    """A store value as text: whatever a process wrote there (Note [what a job trusts]), never a
    UnicodeDecodeError in rank 0."""
    return value.decode("utf-8", "replace")


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


def _other_job_message(run_id: str, theirs: str) -> str:
    return (f"the rendezvous store at MASTER_ADDR:MASTER_PORT belongs to another job (run id {theirs!r}; this "
            f"process's is {run_id!r}): two jobs were pointed at one store. Give each job its own MASTER_PORT, "
            "and the same SHARDWISE_RUN_ID to every rank of one hand-launched job (torchrun sets its own).")


def _claimed_twice_message(ranks: list[int]) -> str:
    names = ", ".join(map(str, ranks))
    return (f"two processes joined as rank {names} through one rendezvous store: two copies of a job (or two jobs "
            "without SHARDWISE_RUN_ID) were pointed at one MASTER_ADDR:MASTER_PORT. Give each job its own "
            "MASTER_PORT, and every rank of one hand-launched job the same SHARDWISE_RUN_ID.")


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
