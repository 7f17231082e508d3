"""`PipeTrainer`: pipeline training over ranks with progressive freezing, an activation
cache and re-packing (PipeTransformer: AutoFreeze, AutoCache, AutoPipe + AutoDP).

One step, on every rank:
  1. the replica's first stage takes its slice of the global batch: raw inputs, or once
     a prefix is frozen, that prefix's outputs (from the cache, or run under no_grad);
  2. torch.distributed.pipelining runs the micro-batches through the stages (GPipe or
     1F1B); the last stage computes the loss; gradients come out as the mean over
     micro-batches (the schedule's scale_grads);
  3. the engine reduces each stage's gradients over the stage's data-parallel ranks: with
     strategy None it averages the whole replicas' gradients after the schedule (Note [whole
     replicas], engine/optim/replica_grads.py), with a zero strategy each unit's rows during the
     last backward; then a weight tied across stages has its reduced gradient summed across the
     stages holding it (`sharded.reduce_tied`), and each rank steps its own optimizer;
  4. the loss (global mean) is all-reduced, so every rank returns the same number.

With strategy None every rank builds the whole model, and every layer's values are brought
up to date on every rank whenever the layout changes (`freeze`). That makes moving layers to
other ranks a broadcast per old stage, and it costs each rank a full copy of the parameters:
that route is for speed (PipeTransformer's setting). With a zero strategy each stage's layers
are sharded over the stage's ranks (Note [sharded stages], sharded.py); a freeze re-packs them through
the layout (Note [re-pack through the layout], repack.py), or with repack=False freezes them in place.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage

from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.optim.replica_grads import average_replica_gradients
from shardwise.engine.schedule.consistency import differs_across_ranks
from shardwise.errors import ShardwiseError
from shardwise.pipeline._moves import State, broadcast_entries
from shardwise.pipeline.balance import measure_layer_times, param_costs, stage_costs
from shardwise.pipeline.cache import ActivationCache, StickySampler
from shardwise.pipeline.config import SCHEDULES, EpochStats, OptimizerFactory, PipelineConfig, check_same_pipeline
from shardwise.pipeline.freeze import FreezePolicy, GradNormWindow
from shardwise.pipeline.layers import LayerChain
from shardwise.pipeline.layout import Layout, plan_layout
from shardwise.pipeline.repack import Skeleton, gather_full, load_rows, rebuilt_chain
from shardwise.pipeline.sharded import (
    ShardedStage,
    freeze_shards,
    reduce_tied,
    shard_stage,
)
from shardwise.pipeline.stage_init import deferred_stages, stage_device


class PipeTrainer:
    """Trains a `LayerChain` on `inputs[i] -> targets[i]` over the ranks of `group`.

    `loss_fn(output, target)` is the mean loss of a micro-batch. `make_optimizer` builds a
    rank's optimizer from its (name, parameter) list; it is called again after each
    re-pack, and state moves with the parameters. `global_batch_size` must be a multiple
    of world size x num_microbatches. `freeze`: the policy consulted at each epoch's end (default: manual
    only, via `freeze`). `num_homes`: the sampler's, the world size by default (Note [data order across world
    sizes], checkpoint/resume.py). `group`: every rank of the world (a smaller group is refused: the layout's
    groups are made by every rank). Every method is a collective: call it on every rank of `group`.
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
        group: dist.ProcessGroup | None = None, num_homes: int | None = None,
    ):
        arguments = {name: value for name, value in locals().items() if name != "self"}
        self.chain, self.loss_fn, self.make_optimizer = chain, loss_fn, make_optimizer
        self.inputs, self.targets, self.config = inputs, targets, config
        self.group = group if group is not None else dist.group.WORLD
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        check_same_pipeline(arguments, self.group)  # first: before any check one rank could fail alone
        if self.world_size % config.num_stages != 0:
            raise ShardwiseError(f"num_stages={config.num_stages} must divide the world size {self.world_size}")
        if global_batch_size % (self.world_size * config.num_microbatches) != 0:
            raise ShardwiseError(
                f"global_batch_size={global_batch_size} must be a multiple of world size x num_microbatches "
                f"= {self.world_size * config.num_microbatches} (any re-packed layout splits it evenly)"
            )
        if self.world_size != dist.get_world_size():  # the layout's groups are made by every rank of the world
            raise ShardwiseError(f"the pipeline runs over every rank of the world ({dist.get_world_size()}), not a "
                                 f"group of {self.world_size}: its layout's groups are collectives of the world "
                                 "(ParallelLayout.pipelined). Drop group=")
        if config.strategy is not None:
            _check_sharded(config, freeze, self.world_size)
        if config.num_stages > chain.num_layers:
            raise ShardwiseError(f"{chain.num_layers} layers cannot fill {config.num_stages} stages")
        if differs_across_ranks([inputs, targets], self.group):  # each stage reads its own rank's copy
            raise ShardwiseError(
                "the ranks were given different datasets (inputs or targets differ): each stage reads its own "
                "rank's copy, so the first stage would train on one rank's inputs while the last scores another's "
                "targets. Pass the same inputs and targets on every rank (draw them after the same "
                "torch.manual_seed, or load the same files); the trainer's sampler gives each replica its samples.")
        self.sampler = StickySampler(len(inputs), global_batch_size, num_homes=num_homes or self.world_size,
                                     seed=seed, num_replicas=self.world_size)
        self.cache = (ActivationCache(self.sampler, memory_bytes=config.cache_memory_bytes,
                                      directory=config.cache_dir) if config.cache else None)
        self.policy = freeze if freeze is not None else FreezePolicy()
        self.device = stage_device(chain.params)
        self.optimizer: torch.optim.Optimizer | None = None
        self._names = {id(p): name for name, p in chain.params.items()}  # what a sharded stage calls them
        self._specs = {name: (p.shape, p.dtype) for name, p in chain.params.items()}
        self._frozen_shards = 0  # sharded stages without repack: layers [0, this) frozen in place
        # Sharded stages re-pack from fresh copies of the layers (Note [re-pack through the layout], repack.py).
        self._skeleton = Skeleton(chain) if config.strategy is not None and config.repack else None
        # Every rank starts from rank 0's values: ranks that built different models cannot drift. A deferred
        # model is replayed from the same recorded init on every rank instead (Note [stage init]).
        if not deferred_stages(chain.params, config.strategy, config.balance):
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
        if self.config.strategy is None:  # whole replicas: the engine averages them (Note [whole replicas])
            average_replica_gradients([p for _, p in self._named], self.mesh)
        reduce_tied(self._tied_buckets)  # a tie's stages sum their reduced gradients (Note [ties across stages])
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
        copies = self.mesh.replicate_world  # each layer's norm is read from every replica's copy of its rows
        self.policy.record(self._norms.window(self.group, copies))  # each layer's rows live on its stage
        self._norms = GradNormWindow(self.chain.num_layers)
        target = self.policy.update(self.chain.num_layers)
        if target > self.layout.num_frozen:
            self.freeze(target)
        return self.layout.num_frozen

    def freeze(self, num_frozen: int) -> Layout:
        """Freeze layers [0, num_frozen) now: they get no gradients, no optimizer state and
        no backward, and (with `repack`) the active layers are re-balanced over fewer stages."""
        if num_frozen <= max(self.layout.num_frozen, self._frozen_shards):
            return self.layout
        if num_frozen >= self.chain.num_layers:
            raise ShardwiseError(f"freeze({num_frozen}) would freeze every layer; the last computes the loss")
        if self.config.strategy is not None and not self.config.repack:
            return self._freeze_shards(num_frozen)
        if self.config.strategy is not None:
            return self._repack_shards(num_frozen)
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

    def _repack_shards(self, num_frozen: int) -> Layout:
        """Sharded stages with `repack`: the prefix leaves the pipeline (whole, cached), the active layers'
        values and optimizer state go through full values to fresh stages sharded over the new layout
        (Note [re-pack through the layout], repack.py)."""
        self._skeleton.check()
        frozen = {name for i in range(num_frozen) for name in self.chain.names[i]}
        layout = plan_layout(self.costs, num_frozen=num_frozen, world_size=self.world_size,
                             num_stages=self.config.num_stages, repack=True, budget=self.budget)
        values, states = gather_full(self.chain, self.layout, self.stage_module, self._local_names, self.optimizer,
                                     self.global_ranks, self.group, self._specs, with_state=True)
        self.stage_module = self.optimizer = None  # the old engine's shards go with it
        self.chain = rebuilt_chain(self._skeleton, self.chain, num_frozen, layout.bounds[layout.coords(self.rank)[1]],
                                   values, frozen)
        del values
        self._names = self.chain.names_by_id()
        self.policy.num_frozen = max(self.policy.num_frozen, num_frozen)
        self._apply_layout(layout, {n: s for n, s in states.items() if n not in frozen})
        return layout

    def _freeze_shards(self, num_frozen: int) -> Layout:
        """Sharded stages without `repack`: the layers stay where they are (no cache), their shards frozen
        (Note [frozen shards], sharded.py)."""
        if num_frozen >= self.layout.bounds[0][1]:
            raise ShardwiseError(f"freeze({num_frozen}) would freeze the whole first stage of sharded stages "
                                 "kept in place (repack=False), which then has no backward to run: freeze fewer "
                                 f"than {self.layout.bounds[0][1]} layers, or let the trainer re-pack (repack=True)")
        frozen = {name for i in range(num_frozen) for name in self.chain.names[i]}
        self._named, self.optimizer = freeze_shards(self._named, frozen, self.optimizer, self.make_optimizer)
        self._tied_buckets = [(params, group) for params, group in self._tied_buckets
                              if all(p.requires_grad for p in params)]
        self._frozen_shards = num_frozen
        self.policy.num_frozen = max(self.policy.num_frozen, num_frozen)
        return self.layout

    def full_parameters(self) -> dict[str, Tensor]:
        """Every parameter's current value by model name (a collective: brings all ranks up to date)."""
        if self.config.strategy is not None:
            return self._full_sharded()
        self._gather(with_state=False)
        return {name: p.detach().clone() for name, p in self.chain.params.items()}

    def _full_sharded(self) -> dict[str, Tensor]:
        """Each stage's full values (gathered over its ranks), sent from its first rank to every rank."""
        return gather_full(self.chain, self.layout, self.stage_module, self._local_names, None, self.global_ranks,
                           self.group, self._specs, with_state=False)[0]

    def local_parameters(self) -> dict[str, Tensor]:
        """This rank's trainable tensors by model name: its stage's layers whole, or (a zero strategy) its
        rows of them (no collective)."""
        return {name: p.detach() for name, p in self._named}

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
        start, end = layout.bounds[stage]
        if self.config.strategy is None:
            stage_runner = self._whole_stage(layout, stage, tie_sets, holders, states)
        else:
            stage_runner = self._sharded_stage(layout, stage, tie_sets, holders, states)
        self._schedule = SCHEDULES[self.config.schedule](
            stage_runner, self._num_microbatches(layout), loss_fn=self.loss_fn)
        owned = [(chain.owner_layer(n), p) for n, p in self._named if start <= chain.owner_layer(n) < end]
        self._owned_params = [p for _, p in owned]
        self._owned_layers = torch.tensor([layer for layer, _ in owned], dtype=torch.long)
        self._norms = GradNormWindow(self.chain.num_layers)
        self._update_cache(old, layout)

    def _whole_stage(self, layout: Layout, stage: int, tie_sets, holders, states: State) -> PipelineStage:
        """Strategy None: this rank's layers whole, its own optimizer; the groups are the engine layout's
        (`pipe x replicate`, one shard: whole copies), whose data-parallel group the engine averages the
        replicas' gradients over (Note [whole replicas], engine/optim/replica_grads.py)."""
        chain, (start, end) = self.chain, layout.bounds[stage]
        self.mesh = ParallelLayout.pipelined(layout.grid(self.global_ranks, 1), ties=tie_sets)
        named = {n: p for i in range(start, end) for n, p in chain.layer_params(i) if p.requires_grad}
        self._named = list(named.items())
        self.optimizer = self.make_optimizer(self._named) if self._named else None
        for name, p in self._named:
            if states.get(name):
                self.optimizer.state[p] = states[name]
        by_name = sorted(self._named, key=lambda item: item[0])  # the same order on every stage of a tie
        self._tied_buckets = [([p for n, p in by_name if holders[n] == stages], group)
                              for stages, group in sorted(self.mesh.tie_groups.items())]
        module = nn.Sequential(*chain.layers[start:end])
        return PipelineStage(module, stage, layout.num_stages, self.device, group=self.mesh.pipe_group)

    def _sharded_stage(self, layout: Layout, stage: int, tie_sets, holders, states: State) -> ShardedStage:
        """A zero strategy: this rank's stage sharded over the stage's ranks (Note [sharded stages]), taking
        its rows of the full optimizer `states` a re-pack brought (Note [re-pack through the layout])."""
        grid = layout.grid(self.global_ranks, self.config.shards or layout.num_replicas)
        self.mesh = ParallelLayout.pipelined(grid, ties=tie_sets)
        start, end = layout.bounds[stage]
        self.stage_module, self._local_names = shard_stage(self.chain.layers[start:end], self._names,
                                                            self.config.strategy, self.mesh,
                                                            keep_gathered=self.config.keep_gathered)
        self._named = [(self._local_names[n], p) for n, p in self.stage_module.named_parameters() if p.requires_grad]
        self.optimizer = self.make_optimizer(self._named) if self._named else None
        if states and self.optimizer is not None:
            load_rows(self.stage_module, self._local_names, self.optimizer, states)
        by_name = sorted(self._named, key=lambda item: item[0])  # the same order on every stage of a tie
        self._tied_buckets = [([p for n, p in by_name if holders[n] == stages], group)
                              for stages, group in sorted(self.mesh.tie_groups.items())]
        return ShardedStage(self.stage_module, stage, layout.num_stages, self.device, group=self.mesh.pipe_group,
                            keep_gathered=self.config.keep_gathered)

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

    def _record_grad_norms(self) -> None:
        # Only the automatic rule reads them; a tied parameter counts in its owner layer.
        if self.policy.threshold is not None:
            self._norms.record(self._owned_params, self._owned_layers)


def _check_sharded(config: PipelineConfig, freeze: FreezePolicy | None, group_size: int) -> None:
    """What sharded stages do not take yet, refused on every rank alike (the arguments are everyone's)."""
    data = group_size // config.num_stages
    if data % (config.shards or data) != 0:
        raise ShardwiseError(f"PipelineConfig.shards={config.shards} must divide the {data} ranks of each stage")
    if freeze is not None and freeze.threshold is not None and not config.repack:
        raise ShardwiseError("automatic freezing of sharded stages needs repack=True (a layer frozen in place "
                             "still runs in the pipeline): drop repack=False, or freeze by hand")


def _run_no_grad(layers: Sequence[nn.Module], x: Tensor) -> Tensor:
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    return x
