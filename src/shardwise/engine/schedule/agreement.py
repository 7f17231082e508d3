"""Ranks agree on what each communicating phase does, on traffic that happens anyway, not in a
barrier before every forward. Uses: collectives, compat, consistency, flat_unit, groups, small.

Note [agreement rides the traffic]: gloo and NCCL pair collectives by their order of issue (Note
[collective order], zero.py), so ranks must agree, before the collectives of a forward or a backward
are used, on (a) which zero1/zero2 units are re-gathered, (b) which parameters are trainable (the
reduces' sizes), (c) how many forwards ran and with or without grad (`if rank == 0: evaluate(model)`
would pair one rank's forward with another's backward) and (d) zero3's prefetch order. This used to
be one blocking all-gather, read on the host, before every forward: a host rendezvous on the critical
path of each training step, evaluation batch and `generate()` token. Now:

- A phase that communicates anyway (zero3's forward: its gathers; a zero1/zero2 forward with a unit
  to re-gather; a backward that reduces or re-gathers) first issues a small header, asynchronously,
  on a gloo group of its own (`Agreement.group`; a CPU group beside NCCL, Note [host values]):
  [digest of requires_grad, forwards so far, phase (forward without grad, with grad, backward),
  digest of the last forward's unit order] and one re-gather flag per unit.
- The header is checked (`confirm`) where the engine waits for that phase's collectives anyway:
  before the first gather lands, before the first reduce is issued (a rank that froze a parameter
  would issue a reduce of another size), at the forward's end. On gloo the host waits there anyway,
  and the header has landed beside the payload. A difference raises the same ShardwiseError on every
  rank, since all of them read the same rows. On NCCL the engine's own waits are stream waits, and a
  `confirm` there would be a wait of the ranks' CPUs for each other's header, about three a step: so
  where the collectives run on a device the headers ride the device and are compared before the
  optimizer step instead (`HeadersOnDevice`, Note [headers on the device] in agreement_device.py, which
  says what that gives up); everything below holds for both forms unless it says otherwise.
- Headers have a channel of their own, so a header always pairs with the other ranks' next header
  whatever the others' phase is (a header sent on the gathers' group could pair with a backward's
  gather of another size): a forward only one rank runs meets the others' next forward or backward
  header and is refused there, with the forward count or phase differing.
- A forward that communicates nothing (a zero1/zero2 evaluation once the units are current) sends no
  header: nothing in it can mis-pair. It still counts, so a forward only some ranks run is refused at
  the next phase that communicates (as before: the same script must run under zero3, where it would
  mis-pair).
- (a) Re-gathers are decided from what every rank knows alike: the optimizer step runs on every
  rank and marks the units whose shards it holds stale on each (optim_hooks.py; whole-tensor and
  in-backward steps go through the same hook). A write of the user's (`p.data.mul_()`,
  `load_state_dict`, `sw.load`) is seen only by the ranks that made it (a version stamp:
  FlatUnit.written). Loading on every rank must work exactly, so a forward after such a write
  confirms its header *before* issuing any re-gather: the writers wait there for the other ranks'
  next header, and a write only some ranks made is refused on every rank (the flags differ) instead
  of re-gathered by a one-sided collective. Steady-state training never waits there: its re-gathers
  come from steps.
- (d) zero3 prefetches in the last forward's order once every rank's header said the same order
  (digest), learned at the previous backward (a training step: the next forward uses it) or the
  previous forward (evaluation: from the forward after next); registration order until then.
- Note [uneven work]: ranks that run different numbers of micro-batches before a step (rank 0 two
  forwards and backwards, rank 1 one) send headers that pair as if nothing differed: rank 0's second
  forward and rank 1's first forward of the next step both say "forward 2". zero3 then trained on,
  its gathers and reduces paired across steps, and a rank whose work had ended left the others waiting
  for the group's timeout (10 minutes) before any error. So an optimizer step over a sharded model sends
  a header of its own (STEP) and waits for it (`agree_on_step`, from the step hook: optim_hooks.py): the
  ranks at their step meet the others' next header, a forward's or a backward's, and every rank refuses
  before the step runs, the ranks still in a forward at their first gather. Why refuse rather than train
  on (torch DDP's `Join` shadows the missing collectives of a rank that ran out): under ZeRO a rank that
  ran out would have to shadow every gather and reduce of a forward and backward it does not run, in the
  same order, for every stage, and its zero gradients would still enter the average (as under `Join`).
  Equal work per step (drop_last, or padding) needs none of that. The wait costs one small all-gather on the
  host group per optimizer step, where the ranks already met for the step's last reduce. On a device the step's
  header is not waited for: it is compared at the next step's settle, so the ranks that reached their step first
  apply it before every rank refuses at the next (Note [headers on the device]). Steps run inside backward
  (`sw.optimizer_in_backward`) send none: their backward's header is the step's. A backward's header says
  whether it reduces (BACKWARD) or accumulates under no_sync (BACKWARD_NO_SYNC): with gradient
  accumulation the uneven rank meets the others' synced backward with one of its no_sync ones.
- What it cannot do: refuse a forward only some ranks run before that forward's own collectives
  are issued (they are issued before the header lands, and are never waited for: the error comes
  first, and the process group is spent after it, as after any mismatched collective); and a rank
  that stops calling collectives entirely (it ended the program) still leaves the others waiting
  until the group's timeout, where a named failure says where they waited. A write only some ranks
  made leaves the same: the others issued their re-gathers before the header landed. After either,
  end the process or destroy the groups on every rank together: a spent gloo group freed on one rank
  while another rank's copy lives waits up to its timeout in its destructor (it joins the thread still
  in the unmatched collective; tests/helpers/harness.py, Note [collect before the group goes]).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.engine.comm.collectives import named_failure
from shardwise.engine.comm.small import start_all_gather_rows
from shardwise.engine.compat import plain_tensors
from shardwise.engine.layout.groups import new_host_group
from shardwise.engine.schedule.consistency import digest
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.errors import ShardwiseError

FORWARD_NO_GRAD, FORWARD_WITH_GRAD, BACKWARD, STEP, BACKWARD_NO_SYNC = 0, 1, 2, 3, 4
_KINDS = {BACKWARD: "backward", BACKWARD_NO_SYNC: "backward", STEP: "step"}
REFUSED = -1  # a rank refused the step (Note [gather tags], gather_tags.py): its last header

_DIFFERENT_PARAMETERS = (
    "train different parameters: requires_grad was changed on some ranks and not on others. Freeze or unfreeze "
    "parameters the same way on every rank, between steps.")
DIFFERENT_FORWARDS = (
    "run different forwards of the sharded model (a different number of them, or one with and one without "
    "grad): every rank must run every forward (evaluate on all ranks, or on an unsharded copy), as every rank "
    "takes part in its collectives; the same number of micro-batches between optimizer steps too (Note [uneven "
    "work]). Generating different numbers of tokens on each rank: pass "
    "generate(..., synced_gpus=True), so a rank that finished keeps stepping until the longest is done (or pad "
    "every rank's work to the longest; docs/strategies.md, evaluation and generate()).")


class Agreement:
    """The headers of one engine's phases (Note [agreement rides the traffic]); one in flight at a time."""

    def __init__(self, units: list[FlatUnit], group, channel=new_host_group) -> None:
        """`channel(group)`: the headers' group of their own (a host group here; Note [headers on the device])."""
        self.units = units
        self.world = dist.get_world_size(group)
        self.group = channel(group) if self.world > 1 else None
        self.pending = None  # (work, sent, received, order, where) of the header in flight
        self.agreed_order: list[int] | None = None  # unit ids in the last order every rank reported
        self.on_refused = None  # called when another rank refused, before this rank raises (Note [gather tags])
        self.on_refusing = None  # called when this rank refuses at its step, before it raises (Note [uneven work])
        self.refusal = None  # the refusing header in flight (never waited for: this rank is raising)
        self.host_waits = 0  # times the host thread waited for the other ranks' header (a host rendezvous)

    def announce(self, phase: int, num_forwards: int, order: list[int], regather: list[FlatUnit]) -> None:
        """Issue this phase's header (asynchronously); the previous one is confirmed first."""
        self.confirm()
        if self.group is None:  # one rank: nothing to pair, and its order is every rank's
            self.agreed_order = list(order) or None
            return
        sent = torch.tensor(self.header(phase, num_forwards, order, regather), dtype=torch.int64)
        received = torch.empty(self.world * sent.numel(), dtype=torch.int64)
        where = self.units[0].where
        with named_failure(f"the agreement of a {_KINDS.get(phase, 'forward')} ({where})"):
            work = start_all_gather_rows(received, sent, self.group)
        self.pending = (work, sent, received, list(order), where)

    def header(self, phase: int, num_forwards: int, order: list[int], regather: list[FlatUnit]) -> list[int]:
        """This rank's header: [digest of requires_grad, forwards so far, phase, digest of `order`], then one
        re-gather flag per unit: 0 no re-gather, 1 a re-gather after a step, 2 after a write outside a step
        (FlatUnit.written)."""
        flagged = {id(unit) for unit in regather}
        index = {id(unit): i for i, unit in enumerate(self.units)}
        with plain_tensors():  # Note [engine reads] (shard_param.py)
            trainable = "".join("1" if shard.requires_grad else "0"
                                for unit in self.units for shard in unit.shard_params)
        header = [digest(trainable), num_forwards, phase, digest(repr([index[key] for key in order if key in index]))]
        return header + [1 + unit.written() if id(unit) in flagged else 0 for unit in self.units]

    def confirm(self) -> None:
        """Wait for the header in flight, if any (a host value: Note [host values]), and raise on any
        difference between the ranks' headers, on every rank alike."""
        if self.pending is None:
            return
        (work, _sent, received, order, where), self.pending = self.pending, None
        with named_failure(f"the agreement of a phase ({where})"):
            work.wait()
        self.host_waits += 1
        self.check(received.view(self.world, -1).tolist(), order)

    def settle(self) -> None:
        """Before an optimizer step: nothing left here, every header was confirmed at its phase (the device
        form compares its headers here: Note [headers on the device], agreement_device.py)."""

    def settle_all(self) -> None:
        """Before values leave the engine (a checkpoint): nothing left here, the step's header too was confirmed
        at the step (the device form compares its last one here: Note [headers on the device])."""

    def check(self, rows: list[list[int]], order: list[int]) -> None:
        """Every rank's header (`rows`, one per rank) says the same, or the same ShardwiseError on every rank
        (they all read the same rows); then the prefetch order every rank reported, if they agree on it."""
        refused = [rank for rank, row in enumerate(rows) if row[2] == REFUSED]
        if refused:
            if self.on_refused is not None:
                self.on_refused()  # raises the refusing rank's own words where this rank can name them
            raise ShardwiseError(f"rank {refused[0]} refused this step (its own error says why): the ranks ran "
                                 "different sequences of collectives")
        stepped = [rank for rank, row in enumerate(rows) if row[2] == STEP]
        if 0 < len(stepped) < len(rows):
            raise ShardwiseError(_uneven_work(rows, stepped))
        synced = [rank for rank, row in enumerate(rows) if row[2] == BACKWARD]
        if synced and any(row[2] == BACKWARD_NO_SYNC for row in rows):
            raise ShardwiseError(_uneven_work(rows, synced))
        first = rows[0]
        for rank, row in enumerate(rows[1:], start=1):
            if row[0] != first[0]:
                raise ShardwiseError(f"ranks 0 and {rank} {_DIFFERENT_PARAMETERS}")
            if row[1] != first[1]:
                raise ShardwiseError(f"ranks 0 and {rank} {DIFFERENT_FORWARDS}")
            if row[4:] != first[4:]:
                raise ShardwiseError(self._different_writes(rank, first[4:], row[4:]))
            if row[2] != first[2]:
                raise ShardwiseError(f"ranks 0 and {rank} {DIFFERENT_FORWARDS}")
        self.agreed_order = order if order and all(row[3] == first[3] for row in rows) else None

    def agree_on_step(self, num_forwards: int, order: list[int]) -> None:
        """Before an optimizer step: every rank's header says it is at its step, or the step is refused on every
        rank before it runs (Note [uneven work]). Waited for here: the last header a rank that ran out of work
        sends may be its last."""
        self.announce(STEP, num_forwards, order, [])
        try:
            self.confirm()
        except ShardwiseError:
            if self.on_refusing is not None:
                self.on_refusing()  # zero3: a rank in a forward waits on a gather's tag (Note [gather tags])
            raise

    def refuse(self) -> None:
        """This rank is about to raise where the others may wait for its next header: send them one that
        says so (Note [gather tags]), paired with theirs whatever their phase."""
        if self.group is None:
            return
        self.pending = None
        sent = torch.full((4 + len(self.units),), REFUSED, dtype=torch.int64)
        received = torch.empty(self.world * sent.numel(), dtype=torch.int64)
        self.refusal = (start_all_gather_rows(received, sent, self.group), sent, received)

    def _different_writes(self, rank: int, mine: list[int], theirs: list[int]) -> str:
        unit = next(unit for unit, a, b in zip(self.units, mine, theirs) if a != b)
        at = self.units.index(unit)
        wrote, other = (0, rank) if mine[at] > theirs[at] else (rank, 0)
        return (f"ranks 0 and {rank} changed different parameters between forwards: the rows of unit {unit.label} "
                f"were written on rank {wrote} (an in-place write such as p.data.mul_(), load_state_dict or "
                f"sw.load, or an optimizer step) and not on rank {other}. Write parameters on every rank alike "
                "(load, and step the optimizer, on every rank); each rank holds only its rows, so a write on one "
                "rank never reaches the others' (Note [agreement rides the traffic]).")


def _uneven_work(rows: list[list[int]], stepped: list[int]) -> str:
    """Note [uneven work]: some ranks reached their optimizer step while others ran another forward or backward."""
    others = [rank for rank in range(len(rows)) if rank not in stepped]
    doing = {FORWARD_NO_GRAD: "a forward", FORWARD_WITH_GRAD: "a forward", BACKWARD: "a backward",
             BACKWARD_NO_SYNC: "a backward under no_sync"}
    where = ", ".join(f"rank {rank} was in {doing.get(rows[rank][2], 'another phase')} (its forward number "
                      f"{rows[rank][1]})" for rank in others)
    at = ", ".join(f"rank {rank} (after forward number {rows[rank][1]})" for rank in stepped)
    reached = "optimizer.step()" if rows[stepped[0]][2] == STEP else "the backward that reduces (the step's last)"
    return (f"uneven work: {at} reached {reached} while {where}. Every rank must run the same number of "
            "forwards and backwards (micro-batches) between optimizer steps, since each takes part in every "
            "collective: give every rank the same number of batches (a DistributedSampler or sw.ResumableSampler "
            "with drop_last=True, or pad the short rank's last step with a batch whose loss is multiplied by 0). "
            "shardwise has no join-style context for uneven inputs (Note [uneven work], agreement.py).")
