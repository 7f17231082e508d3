"""Ranks agree on the model: the same parameters (and which are trainable) at `shard()` and
before every forward, the same starting values, and which units need a re-gather.
Uses: collectives, flat_unit, messages.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine.collectives import named_failure
from shardwise.engine.flat_unit import FlatUnit
from shardwise.engine.messages import all_gather_json
from shardwise.errors import ShardwiseError


def check_same_model_on_every_rank(model: nn.Module, group) -> None:
    """Fail at shard() — not with a hang mid-step — when ranks built different models.

    Ranks first compare a hash of (name, shape, dtype, requires_grad) of every parameter:
    one small all-gather. Only when the hashes differ are the full lists exchanged, to name the
    first differing parameter (as JSON: nothing from another rank is unpickled)."""
    mine = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]
    device = _device(group)
    signatures = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(signatures, torch.tensor([_digest(repr(mine))], device=device), group=group)
    if all(torch.equal(s, signatures[0]) for s in signatures):
        return
    everyone = all_gather_json([list(entry) for entry in mine], group)  # JSON, never a pickle between ranks
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs == reference:
            continue
        for index in range(max(len(theirs), len(reference))):
            a = reference[index] if index < len(reference) else None
            b = theirs[index] if index < len(theirs) else None
            if a != b:
                raise ShardwiseError(
                    f"ranks 0 and {rank} built different models: parameter #{index} is "
                    f"{_describe(a)} on rank 0 but {_describe(b)} on rank {rank}. Build the model "
                    "from the same code and config, and freeze the same parameters, on every rank (only the "
                    "data should differ)."
                )


def _describe(entry) -> str:
    if entry is None:
        return "absent"
    name, shape, dtype, requires_grad = entry
    return f"{name!r} shape {list(shape)} {dtype} {'trainable' if requires_grad else 'frozen'}"


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def agree_before_forward(units: list[FlatUnit], group, num_forwards: int,
                         forward_order: list[int]) -> tuple[list[FlatUnit], bool]:
    """The units any rank must re-gather before this forward, agreed by every rank, and whether
    every rank's last forward used the units in the same order.

    One small all-gather carries each rank's "my rows changed" flag per unit (zero1/zero2: a
    write only some ranks made still re-gathers everywhere, Note [collective order]), a
    digest of which parameters are trainable (a rank that froze or unfroze a parameter the
    others did not is an error here instead of a gloo abort in the next reduce), the number
    of forwards so far (a forward only some ranks run, `if rank == 0: evaluate(model)`, is an
    error instead of mis-paired collectives) and a digest of the last forward's unit order."""
    trainable = "".join("1" if shard.requires_grad else "0" for unit in units for shard in unit.shard_params)
    header = [_digest(trainable), 2 * num_forwards + torch.is_grad_enabled(),
              _digest(repr(_positions(units, forward_order)))]
    local = torch.tensor(header + [int(unit.needs_gather()) for unit in units], device=_device(group))
    world = dist.get_world_size(group)
    everyone = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    with named_failure(f"the agreement before a forward ({units[0].where})"):
        dist.all_gather_single(everyone, local, group=group)
    rows = everyone.view(world, -1).cpu()
    for column, problem in ((0, "train different parameters: requires_grad was changed on some ranks and not "
                                "on others. Freeze or unfreeze parameters the same way on every rank, between "
                                "steps."),
                            (1, "run different forwards of the sharded model (a different number of them, or "
                                "one with and one without grad): every rank must run every forward (evaluate on "
                                "all ranks, or on an unsharded copy), as every rank takes part in its "
                                "collectives. Generating different numbers of tokens on each rank: pass "
                                "generate(..., synced_gpus=True), so a rank that finished keeps stepping until "
                                "the longest is done (or pad every rank's work to the longest; docs/strategies.md, "
                                "evaluation and generate()).")):
        differ = (rows[:, column] != rows[0, column]).nonzero().flatten().tolist()
        if differ:
            raise ShardwiseError(f"ranks 0 and {differ[0]} {problem}")
    same_order = bool((rows[:, 2] == rows[0, 2]).all())
    return [unit for unit, flag in zip(units, rows[:, len(header):].amax(0).tolist()) if flag], same_order


def _positions(units: list[FlatUnit], order: list[int]) -> list[int]:
    index = {id(unit): i for i, unit in enumerate(units)}
    return [index[key] for key in order if key in index]


def _device(group) -> torch.device:
    """Where the group's collectives take tensors: NCCL groups have no CPU backend."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_rank0(unit: FlatUnit, group) -> None:
    """Every rank starts from rank 0's values (as DDP does), one unit at a time."""
    with torch.no_grad():
        for layout in unit.layouts:
            dist.broadcast(layout.owned.param.data, src=dist.get_global_rank(group, 0), group=group)
