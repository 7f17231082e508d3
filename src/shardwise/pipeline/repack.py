"""Re-packing sharded stages: the active layers onto fewer stages, their rows and optimizer rows re-cut
over the new layout's shard groups, the freed ranks joining the shard (or replicate) dimension.

Note [re-pack through the layout]: a re-pack changes the layout (`ParallelLayout.pipelined` over a new
grid: fewer stages, more data ranks each), and a parameter's rows are a function of the layout (Note
[rows]): rank k of a stage's shard group holds rows `k * ceil(R / K) ...`, so a row a rank held under
pipe 2 x shard 2 sits elsewhere under pipe 1 x shard 4. The trainer therefore moves each parameter the
way the engine's own full-state path does (the one checkpoints use across layouts): every old stage
gathers its active layers' full values (`sw.full_parameters`) and full optimizer state by model name
(each state tensor's rows all-gathered over the shard group that holds them, `full_state`), its first
rank sends them to every rank (`_moves.broadcast_entries`: the state's layout as JSON, the tensors as
flat buffers), every rank builds fresh layer modules from a meta skeleton of the chain (`Skeleton`) and
loads the values, each new stage shards its layers with `sw.shard` over the new layout's groups, and
each rank loads its own rows of every state tensor, cut by the new `shard_info` (`load_rows`). Nothing
here computes a row range: the engine's layout does, on both sides.

Memory, honestly: for the duration of a re-pack every rank holds the full values and the full optimizer
state (for AdamW, 3x the active parameters' fp32 bytes) of every active layer, on top of its old shards,
and the frozen prefix whole (it runs before the pipeline, on the first stage, and feeds the cache). The
full copies are dropped when the new stages are sharded; the frozen prefix stays whole on every rank (it
has no gradient and no optimizer state). A layout-to-layout row exchange (each rank receiving only its
new rows) would cut that peak to the new shards; it is not built.

Fresh modules because a sharded layer is the old engine's: its parameters are that engine's shards and
its hooks that engine's. The skeleton is a deep copy of the chain's layers made when the trainer is
built, with every parameter on the meta device (no memory); copying it gives new modules with the same
code and ties (a weight shared by two active layers stays one parameter), and buffers as built. The
frozen prefix is copied apart from the active layers, so a tied weight whose first layer froze (the
embedding) is one whole tensor in the prefix and a frozen shard in the head's stage.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwise.engine import shard_info
from shardwise.errors import ShardwiseError
from shardwise.pipeline._moves import broadcast_entries
from shardwise.pipeline.layers import LayerChain
from shardwise.pipeline.sharded import gather_stage_values

State = dict[str, dict]  # model name -> that parameter's optimizer state


class Skeleton:
    """The chain's layers on the meta device, as built: what a re-pack copies fresh layers from."""

    def __init__(self, chain: LayerChain):
        self.refusal = next((
            f"layer {i} holds a {type(module).__name__} with running statistics: re-packing sharded stages "
            "rebuilds layers with their buffers as built, and running statistics train. Use "
            "PipelineConfig(repack=False), strategy=None, or a norm without running statistics"
            for i, layer in enumerate(chain.layers) for module in layer.modules()
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats), None)
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                for layer in chain.layers for p in layer.parameters()}
        self.layers: list[nn.Module] = copy.deepcopy(chain.layers, memo)
        self.names = chain.names

    def check(self) -> None:
        """Refuse a re-pack of layers it cannot rebuild (the same model on every rank: on every rank alike)."""
        if self.refusal is not None:
            raise ShardwiseError(self.refusal)

    def build(self, indices: range, values: dict[str, Tensor], frozen: set[str]) -> dict[int, nn.Module]:
        """Fresh layers `indices` (one copy: ties among them stay one parameter) holding `values` by model
        name; the parameters named in `frozen` do not require grad."""
        layers = copy.deepcopy([self.layers[i] for i in indices])  # buffers: real copies, as built
        made: dict[int, nn.Parameter] = {}  # one tensor per meta parameter: ties across layers stay ties
        for module in (m for layer in layers for m in layer.modules()):
            for key, meta in list(module._parameters.items()):
                if meta is not None:
                    made.setdefault(id(meta), nn.Parameter(torch.empty_like(meta, device="cpu")))
                    module.register_parameter(key, made[id(meta)])
        for i, layer in zip(indices, layers):
            for p, name in zip(layer.parameters(), self.names[i]):
                with torch.no_grad():
                    p.copy_(values[name])
                p.requires_grad_(name not in frozen)
        return dict(zip(indices, layers))


def rebuilt_chain(skeleton: Skeleton, old: LayerChain, num_frozen: int, stage_bounds: tuple[int, int],
                  values: dict[str, Tensor], frozen: set[str]) -> LayerChain:
    """The chain after a re-pack on this rank: the frozen prefix `[0, num_frozen)` whole, this rank's
    stage `stage_bounds` as fresh modules to shard, every other layer as it was (another stage's: never
    run here)."""
    layers = list(old.layers)
    start, end = stage_bounds
    for built in (skeleton.build(range(num_frozen), values, frozen), skeleton.build(range(start, end), values, frozen)):
        for i, layer in built.items():
            layers[i] = layer
    params: dict[str, nn.Parameter] = {}
    for i in [*range(num_frozen), *range(start, end)]:  # a frozen name: its whole prefix copy, not a shard
        for p, name in zip(layers[i].parameters(), old.names[i]):
            params.setdefault(name, p)
    for name, p in old.params.items():
        params.setdefault(name, p)
    return LayerChain(layers, old.names, {name: params[name] for name in old.params})


def full_state(module: nn.Module, local_names: dict[str, str], optimizer) -> State:
    """The full optimizer state of a sharded stage module's trainable parameters by model name: each state
    tensor shaped like its shard is all-gathered over the shard group holding its rows (a collective over
    the stage); 0-D tensors (AdamW's step) and plain values are the same on every rank and kept as they are."""
    out: State = {}
    for local, info in shard_info(module).items():
        if not info.param.requires_grad or optimizer is None:
            continue
        state = optimizer.state.get(info.param, {})
        out[local_names[local]] = {key: _gather_rows(value, info) if _is_rows(value, info.param) else value
                                   for key, value in state.items()}
    return out


def _is_rows(value, param: Tensor) -> bool:
    if not isinstance(value, Tensor) or value.dim() == 0:
        return False
    if value.shape != param.shape:
        raise ShardwiseError(f"an optimizer state tensor of shape {tuple(value.shape)} belongs to a shard of shape "
                             f"{tuple(param.shape)}: a re-pack moves row-wise state (AdamW, Adam, SGD momentum) and "
                             "0-D state; an optimizer that steps whole tensors cannot be re-packed")
    return True


def _gather_rows(value: Tensor, info) -> Tensor:
    group, world = info.mesh.shard_group, info.mesh.shard_world
    parts = [torch.empty_like(value) for _ in range(world)]
    dist.all_gather(parts, value.detach().contiguous(), group=group)
    return torch.cat([p.reshape(-1) for p in parts])[: info.full_shape.numel()].view(info.full_shape).clone()


def load_rows(module: nn.Module, local_names: dict[str, str], optimizer, states: State) -> None:
    """Give `optimizer` this rank's rows of every full state in `states` (by model name), cut where the new
    layout's `shard_info` says this rank's rows are."""
    for local, info in shard_info(module).items():
        full = states.get(local_names[local])
        if not full or not info.param.requires_grad:
            continue
        optimizer.state[info.param] = {key: _rows_of(value, info) if isinstance(value, Tensor) and value.dim()
                                       else (value.clone() if isinstance(value, Tensor) else value)
                                       for key, value in full.items()}


def _rows_of(full: Tensor, info) -> Tensor:
    per_row = full.numel() // max(full.shape[0], 1) if full.dim() else 1
    mine = torch.zeros_like(info.param)
    start, end = info.row_start * per_row, info.row_end * per_row
    mine.view(-1)[: end - start] = full.reshape(-1)[start:end]
    return mine


def gather_full(chain: LayerChain, layout, module: nn.Module, local_names: dict[str, str], optimizer,
                global_ranks: list[int], group, specs, with_state: bool) -> tuple[dict[str, Tensor], State]:
    """Every parameter's full value by model name on every rank, and (`with_state`) every active one's full
    optimizer state: each stage gathers its own over its ranks, its first rank sends them to all (a
    collective over `group`); the frozen prefix is whole on every rank already."""
    me = dist.get_rank()
    my_stage = layout.coords(dist.get_group_rank(group, me))[1]
    mine = gather_stage_values(module, local_names)
    mine_state = full_state(module, local_names, optimizer) if with_state else {}
    values = {n: p.detach().clone() for n, p in chain.params.items()
              if layout.stage_of_layer(chain.owner_layer(n)) is None}
    states: State = {}
    for stage in range(layout.num_stages):
        src = global_ranks[layout.rank_of(0, stage)]
        names = [n for n in chain.params if layout.stage_of_layer(chain.owner_layer(n)) == stage]
        sent = {n: mine[n] if me == src else torch.empty(specs[n][0], dtype=specs[n][1]) for n in names}
        holder = SimpleNamespace(state={sent[n]: s for n, s in mine_state.items() if n in sent}) \
            if me == src and stage == my_stage else None
        states.update(broadcast_entries(sent, names, holder, src, group, with_state))
        values.update(sent)
    return values, states
