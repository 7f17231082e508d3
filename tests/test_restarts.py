"""Restarts under torchrun: a rank killed mid-run costs the steps since the last checkpoint, never the job.

Each trial launches tests/helpers/restart_job.py (a zero3 GPT that saves every 3 steps and
resumes from `sw.latest()`) with `torchrun --standalone --nproc-per-node 2 --max-restarts 1`,
SIGKILLs one rank at a step drawn from a seeded RNG, and checks that the restarted job
finishes with the uninterrupted run's parameters, bit for bit. bench/faults/faults.py runs the
long version (more trials, and faults during save, load, the first step, SIGSTOP and
scale-down/up). Every launch has a timeout that kills all its processes and names the
ranks that were still there (helpers/launch.py).
"""

from __future__ import annotations

import json
import random

import pytest

from helpers.launch import run, torchrun_argv

STEPS, SAVE_EVERY = 12, 3
LAUNCH_TIMEOUT_S = 180  # a hang fails; a machine loaded by other work must not (one launch took 71 s at load 12)


def _launch(tmp, name, fault=None, restarts=1):
    out = tmp / name
    out.mkdir()
    job = ["--ckpt", str(out / "ckpt"), "--out", str(out), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    if fault:
        # The restarted rank 1 starts a second late: with an init that reads the dead attempt's
        # addresses, rank 0 then always finds rank 1's stale one (not only when it races ahead).
        job += ["--fault", json.dumps(fault), "--stagger", "1"]
    argv = torchrun_argv("--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
                         "--monitor-interval", "0.1", job_args=job)
    launch = run(argv, out / "log.txt", LAUNCH_TIMEOUT_S)
    assert not launch.timed_out, f"{name}: hung; killed it. Still there: {launch.hung}\n{launch.tail()}"
    assert launch.ok, f"{name}: torchrun exited with {launch.returncodes}\n{launch.tail()}"
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return json.loads((out / "result.json").read_text()), events


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result, _ = _launch(tmp_path_factory.mktemp("restarts"), "uninterrupted")
    return result


# make test runs the first trial (about 30 s of two launches); make test-all the other two, and bench/faults/faults.py
# the long version (30 kills at drawn steps, during save and load too).
@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_sigkill_restart_resumes_bitwise(reference, tmp_path, trial):
    """Catches a restarted job that cannot form its group (torchrun's shared store still holding the
    dead attempt's gloo addresses: Note [restart keys] in dist.py), hangs, or resumes to different numbers."""
    rng = random.Random(1500 + trial)
    rank, step = rng.randrange(2), rng.randint(1, STEPS - 1)
    result, events = _launch(tmp_path, "killed", {"kind": "kill", "rank": rank, "step": step})
    faults = [e for e in events if e["event"] == "fault"]
    assert len(faults) == 1 and faults[0]["attempt"] == 0, f"the kill did not happen as planned: {faults}"
    expected_resume = step // SAVE_EVERY * SAVE_EVERY or None
    assert result["resumed_from"] == expected_resume, (rank, step, result)
    assert result["digest"] == reference["digest"], f"rank {rank} killed at step {step}: parameters differ"
