"""Stages on the engine: a stage's layers `sw.shard`ed zero1/zero2/zero3 over its data-parallel ranks,
run by torch.distributed.pipelining, with a weight tied across stages kept one value.

Note [sharded stages]: the pipeline is `pipe x replicate x shard` (Note [pipe dimension],
engine/layout/parallel_layout.py). Each rank shards only its stage's module, over its stage's ranks;
the engine reduces that module's gradients (the mean over the stage's ranks' samples), and nothing here
reduces across data-parallel ranks. A step runs M micro-batches through `ShardedStage`, which
torch's schedules (GPipe, 1F1B) drive: every backward but the last runs under the engine's `no_sync`,
so each unit's gradient is reduced once per step, the last micro-batch's backward reducing the sum of
all M; with `keep_gathered`, zero3 gathers each unit once per step instead of about 2M times (Note
[micro-batches keep their gathers], schedule/driver.py). A user's own loop takes `ShardedStage` in
place of torch's `PipelineStage`, with the same schedules.

Note [ties across stages]: a weight held by the first and the last stage (the GPT's token embedding and
output head) is sharded by each stage's engine over that stage's ranks. Both stages have the same
number of shard ranks, so the rank at shard coordinate k of each stage holds the same rows of it
(Note [rows]); each engine leaves there the mean over its stage's samples of that stage's use of
the weight. The weight's gradient is the sum of its uses, so those rows are summed across the stages
(`reduce_tied`: an all-reduce over the ranks at one (replica, shard) coordinate of the stages that
hold it) before the step: each copy takes the same gradient from the same state, one update, and the
copies stay bitwise equal under zero1, zero2 and zero3.

Note [a stage as one unit]: a sharded stage whose parameters total at most STAGE_UNIT_BYTES is one unit
(the stage module itself), not one unit per layer, unless it is zero3 re-gathering per micro-batch
(`keep_gathered=False`, whose point is one layer whole at a time). Within a step every layer of such a
stage is whole anyway (zero1/zero2 keep full parameters; zero3 under `keep_gathered` holds each unit from
its first gather to the step's reduce), and every backward but the last runs under `no_sync`, holding the
full gradients: per-layer units buy no memory there, only collectives (a gather, a tag and a reduce per
layer and step, each a rendezvous of the stage's ranks). One unit costs one gather and one reduce a step;
its reduce buffers are the stage's size rather than a layer's, hence the bound: DDP's bucket size
(`bucket_cap_mb=25`), the size at which DDP issues a collective. A larger stage keeps a unit per layer.
Measured on the PipeTransformer bench's GPT after its re-pack (pipe 1 x shard 2, 5 blocks of 50K
parameters, 2 micro-batches; 3 interleaved rounds of 40 steps): zero3 74-106 ms a step as one unit against
101-122 with a unit per layer (whole copies 73-76); the bench's speedup (`bench/pipeline/pipetransformer.py
--strategy zero3`, 3 seeds) went from 1.39x to 1.44x, and to 1.47x once one unit sent no gather tags
(Note [gather tags]).

Note [frozen shards]: freezing a prefix of sharded stages keeps every layer on its stage (no activation
cache, no re-pack: those move whole layers, strategy=None's route). Each rank turns `requires_grad` off
on its shards of the frozen layers (the same on every rank of a stage, which the engine's agreement
checks) and rebuilds its optimizer from the shards still training, carrying their state: a frozen
shard gets no gradient (the engine skips frozen parameters: no buffer, no reduce), no optimizer state
and no update. A tied weight frozen on one stage is frozen on the other (the same model name), and its
cross-stage sum goes with it.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from shardwise.engine import full_parameters
from shardwise.engine.optim.grads import no_sync
from shardwise.engine.protocol import engine_of
from shardwise.errors import ShardwiseError
from shardwise.pipeline.stage_init import shard_stage_module

STRATEGIES = ("zero1", "zero2", "zero3")


class ShardedStage(PipelineStage):
    """torch's `PipelineStage` over a module `sw.shard`ed zero1/zero2/zero3 (Note [sharded stages]).

    Every backward but a step's last runs under `sw.no_sync`, so the engine reduces each unit's gradient
    once per step; with `keep_gathered` (zero3) each unit is gathered once per step and stays whole until
    that reduce. Hand it to `ScheduleGPipe` or `Schedule1F1B` as torch's own stage."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device, *,
                 group: dist.ProcessGroup | None = None, keep_gathered: bool = True, **kwargs):
        engine = engine_of(submodule)
        if engine is None or engine.strategy not in STRATEGIES:
            raise ShardwiseError("ShardedStage takes a stage module sharded by sw.shard(module, strategy='zero1', "
                                 "'zero2' or 'zero3', process_group=the stage's data-parallel group); for an "
                                 "unsharded module use torch's PipelineStage")
        super().__init__(submodule, stage_index, num_stages, device, group=group, **kwargs)
        self._engine, self._keep_gathered, self._held = engine, keep_gathered, ExitStack()

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        if self._keep_gathered and fwd_chunk_id == 0:  # a step's first micro-batch: hold until its reduce
            self._held.close()
            self._held.enter_context(self._engine.keep_gathered())
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":
            raise ShardwiseError(f"a sharded stage runs full backwards (GPipe, 1F1B), not {backward_type!r} ones: "
                                 "the engine reduces a unit's gradient at the end of its backward")
        if last_backward:  # the step's reduce: every micro-batch's gradient summed, reduced once
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with no_sync(self.submod):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int):
        super().perform_reduce_grad(grad_scale_factor)  # the mean over micro-batches, on the reduced rows
        self._held.close()


STAGE_UNIT_BYTES = 25 * 2**20  # Note [a stage as one unit]: DDP's default bucket size


def stage_units(stage: nn.Module, layers: Sequence[nn.Module], strategy: str, keep_gathered: bool) -> list[nn.Module]:
    """The units of a sharded `stage` made of `layers`: `[stage]`, or each layer (Note [a stage as one unit])."""
    if strategy == "zero3" and not keep_gathered:
        return list(layers)
    params = {id(p): p for layer in layers for p in layer.parameters()}.values()  # a tie counted once
    return [stage] if sum(p.numel() * p.element_size() for p in params) <= STAGE_UNIT_BYTES else list(layers)


def shard_stage(layers: Sequence[nn.Module], names: dict[int, str], strategy: str, layout,
                keep_gathered: bool = True, **shard_options) -> tuple[nn.Module, dict[str, str]]:
    """`layers` as one module sharded under `strategy` over `layout`'s stage ranks (the stage one unit, or
    each layer one: Note [a stage as one unit]), and the model name of each of its parameter names (`names`:
    id of each original parameter -> model name)."""
    if strategy not in STRATEGIES:
        raise ShardwiseError(f"PipelineConfig.strategy must be one of {STRATEGIES} or None, got {strategy!r}")
    module = nn.Sequential(*layers)
    local = {local_name: names[id(p)] for local_name, p in module.named_parameters()}
    units = stage_units(module, layers, strategy, keep_gathered)
    shard_stage_module(module, strategy, units, layout.shard_arguments(), shard_options)  # Note [stage init]
    return module, local


def reduce_tied(tied: Sequence[tuple[Sequence[nn.Parameter], dist.ProcessGroup]]) -> None:
    """Sum each tied weight's reduced rows across the stages that hold it (Note [ties across stages])."""
    for params, group in tied:
        grads = [p.grad for p in params if p.grad is not None]
        if len(grads) != len(params):
            raise ShardwiseError("a weight tied across stages has no gradient on this rank after the step's "
                                 "backward: every stage holding it must use it in every step")
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def freeze_shards(named: list[tuple[str, nn.Parameter]], frozen: set[str], optimizer, make_optimizer):
    """Freeze the shards named in `frozen` and drop their gradients and optimizer state (Note [frozen
    shards]); returns the shards still training and their optimizer (None when none trains)."""
    for name, p in named:
        if name in frozen:
            p.requires_grad_(False)
            p.grad = None
    training = [(name, p) for name, p in named if name not in frozen]
    rebuilt = make_optimizer(training) if training else None
    for _, p in training:
        if rebuilt is not None and optimizer is not None and p in optimizer.state:
            rebuilt.state[p] = optimizer.state[p]
    return training, rebuilt


def gather_stage_values(module: nn.Module, local_names: dict[str, str]) -> dict[str, Tensor]:
    """The full values of a sharded stage module's parameters by model name (a collective over its stage)."""
    return {local_names[n]: v for n, v in full_parameters(module).items() if n in local_names}
