"""The test launchers themselves: a torchrun launch never leaves a worker behind, and a doc-block
launch ends when one rank's session fails instead of hanging its other ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import launch as launcher

RUNNER = Path(__file__).resolve().parent / "scripts" / "doc_sessions.py"


def _torchrun(script: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *args]


def test_an_interrupted_wait_leaves_no_worker_running(tmp_path, monkeypatch):
    """Catches launch.wait leaving torchrun's workers alive when the wait itself is interrupted (Ctrl-C,
    pytest's timeout): they run in sessions of their own, so only the launch's tag finds them."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    launch = launcher.new_launch(tmp_path / "log")
    launcher.start_agent(launch, _torchrun(script))
    deadline = time.monotonic() + 60
    while sum("RANK" in env for _, env in launcher.processes(launch.tag)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sum("RANK" in env for _, env in launcher.processes(launch.tag)) == 2

    def interrupted(self, timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            launcher.wait(launch, timeout=60)
        monkeypatch.undo()
        assert launcher.processes(launch.tag) == []
    finally:  # this test must not leave them behind either, whatever it finds
        monkeypatch.undo()
        if launcher.processes(launch.tag):
            launcher.kill_all(launch)


def test_a_doc_session_failing_on_one_rank_ends_the_launch(tmp_path):
    """Catches the doc runner going on to the next session after one rank's session failed: rank 0 then
    waits in the next session's sw.init for rank 1 until sw.init's timeout (seen: a 13-minute hang)."""
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("import shardwise as sw, torch.distributed as dist\nsw.init()\n"
                     "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 fails')\n")
    second.write_text("import time, shardwise as sw, torch.distributed as dist\nsw.init()\n"
                      "if dist.get_rank() == 1:\n    time.sleep(600)\n")
    (tmp_path / "sessions.json").write_text(json.dumps({"first": str(first), "second": str(second)}))
    started = time.monotonic()
    launch = launcher.run(_torchrun(RUNNER, "sessions.json", "results.json"), tmp_path / "log", timeout=120,
                          cwd=tmp_path)
    assert not launch.timed_out and launch.returncodes != [0], launch.tail()
    assert time.monotonic() - started < 100
    assert "rank 1 stops the launch: session first failed" in launch.log.read_text()
