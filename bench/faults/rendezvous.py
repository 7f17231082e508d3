"""Stress: many torchrun launches that only join the group (sw.init) and all-reduce once.

    python bench/faults/rendezvous.py                        # 60 launches of 4 ranks
    python bench/faults/rendezvous.py --launches 30 --nproc 4 --timeout 200

The join of sw.init (dist.py, Note [restart keys]) is a small protocol on the store; a race in it
shows as one launch in tens that hangs, more often while the machine is loaded (run it beside a
`make test`, as the race of issue 22 was caught). Each launch goes through tests/helpers/launch.py:
on a timeout every rank's stacks land in its log (kept under --logs) and every process is killed.
Prints one line per failed launch and the count.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.launch import run  # noqa: E402  (the tests' launcher: tags, stacks, kill)

JOB = """\
import faulthandler, signal, torch
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks a hung rank for its stacks
torch.set_num_threads(1)
import shardwise as sw, torch.distributed as dist
sw.init(timeout={init_timeout})
x = torch.ones(1)
dist.all_reduce(x)
assert x.item() == dist.get_world_size()
sw.shutdown()
"""


def main(argv=None) -> None:
    from tqdm import tqdm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=60)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--timeout", type=float, default=200, help="seconds before a launch is killed")
    p.add_argument("--logs", type=Path, default=None, help="keep each launch's log here")
    args = p.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="rendezvous-"))
    logs.mkdir(parents=True, exist_ok=True)
    job = logs / "job.py"
    # The join outlasts the launch, so a rank that never joins is still there to give its stacks.
    job.write_text(JOB.format(init_timeout=args.timeout + 40))
    failed = 0
    for i in tqdm(range(args.launches), desc="launches"):
        started = time.time()
        launch = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      f"--nproc-per-node={args.nproc}", str(job)], logs / f"launch{i}.log", timeout=args.timeout)
        if not launch.ok:
            failed += 1
            tqdm.write(f"launch {i} failed after {time.time() - started:.0f} s: exit codes {launch.returncodes}, "
                       f"still there {launch.hung or 'none'}; log {logs / f'launch{i}.log'}")
    print(f"{failed} of {args.launches} launches of {args.nproc} ranks failed; logs in {logs}")


if __name__ == "__main__":
    main()
