"""The whole-tensor step's collectives: rows to their owner, updated rows back (whole_step.py).
Uses: nothing of the engine.

Note [owner batches]: a parameter stepped whole needs every rank's rows (and gradient rows) on its
owner and the owner's update back in every rank's rows (Note [owner traffic] in whole_step.py). One
collective per parameter paid gloo's per-call cost once per matrix (three per matrix per step), so the
tensors going to (or coming from) one owner travel together: each rank puts its rows of all of them
back to back, one `gather` (one `scatter` back) per owner and dtype, in the order of the optimizer's
parameters, the same on every rank. Batches are issued ahead (`async_op=True`, at most WINDOW in flight:
Note [owner memory]) and waited in order, so the next transfer is in flight while this one's whole tensors
are assembled. The bytes are
the ones each tensor's own collective moved, only cut and joined again: the result is bitwise the
one-collective-per-parameter step's. (The optimizer's own step computes every parameter in one call,
so its compute cannot overlap these: the next batches overlap the assembly, not Newton-Schulz.)

Note [owner memory]: the owner needs each tensor it steps whole, and nothing more. Packed as above, one batch
per owner with every batch in flight at once, the owner held three copies of what it owns while the step began:
the batch's received parts, the whole tensors cut from them, and each rank's packed rows (and at the scatter the
updated wholes, their padded copies and the packed parts again): under zero3 with torchao's 8-bit AdamW, stepped
after backward, a rank's peak was 465 MiB above plain zero3's on the 16-block bench GPT at 2 ranks, where the
moments save 217 MiB (bench/memory/max_model.py probe). So the transfers are bounded: a tensor whose whole is
at least `ALONE_BYTES` travels alone, gathered straight into its whole (a padded buffer, the whole a view of its
first elements: no parts, no copy, and its rows sent as they are) and scattered from it (the view's own
storage, unless the step replaced the tensor); the others are packed in order into transfers of at most
`ALONE_BYTES` of whole values; and at most `WINDOW` transfers are in flight, the next issued as the oldest is
waited. A rank then holds, beyond the wholes it owns, the buffers of at most WINDOW transfers, each at most
3 * ALONE_BYTES (packed: its rows, the received parts, the scatter's joined parts) + the largest whole / N (the
rows an alone scatter receives), whatever the model's size (tests/test_lowbit_optim.py counts them through
`_buffer`). Every value is the packed step's: bitwise the same step (the same bytes, cut into more collectives).

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

from collections import deque
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
    return unit.storage.whole_in_full_view and unit.resident and unit.current_in_step()


def broadcasts_whole(param) -> bool:
    """Whether the owner's update goes back as the whole parameter into every rank's kept full values
    (Note [owner broadcast]) rather than as rows: zero1/zero2 units at the master dtype, whose rows are
    views of those full values. The same on every rank."""
    unit = param._sw_unit
    return unit.storage.whole_in_full_view


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


WINDOW = 2  # transfers in flight at once (Note [owner memory])


def _buffer(numel: int, like: Tensor) -> Tensor:
    """Every buffer the owners' traffic allocates goes through here (Note [owner memory]: counted by tests)."""
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _whole_bytes(piece: Piece, mesh) -> int:
    return mesh.shard_world * piece.param._sw_layout.shard_numel * piece.rows.element_size()


def _transfers(pieces: list[Piece], mesh) -> list[list[Piece]]:
    """The collectives that move `pieces` (Note [owner memory]): by owner and dtype, a tensor of at least
    ALONE_BYTES whole alone, the others packed in order up to ALONE_BYTES of whole values. The same on every
    rank (shapes and dtypes are)."""
    transfers = []
    for batch in _batches(pieces):
        packed, size = [], 0
        for piece in batch:
            whole = _whole_bytes(piece, mesh)
            if whole >= ALONE_BYTES:
                transfers.append([piece])
                continue
            if packed and size + whole > ALONE_BYTES:
                transfers.append(packed)
                packed, size = [], 0
            packed.append(piece)
            size += whole
        if packed:
            transfers.append(packed)
    return transfers


def _windowed(transfers: list, issue, finish) -> None:
    """`issue` each transfer (it returns its pending work), `finish` them in order, at most WINDOW in flight."""
    pending = deque()
    for transfer in transfers:
        pending.append(issue(transfer))
        if len(pending) >= WINDOW:
            finish(*pending.popleft())
    while pending:
        finish(*pending.popleft())


def _travels_alone(transfer: list[Piece], mesh) -> bool:
    return len(transfer) == 1 and _whole_bytes(transfer[0], mesh) >= ALONE_BYTES


def gather_to_owners(pieces: list[Piece], mesh) -> dict:
    """Every rank's rows of each piece on its owner alone, as the unpadded whole tensor: {key: whole} on the
    owner, nothing elsewhere (Note [owner batches], Note [owner memory])."""
    world, wholes = mesh.shard_world, {}

    def issue(batch):
        owner = batch[0].owner
        rows = [piece.rows.detach().reshape(-1).as_subclass(Tensor) for piece in batch]
        if len(rows) == 1 and rows[0].is_contiguous():
            send = rows[0]  # its own rows, as they are
        else:
            send = torch.cat(rows, out=_buffer(sum(r.numel() for r in rows), rows[0]))
        received = _buffer(world * send.numel(), send) if mesh.shard_rank == owner else None
        parts = list(received.view(world, send.numel()).unbind(0)) if received is not None else None
        work = dist.gather(send, parts, dst=mesh.global_rank(owner), group=mesh.shard_group, async_op=True)
        return work, batch, received

    def finish(work, batch, received):
        work.wait()
        if received is None:
            return
        if _travels_alone(batch, mesh):  # received straight into its whole: the whole is a view of it
            layout = batch[0].param._sw_layout
            wholes[batch[0].key] = received[: layout.rows * layout.row_numel].view(layout.shape)
            return
        parts, start = received.view(world, -1), 0
        for piece in batch:
            layout = piece.param._sw_layout
            end, real = start + layout.shard_numel, layout.rows * layout.row_numel
            whole = torch.cat(list(parts[:, start:end]), out=_buffer(world * layout.shard_numel, received))
            wholes[piece.key] = whole[:real].view(layout.shape)
            start = end

    _windowed(_transfers(pieces, mesh), issue, finish)
    return wholes


def _padded(whole: Tensor, numel: int, world: int) -> Tensor:
    """`whole` (the updated tensor on its owner) as `world` rows of `numel`: the padded buffer it is a view of
    when the gather made it (Note [owner memory]), else a copy; past its elements, whatever the buffer holds
    (the scatter copies each rank's real elements only)."""
    total = world * numel
    if whole.is_contiguous() and whole.storage_offset() == 0 and \
            whole.untyped_storage().nbytes() >= total * whole.element_size():
        return whole.as_strided((world, numel), (numel, 1))
    padded = _buffer(total, whole)
    padded[: whole.numel()].copy_(whole.reshape(-1))
    return padded.view(world, numel)


def scatter_from_owners(pieces: list[Piece], wholes: dict, mesh) -> None:
    """Each owner's updated whole tensors (`wholes[key]`, on the owner) back into every rank's rows
    (`piece.rows`), each rank receiving its own rows only; the padding past the real rows is left as it
    is (Note [owner batches], Note [owner memory])."""
    world = mesh.shard_world

    def issue(batch):
        owner, rows = batch[0].owner, batch[0].rows
        out = _buffer(sum(piece.param._sw_layout.shard_numel for piece in batch), rows)
        parts = None
        if mesh.shard_rank == owner:
            padded = [_padded(wholes[piece.key].detach(), piece.param._sw_layout.shard_numel, world)
                      for piece in batch]
            if len(padded) == 1:
                parts = list(padded[0].unbind(0))
            else:
                parts = list(torch.cat(padded, dim=1, out=_buffer(world * out.numel(), out).view(world, -1))
                             .unbind(0))
        work = dist.scatter(out, parts, src=mesh.global_rank(owner), group=mesh.shard_group, async_op=True)
        return work, batch, out

    def finish(work, batch, out):
        work.wait()
        start = 0
        for piece in batch:
            layout = piece.param._sw_layout
            past = layout.rows * layout.row_numel - mesh.shard_rank * layout.shard_numel  # real elements from here on
            real = max(0, min(layout.shard_numel, past))
            piece.rows.reshape(-1)[:real].copy_(out[start : start + real])
            start += layout.shard_numel

    _windowed(_transfers(pieces, mesh), issue, finish)


# Note [owner broadcast] for a large tensor: packing it into the batch's buffer and unpacking it on every
# rank costs two copies into freshly allocated memory, which on CPU means page faults per step; one
# broadcast of its own, straight into the full view, costs one more gloo call instead. Bitwise the same.
# Measured (bench/whole_tensor/results/whole_tensor_d1024.md, 4-16 MiB matrices, ws 2): the broadcast phase
# 0.189 s -> 0.070 s, the step 0.95x -> 0.72x one process's; a 256 KiB threshold gained nothing on the
# d_model 256 bench.
ALONE_BYTES = 4 * 2**20


def _alone(piece: Piece) -> bool:
    """Whether `piece` is broadcast by itself, straight into its full view: the same on every rank."""
    return piece.rows.is_contiguous() and piece.rows.numel() * piece.rows.element_size() >= ALONE_BYTES


def broadcast_from_owners(pieces: list[Piece], wholes: dict, mesh) -> None:
    """Each owner's updated whole tensors (`wholes[key]`, on the owner) into every rank's `piece.rows`, here
    the parameter's whole full view (Note [owner broadcast]): one broadcast per owner and dtype for the
    small ones, one per tensor for the large ones, all issued at once and waited in order."""
    pending = []
    for batch in _batches(pieces):
        owner, like = batch[0].owner, batch[0].rows
        src, mine = mesh.global_rank(owner), mesh.shard_rank == owner
        packed = [piece for piece in batch if not _alone(piece)]
        for piece in batch:
            if _alone(piece):
                buffer = wholes[piece.key].detach().contiguous() if mine else piece.rows
                work = dist.broadcast(buffer, src=src, group=mesh.shard_group, async_op=True)
                pending.append((work, [piece] if mine else [], buffer))
        if not packed:
            continue
        if mine:
            flat = torch.cat([wholes[piece.key].detach().reshape(-1) for piece in packed])
        else:
            flat = torch.empty(sum(piece.rows.numel() for piece in packed), dtype=like.dtype, device=like.device)
        work = dist.broadcast(flat, src=src, group=mesh.shard_group, async_op=True)
        pending.append((work, packed, flat))
    for work, batch, flat in pending:
        work.wait()
        if batch:  # nothing to unpack where a tensor was received in place
            for piece, part in zip(batch, flat.reshape(-1).split([piece.rows.numel() for piece in batch])):
                piece.rows.copy_(part.view(piece.rows.shape))
