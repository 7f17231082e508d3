"""`sw.plan`: every configuration weighed against a memory budget, cheapest first."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.config import config_label
from shardwise.estimate.core import MemoryEstimate, estimate

# Cheapest first: each step down the list communicates more (zero3 gathers parameters
# twice per step, 1.5x ddp's volume), computes in lower precision, or waits on a disk.
PLAN_ORDER = (("ddp", "fp32", False), ("zero1", "fp32", False), ("zero2", "fp32", False),
              ("zero3", "fp32", False), ("zero3", "bf16", False), ("zero3", "fp32", True),
              ("zero3", "bf16", True))


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
         checkpoint_activations: bool = False, **estimate_kwargs) -> list[PlanOption]:
    """Weigh every configuration in PLAN_ORDER against `memory` bytes per rank.

    The first option with `fits` is the cheapest that fits; each other says why not.
    `checkpoint_activations` applies to the zero options (ddp has no units to recompute).
    Extra keyword arguments go to `estimate` (units=, unit_params=, config=, runtime=).
    """
    options = []
    for strategy, precision, offloaded in PLAN_ORDER:
        offload = f"disk:{offload_dir}" if offloaded else None
        est = estimate(model_or_num_params, strategy, world_size, precision, optimizer, offload, batch, seq,
                       checkpoint_activations=checkpoint_activations and strategy != "ddp", **estimate_kwargs)
        fits = est.total <= memory
        why = "" if fits else _why_not(est, memory, checkpoint_activations)
        options.append(PlanOption(strategy, precision, offload, est, fits, why))
    return options


def _why_not(est: MemoryEstimate, memory: int, checkpointing: bool) -> str:
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
