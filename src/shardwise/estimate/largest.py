"""`sw.max_model`: the largest member of a model family each configuration trains within a budget.

A family is a function from one size (a depth, a width) to a model built on the meta device; for each
configuration the planner weighs (PLAN_ORDER, plan.py) the search finds the largest size whose
`sw.estimate` total is within the budget, and the largest within it less the plan's margin (Note [plan
margin]): what `sw.plan` would accept.

Note [largest search]: the estimate grows with a family's size (more layers or wider ones hold more of
every kind), so the largest size that fits is found by search on `estimate` alone, exact against a scan
of every size (tests/test_max_model.py). An estimate at a deep model runs the activation probe over every
layer (seconds to a minute each, at hundreds of layers), so the search spends its estimates where they
tell most: the first size, 8 and 16 steps up (past the first units, where zero3's in-flight gathers still
grow: the total is affine in depth from there), then where the line through the last two fitting sizes
meets the budget, then regula falsi inside the bracket, halving it whenever a line step failed to; it ends
when a size fits and the next does not. An affine total takes five estimates, two of them near the answer.
The search with the margin starts from the estimates already made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from shardwise.config import config_label
from shardwise.errors import ShardwiseError
from shardwise.estimate.core import MemoryEstimate, estimate
from shardwise.estimate.lowbit_bytes import LOW_BIT
from shardwise.estimate.plan import PLAN_MARGIN, PLAN_ORDER, usable_memory

# Sizes tried at most, from `start` by `step`, unless told otherwise: a deep model costs an estimate
# seconds (Note [largest search]); a configuration still within the budget there is reported as capped.
DEFAULT_NUM_SIZES = 1024
_FIRST_STEPS = (8, 16)  # steps above `start` of the first estimates: Note [largest search]


@dataclass(frozen=True)
class MaxModel:
    """One configuration's largest size within the budget (None: not even `start`), and with the margin."""

    strategy: str
    precision: str
    offload: str | None
    size: int | None  # the largest size whose estimate is within the budget
    planned: int | None  # the largest within the budget less the plan's margin: what sw.plan accepts
    capped: bool  # `size` is the limit of the search: larger ones may fit too
    num_params: int | None  # of the model at `size`
    estimate: MemoryEstimate  # at `size`, or at `start` when none fits

    @property
    def label(self) -> str:
        return config_label(self.strategy, self.precision, bool(self.offload))


def largest_fitting(total_of: Callable[[int], int], budget: int, *, start: int = 1, step: int = 1,
                    limit: int | None = None, totals: dict[int, int] | None = None) -> int | None:
    """The largest size in start, start + step, ... (at most `limit`) with `total_of(size) <= budget`,
    assuming `total_of` never falls as the size grows; None when `start` is over. Note [largest search].

    `totals` (size -> total) holds the sizes already weighed and receives the new ones, so a second search
    of the same function (another budget) starts from them."""
    last = _last_step(start, step, limit)
    totals = {} if totals is None else totals

    def total(k: int) -> int:
        size = start + k * step
        if size not in totals:
            totals[size] = int(total_of(size))
        return totals[size]

    known = {(size - start) // step: value for size, value in totals.items()
             if size >= start and (size - start) % step == 0 and size <= start + last * step}
    if total(0) > budget:
        return None
    known[0] = totals[start]
    fits = [k for k, value in known.items() if value <= budget]
    over = [k for k, value in known.items() if value > budget]
    lo, hi = max(fits), min(over, default=None)
    halve = False
    while hi is None or hi - lo > 1:
        k = _next_step(known, budget, lo, hi, last, halve)
        if k is None:  # the limit fits: the answer may be larger
            return start + lo * step
        width = None if hi is None else hi - lo
        known[k] = total(k)
        if known[k] <= budget:
            lo = k
        else:
            hi = k
        # A line step that did not halve the bracket: the next one halves it (no slow one-sided creep).
        halve = width is not None and not halve and hi - lo > width // 2
    return start + lo * step


def _last_step(start: int, step: int, limit: int | None) -> int:
    """How many steps above `start` the search may go."""
    if not all(isinstance(v, int) and v >= 1 for v in (start, step)):
        raise ShardwiseError(f"start={start!r}, step={step!r}: both must be positive int sizes")
    last = (limit - start) // step if limit is not None else DEFAULT_NUM_SIZES - 1
    if last < 0:
        raise ShardwiseError(f"limit={limit} is below start={start}: raise the limit")
    return last


def _next_step(known: dict[int, int], budget: int, lo: int, hi: int | None, last: int, halve: bool) -> int | None:
    """The next step to weigh (Note [largest search]); None when the bracket is open and `last` fits."""
    if hi is None:
        if lo >= last:
            return None
        first = next((k for k in _FIRST_STEPS if k > lo and k not in known), None)
        below = [k for k in known if k < lo]
        if first is not None or not below:
            return min(last, first if first is not None else 2 * lo + 1)
        k0 = max(below)
        slope = (known[lo] - known[k0]) / (lo - k0)
        target = last if slope <= 0 else lo + int((budget - known[lo]) // slope)
        return max(lo + 1, min(last, target))
    if halve:
        return (lo + hi) // 2
    slope = (known[hi] - known[lo]) / (hi - lo)  # > 0: known[hi] > budget >= known[lo]
    return max(lo + 1, min(hi - 1, lo + int((budget - known[lo]) // slope)))


def max_model(family: Callable[[int], nn.Module], memory: int, world_size: int, *, start: int = 1,
              step: int = 1, limit: int | None = None, optimizer: str = "adamw", batch: int | None = None,
              seq: int | None = None, offload_dir: str = "/tmp/shardwise-offload",
              checkpoint_activations: bool = False, optimizer_in_backward: bool = False, margin: float = PLAN_MARGIN,
              configurations=PLAN_ORDER, **estimate_kwargs) -> list[MaxModel]:
    """For each configuration `sw.plan` weighs, the largest size of `family` it trains in `memory` bytes
    per rank, by `sw.estimate` (Note [largest search]).

    `family(size)` returns the model of that size (a depth, a width), built under `torch.device("meta")`;
    sizes run from `start` by `step` up to `limit` (default: 1024 sizes). Each row has `size` (the largest
    whose estimate is within `memory`) and `planned` (within `memory` less `margin`, as `sw.plan` accepts:
    Note [plan margin]). `configurations`: (strategy, precision, disk offload) triples, default the plan's
    rows. `optimizer_in_backward`: the zero rows as under sw.optimizer_in_backward (Note [gradients stepped in
    backward]; ddp has none, so its row is as without). `optimizer`: as sw.estimate's; a low-bit one
    ("adamw8bit", "adamw4bit") has no offload rows (not modelled: Note [low-bit estimate]). The other arguments
    are `sw.plan`'s; extra keyword arguments go to `estimate` (units=, runtime=).
    """
    if isinstance(family, nn.Module) or not callable(family):  # a model is callable too: its forward
        raise ShardwiseError(f"family={type(family).__name__} must be a function size -> model (e.g. lambda depth: "
                             "GPT(GPTConfig(n_layers=depth)) under torch.device('meta'))")
    usable, last = usable_memory(memory, margin), _last_step(start, step, limit)
    models = _Models(family)
    if last and models.num_params(start) == models.num_params(start + step):
        raise ShardwiseError(f"family({start}) and family({start + step}) have the same number of parameters: "
                             "the size it takes must change the model (a depth or a width it builds with)")
    rows = []
    for strategy, precision, offloaded in configurations:
        if offloaded and optimizer in LOW_BIT:  # not modelled (Note [low-bit estimate]): no row
            continue
        offload = f"disk:{offload_dir}" if offloaded else None
        recompute = checkpoint_activations and strategy != "ddp"  # ddp has no units to recompute
        in_backward = optimizer_in_backward and strategy != "ddp"  # nor sw.optimizer_in_backward

        def weigh(size: int, strategy=strategy, precision=precision, offload=offload, recompute=recompute,
                  in_backward=in_backward):
            return estimate(models.get(size), strategy, world_size, precision, optimizer, offload, batch, seq,
                            checkpoint_activations=recompute, optimizer_in_backward=in_backward, **estimate_kwargs)

        estimates: dict[int, MemoryEstimate] = {}

        def total_of(size: int) -> int:
            estimates[size] = weigh(size)
            return estimates[size].total

        totals: dict[int, int] = {}
        size = largest_fitting(total_of, memory, start=start, step=step, limit=limit, totals=totals)
        planned = largest_fitting(total_of, usable, start=start, step=step, limit=limit, totals=totals)
        at = size if size is not None else start
        rows.append(MaxModel(strategy, precision, offload, size, planned, size == start + last * step,
                             models.num_params(size) if size is not None else None, estimates[at]))
    return rows


class _Models:
    """The family's models, built once per size: the rows search near the same sizes (a deep model takes
    seconds to build on meta). Only the parameter count of each is kept, and the last few models."""

    def __init__(self, family: Callable[[int], nn.Module], keep: int = 4):
        self.family, self.keep = family, keep
        self.recent: dict[int, nn.Module] = {}
        self.counts: dict[int, int] = {}

    def get(self, size: int) -> nn.Module:
        if size not in self.recent:
            model = self.family(size)
            if not isinstance(model, nn.Module):
                raise ShardwiseError(f"family({size}) returned {type(model).__name__}, not a torch.nn.Module")
            if len(self.recent) >= self.keep:
                self.recent.pop(next(iter(self.recent)))
            self.recent[size] = model
            self.counts[size] = sum(p.numel() for p in model.parameters())
        return self.recent[size]

    def num_params(self, size: int) -> int:
        if size not in self.counts:
            self.get(size)
        return self.counts[size]
