"""`sw.estimate_pipe`: what one rank holds under a pipe x shard layout, and the pipe rows of the plan.

Note [pipe estimate]: a pipeline of S stages over W ranks gives each stage D = W / S ranks, over which
the stage's layers are sharded (`PipelineConfig(strategy=, shards=)`: K ranks per shard group, D / K
replicas). A rank holds its own stage only (Note [stage init] in pipeline/stage_init.py), sharded over K
ranks as `sw.shard` shards any module, so its model state is `estimate`'s for the stage's module at
world size K, unit by unit (the stage one unit, or each layer one, as `shard_stage` cuts it: Note [a stage
as one unit] in pipeline/sharded.py).
The stages are cut as the trainer cuts them (balance by parameter count); a weight tied across the first
and last stage counts on both. A rank's figure is its own stage's; the layout's is the heaviest stage's.
zero3 with `keep_gathered` (the default) holds the whole stage gathered during a step, counted on top
where the stage has a unit per layer (one unit counts its whole stage already).
Activations are not counted: a stage holds each micro-batch in flight of its layers' activations (GPipe:
all M of a step; 1F1B: up to S), which the probe does not measure yet; pass a lower budget for them.
While the pipeline is built under `sw.deferred_init()`, a rank's peak is its stage's shards plus the
model's largest tensor (`build_bytes`, besides the runtime): tests/test_pipe_memory.py measures it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch import nn

from shardwise.engine.layout.rows import shard_numel
from shardwise.errors import ShardwiseError
from shardwise.estimate.core import MIB, RUNTIME_BYTES, MemoryEstimate, estimate

PIPE_STRATEGIES = ("zero1", "zero2", "zero3")


@dataclass(frozen=True)
class PipeEstimate:
    """Per-rank bytes of a pipe x shard layout: `stages[s]` is a rank of stage s (its layers `bounds[s]`),
    sharded over `shards` ranks; `total` is the heaviest stage's peak (Note [pipe estimate])."""

    strategy: str
    world_size: int
    num_stages: int
    shards: int
    bounds: tuple[tuple[int, int], ...]
    stages: tuple[MemoryEstimate, ...]
    build_bytes: tuple[int, ...]  # what building under sw.deferred_init() adds at its peak: shards + a tensor

    @property
    def replicas(self) -> int:
        """Copies of each stage's shard group (replicate x shard within a stage)."""
        return self.world_size // self.num_stages // self.shards

    @property
    def heaviest(self) -> MemoryEstimate:
        """The stage whose ranks hold the most."""
        return max(self.stages, key=lambda e: e.total)

    @property
    def total(self) -> int:
        """The predicted peak of the heaviest stage's ranks (activations not counted)."""
        return self.heaviest.total

    @property
    def label(self) -> str:
        hybrid = f" x replicate {self.replicas}" if self.replicas > 1 else ""
        return f"pipe {self.num_stages} x {self.strategy} {self.shards}{hybrid}"

    def __str__(self) -> str:
        lines = [f"{self.label}: {self.world_size} ranks, {self.num_stages} stages, each sharded over "
                 f"{self.shards} ranks", f"  {'per rank of stage':<26}" + "".join(
                     f"{s:>10}" for s in range(self.num_stages))]
        rows = [name for name, _ in self.stages[0].rows()]
        for index, name in enumerate(rows):
            if name == "total per rank":
                lines.append("  " + "-" * (26 + 10 * self.num_stages))
                name = "peak per rank (MiB)"
            lines.append(f"  {name:<26}" + "".join(f"{e.rows()[index][1] / MIB:>10,.1f}" for e in self.stages))
        lines.append(f"  {'building it (deferred)':<26}" + "".join(f"{b / MIB:>10,.1f}" for b in self.build_bytes))
        lines.append("  layers per stage: " + ", ".join(f"[{a}, {b})" for a, b in self.bounds))
        lines += [f"  note: {note}" for note in self.stages[0].notes if note.startswith("keep_gathered")]
        lines.append("  note: activations not counted (each micro-batch in flight holds its stage's; Note [pipe "
                     "estimate])")
        return "\n".join(lines)


def estimate_pipe(model: nn.Module, strategy: str, world_size: int, num_stages: int, *, shards: int | None = None,
                  precision: str = "fp32", optimizer: str = "adamw", runtime: int | None = None,
                  keep_gathered: bool = True) -> PipeEstimate:
    """Predict what one rank holds when `model` (built on meta: only shapes are read) trains as a pipeline
    of `num_stages` stages over `world_size` ranks, each stage sharded `strategy` over `shards` ranks (None:
    all of the stage's), as `PipelineConfig(num_stages=, strategy=, shards=, keep_gathered=)` runs it (Note [pipe
    estimate]). zero3 with `keep_gathered` holds its whole stage gathered during a step."""
    # Imported here: shardwise.pipeline loads torch.distributed.pipelining (1.5 s), which `import shardwise`
    # (and so sw.estimate_pipe's module) should not pay for.
    from shardwise.pipeline import chain_layers, param_costs
    from shardwise.pipeline.layout import plan_layout
    from shardwise.pipeline.sharded import stage_units

    if strategy not in PIPE_STRATEGIES:
        raise ShardwiseError(f"a pipeline's stages are sharded zero1, zero2 or zero3, not {strategy!r}")
    if num_stages < 1 or world_size % num_stages:
        raise ShardwiseError(f"num_stages={num_stages} must divide the world size {world_size}")
    per_stage = world_size // num_stages
    shards = per_stage if shards is None else shards
    if shards < 1 or per_stage % shards:
        raise ShardwiseError(f"shards={shards} must divide the {per_stage} ranks of each stage")
    chain = chain_layers(model)
    if num_stages > chain.num_layers:
        raise ShardwiseError(f"{chain.num_layers} layers cannot fill {num_stages} stages")
    bounds = plan_layout(param_costs(chain), num_frozen=0, world_size=world_size, num_stages=num_stages,
                         repack=False, budget=math.inf).bounds
    runtime = RUNTIME_BYTES if runtime is None else runtime  # every rank is in a process group, even unsharded
    stages, built = [], []
    for start, end in bounds:
        layers = chain.layers[start:end]
        stage = nn.Sequential(*layers)  # what shard_stage shards, into the units it chooses
        units = stage_units(stage, layers, strategy, keep_gathered)
        est = estimate(stage, strategy, shards, precision, optimizer, units=units, runtime=runtime)
        if strategy == "zero3" and keep_gathered and units[0] is not stage:
            est = _kept_gathered(est, stage, shards, precision)
        stages.append(est)
        built.append(_build_bytes(stage, shards, model))
    return PipeEstimate(strategy, world_size, num_stages, shards, tuple(bounds), tuple(stages), tuple(built))


def _kept_gathered(est: MemoryEstimate, stage: nn.Module, shards: int, precision: str) -> MemoryEstimate:
    """zero3 under keep_gathered (Note [micro-batches keep their gathers], schedule/driver.py): every unit of
    the stage stays whole from its first gather to the step's reduce. Counted on top of the step's usual
    buffers (which already hold 1 + prefetch units whole, 2 by default): an upper bound by those units."""
    c = 2 if precision in ("bf16", "fp16") else 4
    whole = c * sum(shards * shard_numel(p.shape, shards) for p in stage.parameters())
    return replace(est, gather_buffers=est.gather_buffers + whole, notes=est.notes + (
        "keep_gathered: the whole stage gathered during a step (keep_gathered=False re-gathers per micro-batch)",))


def _build_bytes(stage: nn.Module, shards: int, model: nn.Module) -> int:
    """Note [stage init]: the stage's fp32 shards, plus the largest tensor of the model: the replay makes one
    parameter real at a time, of this stage or (its draws replayed) of another."""
    rows = sum(4 * shard_numel(p.shape, shards) for p in stage.parameters())
    return rows + 4 * max(p.numel() for p in model.parameters())


def plan_pipe(model: nn.Module, memory: int, world_size: int, *, precision: str = "fp32",
              optimizer: str = "adamw", runtime: int | None = None) -> list[tuple[PipeEstimate, bool]]:
    # zero3 rows re-gather per micro-batch (keep_gathered=False): the layout that fits is the point here.
    """Every pipe x shard layout of `world_size` ranks (2 stages or more; each stage sharded over all of its
    ranks), cheapest first (zero1, zero2, zero3; fewer stages first: a shorter pipeline has less bubble), with
    whether it fits `memory` bytes per rank. Layouts the model has too few layers for are left out."""
    from shardwise.pipeline import chain_layers  # as in estimate_pipe

    chain_length = chain_layers(model).num_layers
    options = []
    for strategy in PIPE_STRATEGIES:
        for stages in range(2, min(world_size, chain_length) + 1):
            if world_size % stages == 0:
                est = estimate_pipe(model, strategy, world_size, stages, precision=precision, optimizer=optimizer,
                                    runtime=runtime, keep_gathered=False)
                options.append((est, est.total <= memory))
    return options
