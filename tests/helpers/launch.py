"""Launch torchrun as a subprocess, with a timeout that kills every process of the run and names the hung ranks.

torchrun starts each worker in a session of its own (torch's SubprocessHandler passes
`start_new_session=True`), so killing the agent's process group leaves the workers
running. Each launch therefore carries a tag in the environment (`SHARDWISE_LAUNCH_TAG`),
which every agent and worker inherits; on timeout the launcher finds them by the tag,
makes each worker print its stacks (SIGUSR1: restart_job.py registers faulthandler),
reports which ranks were still there and in what state, and SIGKILLs them all.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TAG = "SHARDWISE_LAUNCH_TAG"
JOB = Path(__file__).resolve().parent / "restart_job.py"


@dataclass
class Launch:
    """One torchrun (or several agents sharing a tag) and what became of it."""

    tag: str
    log: Path
    agents: list[subprocess.Popen] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    returncodes: list[int | None] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)  # "rank 1 (pid 123, stopped)" for each rank left at timeout
    hung_agents: list[int] = field(default_factory=list)  # index of each agent still running at timeout

    @property
    def timed_out(self) -> bool:
        return bool(self.hung) or any(code is None for code in self.returncodes)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.returncodes)

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def torchrun_argv(*launcher_args: str, job_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, str(JOB), *job_args]


def start_agent(launch: Launch, argv: list[str], env: dict | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """Start one torchrun agent in the launch (its own session; output appended to the log)."""
    full_env = dict(os.environ if env is None else env)
    full_env[TAG] = launch.tag
    full_env.setdefault("OMP_NUM_THREADS", "1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    full_env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [full_env.get("PYTHONPATH")])])
    with open(launch.log, "ab") as log:
        agent = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                 start_new_session=True)
    launch.agents.append(agent)
    return agent


def new_launch(log: Path) -> Launch:
    return Launch(tag=uuid.uuid4().hex, log=log)


def wait(launch: Launch, timeout: float) -> Launch:
    """Wait for every agent; past `timeout` (seconds from the launch's start), kill the whole run."""
    deadline = launch.started + timeout
    try:
        for agent in launch.agents:
            try:
                agent.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                break
    except BaseException:  # Ctrl-C or pytest's own timeout while waiting: leave no worker running
        kill_all(launch)
        raise
    if any(agent.poll() is None for agent in launch.agents) or processes(launch.tag):
        launch.hung_agents = [k for k, agent in enumerate(launch.agents) if agent.poll() is None]
        launch.hung = kill_all(launch)  # also workers an agent left behind
    launch.returncodes = [agent.poll() for agent in launch.agents]
    return launch


def run(argv: list[str], log: Path, timeout: float, env: dict | None = None, cwd: Path | None = None) -> Launch:
    """One torchrun, waited for."""
    launch = new_launch(log)
    start_agent(launch, argv, env, cwd)
    return wait(launch, timeout)


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago (the launch binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(per_node_args: list[list[str]], job_args: list[list[str]], log: Path, timeout: float,
              env: dict | None = None) -> Launch:
    """Several torchrun agents on this machine, one per simulated node (agent K gets `per_node_args[K]`
    and `job_args[K]`), in one launch: a timeout kills every agent and worker and names the ranks left."""
    launch = new_launch(log)
    for launcher_args, job in zip(per_node_args, job_args):
        start_agent(launch, torchrun_argv(*launcher_args, job_args=job), env)
    return wait(launch, timeout)


def processes(tag: str) -> list[tuple[int, dict[str, str]]]:
    """(pid, environment) of every live process of this machine that carries `tag`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if env.get(TAG) == tag:
            found.append((int(entry.name), env))
    return found


def _state(pid: int) -> str:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    return {"R": "running", "S": "sleeping", "D": "in I/O", "T": "stopped", "Z": "zombie"}.get(fields[0], fields[0])


def kill_all(launch: Launch) -> list[str]:
    """Dump each worker's stacks into the log, SIGKILL every process of the launch; name the ranks found."""
    found = processes(launch.tag)
    workers = [(pid, env) for pid, env in found if "RANK" in env]
    workers.sort(key=lambda w: int(w[1]["RANK"]))
    hung = [f"rank {env['RANK']} (pid {pid}, {_state(pid)})" for pid, env in workers]
    for pid, _ in workers:
        _signal(pid, signal.SIGCONT)  # a stopped rank cannot print its stacks
        _signal(pid, signal.SIGUSR1)
    if workers:
        time.sleep(1.0)
    for pid, _ in found:
        _signal(pid, signal.SIGKILL)
    _wait_gone([pid for pid, _ in found], seconds=10)  # SIGKILL lands later on a loaded host
    for agent in launch.agents:
        try:
            agent.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    with open(launch.log, "a") as log:
        log.write(f"\n[launch] timed out; killed the run. Ranks still there: {', '.join(hung) or 'none'}\n")
    return hung or ["no rank (only the agent was left)"]


def _wait_gone(pids: list[int], seconds: float) -> None:
    """Until each of `pids` is dead (gone, or a zombie no parent reaped yet: it runs nothing), at most
    `seconds`: a killed worker is no longer listed by `processes` once this returns."""
    deadline = time.monotonic() + seconds
    while any(_state(pid) not in ("gone", "zombie") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
