"""The whole-tensor step's collectives: rows to their owner, updated rows back (whole_step.py).
Uses: nothing of the engine.

Note [owner batches]: a parameter stepped whole needs every rank's rows (and gradient rows) on its
owner and the owner's update back in every rank's rows (Note [owner traffic] in whole_step.py). One
collective per parameter paid gloo's per-call cost once per matrix (three per matrix per step), so the
tensors going to (or coming from) one owner travel together: each rank puts its rows of all of them
back to back, one `gather` (one `scatter` back) per owner and dtype, in the order of the optimizer's
parameters, the same on every rank. Every batch is issued at once (`async_op=True`) and waited in
order, so owner k+1's transfer is in flight while owner k's whole tensors are assembled. The bytes are
the ones each tensor's own collective moved, only cut and joined again: the result is bitwise the
one-collective-per-parameter step's. (The optimizer's own step computes every parameter in one call,
so its compute cannot overlap these: the next batches overlap the assembly, not Newton-Schulz.)

Note [owner broadcast]: under zero1/zero2 at the master dtype (an aliased unit) every rank keeps the
unit's full values, and its rows are views of them. Scattering the updated rows back made every rank's
full values stale, so the next forward re-gathered the parameter: each rank received |p|/N in the
scatter and |p|·(N−1)/N in the re-gather, the owner included. The owner instead broadcasts the whole
updated parameter into every rank's full view, which updates each rank's rows in place (they are views
of it) and leaves the full values current: non-owners receive |p|, the owner nothing, and the forward
re-gathers only the unit's other parameters (FlatUnit.mark_fresh). Bytes per step against AdamW zero2's:
1 + f/(2N) where the scatter made it 1 + f/N (f: the whole-stepped fraction of the parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Piece:
    """One tensor in an owner's batch: `key` names it for the caller, `param` holds its layout (a sharded
    parameter: `_sw_layout`, `_sw_unit`), `rows` this rank's rows of it (gather) or where they go (scatter)."""

    key: object
    param: object
    owner: int
    rows: Tensor


def can_copy_whole(param) -> bool:
    """Whether the owner may copy its whole parameter instead of gathering it (Note [owner traffic]):
    zero1/zero2 keep the unit's full values, which are bit copies of every rank's rows when they are the
    master dtype (aliased) and current (no rows written since their gather). The same on every rank."""
    unit = param._sw_unit
    return unit.stage.keeps_full_params and unit.aliased and unit.resident and unit.current_in_step()


def broadcasts_whole(param) -> bool:
    """Whether the owner's update goes back as the whole parameter into every rank's kept full values
    (Note [owner broadcast]) rather than as rows: zero1/zero2 units at the master dtype, whose rows are
    views of those full values. The same on every rank."""
    unit = param._sw_unit
    return unit.stage.keeps_full_params and unit.aliased


def full_view(param) -> Tensor:
    """The parameter's whole values in its unit's kept full buffer (zero1/zero2)."""
    unit = param._sw_unit
    return unit.full_views[unit.index_of[id(param._sw_layout)]]


def kept_whole(param) -> Tensor:
    """A copy of the whole parameter from its unit's kept full values (`can_copy_whole`): the step must not
    write the kept buffer, which the next forward re-gathers anyway."""
    return full_view(param).detach().clone()


def _batches(pieces: list[Piece]) -> list[list[Piece]]:
    """`pieces` by (owner, dtype), in order of first appearance: the same batches on every rank."""
    batches: dict[tuple, list[Piece]] = {}
    for piece in pieces:
        batches.setdefault((piece.owner, piece.rows.dtype, piece.rows.device), []).append(piece)
    return list(batches.values())


def gather_to_owners(pieces: list[Piece], mesh) -> dict:
    """Every rank's rows of each piece on its owner alone, as the unpadded whole tensor: {key: whole} on the
    owner, nothing elsewhere (Note [owner batches])."""
    pending = []
    for batch in _batches(pieces):
        send = torch.cat([piece.rows.detach().reshape(-1).as_subclass(Tensor) for piece in batch])
        owner = batch[0].owner
        parts = [torch.empty_like(send) for _ in range(mesh.shard_world)] if mesh.shard_rank == owner else None
        work = dist.gather(send, parts, dst=mesh.global_rank(owner), group=mesh.shard_group, async_op=True)
        pending.append((work, batch, parts))
    wholes = {}
    for work, batch, parts in pending:
        work.wait()
        if parts is None:
            continue
        start = 0
        for piece in batch:
            layout = piece.param._sw_layout
            end = start + layout.shard_numel
            whole = torch.cat([part[start:end] for part in parts])[: layout.rows * layout.row_numel]
            wholes[piece.key] = whole.view(layout.shape)
            start = end
    return wholes


def scatter_from_owners(pieces: list[Piece], wholes: dict, mesh) -> None:
    """Each owner's updated whole tensors (`wholes[key]`, on the owner) back into every rank's rows
    (`piece.rows`), each rank receiving its own rows only; the padding past the real rows is left as it
    is (Note [owner batches])."""
    pending = []
    for batch in _batches(pieces):
        owner, rows = batch[0].owner, batch[0].rows
        size = sum(piece.param._sw_layout.shard_numel for piece in batch)
        out = torch.empty(size, dtype=rows.dtype, device=rows.device)
        parts = None
        if mesh.shard_rank == owner:
            padded = []
            for piece in batch:
                numel = piece.param._sw_layout.shard_numel
                flat = torch.zeros(mesh.shard_world * numel, dtype=rows.dtype, device=rows.device)
                flat[: wholes[piece.key].numel()] = wholes[piece.key].reshape(-1)
                padded.append(flat.view(mesh.shard_world, numel))
            parts = list(torch.cat(padded, dim=1).unbind(0))
        work = dist.scatter(out, parts, src=mesh.global_rank(owner), group=mesh.shard_group, async_op=True)
        pending.append((work, batch, out))
    for work, batch, out in pending:
        work.wait()
        start = 0
        for piece in batch:
            layout = piece.param._sw_layout
            past = layout.rows * layout.row_numel - mesh.shard_rank * layout.shard_numel  # real elements from here on
            real = max(0, min(layout.shard_numel, past))
            piece.rows.reshape(-1)[:real].copy_(out[start : start + real])
            start += layout.shard_numel


def broadcast_from_owners(pieces: list[Piece], wholes: dict, mesh) -> None:
    """Each owner's updated whole tensors (`wholes[key]`, on the owner) into every rank's `piece.rows`, here
    the parameter's whole full view (Note [owner broadcast]): one broadcast per owner and dtype, all issued
    at once and waited in order."""
    pending = []
    for batch in _batches(pieces):
        owner, like = batch[0].owner, batch[0].rows
        if mesh.shard_rank == owner:
            flat = torch.cat([wholes[piece.key].detach().reshape(-1) for piece in batch])
        else:
            flat = torch.empty(sum(piece.rows.numel() for piece in batch), dtype=like.dtype, device=like.device)
        work = dist.broadcast(flat, src=mesh.global_rank(owner), group=mesh.shard_group, async_op=True)
        pending.append((work, batch, flat))
    for work, batch, flat in pending:
        work.wait()
        for piece, part in zip(batch, flat.split([piece.rows.numel() for piece in batch])):
            piece.rows.copy_(part.view(piece.rows.shape))
