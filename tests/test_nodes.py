"""Two torchrun agents on this machine, one per simulated node, launched the way a cluster is (issue 34).

Each test starts two agents (`torchrun --nnodes 2 --node-rank K --nproc-per-node 2`, static rendezvous on
`--master-addr 127.0.0.1 --master-port P`, or c10d rendezvous on `--rdzv-endpoint`) running
tests/helpers/restart_job.py, and compares the final parameters with the same job run by one process (same
seed, same global batch of 8) within tests/helpers/parity.py's bound, rtol 1e-5 / atol 1e-5, with AdamW's
eps 1e-3 as there (at eps 1e-8 AdamW turns float rounding in a near-zero gradient into up to 2.7e-5,
measured). A launch that outlives its timeout is killed whole (every agent and worker, found by the
launch's tag) and the failure names the agents and ranks that were still there (helpers/launch.py).
All slow (each launch is 4 or 5 processes on 2 cores).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import torch

from helpers.launch import free_port, run, run_nodes, torchrun_argv

STEPS, SAVE_EVERY = 4, 2
LAUNCH_TIMEOUT_S = 240  # a hang fails; a machine loaded by other work must not

pytestmark = pytest.mark.slow


def _job(out: Path, extra: list[str]) -> list[str]:
    return ["--ckpt", str(out / "ckpt"), "--out", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--adam-eps", "1e-3", *extra]


def _check(launch, name: str, out: Path) -> dict:
    assert not launch.timed_out, (f"{name}: hung; killed it. Agents still running (node rank): {launch.hung_agents}; "
                                  f"ranks still there: {launch.hung}\n{launch.tail()}")
    assert launch.ok, f"{name}: the agents exited with {launch.returncodes}\n{launch.tail()}"
    return json.loads((out / "result.json").read_text())


def _one_process(tmp: Path, name: str, extra: list[str]) -> dict[str, torch.Tensor]:
    out = tmp / name
    out.mkdir()
    argv = torchrun_argv("--standalone", "--nproc-per-node", "1", job_args=_job(out, extra))
    _check(run(argv, out / "log.txt", LAUNCH_TIMEOUT_S), name, out)
    return torch.load(out / "final.pt")


def _two_nodes(tmp: Path, name: str, extra: list[str], rendezvous: str = "static", restarts: int = 0,
               per_node: list[list[str]] | None = None) -> tuple[Path, dict]:
    out = tmp / name
    out.mkdir()
    port = free_port()
    if rendezvous == "static":
        common = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    else:
        common = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex[:8]]
    launcher = [["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2", "--max-restarts", str(restarts),
                 "--monitor-interval", "0.1", *common] for k in range(2)]
    jobs = [_job(out, extra + (per_node[k] if per_node else [])) for k in range(2)]
    result = _check(run_nodes(launcher, jobs, out / "log.txt", LAUNCH_TIMEOUT_S), name, out)
    return out, result


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=lambda m, k=key: f"{what}: {k}: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _one_process(tmp_path_factory.mktemp("nodes"), "one-process", [])


@pytest.mark.parametrize("mesh, rendezvous", [(None, "static"), ("2x2", "static"), ("2x2", "c10d")],
                         ids=["zero3-flat-static", "hsdp-2x2-static", "hsdp-2x2-c10d"])
def test_two_agents_match_one_process(reference, tmp_path, mesh, rendezvous):
    """Catches a launch across agents that cannot form its group (node ranks, the rendezvous store on the other
    agent), ranks numbered differently from what the mesh assumes (replicate across agents, shard inside one),
    or a mesh whose replicas are not averaged: 4 zero3 steps over 2 agents x 2 ranks equal one process."""
    _, result = _two_nodes(tmp_path, "two-nodes", ["--mesh", mesh] if mesh else [], rendezvous)
    assert result["world_size"] == 4
    _assert_close(torch.load(tmp_path / "two-nodes" / "final.pt"), reference, f"{mesh or 'flat'} {rendezvous}")


@pytest.mark.parametrize("distinct_hosts", [False, True], ids=["one-host", "host-per-agent"])
def test_two_agents_frozen_host_copy(tmp_path, distinct_hosts):
    """Catches two agents on one machine clashing over the host copy in /dev/shm (both agents' local rank 0 write
    one: same directory name, one overwriting or removing the other's file, a rank mapping the other run's
    file), or, with one agent per host, a rank mapping another host's copy: trained parameters equal one
    process with the same frozen block, and each rank maps the copy the docs say (docs/several-machines.md)."""
    want = _one_process(tmp_path, "one-process", ["--frozen", "host"])
    names = [["--host-name", "node-a"], ["--host-name", "node-b"]] if distinct_hosts else None
    out, _ = _two_nodes(tmp_path, "two-nodes", ["--frozen", "host"], per_node=names)
    _assert_close(torch.load(out / "final.pt"), want, "frozen host copy")
    maps = {rank: json.loads((out / f"maps-{rank}.json").read_text()) for rank in range(4)}
    assert all(len(files) == 1 for files in maps.values()), maps  # one copy mapped per rank
    writers = {rank: Path(files[0]).parent.name for rank, files in maps.items()}
    # Node rank K holds global ranks 2K, 2K+1; each local rank 0 (ranks 0 and 2) writes a copy and maps it.
    assert writers[0] != writers[2], writers
    if distinct_hosts:  # each host's ranks map their own host's copy
        assert writers[1] == writers[0] and writers[3] == writers[2], writers
    else:  # one host name: the other local ranks map the first copy on it (rank 0's)
        assert writers[1] == writers[0] and writers[3] == writers[0], writers
    assert not list(Path("/dev/shm").glob(f"shardwise-host-*{writers[0].rsplit('-', 1)[-1]}")), "copy left behind"


def test_two_agents_sigkill_restart_resumes(tmp_path):
    """Catches a restart across agents that hangs (the surviving agent's workers blocked on a dead peer, the
    c10d rendezvous never re-forming), resumes from the wrong checkpoint, or ends with other numbers: rank 3
    (node 1) is SIGKILLed at step 3, both agents restart (--max-restarts 1), the job resumes from step 2's
    checkpoint and ends bit for bit equal to the same two-agent run uninterrupted."""
    fault = {"kind": "kill", "rank": 3, "step": 3}
    _, plain = _two_nodes(tmp_path, "uninterrupted", ["--mesh", "2x2"], "c10d", restarts=1)
    out, killed = _two_nodes(tmp_path, "killed", ["--mesh", "2x2", "--fault", json.dumps(fault), "--stagger", "1"],
                             "c10d", restarts=1)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["attempt"] for e in events if e["event"] == "fault"] == [0], events
    assert killed["resumed_from"] == 2, killed
    assert killed["digest"] == plain["digest"], "the restarted run ended with other parameters"
