"""`strategy="zero1" | "zero2" | "zero3"`: three stages (Note [stages], stage.py) over one mechanism
(flat_unit.py). Uses: buffers, consistency, context, driver, groups, host_offload, info, offload, optim_hooks,
parallel_layout, phase, precision, protocol, quantize, residency, sharding, stage, state_dict, unit_choice, units.
Optimizer state is always sharded: by rows, or by parameter for whole-tensor optimizers (whole_step.py).

`ZeroEngine` builds, in this order: the layout (Note [mesh info]), the units (init/sharding.py), the
step hooks' watch (Note [one step hook]), the state-dict hooks (Note [state dict]) and the step driver
(schedule/driver.py), which then runs every forward and backward; what the layers above may ask of it is
the `Engine` protocol (protocol.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import ShardConfig
from shardwise.engine.comm.buffers import comm_buffer_bytes
from shardwise.engine.comm.context import CommContext
from shardwise.engine.comm.quantize import wire_buffer_bytes
from shardwise.engine.init.sharding import shard_units
from shardwise.engine.layout.groups import host_group_of, new_node_group, new_reduce_group
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.engine.memory.host_offload import open_host
from shardwise.engine.memory.offload import open_store
from shardwise.engine.memory.precision import cast_floating_inputs
from shardwise.engine.optim.optim_hooks import StepWatch
from shardwise.engine.phase import Clock
from shardwise.engine.protocol import Engine, slicing_of
from shardwise.engine.schedule.consistency import check_same_model_on_every_rank
from shardwise.engine.schedule.driver import StepDriver
from shardwise.engine.state_dict import install_state_dict_hooks
from shardwise.engine.unit.info import ShardInfo, module_paths, units_shard_info
from shardwise.engine.unit.residency import Residents
from shardwise.engine.unit.stage import policy_of
from shardwise.engine.unit.unit_choice import names_the_root, warn_if_root_holds_most
from shardwise.engine.unit.units import UnitSpec, build_units
from shardwise.errors import ShardwiseError


class ZeroEngine(Engine):
    """What `shard(..., strategy="zero*")` attaches to the model (Note [engine protocol])."""

    shards_rows = True

    def __init__(self, model: nn.Module, config: ShardConfig, units: UnitSpec, group, init_fn=None, mesh=None):
        self.config, self.strategy, self.group = config, config.strategy, group  # group: every rank of the mesh
        self.policy = policy_of(config.strategy, config.prefetch, config.keep_comm_buffers)
        self.precision, self.clock = config.precision, Clock()
        self.compression = config.compression  # quantized collectives (Note [quantized collectives]), or None
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # Note [mesh info]: which rows this rank holds, its shard group and its replicas.
        self.mesh = ParallelLayout.of_mesh(mesh, group) if mesh is not None else ParallelLayout.flat(group)
        plans = build_units(model, units)
        if not names_the_root(model, units):  # the caller's own choice: nothing to warn about
            warn_if_root_holds_most(model, [owned.param for owned in plans[0].params])
        self.module_paths = module_paths(model)
        check_same_model_on_every_rank(model, group)  # before any group is made
        self.store = open_store(config.offload, self.rank)  # disk offload: the master rows' files
        self.host = open_host(config.offload)  # offload="host": the copies to and from host rows (Note [host offload])
        self.host_group = host_group_of(group)  # Note [host values] (collectives.py)
        if slicing_of(model) is not None:  # sliced first (sw.slice): the layout's "tensor" dimension
            self.mesh = self.mesh.with_tensor_group(slicing_of(model).group)
        if config.reshard_after_forward is not True:  # hpZ: Note [secondary shards]
            self.mesh = self.mesh.with_node_group(self._node_group(config.reshard_after_forward))
        reduce_group = new_reduce_group(self.mesh.shard_group)  # Note [collective order]
        self.residents = Residents()  # zero3's units holding full values: counted by the units themselves
        self.comm = CommContext.for_group(group, config.compression)  # every unit's collectives (Note [comm context])
        self.units = shard_units(model, plans, config, group, self.mesh, self.store, init_fn, policy=self.policy,
                                 reduce_group=reduce_group, clock=self.clock, residents=self.residents,
                                 comm=self.comm, host=self.host)
        self.root = self.units[0]
        self.comm.bound_buffers(self._comm_bound())  # Note [reused buffers]
        # Note [one step hook]; headers and zero3's tags on a device are compared before any step (Note [headers on
        # the device] in agreement_device.py, Note [tags on the device])
        self.step_watch = StepWatch(self.units, before_step=self._settle)
        install_state_dict_hooks(model, self)  # Note [state dict]
        # The used-flags agreement may run inside backward (optimizer_in_backward), where zero3's gathers
        # are in flight on `group`: on gloo it rides the reduce group, in that group's fixed order. On a
        # hybrid mesh the flags span every replica (a parameter used on one replica has a gradient on all)
        # and the gathers run on the shard group, so they take the host group of the whole mesh. On NCCL they
        # ride the device on a group of the whole mesh's own instead (Note [used flags on the device]).
        flags_group = reduce_group if self.host_group is group and not self.mesh.hybrid else self.host_group
        self.driver = StepDriver(self.units, self.policy, group, flags_group, self.clock)
        self.step_watch.agree_on_step = self._agree_on_step  # Note [uneven work] (agreement.py)
        if self.precision.param_dtype != torch.float32:
            self.root.module.register_forward_pre_hook(cast_floating_inputs(self.precision.param_dtype),
                                                       with_kwargs=True)
        self.driver.install(model, config.checkpoint_activations)

    def _node_group(self, per_node: int):
        """hpZ's group: this rank's node of `per_node` ranks, refused (on every rank alike: the arguments and the
        layout are the same everywhere) where it cannot keep backward's gathers in the node."""
        world = self.world_size
        if world % per_node or per_node >= world:
            raise ShardwiseError(f"reshard_after_forward={per_node} (hpZ) needs the {world} ranks to form whole nodes "
                                 f"of {per_node}, more than one: pass the ranks per node (torchrun's "
                                 "--nproc-per-node), a divisor of the world size below it, or drop the option")
        node_group = new_node_group(self.group, per_node)
        if dist.get_process_group_ranks(node_group) == dist.get_process_group_ranks(self.mesh.shard_group):
            raise ShardwiseError(f"reshard_after_forward={per_node} (hpZ): the shard group already lies inside a "
                                 "node (hybrid sharding shards within the node), so backward's re-gather never "
                                 "leaves it; drop reshard_after_forward")
        return node_group

    def _agree_on_step(self) -> None:
        """Before an optimizer step: every rank is at it (Note [uneven work]). A step inside backward
        (optimizer_in_backward) is its backward's, whose header said so already."""
        if not self.steps_in_backward():
            self.driver.agreement.agree_on_step(self.driver.num_forwards, self.driver.forward_order)

    def _settle(self) -> None:
        """Before any optimizer step: the headers in flight compared, then zero3's tags (the same words on every
        rank: Note [headers on the device])."""
        self.driver.agreement.settle()
        self.driver.gathers.settle_tags()

    def _comm_bound(self) -> int:
        """The comm pool's bound: the estimator's formula (comm_buffer_bytes) over this engine's units."""
        others = self.units[1:] or self.units[:1]
        c = max(unit.full_flat.element_size() for unit in self.units)
        r = max(torch.empty(0, dtype=unit.reduce_dtype).element_size() for unit in self.units)
        biggest = max(unit.numel_full for unit in others)
        largest = max(biggest, self.root.numel_full)  # the root's buffers too (Note [reused buffers])
        wire = wire_buffer_bytes(self.comm.compression, self.mesh.shard_world, largest)  # compressed forms' buffers
        return comm_buffer_bytes(self.policy, c, r, self.root.numel_full, biggest, wire)

    # ---- what the layers above ask (Note [engine protocol]) -----------------------------

    @property
    def agreement(self):
        """The ranks' agreement (Note [agreement rides the traffic]): its group carries every header."""
        return self.driver.agreement

    @property
    def reducer(self):
        return self.driver.reducer

    @property
    def num_forwards(self) -> int:
        """Root forwards so far, counted in every header."""
        return self.driver.num_forwards

    def no_sync(self):
        """Skip the reduce: full gradients accumulate locally (StepDriver.no_sync)."""
        return self.driver.no_sync()

    def keep_gathered(self):
        """zero3: units stay gathered across the micro-batches of a step (StepDriver.keep_gathered)."""
        return self.driver.keep_gathered()

    @property
    def num_steps(self) -> int:
        """Finished backwards."""
        return self.clock.steps

    @property
    def peak_resident_units(self) -> int:
        """Most non-root units gathered at once (zero3's memory check)."""
        return self.residents.peak

    def shard_info(self) -> dict[str, ShardInfo]:
        return units_shard_info(self.units, self.module_paths)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: value for unit in self.units for name, value in unit.gather_copy().items()}

    def steps_in_backward(self) -> bool:
        return self.driver.reducer.stepper is not None

    def settle_agreement(self) -> None:
        self.driver.agreement.settle_all()
        self.driver.gathers.settle_tags()


def apply_zero(model: nn.Module, config: ShardConfig, units: UnitSpec, group: dist.ProcessGroup,
               init_fn=None, mesh=None) -> ZeroEngine:
    """Shard `model` in place under `config.strategy` (over `mesh`'s shard dimension when given: Note
    [mesh info]) and return its engine."""
    return ZeroEngine(model, config, units, group, init_fn, mesh)
