"""Which optimizers may step rows, and the whole-tensor step for every other one.
Uses: compat, lowbit, offload, owner_traffic, small.

Note [whole-tensor step]: after `shard()` each parameter holds this rank's rows, which is exact
for an optimizer whose update of an element reads only that element (SGD, Adam, AdamW, Adagrad,
...). Many read a parameter as a whole tensor: Muon (Newton-Schulz on the matrix), Adafactor
(row and column statistics), LAMB/LARS (whole-tensor norms), Shampoo/SOAP (per-matrix
preconditioners). Run on rows they train a different model without a word. The policy:

- `ROWS`: the classes listed in `_ELEMENTWISE`, exactly (a subclass may override `step`), step
  their rows as before: the fast path, optimizer state and work split by rows.
- `REFUSE`: optimizers that couple tensors (LBFGS's dot products over every parameter, with a
  closure re-running forward) are refused at their first step, on every rank, with the fix.
- `WHOLE`: every other class, including one shardwise has never seen (a user's LAMB), is taken
  to be per-tensor and is stepped on whole tensors. Each sharded parameter gets one owner rank
  (balanced by the step's cost, Note [owner cost], the same on every rank, as
  ZeroRedundancyOptimizer partitions whole parameters); before the step the parameter's rows and
  gradient rows are gathered to the owner (Note [owner traffic]), which swaps the whole values into
  the Parameter object the optimizer holds; the others hide its gradient so the optimizer skips
  it. After the step the owner scatters the updated rows back. A parameter keeps its owner (Note [kept owners]).
  Optimizer state is thus split by parameter, full shaped on its owner (what such optimizers
  need), and the result is one process's.

The alternative shape, `Shard(0)` DTensor parameters between steps (FSDP2), was measured on the
bench GPT (e4a0bc2:bench/results/whole_tensor.md, 3 interleaved rounds, a loaded machine): it makes
`p.norm()` global by construction, but Muon there ends 3.7e-4 from one process after 3 steps
(its Newton-Schulz runs in bf16 and distributed matmuls round differently), `torch.optim.Adafactor`
raises (`aten.pow_`: in-place op needing a placement change), and its Muon step took 23.7x an
AdamW row step at ws 2 (60.9x at ws 4), every rank doing the whole work. The owner step is bitwise
for Muon and Adafactor at ws 2 and 4. With the standard recipe (Muon on the blocks' matrices) on a host
whose bf16 matmul was slow (compute-bound), its step took 0.51x one process's at ws 2 and the busiest
rank's CPU 0.31x at ws 4 (0d8f929:bench/results/whole_tensor_prev_host.md); where bf16 matmul is fast the step
is bound by the owner traffic on loopback (bench/whole_tensor/results/whole_tensor.md, owner_bound.md: 1.18x,
bound 0.81x). With one owner per matrix the largest matrix's share of the work is the floor
(bench/whole_tensor/owner_cost.py).

Note [owner traffic]: only the owner needs a parameter whole, so its rows and gradient rows are
gathered to the owner alone (`dist.gather`) and the updated rows scattered back (`dist.scatter`),
each rank receiving its own rows only. A rank then receives, per step, 2·|owned|·(N−1)/N elements
of the parameters it owns plus |P|/N of its rows, where the all-gathers and broadcast made every
rank receive 3·|P|·(N−1)/N: the whole model three times. Under zero1/zero2 at the master dtype the
owner already holds the whole parameter (the unit's kept full values, current unless rows were written
since their gather): it copies it and gathers only the gradient, 2·|owned|·(N−1)/N becoming
|owned|·(N−1)/N. The gradient stays reduce-scattered in backward (overlapped with it), then gathered
to its owner. Counted (shardwise.testing.count_received, owners balanced), a reduce straight to the
owner would receive less per rank: |G|/2 instead of 3|G|/4 at N = 2, 3|G|/4 instead of 15|G|/16 at
N = 4 (|G|: the whole-stepped gradients). It is not done: non-owners would hold no gradient rows
between backward and step (sw.clip_grad_norm_, the fp16 scaler's inf check and a user's reads use
them), backward learns which optimizer steps a parameter whole only at its first step, and a reduce
sums in another order than the reduce-scatter at N > 2 (no longer bitwise with the row path).
There the owner also sends its update back whole into every rank's kept full values, so the next
forward need not re-gather it (Note [owner broadcast]: 1 + f/(2N) of AdamW zero2's bytes, not 1 + f/N).
The collectives go by owner, batched and overlapped, their buffers bounded: Note [owner batches], Note [owner
memory] in owner_traffic.py.

Note [whole step per unit]: under sw.optimizer_in_backward each unit's step is the optimizer's own step over
that unit's shards (step_in_backward.py), so for a WHOLE optimizer it is a WholeStep over those parameters:
gathered to their owners, stepped whole, scattered back, inside backward, one unit at a time. The update is the
one after backward (each parameter's reads only itself, its gradient and state), and what lives at once is one
unit's owned whole values and gradients, not the model's. Owners are kept (Note [kept owners]) over every
unit's step, so a checkpoint finds each state where the steps put it, and balanced over every parameter
owned so far, not unit by unit.

Note [no gradient, no traffic]: a parameter with no gradient on any rank is left out of a WholeStep: torch's
optimizers (and torchao's) skip it, so gathering and scattering it would move its values for nothing. The
user's step after an optimizer-in-backward backward (every gradient already stepped and dropped) then moves
no tensor at all, where it gathered every owned parameter whole: 1/N of the model more at its peak.

Note [raising step]: an owner's step can raise on one rank only (its out-of-memory, a check in the
user's optimizer). Its peers would then wait in the broadcast of the next parameter forever. So
before broadcasting every rank reaches one agreement (an all-reduce of a flag per rank): the
raising rank reaches it from the step's error hook (compat.on_step_error), the others from the
post-step hook. If any rank failed, every rank puts its parameters back to their rows from
before the step, drops the whole tensors, and raises a ShardwiseError naming the failed rank and
the parameters it owns. A gradient present on some ranks only is refused before anything moves.
"""

from __future__ import annotations

import enum
import math

import torch
from torch import Tensor

from shardwise.engine.comm.owner_traffic import (
    Piece,
    broadcast_from_owners,
    broadcasts_whole,
    can_copy_whole,
    full_view,
    gather_to_owners,
    kept_whole,
    scatter_from_owners,
)
from shardwise.engine.comm.small import all_reduce_max
from shardwise.engine.compat import set_data, set_grad
from shardwise.engine.memory.offload import offloaded_params
from shardwise.engine.optim.lowbit import quantizes_state
from shardwise.errors import ShardwiseError

_set_data, _set_grad = set_data, set_grad  # compat.py; they keep the Parameter object an optimizer holds


class StepShape(enum.Enum):
    """How an optimizer's step must see a sharded parameter (Note [whole-tensor step])."""

    ROWS = "rows"
    WHOLE = "whole"
    REFUSE = "refuse"


_ELEMENTWISE = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
                torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD,
                torch.optim.Rprop}
_COUPLED = {torch.optim.LBFGS: "its line search takes dot products over every parameter at once and re-runs "
                               "the forward through a closure"}


def unwrapped(optimizer):
    """The torch optimizer inside Accelerate's (`.optimizer`) or Lightning's (`._optimizer`) wrapper,
    whose own step just calls it (the step hooks see the inner one)."""
    for attribute in ("optimizer", "_optimizer"):
        inner = getattr(optimizer, attribute, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
            return unwrapped(inner)
    return optimizer


def step_shape(optimizer) -> StepShape:
    """ROWS for the elementwise classes shardwise knows, REFUSE for coupled ones, WHOLE otherwise."""
    kind = type(unwrapped(optimizer))
    if kind in _ELEMENTWISE:
        return StepShape.ROWS
    if kind in _COUPLED or any(base in _COUPLED for base in kind.__mro__):
        return StepShape.REFUSE
    return StepShape.WHOLE


def sharded_params(optimizer) -> list:
    """The optimizer's parameters that hold rows of a tensor sharded over more than one rank."""
    return [param for group in optimizer.param_groups for param in group["params"]
            if getattr(param, "_sw_unit", None) is not None and param._sw_unit.mesh.shard_world > 1]


def refuse_coupled(optimizer) -> None:
    kind = type(unwrapped(optimizer))
    reason = next(why for base, why in _COUPLED.items() if base in kind.__mro__)
    raise ShardwiseError(
        f"{kind.__name__} cannot step a sharded model: {reason}, and each rank holds only some rows. "
        "Use a per-tensor optimizer (AdamW, Muon, Adafactor, ...: Note [whole-tensor step]), or train "
        "with strategy='ddp', where every rank holds whole parameters."
    )


def refuse_compressed(optimizer, sharded: list) -> None:
    """An optimizer stepped on whole tensors reads each parameter exactly as one process holds it (Note
    [whole-tensor step]): quantized gathers and gradients (Note [quantized collectives]) would feed its
    matrix-wide statistics values no rank holds. Refused at its first step, on every rank."""
    used = next((param._sw_unit.comm.compression for param in sharded if param._sw_unit.comm.compression is not None),
                None)
    if used is None:
        return
    kind = type(unwrapped(optimizer))
    raise ShardwiseError(
        f"{kind.__name__} steps whole tensors exactly (Note [whole-tensor step]) and this model was sharded with "
        f"compression ({used.label}), whose quantized parameters and gradients it would read as exact. Drop "
        "compression= from sw.shard(), or use an elementwise optimizer (AdamW, Adam, SGD, ...) with it."
    )


def refuse_disk_offload(optimizer) -> None:
    """Note [what a chunk can step] (offload.py): offload='disk:...' steps rows chunk by chunk, so an optimizer
    stepped on whole tensors over ranks, or keeping quantized state, is refused before its first step moves
    anything, on every rank (the same class and option everywhere)."""
    offloaded = offloaded_params(unwrapped(optimizer))
    if not offloaded:
        return
    inner, kind = unwrapped(optimizer), type(unwrapped(optimizer)).__name__
    if quantizes_state(inner):
        why = (f"{kind} keeps its state block-quantized (tensor subclasses of codes and scales, Note [low-bit "
               "state]), which the disk offload's mapped files cannot hold")
        saved = " (its state already takes about a quarter of AdamW's or less)"
    elif step_shape(inner) is StepShape.WHOLE and any(p._sw_unit.mesh.shard_world > 1 for p in offloaded):
        why = f"{kind} steps whole tensors (Note [whole-tensor step]), and the disk offload's step runs on rows"
        saved = ""
    else:
        return
    raise ShardwiseError(
        f"{why}: it cannot step a model sharded with offload='disk:...' (Note [what a chunk can step], offload.py). "
        f"Drop offload= to step it whole on owner ranks{saved}, or use torch.optim.AdamW (or another elementwise "
        "optimizer) with offload='disk:...'. Nothing was stepped.")


def step_cost(kind: type, shape) -> int:
    """Note [owner cost]: what stepping one whole tensor of `shape` costs an owner, in the optimizer's
    own terms: Newton-Schulz for a Muon (any class named so: torch's, Keller Jordan's, Dion's)
    multiplies m x n matrices, ∝ m·n·min(m, n); anything else, its elements. Owners are balanced
    by it, as Keller Jordan's and Dion's distributed Muon balance by size."""
    numel = math.prod(shape)
    if len(shape) >= 2 and any(base.__name__ == "Muon" for base in kind.__mro__):
        rows, cols = shape[0], numel // max(1, shape[0])
        return rows * cols * min(rows, cols)
    return numel


def _owners(params: list, world_size: int, known: dict[int, int], load: list[int], kind: type = object) -> list[int]:
    """Each parameter's owner rank: the one it already has (`known`), else the least loaded so far by
    `step_cost` (identical on every rank). `load`: each rank's cost of every parameter it owns already,
    in this step or not (Note [kept owners]), updated with the new owners."""
    owners = []
    for param in params:
        owner = known.get(id(param))
        if owner is None:
            owner = min(range(world_size), key=lambda r: (load[r], r))
            load[owner] += step_cost(kind, param._sw_layout.shape)
        owners.append(owner)
    return owners


def owner_map(optimizer) -> dict[int, int]:
    """id(param) -> its owner rank (in its unit's group) for every parameter a WHOLE optimizer steps
    on an owner (Note [whole-tensor step]); empty for any other optimizer. What `WholeStep` uses, so a
    checkpoint load puts each whole state where the next step looks for it.

    Note [kept owners]: a parameter keeps its owner for the optimizer's life, kept on the optimizer
    (`_sw_owners`), since its state lives there: param groups reordered or added after the first step
    (a group for a new head) would otherwise move an owner and orphan the state. New parameters go
    to the least loaded rank, by every parameter the rank owns (`_sw_owner_load`), not only those of
    this step: each unit's step under sw.optimizer_in_backward sees its own parameters, and balanced
    unit by unit, every block's largest matrix went to rank 0 (at 4 ranks, 4:4:3:1 of a GPT block's
    state). The same on every rank, as every rank sees the same groups."""
    inner = unwrapped(optimizer)
    if step_shape(inner) is not StepShape.WHOLE:
        return {}
    params = sharded_params(inner)
    world_size = params[0]._sw_unit.mesh.shard_world if params else 1
    known = getattr(inner, "_sw_owners", {})
    load = inner.__dict__.setdefault("_sw_owner_load", [0] * world_size)
    owners = dict(zip(map(id, params), _owners(params, world_size, known, load, type(inner))))
    # Merged, not replaced: a step over some groups' parameters only (each unit's step under
    # sw.optimizer_in_backward, Note [whole step per unit]) keeps every other parameter's owner.
    inner._sw_owners = {**known, **owners}
    return owners


def adopt_owners(optimizer, recorded: dict[int, int]) -> None:
    """Note [recorded owners] (checkpoint/format/optim_state.py): an optimizer that has no owners yet (never
    stepped, never loaded) takes a checkpoint's owner map made at its shard group's size (`recorded`: id(param)
    -> rank), so the loaded run keeps the saved run's owners, however that run assigned them (param groups in
    another order, each unit's step under sw.optimizer_in_backward). One that has owners keeps them."""
    inner = unwrapped(optimizer)
    if getattr(inner, "_sw_owners", None) or step_shape(inner) is not StepShape.WHOLE:
        return
    params = {id(param): param for param in sharded_params(inner)}
    if not params:
        return
    world_size = next(iter(params.values()))._sw_unit.mesh.shard_world
    owners = {key: owner for key, owner in recorded.items() if key in params and 0 <= owner < world_size}
    load = [0] * world_size
    for key, owner in owners.items():
        load[owner] += step_cost(type(inner), params[key]._sw_layout.shape)
    inner._sw_owners, inner._sw_owner_load = owners, load


def owners_layout(optimizer):
    """The layout whose shard ranks `owner_map(optimizer)` names (the sharded parameters' shard group: one
    engine's), for checkpoints that record and place whole state; None when the optimizer holds no sharded
    parameter. What they ask instead of reading a parameter's unit."""
    params = sharded_params(unwrapped(optimizer))
    return params[0]._sw_unit.mesh if params else None


def _name(param) -> str:
    return param._sw_layout.owned.name


class WholeStep:
    """One step of a WHOLE optimizer: `begin` before the optimizer's own step, `end` after, or
    `abort` on the rank whose step raised (Note [raising step])."""

    def __init__(self, optimizer):
        self.kind = type(unwrapped(optimizer)).__name__
        self.params = sharded_params(optimizer)
        owners = owner_map(optimizer)
        self.owners = [owners[id(param)] for param in self.params]
        self.mesh = self.params[0]._sw_unit.mesh if self.params else None
        self.group = self.params[0]._sw_unit.mesh.shard_group if self.params else None
        self.world_size = self.params[0]._sw_unit.mesh.shard_world if self.params else 1
        self.rank = self.params[0]._sw_unit.mesh.shard_rank if self.params else 0
        self.saved: list[tuple[Tensor, Tensor | None]] = []  # each param's own rows and gradient rows

    def begin(self) -> None:
        copied = [can_copy_whole(param) for param in self.params]  # owner_traffic.py
        stepped = self._agree_on_grads(copied)
        # Note [no gradient, no traffic]: a parameter without a gradient on every rank is skipped by the
        # optimizer (torch's contract, torchao's too), so it is neither gathered nor scattered.
        self.params, self.owners, copied = (
            [item for item, has in zip(items, stepped) if has] for items in (self.params, self.owners, copied))
        pieces = [Piece(("data", i), param, owner, param.detach())
                  for i, (param, owner, copy) in enumerate(zip(self.params, self.owners, copied)) if not copy]
        pieces += [Piece(("grad", i), param, owner, param.grad)
                   for i, (param, owner) in enumerate(zip(self.params, self.owners)) if param.grad is not None]
        wholes = gather_to_owners(pieces, self.mesh) if pieces else {}  # Note [owner batches]
        for i, (param, owner) in enumerate(zip(self.params, self.owners)):
            self.saved.append((param.detach(), param.grad))
            if self.rank == owner:
                _set_data(param, kept_whole(param) if copied[i] else wholes["data", i])
                _set_grad(param, wholes.get(("grad", i)))  # plain: the whole gradient is no RowsGrad
            else:
                param.grad = None  # this rank does not step it: the optimizer skips a parameter without one

    def _agree_on_grads(self, copied: list[bool]) -> list[bool]:
        """Refuse, on every rank and before anything moves, a gradient some ranks have and others not
        (set to None on one rank only), and kept full values current on some ranks only (rows written on
        one rank since the last forward): the gathers would pair with other collectives. Else, which
        parameters have a gradient (on every rank alike)."""
        has = torch.tensor([float(p.grad is not None) for p in self.params] + list(map(float, copied)))
        both = torch.cat([has, -has])
        all_reduce_max(both, self.group, f"{self.kind}.step()'s agreement on gradients")
        anywhere, everywhere = both[: len(has)].tolist(), (-both[len(has):]).tolist()
        count = len(self.params)
        written = [_name(p) for p, a, e in zip(self.params, anywhere[count:], everywhere[count:]) if a != e]
        if written:
            raise ShardwiseError(
                f"{self.kind}.step(): the rows of {written[:4]}{'...' if len(written) > 4 else ''} were written on "
                "some ranks and not on others since the last forward (an in-place write such as p.data.mul_() or "
                "load_state_dict on one rank only). Write parameters on every rank alike: each rank holds only its "
                "rows, so a write on one rank never reaches the others'. Nothing was stepped.")
        differ = [_name(p) for p, a, e in zip(self.params, anywhere[:count], everywhere[:count]) if a != e]
        if differ:
            raise ShardwiseError(
                f"{self.kind}.step(): the gradient of {differ[:4]}{'...' if len(differ) > 4 else ''} is None on some "
                "ranks and not on others (set to None on one rank only?). Every rank must hold the same gradients "
                "at a step: zero or skip them on every rank. Nothing was stepped.")
        return [bool(flag) for flag in anywhere[:count]]

    def _agree(self, failed: bool) -> list[int]:
        """The ranks whose step raised (Note [raising step]): one all-reduce, every rank reaches it."""
        flags = torch.zeros(self.world_size, dtype=torch.float32)
        flags[self.rank] = float(failed)
        all_reduce_max(flags, self.group, f"{self.kind}.step()'s agreement on failures")
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def end(self) -> None:
        failed = self._agree(False)
        if failed:
            self._restore()
            raise self._error(failed, None)
        with torch.no_grad():
            wholes, as_rows, as_wholes = {}, [], []
            for i, (param, owner, (rows, grad)) in enumerate(zip(self.params, self.owners, self.saved)):
                if self.rank == owner:
                    wholes[i] = param.detach()
                param.grad = None  # the whole gradient goes first: a grad must match the data's shape
                _set_data(param, rows)
                param.grad = grad
                if broadcasts_whole(param):  # the same on every rank (Note [owner broadcast])
                    as_wholes.append(Piece(i, param, owner, full_view(param)))
                else:
                    as_rows.append(Piece(i, param, owner, rows))
            if as_wholes:
                broadcast_from_owners(as_wholes, wholes, self.mesh)
                for piece in as_wholes:  # current on every rank: the next forward does not re-gather them
                    piece.param._sw_unit.mark_fresh(piece.param._sw_layout)
            if as_rows:
                scatter_from_owners(as_rows, wholes, self.mesh)  # Note [owner batches]
        self.saved = []

    def abort(self, error: BaseException) -> ShardwiseError:
        """This rank's step raised `error`: tell every rank, put back the rows; the error to raise."""
        failed = self._agree(True)
        self._restore()
        return self._error(failed, error)

    def _restore(self) -> None:
        """Every parameter back to its rows and gradient rows from before the step (Note [raising step])."""
        for param, (rows, grad) in zip(self.params, self.saved):
            param.grad = None
            _set_data(param, rows)
            param.grad = grad
        self.saved = []

    def _error(self, failed: list[int], error: BaseException | None) -> ShardwiseError:
        owned = {rank: [_name(p) for p, o in zip(self.params, self.owners) if o == rank] for rank in failed}
        where = "; ".join(f"rank {rank}, owner of {names[:4]}{'...' if len(names) > 4 else ''}"
                          for rank, names in owned.items())
        why = f" ({type(error).__name__}: {error})" if error is not None else ""
        return ShardwiseError(
            f"{self.kind}.step() raised on {where}{why}. Every rank stopped this step: the parameters hold "
            "their rows from before it, but the optimizer state of parameters stepped before the error may "
            "have moved on. Fix the cause and step again, or sw.load the last checkpoint to resume exactly.")
