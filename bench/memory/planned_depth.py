"""The depth `shardwise plan --max-model` accepts for max_model.py's GPT: the deepest whose sw.estimate is within the
budget less the plan's margin (Note [plan margin]; sw.max_model's `planned`), beside the no-margin depth that
max_model.py --verify probes first (its "estimator's depth").

    python bench/memory/planned_depth.py --configs zero3,fsdp2,zero3_offload     # 2 GiB, 4 ranks: estimates only

Each row's estimate is max_model.py's own (`estimated_total`), searched as sw.max_model searches (largest_fitting).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `bench.` imports: bench/README.md
from bench.memory import max_model  # noqa: E402
from shardwise.estimate.largest import largest_fitting  # noqa: E402
from shardwise.estimate.plan import PLAN_MARGIN, usable_memory  # noqa: E402


def main(argv=None) -> None:
    args = max_model.parse_args(argv)  # the same flags: --configs, --budget, --world-size, ...
    for config in args.configs.split(","):
        started, totals = time.time(), {}
        usable = usable_memory(args.budget_bytes, PLAN_MARGIN)
        planned = largest_fitting(lambda depth: max_model.estimated_total(args, config, depth), usable, totals=totals)
        print(f"{config}: planned {planned} blocks (estimate {totals.get(planned, 0) / 2**20:.0f} MiB within "
              f"{usable / 2**20:.0f} MiB, the budget less {PLAN_MARGIN:.0%}; {time.time() - started:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
