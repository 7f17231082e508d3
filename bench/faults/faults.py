"""Benchmark: restarts under torchrun. Faults injected at seeded random points; does the job finish, equal?

    python bench/faults/faults.py                                   # the issue's trial counts (about 40 min here)
    python bench/faults/faults.py --trials sigkill=3,save=2 --seed 1

Every trial runs tests/helpers/restart_job.py (zero3 GPT, saves every 3 of 12 steps,
resumes from `sw.latest()`) under torchrun and makes it fail once (or twice):

  sigkill      SIGKILL one rank at a random step; `--standalone --max-restarts 1`, 2 ranks
  save         SIGKILL a rank inside `sw.save` (while writing tensor k of its file, or rank 0
               after index.json is written, before the rename)
  load         SIGKILL a rank at a random step, then SIGKILL a rank inside the `sw.load` of
               the restart (before reading tensor k); `--max-restarts 2`
  first_step   SIGKILL a rank at a random step, then SIGKILL a rank in the first step after the
               restart resumed; `--max-restarts 2`
  sigstop      SIGSTOP one rank at a random step: the others must fail within the collective
               timeout (`sw.init(timeout=10)`) with an error naming the step; the agent
               kills the stopped rank and restarts
  elastic      two agents on this machine as two hosts (`--nnodes 1:2 --rdzv-backend c10d`,
               2 ranks each): SIGKILL one agent and its ranks at a random step (4 ranks -> 2),
               then start a new agent (2 -> 4); compared with an uninterrupted 4-rank run

A trial counts as equal when the final parameters are bitwise those of the uninterrupted
run (same world size), or, for elastic, within 1e-5 (max abs difference) of the uninterrupted
4-rank run: the reduction order changes with the world size. For scale, the table also gives
how far an uninterrupted 2-rank run of the same job ends from the 4-rank one.
"resumed from" is the checkpoint step each restart loaded, "restart cost" the seconds from
the fault to the first step of the restarted job, "time lost" the trial's wall time minus
the uninterrupted run's. Results: bench/faults/results/faults.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers.launch import new_launch, processes, run, start_agent, torchrun_argv, wait  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FAULTS = ("sigkill", "save", "load", "first_step", "sigstop", "elastic")
ISSUE_TRIALS = {"sigkill": 20, "save": 10, "load": 10, "first_step": 10, "sigstop": 5, "elastic": 5}
STEPS, SAVE_EVERY = 12, 3
TENSORS_PER_FILE, TENSORS_LOADED = 78, 26  # of this GPT at 2 ranks: write_next calls per rank, params read
ELASTIC_STEPS, ELASTIC_SLEEP = 24, 0.8  # long enough for an agent to join while 2 ranks train
# Torch's elastic agents share one TCPStore across rounds by default, and an agent that joins a
# later round never gets its address (dynamic_rendezvous.py: only a node without bootstrap info,
# or a new rank 0, publishes MASTER_ADDR/PORT): the round hangs. This opt-out makes each round's
# rank 0 host a fresh store, which is what the scale-up needs (docs/checkpoints.md, "Restarts").
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"
ELASTIC_ATOL = 1e-5  # the issue's bar for a run that changed world size (the reduction order changes)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", default=",".join(f"{k}={v}" for k, v in ISSUE_TRIALS.items()),
                   help="fault=count,... (default: the issue's counts)")
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--scratch", default=None, help="where trials run (default: a temp dir)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def job_args(out: Path, *, steps=STEPS, extra=()) -> list[str]:
    return ["--ckpt", str(out / "ckpt"), "--out", str(out), "--steps", str(steps),
            "--save-every", str(SAVE_EVERY), *extra]


def standalone(out: Path, nproc: int, restarts: int, faults=None, extra=(), steps=STEPS, timeout=180.0):
    out.mkdir(parents=True)
    args = job_args(out, steps=steps, extra=[*extra, *(["--fault", json.dumps(faults)] if faults else [])])
    argv = torchrun_argv("--standalone", "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
                         "--monitor-interval", "0.1", job_args=args)
    start = time.time()
    launch = run(argv, out / "log.txt", timeout)
    return launch, time.time() - start


def read_events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def outcome(out: Path, launch, wall: float, reference: dict, fault_time: float | None, exact: bool) -> dict:
    """The columns of one trial from its events, result and final parameters."""
    events = read_events(out)
    faults = [e for e in events if e["event"] == "fault"]
    if fault_time is None and faults:
        fault_time = faults[-1]["t"]  # the last fault: the cost of the restart that finished the job
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else None
    finished = launch.ok and result is not None
    row = {"finished": finished, "faults_fired": len(faults), "hung": launch.hung,
           "resumed_from": [e["step"] for e in events if e["event"] == "resumed"],
           "wall_s": wall, "lost_s": wall - reference["wall_s"], "restart_s": None, "equal": False,
           "max_abs_diff": None}
    row["restart_s"] = restart_cost(events, fault_time)
    if finished:
        final = torch.load(out / "final.pt", weights_only=True)
        row["max_abs_diff"] = max((final[k] - reference["final"][k]).abs().max().item() for k in final)
        row["equal"] = result["digest"] == reference["digest"] if exact else row["max_abs_diff"] <= ELASTIC_ATOL
    return row


def resumes(step: int) -> list[int]:
    """The checkpoint a restart after a fault at `step` loads: [] when none was saved yet."""
    return [step // SAVE_EVERY * SAVE_EVERY] if step >= SAVE_EVERY else []


def restart_cost(events: list[dict], fault_time: float | None) -> float | None:
    """Seconds from the fault to the first step of the attempt that started after it.

    Not simply the first step logged after the fault: a survivor may still log the step it
    finished as its peer dies."""
    if fault_time is None:
        return None
    starts = [e["t"] for e in events if e["event"] == "start" and e["t"] > fault_time]
    steps = [e["t"] for e in events if e["event"] == "step" and starts and e["t"] > starts[0]]
    return steps[0] - fault_time if steps else None


def kill_point(rng: random.Random, lowest: int = 1) -> tuple[int, int]:
    return rng.randrange(2), rng.randint(lowest, STEPS - 1)


def trial_sigkill(out, rng, reference):
    rank, step = kill_point(rng)
    launch, wall = standalone(out, 2, 1, {"kind": "kill", "rank": rank, "step": step})
    row = outcome(out, launch, wall, reference, None, exact=True)
    return row | {"plan": f"rank {rank} at step {step}", "expected": resumes(step)}


def trial_save(out, rng, reference):
    save_step = rng.choice([3, 6, 9])
    if rng.random() < 0.25:
        rank, at, where = 0, -1, "after index.json, before the rename"
    else:
        rank, at = rng.randrange(2), rng.randrange(TENSORS_PER_FILE)
        where = f"writing tensor {at}"
    launch, wall = standalone(out, 2, 1, {"kind": "save", "rank": rank, "step": save_step, "at": at})
    row = outcome(out, launch, wall, reference, None, exact=True)
    return row | {"plan": f"rank {rank} in sw.save of step {save_step}, {where}",
                  "expected": [save_step - SAVE_EVERY] if save_step > SAVE_EVERY else []}


def trial_load(out, rng, reference):
    rank, step = kill_point(rng, lowest=SAVE_EVERY)
    rank2, at = rng.randrange(2), rng.randrange(TENSORS_LOADED)
    faults = [{"kind": "kill", "rank": rank, "step": step},
              {"kind": "load", "rank": rank2, "attempt": 1, "at": at}]
    launch, wall = standalone(out, 2, 2, faults)
    row = outcome(out, launch, wall, reference, None, exact=True)
    resume = step // SAVE_EVERY * SAVE_EVERY
    return row | {"plan": f"rank {rank} at step {step}; rank {rank2} in sw.load before tensor {at}",
                  "expected": [resume]}  # the killed load logs nothing; the one that finishes does


def trial_first_step(out, rng, reference):
    rank, step = kill_point(rng, lowest=SAVE_EVERY)
    rank2 = rng.randrange(2)
    faults = [{"kind": "kill", "rank": rank, "step": step}, {"kind": "first_step", "rank": rank2, "attempt": 1}]
    launch, wall = standalone(out, 2, 2, faults)
    row = outcome(out, launch, wall, reference, None, exact=True)
    resume = step // SAVE_EVERY * SAVE_EVERY
    return row | {"plan": f"rank {rank} at step {step}; rank {rank2} in the first step after resuming",
                  "expected": [resume, resume]}


def trial_sigstop(out, rng, reference):
    rank, step = kill_point(rng)
    launch, wall = standalone(out, 2, 1, {"kind": "stop", "rank": rank, "step": step}, extra=["--timeout", "10"],
                              timeout=240.0)
    row = outcome(out, launch, wall, reference, None, exact=True)
    named = re.findall(r"ShardwiseError: (.*?\(step (\d+)[^)]*\) failed)", launch.log.read_text(errors="replace"))
    row["named_error"] = named[0][0] if named and int(named[0][1]) == step else None
    return row | {"plan": f"rank {rank} stopped at step {step}",
                  "expected": resumes(step)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial_elastic(out, rng, reference):
    """4 ranks (agents A and B) -> SIGKILL B at a random step -> 2 ranks -> a new agent joins -> 4 ranks."""
    out.mkdir(parents=True)
    kill_step, grow_after = rng.randint(4, 8), rng.randint(1, 3)
    port = free_port()

    def agent_argv(host: bool) -> list[str]:
        return torchrun_argv(
            "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", f"faults-{port}", "--max-restarts", "3", "--monitor-interval", "0.1",
            "--rdzv-conf", f"is_host={int(host)},{RDZV_CONF}",
            job_args=job_args(out, steps=ELASTIC_STEPS, extra=["--step-sleep", str(ELASTIC_SLEEP), "--timeout", "30"]))

    def env(name: str) -> dict:
        return dict(os.environ, **ELASTIC_ENV, SHARDWISE_AGENT=name)

    def until(condition, limit: float) -> bool:
        end = time.time() + limit
        while time.time() < end:
            if condition(read_events(out)):
                return True
            time.sleep(0.1)
        return False

    launch = new_launch(out / "log.txt")
    start = time.time()
    start_agent(launch, agent_argv(True), env("A"))
    time.sleep(1.0)  # A hosts the rendezvous store
    start_agent(launch, agent_argv(False), env("B"))
    plan = f"kill agent B at step {kill_step} (4 -> 2 ranks), new agent {grow_after} steps after the resume (2 -> 4)"
    reached = until(lambda ev: any(e["event"] == "step" and e["world_size"] == 4 and e["step"] >= kill_step
                                   for e in ev), 120)
    fault_time = time.time()
    for pid, environment in processes(launch.tag):
        if environment.get("SHARDWISE_AGENT") == "B":
            os.kill(pid, signal.SIGKILL)
    shrunk = reached and until(lambda ev: any(e["event"] == "resumed" and e["world_size"] == 2 and e["t"] > fault_time
                                              for e in ev), 120)
    if shrunk:
        resumed = [e for e in read_events(out) if e["event"] == "resumed" and e["t"] > fault_time][0]["step"]
        until(lambda ev: any(e["event"] == "step" and e["world_size"] == 2 and e["step"] >= resumed + grow_after
                             for e in ev), 60)
        start_agent(launch, agent_argv(False), env("B2"))
    launch.started = time.time()
    wait(launch, 240)
    launch.returncodes = [code for code in launch.returncodes if code != -signal.SIGKILL]  # agent B: killed by us
    row = outcome(out, launch, time.time() - start, reference, fault_time, exact=False)
    sizes = [e["world_size"] for e in read_events(out) if e["event"] == "step"]
    row["world_sizes"] = [size for i, size in enumerate(sizes) if i == 0 or size != sizes[i - 1]]
    if not reached or not shrunk:
        row["finished"] = False
    return row | {"plan": plan, "expected": None}


TRIALS = {"sigkill": trial_sigkill, "save": trial_save, "load": trial_load, "first_step": trial_first_step,
          "sigstop": trial_sigstop, "elastic": trial_elastic}


def uninterrupted(out: Path, nproc: int, steps: int, extra=()) -> dict:
    launch, wall = standalone(out, nproc, 0, None, extra=extra, steps=steps)
    if not launch.ok:
        raise SystemExit(f"the uninterrupted {nproc}-rank run failed:\n{launch.tail()}")
    result = json.loads((out / "result.json").read_text())
    return {"digest": result["digest"], "wall_s": wall, "final": torch.load(out / "final.pt", weights_only=True)}


def verdict(fault: str, row: dict) -> bool:
    """Did the trial meet the issue's bar for its fault?"""
    planned = {"elastic": 0, "load": 2, "first_step": 2}.get(fault, 1)
    ok = row["finished"] and row["equal"] and row["faults_fired"] == planned
    if row.get("expected") is not None:
        ok = ok and row["resumed_from"] == row["expected"]
    if fault == "sigstop":
        ok = ok and row.get("named_error") is not None
    if fault == "elastic":
        ok = ok and row.get("world_sizes") == [4, 2, 4]
    return ok


def summarize(rows: list[dict]) -> list[dict]:
    table = []
    for fault in FAULTS:
        mine = [r for r in rows if r["fault"] == fault]
        if not mine:
            continue
        costs = [r["restart_s"] for r in mine if r["restart_s"] is not None]
        lost = [r["lost_s"] for r in mine if r["finished"]]
        table.append({
            "fault": fault, "trials": len(mine), "finished": sum(r["finished"] for r in mine),
            "equal": sum(r["equal"] for r in mine), "as_expected": sum(r["verdict"] for r in mine),
            "resumed_from": sorted({s for r in mine for s in r["resumed_from"]}),
            "restart_s_median": statistics.median(costs) if costs else None,
            "restart_s_max": max(costs) if costs else None,
            "lost_s_median": statistics.median(lost) if lost else None,
            "max_abs_diff": max((r["max_abs_diff"] for r in mine if r["max_abs_diff"] is not None), default=None),
        })
    return table


def markdown(table: list[dict], rows: list[dict], args, references: dict) -> str:
    def num(x, fmt="{:.1f}"):
        return "–" if x is None else fmt.format(x)

    lines = [
        "# Restarts under torchrun: faults x trials",
        "",
        f"`python bench/faults/faults.py --trials {args.trials} --seed {args.seed}`; torch {torch.__version__}, gloo, "
        "CPU, 2 cores shared with other work (so seconds are noisy). Job: tests/helpers/restart_job.py, zero3 GPT, "
        f"{STEPS} steps (elastic: {ELASTIC_STEPS} steps, {ELASTIC_SLEEP} s sleep each), checkpoint every "
        f"{SAVE_EVERY}. Uninterrupted runs: 2 ranks {references['2']:.1f} s, 4 ranks (elastic) "
        f"{references['4']:.1f} s.",
        "",
        "| fault | trials | finished | equal | as expected | resumed from (steps) | restart cost s (median / max)"
        " | time lost s (median) | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in table:
        lines.append(
            f"| {t['fault']} | {t['trials']} | {t['finished']} | {t['equal']} | {t['as_expected']} | "
            f"{', '.join(map(str, t['resumed_from'])) or 'start'} | {num(t['restart_s_median'])} / "
            f"{num(t['restart_s_max'])} | {num(t['lost_s_median'])} | {num(t['max_abs_diff'], '{:.1e}')} |")
    lines += [
        "",
        "equal: bitwise equal to the uninterrupted run at the same world size (elastic: max abs parameter "
        "difference from the uninterrupted 4-rank run at most 1e-5; an uninterrupted 2-rank run of the same "
        f"job ends {references.get('floor', float('nan')):.1e} from it). as expected: "
        "finished, equal, resumed from the checkpoint the fault should leave as the "
        "newest (a kill inside `sw.save` of step s: the one before s), and for sigstop an error naming the "
        "step; for elastic, ran at 4 ranks, then 2, then 4. restart cost: seconds from the fault to the first "
        "step of the restarted job (includes the collective timeout and torchrun's 30 s SIGTERM grace for a "
        "stopped rank in sigstop, and the rendezvous' keep-alive expiry in elastic).",
        "",
        "## Trials",
        "",
        "| fault | # | plan | finished | equal | resumed from | restart s | lost s | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = []
        if r.get("named_error"):
            note.append(f"error: {r['named_error'][:90]}")
        if r.get("world_sizes"):
            note.append("world sizes " + " -> ".join(map(str, r["world_sizes"])))
        if r["hung"]:
            note.append(f"hung: {', '.join(r['hung'])}")
        if not r["verdict"]:
            note.append("NOT AS EXPECTED")
        lines.append(f"| {r['fault']} | {r['trial']} | {r['plan']} | {r['finished']} | {r['equal']} | "
                     f"{r['resumed_from']} | {num(r['restart_s'])} | {num(r['lost_s'])} | {'; '.join(note)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = [f for f in FAULTS if any(r["fault"] == f for r in rows)]
    figure, axes = plt.subplots(figsize=(7, 3.5))
    for i, fault in enumerate(faults):
        mine = [r for r in rows if r["fault"] == fault and r["restart_s"] is not None]
        axes.scatter([i + random.Random(j).uniform(-0.15, 0.15) for j in range(len(mine))],
                     [r["restart_s"] for r in mine], c=["tab:green" if r["verdict"] else "tab:red" for r in mine],
                     s=18)
    axes.set_xticks(range(len(faults)), faults)
    axes.set_ylabel("fault -> first resumed step (s)")
    axes.set_title("restart cost per trial (green: finished as expected)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = {k: int(v) for k, v in (item.split("=") for item in args.trials.split(",") if item)}
    unknown = set(counts) - set(FAULTS)
    if unknown:
        raise SystemExit(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="sw-faults-"))
    rng = random.Random(args.seed)
    references = {"2": uninterrupted(scratch / "uninterrupted-2", 2, STEPS)}
    if counts.get("elastic"):
        elastic_job = ["--step-sleep", str(ELASTIC_SLEEP), "--timeout", "30"]
        references["4"] = uninterrupted(scratch / "uninterrupted-4", 4, ELASTIC_STEPS, extra=elastic_job)
        two = uninterrupted(scratch / "uninterrupted-2-elastic", 2, ELASTIC_STEPS, extra=elastic_job)["final"]
        floor = max((two[k] - references["4"]["final"][k]).abs().max().item() for k in two)
    plan = [(fault, i) for fault in FAULTS for i in range(counts.get(fault, 0))]
    rows = []
    for fault, i in tqdm(plan, desc="fault trials", unit="trial"):
        reference = references["4" if fault == "elastic" else "2"]
        row = TRIALS[fault](scratch / f"{fault}-{i}", rng, reference)
        row |= {"fault": fault, "trial": i}
        row["verdict"] = verdict(fault, row)
        rows.append(row)
        tqdm.write(f"{fault} #{i}: {row['plan']}: finished={row['finished']} equal={row['equal']} "
                   f"resumed_from={row['resumed_from']} restart={row['restart_s']} ok={row['verdict']}")
    table = summarize(rows)
    walls = {k: v["wall_s"] for k, v in references.items()}
    walls.setdefault("4", float("nan"))
    if counts.get("elastic"):
        walls["floor"] = floor
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps({"table": table, "trials": rows, "references_s": walls,
                                                 "seed": args.seed, "trials_asked": counts}, indent=1))
    text = markdown(table, rows, args, walls)
    (out / "faults.md").write_text(text)
    plot(rows, out / "faults.png")
    print(text)
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(r["verdict"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
