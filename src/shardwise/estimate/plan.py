"""`sw.plan`: every configuration weighed against a memory budget, cheapest first.

Note [plan margin]: a row fits when its estimate is within the budget less PLAN_MARGIN of it (3%), kept
free for the estimator's error. Followed exactly, a plan peaks at its estimate plus that error, and the
error has both signs (estimate against measured peak RSS, bench/estimate/results/): estimator_grid.md's
48 cases +0.6% to +2.6%; estimator.md +2.5% to +5.9%; plan_followed.md +1.7%, +2.0%, and two rows under:
Qwen2 at 720 MiB, zero3 planned at 717 MiB with no margin, measured at 720 (-0.4%; the run before was
over the budget by 8 KiB), and zero3+bf16, which the margin chose instead, planned at 691 and measured at
700 (-1.3%). With no margin a row estimated just under its budget is as likely over it as under. 3% is the
accuracy issue 61 holds the estimator to at every row's measured maximum (bench/memory/max_model.py), and
more than twice the worst under-estimate measured here; it gives up a few blocks of depth in a large
budget (`sw.max_model` reports the depth both ways). `margin=0` (`--margin 0%`) plans to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.config import config_label
from shardwise.errors import ShardwiseError
from shardwise.estimate.core import MemoryEstimate, estimate
from shardwise.estimate.lowbit_bytes import LOW_BIT, OFFLOAD_NOT_MODELLED

# Cheapest first: each step down the list communicates more (zero3 gathers parameters
# twice per step, 1.5x ddp's volume), computes in lower precision, or waits on a disk.
PLAN_ORDER = (("ddp", "fp32", False), ("zero1", "fp32", False), ("zero2", "fp32", False),
              ("zero3", "fp32", False), ("zero3", "bf16", False), ("zero3", "fp32", True),
              ("zero3", "bf16", True))
PLAN_MARGIN = 0.03  # share of the budget kept free for the estimator's error: Note [plan margin]


@dataclass(frozen=True)
class PlanOption:
    """One configuration the planner weighed: its estimate, whether it fits, and why not."""

    strategy: str
    precision: str
    offload: str | None
    estimate: MemoryEstimate | None  # None when the configuration is not available
    fits: bool
    reason: str  # why it does not fit (or is not available); "" when it fits

    @property
    def label(self) -> str:
        return config_label(self.strategy, self.precision, bool(self.offload))


def plan(model_or_num_params: nn.Module | int, memory: int, world_size: int, *, optimizer: str = "adamw",
         batch: int | None = None, seq: int | None = None, offload_dir: str = "/tmp/shardwise-offload",
         checkpoint_activations: bool = False, margin: float = PLAN_MARGIN, **estimate_kwargs) -> list[PlanOption]:
    """Weigh every configuration in PLAN_ORDER against `memory` bytes per rank.

    The first option with `fits` is the cheapest that fits; each other says why not. A row fits when its
    estimate is within `memory` less `margin` of it (default 3%, kept for the estimator's error: Note
    [plan margin]); `margin=0` plans to the byte.
    `checkpoint_activations` applies to the zero options (ddp has no units to recompute).
    Extra keyword arguments go to `estimate` (units=, unit_params=, config=, runtime=).
    """
    usable = usable_memory(memory, margin)
    options = []
    for strategy, precision, offloaded in PLAN_ORDER:
        offload = f"disk:{offload_dir}" if offloaded else None
        if offloaded and optimizer in LOW_BIT:  # Note [low-bit estimate]
            options.append(PlanOption(strategy, precision, offload, None, False, OFFLOAD_NOT_MODELLED))
            continue
        est = estimate(model_or_num_params, strategy, world_size, precision, optimizer, offload, batch, seq,
                       checkpoint_activations=checkpoint_activations and strategy != "ddp", **estimate_kwargs)
        fits = est.total <= usable
        why = "" if fits else _why_not(est, memory, checkpoint_activations, usable)
        options.append(PlanOption(strategy, precision, offload, est, fits, why))
    return options


def usable_memory(memory: int, margin: float = PLAN_MARGIN) -> int:
    """The bytes of a `memory` budget a plan may fill: less `margin` of it (Note [plan margin])."""
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ShardwiseError(f"margin={margin!r} is not a share of the budget in [0, 1): write e.g. margin=0.03 "
                             "(3% kept free, the default) or margin=0 (plan to the byte)")
    return int(memory * (1 - margin))


def _why_not(est: MemoryEstimate, memory: int, checkpointing: bool, usable: int | None = None) -> str:
    if usable is not None and est.total <= memory:  # within the budget, not within the margin
        return (f"{est.total / 2**20:,.1f} MiB is within {memory / 2**20:,.1f} MiB by less than the "
                f"{(memory - usable) / 2**20:,.1f} MiB margin kept for the estimator's error (Note [plan margin]: "
                "margin=0, --margin 0%, to plan to the byte)")
    over = est.total - memory
    parts = sorted(est.rows()[:-1], key=lambda row: row[1], reverse=True)
    name, largest = parts[0]
    total, budget = _gib(est.total), _gib(memory)
    if total == budget:  # two decimals of GiB hide the difference
        total, budget = f"{est.total / 2**20:,.1f} MiB", f"{memory / 2**20:,.1f} MiB"
    text = f"{total} > {budget} by {_gib(over)}; largest: {name} {_gib(largest)}"
    floor = est.activations + est.runtime
    if floor > memory and est.activations == 0:  # no batch given: the runtime alone, nothing to lower
        text += f" (a rank's Python and torch runtime alone needs {_gib(est.runtime)}: give each rank more memory)"
    elif floor > memory:  # advice this row can follow: ddp has no units to recompute
        fix = ("lower the batch, or a zero strategy with checkpoint_activations=True" if est.strategy == "ddp" else
               "lower the batch or the sequence length" if checkpointing else
               "lower the batch or checkpoint activations")
        text += f" (activations + runtime alone need {_gib(floor)}: {fix})"
    return text


def _gib(value: int) -> str:
    """GiB with two decimals; MiB when two decimals of GiB would hide the difference."""
    return f"{value / 2**30:.2f} GiB" if abs(value) >= 2**30 / 10 else f"{value / 2**20:.1f} MiB"
