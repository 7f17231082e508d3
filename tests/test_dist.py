"""`sw.init()`: torchrun's environment, a single process, a half-set environment, the join of each attempt."""

import os
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.dist import _agree_token, _host_join, _read_launch_env


@pytest.mark.parametrize("present", [("RANK",), ("RANK", "WORLD_SIZE"), ("MASTER_ADDR", "MASTER_PORT", "RANK")])
def test_half_set_environment_names_the_missing_variable(monkeypatch, present):
    """Catches a launch with RANK but no WORLD_SIZE (etc.) hanging or failing deep inside torch."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name in present:
        monkeypatch.setenv(name, "0" if name != "MASTER_ADDR" else "127.0.0.1")
    missing = {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} - set(present)
    with pytest.raises(sw.ShardwiseError) as info:
        _read_launch_env()
    for name in missing:
        assert name in str(info.value)


def test_bad_rank_values_are_named(monkeypatch):
    """Catches RANK=abc or RANK >= WORLD_SIZE getting past init."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "abc")
    with pytest.raises(sw.ShardwiseError, match="RANK='abc' is not an integer"):
        _read_launch_env()
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(sw.ShardwiseError, match="outside 0..WORLD_SIZE-1"):
        _read_launch_env()


def _single_process_init():
    dist.destroy_process_group()  # the harness formed one; start as a bare process would
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    group = sw.init(timeout=30)
    again = sw.init()
    t = torch.ones(1)
    dist.all_reduce(t)
    return sw.get_rank(), sw.get_world_size(), group is again, dist.get_backend(), t.item()


def test_single_process_without_environment(ranks):
    """Catches `python train.py` (no torchrun) failing, or a second init() forming a new group."""
    assert ranks.run(_single_process_init, 1) == [(0, 1, True, "gloo", 1.0)]


def test_torchrun_launch_forms_the_group(tmp_path):
    """Catches init() misreading torchrun's variables (wrong rank, wrong world, no rendezvous)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist, shardwise as sw
        sw.init(timeout=60)
        t = torch.tensor([float(sw.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank={sw.get_rank()} world={sw.get_world_size()} sum={t.item()}", flush=True)
        sw.shutdown()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "rank=0 world=2 sum=3.0" in done.stdout and "rank=1 world=2 sum=3.0" in done.stdout


def _join(store, world_size, ranks, wait_s):
    """Run `_agree_token` for `ranks` in threads on one store; each rank's token or its error."""
    deadline = time.monotonic() + wait_s

    def one(rank):
        try:
            return _agree_token(store, rank, world_size, deadline)
        except sw.ShardwiseError as error:
            return error

    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(one, ranks))


def test_each_attempt_agrees_on_a_token_no_earlier_attempt_wrote():
    """Catches a restarted group reading an earlier attempt's keys (the stale gloo addresses of
    Note [restart keys]): a second attempt on the same store must agree on a new token."""
    store = dist.HashStore()
    first = _join(store, 3, [0, 1, 2], 20)
    assert len(set(first)) == 1 and isinstance(first[0], str)
    second = _join(store, 3, [2, 1, 0], 20)  # the stale hello/welcome keys of the first are still there
    assert len(set(second)) == 1 and isinstance(second[0], str)
    assert second[0] != first[0]


def test_a_rank_that_never_joins_is_named_on_every_rank():
    """Catches a join that hangs, or fails without saying which rank is missing."""
    store = dist.HashStore()
    start = time.monotonic()
    results = _join(store, 3, [0, 1], 1.0)
    assert time.monotonic() - start < 10
    for error in results:
        assert isinstance(error, sw.ShardwiseError)
        assert "rank 2 of 3 did not join" in str(error)


def test_hand_launch_names_the_rank_that_never_came(tmp_path):
    """Catches a hand launch (rank 0 hosts the store) that fails with the store's own timeout
    ("1/2 clients joined") instead of naming the missing rank, or waits forever."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", RANK="0",
               OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    code = "import shardwise as sw\ntry:\n    sw.init(timeout=3)\nexcept sw.ShardwiseError as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "rank 1 of 2 did not join" in done.stdout, done.stdout + done.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_jobs(store, world_size, claimants, wait_s):
    """`_agree_token` for each (rank, run id) in threads on one store: each claimant's token or error."""
    deadline = time.monotonic() + wait_s

    def one(claimant):
        rank, run_id = claimant
        try:
            return _agree_token(store, rank, world_size, deadline, run_id=run_id)
        except sw.ShardwiseError as error:
            return error

    with ThreadPoolExecutor(len(claimants)) as pool:
        return list(pool.map(one, claimants))


def test_a_rank_of_another_job_on_the_same_store_is_refused():
    """Catches two jobs pointed at one store forming one group from ranks of each (Note [what a job
    trusts]): job B's rank 1 must be refused, job A's ranks must agree on their token."""
    store = dist.HashStore()
    a0, b1, a1 = _join_jobs(store, 2, [(0, "job-a"), (1, "job-b"), (1, "job-a")], 20)
    assert isinstance(a0, str) and a1 == a0, (a0, a1)
    assert isinstance(b1, sw.ShardwiseError) and "belongs to another job" in str(b1), b1


def test_a_rank_of_another_job_that_comes_after_the_group_formed_is_refused():
    """Catches a rank of job B that reaches job A's store after A's group formed (rank 0 answers no
    hellos any more) waiting out its timeout and blaming "rank 0 did not join": it must be refused at
    once, naming both run ids (the store's owner, Note [what a job trusts])."""
    store = dist.HashStore()
    a0, a1 = _join_jobs(store, 2, [(0, "job-a"), (1, "job-a")], 20)
    assert isinstance(a0, str) and a1 == a0, (a0, a1)
    start = time.monotonic()
    [b1] = _join_jobs(store, 2, [(1, "job-b")], 5)
    assert isinstance(b1, sw.ShardwiseError) and "belongs to another job (run id 'job-a'" in str(b1), b1
    assert "'job-b'" in str(b1) and time.monotonic() - start < 4, b1


def test_a_rank_claimed_twice_forms_no_group_with_both():
    """Catches two copies of one job (no run id to tell them apart) both joining as rank 1: at most
    one claimant may get rank 0's token, and the other must hear why."""
    store = dist.HashStore()
    results = _join_jobs(store, 2, [(1, ""), (1, ""), (0, "")], 20)
    tokens = [r for r in results[:2] if isinstance(r, str)]
    errors = [r for r in results if isinstance(r, sw.ShardwiseError)]
    assert len(tokens) <= 1 and errors, results
    assert all("two processes joined as rank 1" in str(e) for e in errors), errors
    if isinstance(results[2], str):
        assert tokens == [results[2]], results


class _CountInDuringTheCheck:
    """A store on which rank 2 counts in right after rank 0 has listed the missing ranks and before it reads
    how many counted in: the window in which the race of 2026-12-02 struck."""

    def __init__(self, store):
        self.store, self.raced = store, False

    def add(self, key, value):
        if key.endswith("/joins") and value == 0 and not self.raced:
            self.raced = True
            prefix = key.rsplit("/", 1)[0]
            self.store.add(f"{prefix}/joins", 1)
            self.store.add(f"{prefix}/joined/2", 1)
        return self.store.add(key, value)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_rank_that_has_not_counted_in_is_never_taken_for_one_that_has():
    """Catches rank 0's check for a rank claimed twice creating the count-in key of a rank that had not
    counted in yet (`store.add(key, 0)` creates the key), so that rank 0 said go without it: measured in 1
    of 30 4-rank launches under load, the three others then waited in gloo for the fourth's address
    (test_deferred's "StoreError: wait timeout ... /0//cpu//0/2") while it still waited for its welcome.
    Rank 1 never says hello here: rank 0 must name it, and never write its count-in key."""
    inner = dist.HashStore()
    inner.add("shardwise/hello/2/count", 1)
    inner.set("shardwise/hello/2/1", "\nnonce-of-rank-2")
    store = _CountInDuringTheCheck(inner)
    with pytest.raises(sw.ShardwiseError, match="rank 1 of 3 did not join"):
        _host_join(store, 3, time.monotonic() + 1.0, "")
    assert store.raced
    token = inner.get("shardwise/welcome/nonce-of-rank-2").decode().partition("\n")[2]
    assert not inner.check([f"shardwise/{token}/joined/1"])


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} write them) of sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


def test_a_hand_launch_store_listens_on_master_addr_only():
    """Catches rank 0's store of a hand launch listening on every interface (0.0.0.0 / ::) when
    MASTER_ADDR=127.0.0.1: anyone on the network could join or feed the job's group."""
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK="0",
               OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    code = "import shardwise as sw\nsw.init(timeout=60)"
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        addresses, deadline = [], time.monotonic() + 60
        while not addresses and time.monotonic() < deadline and rank0.poll() is None:
            addresses = _listening_addresses(port)
            time.sleep(0.05)
    finally:
        rank0.kill()  # it would wait for rank 1 until its timeout
        out, err = rank0.communicate(timeout=60)
    assert addresses == ["0100007F"], (addresses, out, err)  # 127.0.0.1, little-endian hex


TWO_JOBS_SCRIPT = textwrap.dedent("""
    import pathlib, sys, time, torch, torch.distributed as dist, shardwise as sw
    try:
        sw.init(timeout=15)
    except sw.ShardwiseError as error:
        print("refused:", error, flush=True)
        sys.exit(0)
    t = torch.tensor([float(sys.argv[1])])
    dist.all_reduce(t)
    print(f"sum={t.item():g}", flush=True)
    flags = pathlib.Path(sys.argv[2])
    if dist.get_rank() == 0:  # rank 0 hosts the store: it keeps it until the test says so
        (flags / "formed").touch()
        deadline = time.monotonic() + 120
        while not (flags / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    sw.shutdown()
""")


def _wait_listening(port: int, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"nothing listens on port {port} after {seconds} s")


def test_two_hand_launched_jobs_on_one_store_never_mix(tmp_path):
    """Catches a rank of job B (another SHARDWISE_RUN_ID, the same MASTER_ADDR:MASTER_PORT) joining job A's
    group (before: 3 of 10 trials formed a group from one rank of each), or failing for a reason that
    depends on timing: A's ranks sum their own values, and B's rank 1 is refused naming both run ids
    whether it comes before A's group formed or after (A's rank 0 keeps its store until B's ranks end;
    once the store is gone, nothing can say whose it was: test_a_store_that_goes_away_mid_join_is_named)."""
    script = tmp_path / "job.py"
    script.write_text(TWO_JOBS_SCRIPT)
    port = _free_port()

    def start(rank, run_id, value):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   OMP_NUM_THREADS="1", SHARDWISE_RUN_ID=run_id)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        return subprocess.Popen([sys.executable, str(script), value, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)

    a0 = start(0, "job-a", "1")
    try:
        _wait_listening(port)  # rank 0 hosts the store (importing torch takes seconds on a loaded machine)
        early = start(1, "job-b", "100")  # races A's rank 1 for rank 0's first answer
        a1 = start(1, "job-a", "1")
        deadline = time.monotonic() + 90
        while not (tmp_path / "formed").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        late = start(1, "job-b", "100")  # A's group has formed: rank 0 answers no one now
        b_outs = [p.communicate(timeout=90)[0] for p in (early, late)]
    finally:
        (tmp_path / "release").touch()
    a_outs = [p.communicate(timeout=90)[0] for p in (a0, a1)]
    assert all("sum=2" in out for out in a_outs), a_outs
    for out in b_outs:
        assert "refused: the rendezvous store" in out and "belongs to another job (run id 'job-a'" in out, b_outs
        assert "this process's is 'job-b'" in out and "sum=" not in out, b_outs


def test_one_process_without_a_launcher_says_so_once(tmp_path):
    """Catches `python train.py` meant for torchrun silently training as one process (issue 20): one
    log line through the `logging` module, however often sw.init() is called."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = "import warnings\nwarnings.simplefilter('error')\nimport shardwise as sw\nsw.init()\nsw.init()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("runs this script as one process") == 1, done.stderr


def test_a_store_that_goes_away_mid_join_is_named(tmp_path):
    """Catches a rank whose store's host exits while it waits to be welcomed (its rank 0 died, or another
    job's rank 0 finished) failing with torch's raw store error instead of a ShardwiseError that says so."""
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE="2", RANK="1",
               OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    code = "import shardwise as sw\ntry:\n    sw.init(timeout=60)\nexcept sw.ShardwiseError as e:\n    print(e)"
    rank1 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    deadline = time.monotonic() + 60
    while not store.check(["shardwise/hello/1/1"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    del store  # the host of the store exits before welcoming rank 1
    out, err = rank1.communicate(timeout=90)
    assert "lost the rendezvous store" in out, out + err[-2000:]


class _Chosen(Exception):
    """torch.cuda.set_device's argument, raised so that no group is formed."""


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_a_mixed_backend_gives_each_rank_its_gpu(monkeypatch, backend):
    """Catches sw.init(backend="cpu:gloo,cuda:nccl") (the mixed group FSDP users pass, Note [group backends])
    skipping the choice of LOCAL_RANK's device, which only `backend == "nccl"` made: every rank of a node then
    computed and ran NCCL on GPU 0."""
    assert not dist.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # one process: local rank 0, no store to reach

    def chosen(device):
        raise _Chosen(device)

    def formed(*args, **kwargs):
        raise _Chosen("a group formed before any device was chosen")

    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen)
    monkeypatch.setattr(dist, "init_process_group", formed)
    with pytest.raises(_Chosen) as caught:
        sw.init(backend=backend)
    assert caught.value.args == (0,)
