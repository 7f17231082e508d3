"""The parallel layout: which ranks exist along which dimension, which rows of any tensor each rank
holds, and who writes what. One object every package asks. Uses: groups, rows.

Note [mesh info]: a zero engine's ranks form a `replicate x shard` mesh (FSDP2's names; its
`FSDPParallelLayout` / `HSDPParallelLayout`, torchtitan's `ParallelDims`). Parameters are cut into dim-0 chunks
over the *shard* group only (Note [rows], rows.py), so the units' gathers and reduce-scatters stay
inside the shard group. Every replica holds the same rows; after a unit's reduce-scatter (an average
over the shard group) its rows are averaged over the *replicate* group (an all-reduce), which makes
the mean over every rank of the mesh. The flat layout of `strategy="zero*"` without a mesh is the
1 x N mesh: one replica, every rank in the shard group; nothing is all-reduced and the arithmetic is
the one it always was. A sliced model's "tensor" dimension (Note [sliced mesh]) is recorded beside
them; the groups themselves are made in groups.py (Note [one maker of groups]).

What follows from it, asked here and nowhere else:
- this rank's rows of a parameter (`row_range`, `rows_of`) and of a flat chunked buffer (`own_start`,
  `own_chunk`); the engine's units, their gradients, the whole-tensor owners, `shard_info` and
  the checkpoints' row ranges all come from these.
- the gradient norm (`norm_group`): every replica holds the same averaged rows, so the norm
  is summed over the shard group alone; over every rank it would count each row once per replica.
- which rows a checkpoint writes (`rows_to_write`): replica 0's ranks write their rows, the
  other replicas write none (they hold the same values), so a file holds each row once.

Note [where the next capabilities land]: the shape is meant to take each of the next three
features in one subpackage; the issues that build them are held to this page.

(a) A quantized parameter all-gather (ZeRO++'s qwZ: int8 blocks, per-block scales; the fp32 master
    rows never quantized). A unit asks comm/ for its full values (`FlatUnit.start_gather` ->
    `coll.gather_into`, which returns a `Pending`) and waits on the handle (`finish_gather`). The
    feature is a gather strategy in engine/comm/ (comm/quantized.py, new: quantize this rank's parts
    before the all-gather, dequantize into the same `full_flat` regions in `Pending.finish`), picked in
    comm/collectives.py from an option the layout carries. unit/, schedule/ and zero.py do not change:
    they see a `Pending` whose `wait()` leaves full values in place.
(b) Pipeline stages running on the engine. A stage's module is `sw.shard`ed over the stage's
    data-parallel ranks: this object gains the "pipe" dimension (its group made in groups.py like
    every other), and each stage's `replicate x shard` part is `ParallelLayout.of_mesh(mesh["replicate",
    "shard"], ...)` over the stage's ranks. What a schedule flips per micro-batch (keep full values across
    the micro-batches of a step, reduce once per step) is a stage policy's answer (unit/stage.py:
    `free`, `kept_grads`) and the step driver's `no_sync` (schedule/driver.py). The feature
    lands in pipeline/ (stage construction, schedules, freezing, cache, re-packing), with the
    micro-batch switch as a policy in engine/schedule/; pipeline/ keeps no data-parallel code.
(c) A stream-overlapped prefetch on a GPU (landed: Note [streams per collective], comm/streams.py). The
    gather scheduler (schedule/gather_schedule.py) issues the next units' gathers ahead of use (as many as
    `sw.shard(prefetch=)`) and lands each before use; the collective and its copy-out run on the gathers'
    stream, and `Pending.wait` makes the compute stream wait on the handle's own event instead of the host.
    Reduce-scatters and replica all-reduces have streams of their own; buffers are reused by the comm
    context within a stated bound, each after its last reader's event. The scheduler's order and the
    residency machine (unit/residency.py) did not change.

Note [pipe dimension]: a pipelined layout is `pipe x replicate x shard`, given as a grid of global ranks
`grid[stage][replica][shard]` (`ParallelLayout.pipelined`). A rank's *stage* is its place along "pipe";
its stage's `replicate x shard` ranks are its data-parallel group, and the fields above describe that
part alone, exactly as a flat or hybrid layout does: the stage's module is sharded over them and the
engine never sees the other stages. `pipe_group` holds one rank of every stage at this rank's
(replica, shard) coordinate: the ranks a micro-batch's activations travel through, and the ranks that
hold the same rows of a parameter tied across stages (the same shard coordinate of the same shape:
Note [rows]); `tie_groups` holds, for each set of stages sharing such a parameter, this coordinate's ranks
of those stages, over which its reduced rows are summed (Note [ties across stages], pipeline/sharded.py).
Every group is made here, through groups.make_group, by every rank in one order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from shardwise.engine.layout.groups import make_group
from shardwise.engine.layout.rows import num_rows, row_range, rows_per_rank
from shardwise.errors import ShardwiseError
from shardwise.wire.backends import device_of


@dataclass(frozen=True, eq=False)
class ParallelLayout:
    """This rank's place in the `replicate x shard` mesh (Note [mesh info])."""

    group: dist.ProcessGroup | None  # every rank of the mesh: the data-parallel group (checkpoints, agreements)
    shard_group: dist.ProcessGroup | None
    shard_rank: int
    shard_world: int
    replicate_group: dist.ProcessGroup | None = None  # None: one replica (the flat layout)
    replicate_rank: int = 0
    replicate_world: int = 1
    device_mesh: object = None  # the user's 2-D DeviceMesh; None for the flat layout
    pipe_group: dist.ProcessGroup | None = None  # one rank per stage at this rank's coordinate (Note [pipe dimension])
    pipe_rank: int = 0  # this rank's stage
    pipe_world: int = 1  # stages; 1: no pipeline
    node_group: dist.ProcessGroup | None = None  # hpZ: this rank's node, where backward re-gathers (None: off)
    node_rank: int = 0
    node_world: int = 1
    tensor_group: dist.ProcessGroup | None = None  # sw.slice's group: ranks holding other slices (None: unsliced)
    tensor_rank: int = 0
    tensor_world: int = 1
    tie_groups: dict = field(default_factory=dict)  # stages sharing a weight -> their ranks at this coordinate
    _flat_mesh: dict = field(default_factory=dict, repr=False)  # device type -> the shard group's DeviceMesh

    @classmethod
    def flat(cls, group) -> ParallelLayout:
        """The 1 x N mesh: every rank of `group` holds a chunk."""
        return cls(group, group, dist.get_rank(group), dist.get_world_size(group))

    @classmethod
    def of_mesh(cls, mesh, group) -> ParallelLayout:
        """A 2-D `DeviceMesh` named ("replicate", "shard") (`check_mesh` says so first)."""
        shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
        return cls(group, shard, dist.get_rank(shard), dist.get_world_size(shard), replicate, dist.get_rank(replicate),
                   dist.get_world_size(replicate), mesh)

    @classmethod
    def pipelined(cls, grid, *, ties=(), what: str = "a pipeline group") -> ParallelLayout:
        """This rank's place in the `pipe x replicate x shard` grid of global ranks `grid[stage][replica][shard]`
        (Note [pipe dimension]), with a tie group for each set of stages in `ties` (stage indices sharing a
        weight). A collective over every rank of the world: each makes every group, in one order."""
        stages, me = _check_grid(grid), dist.get_rank()
        where = [(s, r, k) for s, plane in enumerate(stages) for r, row in enumerate(plane) for k, rank in
                 enumerate(row) if rank == me]
        if not where:
            raise ShardwiseError(f"rank {me} is in no stage of the pipeline grid {stages}: every rank of the world "
                                 "runs a stage (build the grid over range(world_size))")
        stage, replica, shard = where[0]
        num_replicas, num_shards = len(stages[0]), len(stages[0][0])
        def made(ranks: list[int]):  # a non-member gets torch's placeholder: nothing of it to close at exit
            return make_group(ranks, like=dist.group.WORLD, what=what if me in ranks else None)

        mine: dict = {}
        for s, plane in enumerate(stages):  # each stage's data-parallel, shard and replicate groups
            group = made([rank for row in plane for rank in row])
            shard_groups = [made(row) for row in plane]
            replicate_groups = [made([row[k] for row in plane]) for k in range(num_shards)]
            if s == stage:
                mine.update(group=group, shard_group=shard_groups[replica], replicate_group=replicate_groups[shard])
        for r in range(num_replicas):  # each coordinate's pipeline, through every stage
            for k in range(num_shards):
                pipe = made([plane[r][k] for plane in stages])
                if (r, k) == (replica, shard):
                    mine["pipe_group"] = pipe
        tie_groups = {}
        for tied in sorted(set(ties)):  # each coordinate's ranks of the stages sharing a weight
            for r in range(num_replicas):
                for k in range(num_shards):
                    group = made([stages[s][r][k] for s in tied])
                    if stage in tied and (r, k) == (replica, shard):
                        tie_groups[tied] = group
        mesh = None
        if num_replicas > 1:  # the engine's hybrid route takes a 2-D mesh of the stage's own groups
            mesh = DeviceMesh.from_group([mine["replicate_group"], mine["shard_group"]], device_of(mine["group"]).type,
                                         mesh=torch.tensor(stages[stage]), mesh_dim_names=MESH_NAMES)
        return cls(mine["group"], mine["shard_group"], shard, num_shards,
                   mine["replicate_group"] if num_replicas > 1 else None, replica, num_replicas, mesh,
                   mine["pipe_group"], stage, len(stages), tie_groups=tie_groups)

    def shard_arguments(self) -> dict:
        """What `sw.shard` takes to shard a module over this rank's stage (its data-parallel part):
        the stage's group, and its `replicate x shard` mesh when it has more than one replica."""
        return {"process_group": self.group, "mesh": self.device_mesh}
    def with_node_group(self, node_group) -> ParallelLayout:
        """This layout with hpZ's in-node group (Note [secondary shards], unit/secondary.py)."""
        return replace(self, node_group=node_group, node_rank=dist.get_rank(node_group),
                       node_world=dist.get_world_size(node_group), _flat_mesh={})

    def with_tensor_group(self, tensor_group) -> ParallelLayout:
        """This layout with a sliced model's tensor dimension (Note [sliced mesh]): the group `sw.slice` cut over."""
        return replace(self, tensor_group=tensor_group, tensor_rank=dist.get_rank(tensor_group),
                       tensor_world=dist.get_world_size(tensor_group), _flat_mesh={})

    def dims(self) -> dict[str, int]:
        """Each dimension's size, outermost first: {"pipe", "replicate", "shard", "tensor"}; hpZ's node
        group (a part of the shard group, not a dimension of its own) is not one of them."""
        return {"pipe": self.pipe_world, "replicate": self.replicate_world, "shard": self.shard_world,
                "tensor": self.tensor_world}

    @property
    def hybrid(self) -> bool:
        """More than one replica: gradients are also all-reduced across replicas."""
        return self.replicate_world > 1

    # ---- rows ---------------------------------------------------------------------------

    def rows_per_rank(self, rows: int) -> int:
        """Rows each shard rank holds of a parameter of `rows` rows, padding included."""
        return rows_per_rank(rows, self.shard_world)

    def row_range(self, rows: int, shard_rank: int | None = None) -> tuple[int, int]:
        """The real rows `lo:hi` of the full tensor that `shard_rank` (this rank's by default) holds."""
        return row_range(rows, self.shard_world, self.shard_rank if shard_rank is None else shard_rank)

    def rows_of(self, shape, shard_rank: int | None = None) -> tuple[int, int]:
        """The real rows `lo:hi` of a tensor of `shape` that `shard_rank` holds (a 0-D one: Note [rows])."""
        return self.row_range(num_rows(shape), shard_rank)

    def own_start(self, chunk_numel: int) -> int:
        """Where this rank's chunk starts in a buffer of `shard_world` chunks of `chunk_numel` each."""
        return self.shard_rank * chunk_numel

    def own_chunk(self, full: Tensor, chunk_numel: int) -> Tensor:
        """This rank's chunk of a full (unpadded) tensor, flat and zero-padded to `chunk_numel`."""
        flat = full.detach().reshape(-1)
        start = min(self.own_start(chunk_numel), flat.numel())
        rows = flat[start : start + chunk_numel]
        if rows.numel() == chunk_numel:
            return rows
        padded = torch.zeros(chunk_numel, dtype=flat.dtype, device=flat.device)
        padded[: rows.numel()] = rows
        return padded

    def rows_to_write(self, lo: int, hi: int) -> tuple[int, int]:
        """Of this rank's rows `lo:hi`, the ones a checkpoint writes: all of them on replica 0, none on
        the other replicas, which hold the same values (Note [mesh info])."""
        return (lo, hi) if self.replicate_rank == 0 else (lo, lo)

    # ---- groups -------------------------------------------------------------------------

    def global_rank(self, shard_rank: int) -> int:
        """The global rank of shard rank `shard_rank` (what `dst=`/`src=` of a collective on the shard group
        take): a whole-tensor owner's, a gather's root."""
        return dist.get_global_rank(self.shard_group, shard_rank)

    @property
    def norm_group(self):
        """Where a gradient norm's per-rank parts are summed: the shard group (Note [mesh info])."""
        return self.shard_group

    def dtensor_placements(self, device_type: str):
        """The `DeviceMesh` and placements a shard is exposed with in `state_dict()` (Note [state dict]):
        `Shard(0)` over the shard group, and `(Replicate(), Shard(0))` on a 2-D mesh."""
        from torch.distributed.tensor import Replicate, Shard  # DTensor costs ~1 s to import: only when asked
        if self.device_mesh is not None:
            return self.device_mesh, [Replicate(), Shard(0)]
        # a DeviceMesh costs a little to build: one per device type, since a mesh names its device type and a
        # DTensor's local rows must live there (host-offloaded rows on "cpu" beside the device's)
        if device_type not in self._flat_mesh:
            self._flat_mesh[device_type] = DeviceMesh.from_group(self.shard_group, device_type=device_type)
        return self._flat_mesh[device_type], [Shard(0)]


MESH_NAMES = ("replicate", "shard")


def _check_grid(grid) -> list[list[list[int]]]:
    """`grid` as nested lists, refused unless it is `stages x replicas x shards` of distinct global ranks
    covering the world once (the same argument on every rank, so every rank raises alike)."""
    stages = [[[int(rank) for rank in row] for row in plane] for plane in grid]
    shape = (len(stages), len(stages[0]) if stages else 0, len(stages[0][0]) if stages and stages[0] else 0)
    flat = [rank for plane in stages for row in plane for rank in row]
    world = dist.get_world_size()
    even = all(len(plane) == shape[1] and all(len(row) == shape[2] for row in plane) for plane in stages)
    if 0 in shape or not even or sorted(flat) != list(range(world)):
        raise ShardwiseError(f"a pipeline grid is stages x replicas x shards of global ranks, each rank of the "
                             f"world ({world}) once, every stage alike; got {stages}. Build it as "
                             "torch.arange(world_size).view(stages, replicas, shards) or its permutation")
    return stages
SLICED_MESH_NAMES = ("replicate", "shard", "tensor")
_BUILD = ('build it with torch.distributed.device_mesh.init_device_mesh("cuda" or "cpu", (num_replicas, '
          'ranks_per_replica), mesh_dim_names=("replicate", "shard"))')


def check_mesh(mesh, strategy: str, group) -> None:
    """Refuse, on every rank alike (the arguments are the same everywhere), a `mesh=` that `shard()` cannot
    honour, naming the fix: the strategy, the type, the dimensions and their names, the ranks it spans."""
    if strategy not in ("zero1", "zero2", "zero3"):
        raise ShardwiseError(f"strategy={strategy!r} does not take mesh=: hybrid sharding (replicate x shard) is for "
                             "'zero1', 'zero2' and 'zero3'. Drop mesh= (ddp replicates over the whole group: pass "
                             "process_group= to choose it), or pick a zero strategy.")
    if not isinstance(mesh, DeviceMesh):
        raise ShardwiseError(f"mesh= takes a torch DeviceMesh, not {type(mesh).__name__}: {_BUILD}.")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2:
        fix = (f'slice the two data dimensions out of it, mesh["replicate", "shard"] (its dimensions are '
               f"{names or 'unnamed'}; a tensor dimension goes to sw.slice)") if mesh.ndim > 2 else _BUILD
        raise ShardwiseError(f"mesh= must be 2-D (replicate x shard), got a {mesh.ndim}-D mesh: {fix}.")
    if names != MESH_NAMES:
        raise ShardwiseError(f"mesh= must name its dimensions {MESH_NAMES} (FSDP2's names), got "
                             f"{names or 'no names'}: {_BUILD}.")
    if mesh.size() != dist.get_world_size(group):
        raise ShardwiseError(f"mesh= spans {mesh.size()} ranks but the process group has "
                             f"{dist.get_world_size(group)}: build the mesh over every rank of the group "
                             "(or pass the group of the mesh's ranks as process_group=).")


def data_mesh(mesh, tensor_group, process_group):
    """The `replicate x shard` mesh and the process group of its ranks that `shard(mesh=...)` runs on.

    Note [sliced mesh]: a model sliced over the "tensor" dimension of a 3-D mesh named
    ("replicate", "shard", "tensor") is sharded over the other two (FSDP2 + TP's layout): each tensor
    rank's slices form their own 2-D mesh, `mesh["replicate", "shard"]`, whose ranks hold the same
    slices (sw.slice checks that of the group). `mesh` may be that 3-D mesh (`tensor_group` is then
    the group sw.slice cut over, which must be its "tensor" dimension) or a 2-D one; the group is
    `process_group`, else the mesh's own ranks flattened (fewer than the world's on a sliced model)."""
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 3 and tuple(mesh.mesh_dim_names or ()) == SLICED_MESH_NAMES:
        if tensor_group is None:
            raise ShardwiseError(f"mesh= is 3-D {SLICED_MESH_NAMES} but the model is not sliced: call "
                                 'sw.slice(model, group=mesh) first (it cuts over "tensor"), or pass '
                                 'mesh["replicate", "shard"]')
        if dist.get_process_group_ranks(tensor_group) != dist.get_process_group_ranks(mesh.get_group("tensor")):
            raise ShardwiseError('the model was sliced over another group than this mesh\'s "tensor" dimension: '
                                 "slice and shard with the same mesh, sw.slice(model, group=mesh) then "
                                 "sw.shard(model, ..., mesh=mesh)")
        mesh = mesh["replicate", "shard"]
    if process_group is not None or not isinstance(mesh, DeviceMesh) or mesh.size() == dist.get_world_size():
        return mesh, process_group or dist.group.WORLD
    if tuple(mesh.mesh_dim_names or ()) != MESH_NAMES:
        return mesh, dist.group.WORLD  # check_mesh names the problem
    return mesh, mesh._flatten().get_group()  # torch's flattened dimension: built once, collectively
