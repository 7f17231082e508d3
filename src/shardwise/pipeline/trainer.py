"""`PipeTrainer`: pipeline training over ranks with progressive freezing, an activation
cache and re-packing (PipeTransformer: AutoFreeze, AutoCache, AutoPipe + AutoDP).

One step, on every rank:
  1. the replica's first stage takes its slice of the global batch: raw inputs, or once
     a prefix is frozen, that prefix's outputs (from the cache, or run under no_grad);
  2. torch.distributed.pipelining runs the micro-batches through the stages (GPipe or
     1F1B); the last stage computes the loss; gradients come out as the mean over
     micro-batches (the schedule's scale_grads);
  3. gradients are averaged over replicas and tied copies summed across stages
     (`_moves.reduce_gradients`), then each rank steps its own optimizer;
  4. the loss (global mean) is all-reduced, so every rank returns the same number.

Every rank builds the whole model, and every layer's values are brought up to date on
every rank whenever the layout changes (`freeze`). That makes moving layers to other
ranks a broadcast per old stage, and it costs each rank a full copy of the parameters:
this pipeline is for speed (PipeTransformer's setting), not for models bigger than one
rank. Gradients and optimizer state exist only for a rank's own active layers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shardwise.engine.schedule.consistency import differs_across_ranks
from shardwise.errors import ShardwiseError
from shardwise.pipeline._moves import State, broadcast_entries, reduce_gradients
from shardwise.pipeline.balance import measure_layer_times, param_costs, stage_costs
from shardwise.pipeline.cache import ActivationCache, StickySampler
from shardwise.pipeline.freeze import FreezePolicy
from shardwise.pipeline.layers import LayerChain
from shardwise.pipeline.layout import Layout, LayoutGroups, build_groups, plan_layout

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

# Builds a rank's optimizer from its trainable parameters, as (model name, parameter).
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


@dataclass(frozen=True)
class PipelineConfig:
    """How to run the pipeline.

    `num_stages`: pipeline length at the start (must divide the world size; the other
    factor is the number of data-parallel replicas). `num_microbatches` per replica per
    step at the start; a re-packed, shorter pipeline keeps the micro-batch size (its
    bubble shrinks with it), so it runs num_microbatches x new / old stages of them.
    `schedule`: "gpipe" or "1f1b". `balance`: cut stages by "params" (parameter count),
    "time" (measured forward + backward per layer), or a list of per-layer costs.
    `repack`: when the frozen prefix grows, run the active layers on fewer stages and
    use the freed ranks as replicas. `cache`: keep the frozen prefix's outputs per sample
    (`cache_memory_bytes` in memory per rank, the rest in a file under `cache_dir`).
    """

    num_stages: int
    num_microbatches: int = 4
    schedule: str = "1f1b"
    balance: str | tuple[float, ...] = "params"
    repack: bool = True
    cache: bool = True
    cache_memory_bytes: int = 1 << 30
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ShardwiseError(f"PipelineConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.schedule not in SCHEDULES:
            raise ShardwiseError(f"PipelineConfig.schedule must be one of {sorted(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "1f1b" and self.num_microbatches < self.num_stages:
            raise ShardwiseError(
                f"PipelineConfig: 1f1b needs num_microbatches ({self.num_microbatches}) >= num_stages "
                f"({self.num_stages}); raise num_microbatches or use schedule='gpipe'"
            )
        if self.num_microbatches < 1:
            raise ShardwiseError(f"PipelineConfig.num_microbatches must be >= 1, got {self.num_microbatches}")
        if isinstance(self.balance, str) and self.balance not in ("params", "time"):
            raise ShardwiseError(
                f"PipelineConfig.balance must be 'params', 'time' or per-layer costs, got {self.balance!r}"
            )


@dataclass
class EpochStats:
    """One epoch: mean loss over its steps, wall seconds (including any freeze and
    re-pack at its end), and the layout it ran under."""

    epoch: int
    loss: float
    seconds: float
    num_frozen: int
    num_stages: int
    num_replicas: int
    cache_hits: int = 0
    cache_misses: int = 0
    losses: list[float] = field(default_factory=list, repr=False)


class PipeTrainer:
    """Trains a `LayerChain` on `inputs[i] -> targets[i]` over the ranks of `group`.

    `loss_fn(output, target)` is the mean loss of a micro-batch. `make_optimizer` builds a
    rank's optimizer from its (name, parameter) list; it is called again after each
    re-pack, and state moves with the parameters. `global_batch_size` must be a multiple
    of world size x num_microbatches. `freeze`: the policy consulted at each epoch's end
    (default: manual only, via `freeze`). Every method is a collective: call it on every
    rank of `group`.
    """

    def __init__(
        self,
        chain: LayerChain,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        make_optimizer: OptimizerFactory,
        inputs: Tensor,
        targets: Tensor,
        *,
        global_batch_size: int,
        config: PipelineConfig,
        freeze: FreezePolicy | None = None,
        seed: int = 0,
        group: dist.ProcessGroup | None = None,
    ):
        self.chain, self.loss_fn, self.make_optimizer = chain, loss_fn, make_optimizer
        self.inputs, self.targets, self.config = inputs, targets, config
        self.group = group if group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        if self.world_size % config.num_stages != 0:
            raise ShardwiseError(f"num_stages={config.num_stages} must divide the world size {self.world_size}")
        if global_batch_size % (self.world_size * config.num_microbatches) != 0:
            raise ShardwiseError(
                f"global_batch_size={global_batch_size} must be a multiple of world size x num_microbatches "
                f"= {self.world_size * config.num_microbatches} (any re-packed layout splits it evenly)"
            )
        if config.num_stages > chain.num_layers:
            raise ShardwiseError(f"{chain.num_layers} layers cannot fill {config.num_stages} stages")
        if differs_across_ranks([inputs, targets], self.group):  # each stage reads its own rank's copy
            raise ShardwiseError(
                "the ranks were given different datasets (inputs or targets differ): each stage reads its own "
                "rank's copy, so the first stage would train on one rank's inputs while the last scores another's "
                "targets. Pass the same inputs and targets on every rank (draw them after the same "
                "torch.manual_seed, or load the same files); the trainer's sampler gives each replica its samples.")
        self.sampler = StickySampler(len(inputs), global_batch_size, num_homes=self.world_size, seed=seed)
        self.cache = (ActivationCache(self.sampler, memory_bytes=config.cache_memory_bytes,
                                      directory=config.cache_dir) if config.cache else None)
        self.policy = freeze if freeze is not None else FreezePolicy()
        self.device = next(iter(chain.params.values())).device
        self.optimizer: torch.optim.Optimizer | None = None
        # Every rank starts from rank 0's values: ranks that built different models cannot drift.
        broadcast_entries(chain.params, list(chain.params), None, self.global_ranks[0], self.group, False)
        self.costs = self._layer_costs()
        first = plan_layout(self.costs, num_frozen=0, world_size=self.world_size,
                            num_stages=config.num_stages, repack=False, budget=math.inf)
        self.budget = max(stage_costs(self.costs, first.bounds))
        self.layout: Layout = first
        self._apply_layout(first, {})

    # ---- training --------------------------------------------------------------

    def step(self, batch: Tensor) -> float:
        """One optimizer step on the global batch of sample indices `batch`; returns its mean loss."""
        replica, stage = self.layout.coords(self.rank)
        first, last = stage == 0, stage == self.layout.num_stages - 1
        mine = self.sampler.replica_slice(batch, replica, self.layout.num_replicas)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        losses: list[Tensor] = []
        args = (self._stage_input(mine),) if first else ()
        kwargs = {"target": self.targets[mine], "losses": losses} if last else {}
        self._schedule.step(*args, **kwargs)
        reduce_gradients(self._data_params, self.groups.data, self._tied_buckets, self.layout.num_replicas)
        self._record_grad_norms()
        if self.optimizer is not None:
            self.optimizer.step()
        # Only last stages hold losses; the sum over them of (replica mean / replicas) is the global mean.
        local = sum(loss.item() for loss in losses) / len(losses) / self.layout.num_replicas if last else 0.0
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total, group=self.group)
        return total.item()

    def train_epoch(self, epoch: int) -> EpochStats:
        """Every batch of `epoch` from the sampler, then `end_epoch` (which may freeze and re-pack)."""
        start = time.perf_counter()
        layout = self.layout
        hits0, misses0 = (self.cache.hits, self.cache.misses) if self.cache else (0, 0)
        losses = [self.step(batch) for batch in self.sampler.batches(epoch)]
        hits, misses = (self.cache.hits - hits0, self.cache.misses - misses0) if self.cache else (0, 0)
        self.end_epoch()
        return EpochStats(epoch, sum(losses) / len(losses), time.perf_counter() - start, layout.num_frozen,
                          layout.num_stages, layout.num_replicas, hits, misses, losses)

    def end_epoch(self) -> int:
        """Give the policy this epoch's gradient norm per layer and apply its decision;
        returns the frozen prefix length."""
        norms = self._norm_sums / max(self._norm_steps, 1)
        dist.all_reduce(norms, op=dist.ReduceOp.MAX, group=self.group)  # each layer's norm lives on its stage
        self.policy.record(norms.tolist())
        self._reset_grad_norms()
        target = self.policy.update(self.chain.num_layers)
        if target > self.layout.num_frozen:
            self.freeze(target)
        return self.layout.num_frozen

    def freeze(self, num_frozen: int) -> Layout:
        """Freeze layers [0, num_frozen) now: they get no gradients, no optimizer state and
        no backward, and (with `repack`) the active layers are re-balanced over fewer stages."""
        if num_frozen <= self.layout.num_frozen:
            return self.layout
        if num_frozen >= self.chain.num_layers:
            raise ShardwiseError(f"freeze({num_frozen}) would freeze every layer; the last computes the loss")
        states = self._gather(with_state=True)
        for i in range(num_frozen):
            for _, p in self.chain.layer_params(i):
                p.requires_grad_(False)
                p.grad = None
        self.policy.num_frozen = max(self.policy.num_frozen, num_frozen)
        layout = plan_layout(self.costs, num_frozen=num_frozen, world_size=self.world_size,
                             num_stages=self.config.num_stages, repack=self.config.repack, budget=self.budget)
        self._apply_layout(layout, states)
        return layout

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter's current value by model name (a collective: brings all ranks up to date)."""
        self._gather(with_state=False)
        return {name: p.detach().clone() for name, p in self.chain.params.items()}

    def run_prefix(self, indices: Tensor) -> Tensor:
        """The frozen prefix's outputs for samples `indices`, computed (not from the cache)."""
        return _run_no_grad(self.chain.layers[: self.layout.num_frozen], self.inputs[indices])

    # ---- layout changes ----------------------------------------------------------

    def _apply_layout(self, layout: Layout, states: State) -> None:
        chain, old = self.chain, self.layout
        self.layout = layout
        replica, stage = layout.coords(self.rank)
        holders = {name: layout.stages_holding(chain, name) for name in chain.params}
        tie_sets = sorted({s for name, s in holders.items() if len(s) > 1 and chain.params[name].requires_grad})
        self.groups: LayoutGroups = build_groups(layout, tie_sets, self.global_ranks, self.rank)
        start, end = layout.bounds[stage]
        module = nn.Sequential(*chain.layers[start:end])
        stage_runner = PipelineStage(module, stage, layout.num_stages, self.device, group=self.groups.pipe)
        self._schedule = SCHEDULES[self.config.schedule](
            stage_runner, self._num_microbatches(layout), loss_fn=self.loss_fn)
        named = {n: p for i in range(start, end) for n, p in chain.layer_params(i) if p.requires_grad}
        self._named = list(named.items())
        self.optimizer = self.make_optimizer(self._named) if self._named else None
        for name, p in self._named:
            if states.get(name):
                self.optimizer.state[p] = states[name]
        self._data_params = [p for n, p in self._named if len(holders[n]) == 1]
        self._tied_buckets = [([p for n, p in self._named if holders[n] == stages], group)
                              for stages, group in sorted(self.groups.tie.items())]
        owned = [(chain.owner_layer(n), p) for n, p in self._named if start <= chain.owner_layer(n) < end]
        self._owned_params = [p for _, p in owned]
        self._owned_layers = torch.tensor([layer for layer, _ in owned], dtype=torch.long)
        self._reset_grad_norms()
        self._update_cache(old, layout)

    def _update_cache(self, old: Layout, new: Layout) -> None:
        # Called only when the frozen prefix grew: held outputs are of a shorter prefix. A
        # rank that stays a first stage keeps a subset of its samples (Note [cache across
        # re-packs] in layout.py): it runs only the newly frozen layers over what it holds.
        if self.cache is None:
            return
        replica, stage = new.coords(self.rank)
        capacity = self.sampler.samples_per_replica(new.num_replicas)
        if stage != 0 or new.num_frozen == 0:
            self.cache.close()
        elif old.coords(self.rank)[1] == 0 and 0 < old.num_frozen < new.num_frozen and self.cache.num_cached:
            layers = self.chain.layers[old.num_frozen : new.num_frozen]
            self.cache.advance(new.num_frozen, capacity, lambda x: _run_no_grad(layers, x),
                               keep=lambda idx: self.sampler.replica_of(idx, new.num_replicas) == replica)
        else:
            self.cache.reset(new.num_frozen, capacity)

    def _gather(self, with_state: bool) -> State:
        """Bring every active layer's values (and optimizer state) from its stage in replica 0
        to every rank; frozen layers are already everywhere (sent when they froze)."""
        states: State = {}
        for stage in range(self.layout.num_stages):
            src = self.global_ranks[self.layout.rank_of(0, stage)]
            names = [n for n, p in self.chain.params.items()
                     if p.requires_grad and self.layout.stage_of_layer(self.chain.owner_layer(n)) == stage]
            states.update(broadcast_entries(self.chain.params, names, self.optimizer, src, self.group, with_state))
        return states

    def _layer_costs(self) -> list[float]:
        balance = self.config.balance
        if not isinstance(balance, str):
            if len(balance) != self.chain.num_layers:
                raise ShardwiseError(f"PipelineConfig.balance has {len(balance)} costs for "
                                    f"{self.chain.num_layers} layers")
            return [float(c) for c in balance]
        if balance == "params":
            return param_costs(self.chain)
        # Measured on rank 0 only and broadcast: every rank must cut the same stages.
        costs = torch.zeros(self.chain.num_layers, dtype=torch.float64)
        if self.rank == 0:
            size = self.sampler.global_batch_size // self.world_size // self.config.num_microbatches
            costs[:] = torch.tensor(measure_layer_times(self.chain.layers, self.inputs[:size]))
        dist.broadcast(costs, src=self.global_ranks[0], group=self.group)
        return costs.tolist()

    # ---- per step helpers --------------------------------------------------------------

    def _stage_input(self, indices: Tensor) -> Tensor:
        if self.layout.num_frozen == 0:
            return self.inputs[indices]
        if self.cache is not None:
            return self.cache.fetch(indices, self.run_prefix)
        return self.run_prefix(indices)

    def _num_microbatches(self, layout: Layout) -> int:
        # The first layout's micro-batch size: M x S' / S micro-batches of the replica's
        # B x S' / W samples. When M x S' / S is not an integer, keep M (smaller ones). Both
        # split the replica batch evenly (B is a multiple of W x M) and satisfy 1F1B's
        # micro-batches >= stages (M >= S >= S').
        m, s = self.config.num_microbatches, self.config.num_stages
        if (m * layout.num_stages) % s != 0:
            return m
        return max(m * layout.num_stages // s, 1)

    def _reset_grad_norms(self) -> None:
        self._norm_sums = torch.zeros(self.chain.num_layers, dtype=torch.float64)
        self._norm_steps = 0

    def _record_grad_norms(self) -> None:
        # Only the automatic rule reads them; a tied parameter counts in its owner layer.
        # Kept as tensors (no per-parameter .item()): this runs every step.
        if self.policy.threshold is None or not self._owned_params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._owned_params]
        squares = torch.stack(torch._foreach_norm(grads)).double().pow(2)
        per_layer = torch.zeros(self.chain.num_layers, dtype=torch.float64).index_add_(0, self._owned_layers, squares)
        self._norm_sums += per_layer.sqrt()
        self._norm_steps += 1


def _run_no_grad(layers: Sequence[nn.Module], x: Tensor) -> Tensor:
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x


def grouped_adamw(lr: Sequence[float] = (1e-2, 3e-3), weight_decay: Sequence[float] = (0.1, 0.0),
                  eps: float = 1e-8) -> OptimizerFactory:
    """An `OptimizerFactory`: AdamW with matrices (ndim >= 2) in a decayed group and the rest
    (biases, norms) in an undecayed one, each with its own lr."""

    def make(named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        decay = [p for _, p in named if p.ndim >= 2]
        rest = [p for _, p in named if p.ndim < 2]
        groups = [{"params": decay, "lr": lr[0], "weight_decay": weight_decay[0]},
                  {"params": rest, "lr": lr[1], "weight_decay": weight_decay[1]}]
        return torch.optim.AdamW([g for g in groups if g["params"]], eps=eps)

    return make
