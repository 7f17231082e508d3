"""A step's window: its states and checked transitions (`Window`), and its autograd piece `GatherUnit`.
Uses: compat, flat_unit, phase, shard_param.

Note [unit window]: a window runs from the first forward after the shards were installed
to the end of the backward through it. The unit's first use in the window runs
`GatherUnit`, an autograd function whose outputs are the full parameter views; every
later use in the window — a block reused N times, a module shared by two branches, a
unit used again after others ran (A, B, A), a second forward before one backward
(`model(a) + model(b)`: siamese and contrastive losses) — uses those same tensors. So
autograd sums every use's gradient and runs `GatherUnit.backward` once per backward,
after the last use: that is where the unit's gradients are reduced, each contribution
exactly once. zero3 frees a unit whenever another unit opens and gathers it again at its next use, forward
or backward: one extra gather for each non-consecutive reuse, which is the price of
keeping one unit's full values (plus the prefetched one) at a time.

Note [window states]: a window is in one of four states, changed only by `Window.move`, which takes
these transitions and refuses any other:

    CLOSED   --a forward begins---------------------------------------> FORWARD
    CLOSED   --a backward through a graph kept from a closed window---> BACKWARD  (retain_graph=True)
    FORWARD  --the pass returns, a graph holds the window's views-----> OPEN
    FORWARD  --the pass returns with no graph (no_grad, all frozen)---> CLOSED
    OPEN     --another forward begins: it joins-----------------------> FORWARD
    OPEN     --the backward's first hook------------------------------> BACKWARD
    OPEN     --a forward finds a requires_grad changed----------------> CLOSED    (then FORWARD)
    BACKWARD --its end (`_finalize_backward`)-------------------------> CLOSED
    BACKWARD --a forward after it raised------------------------------> CLOSED    (then FORWARD)

A backward that starts inside the forward (FORWARD -> BACKWARD) is a ShardwiseError that names it; a
backward inside the window's own is refused by `enter_backward` (Note [one backward at a time]); any
other transition is an engine bug.

Only events the engine sees move it: a forward's first hook and its outermost return, a backward's first
hook and its end (`_finalize_backward`, queued on the graph task), a forward that finds a backward that
never ended (Note [aborted backward]), and a forward that finds a parameter's requires_grad changed since
the window's `GatherUnit` (its outputs would not carry that gradient: the window closes and a fresh one
opens). Not the death of a graph: torch says nothing when a user drops a loss, a weak reference's death
differs between ranks (one rank keeping a loss, the garbage collector's timing) and so did each rank's
choice to join or close, which paired different gathers (zero3: a rank died); and a loss kept alive across
steps (`loss` held by the loop variable, `losses.append(loss)`, an evaluation's output kept with grad on)
is harmless, since a backward closes the window it came from. So an OPEN window stays open, whether or
not a graph can still be backwarded, until the next backward ends: every forward meanwhile joins it, and
its backward runs each `GatherUnit` once with only the gradients that reach it (the views' values are
the rows' of the moment: zero1/zero2 re-gather written rows in place, zero3 gathers on use). A graph kept
from a closed window may be backwarded on its own later (`la.backward(); lb.backward()`, retain_graph);
backwarded together with a newer window's graph, one backward reaches two `GatherUnit`s of a unit and
would reduce it twice: refused, with the fix (tests/test_window.py).

Note [aborted backward]: a backward that raises midway never reaches `_finalize_backward`.
The next forward finds the window still BACKWARD, outside any backward (an event: whether the
raised graph is still alive does not matter, Note [window states]): it waits for the reduces
already issued, drops the step's gradients (the partial ones, and this step's accumulation: as
`zero_grad()` would before redoing the step; until then `model.parameters()` still shows the
window's full views) and starts the reduce order afresh, the same on every rank.

Note [one backward at a time]: a window's backward is one autograd graph task; its end
(`_finalize_backward`, queued on that task) reduces what is left and closes the window. A
backward run *inside* it — a reentrant activation checkpoint (`torch.utils.checkpoint(...,
use_reentrant=True)`, torch's default when the flag is not given) recomputes under a nested
`torch.autograd.backward` — would hand the unit's gradients to a graph the window does not
see and lose them (measured: parameters 0.43 off one process after one step). Every unit hook
in backward checks that it runs in the window's graph task and raises otherwise, on every rank
(they all run the same checkpoint), naming the fix: `use_reentrant=False`.

Note [gradients of inputs]: a gradient penalty (WGAN-GP, R1) takes
`torch.autograd.grad(score, inputs, create_graph=True)` through the model, then backwards a loss
that holds that gradient. The first call reaches the units' pre-backward hooks but is not the
step's backward: it must not open the reduce (which would close the window with zero gradients),
and zero3 must gather each unit it passes and keep it (pinned) until the window closes, since the
gradient's own graph reads the full values again in the real backward.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.autograd.graph import get_gradient_edge

from shardwise.engine.compat import Reach, graph_task_id, in_reentrant_backward, plain_tensors, reach
from shardwise.engine.phase import Clock, Phase
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.engine.unit.shard_param import run_grad_hooks
from shardwise.errors import ShardwiseError


class GatherUnit(torch.autograd.Function):
    """Forward: hand out the unit's full views. Backward: give the full grads to the engine."""

    @staticmethod
    def forward(ctx, engine, unit, *trainable_shards):
        ctx.engine, ctx.unit, ctx.num_shards = engine, unit, len(trainable_shards)
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None, not zeros
        # Fresh view objects every window: autograd attaches this window's graph to them,
        # and a view reused from an earlier window would carry that window's history.
        outputs = tuple(view.view(view.shape) for view in unit.full_views)
        with plain_tensors():  # Note [engine reads] (shard_param.py)
            frozen = [out for out, shard in zip(outputs, unit.shard_params) if not shard.requires_grad]
        ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.num_shards and reach(ctx.next_functions[0][0]) is Reach.CAPTURES:
            raise ShardwiseError(
                "torch.autograd.grad over a sharded model's parameters: each rank holds only rows of them, and "
                "their gradients exist whole only inside shardwise's reduce. Call loss.backward() and read "
                "p.grad (this rank's rows of the averaged gradient), or p.register_hook(fn) to see each "
                "parameter's whole gradient; for MAML-style inner steps use strategy='ddp'. A gradient "
                "penalty with respect to the inputs (autograd.grad(out, inputs)) works as it is."
            )
        grads = [grad if grad is None else run_grad_hooks(shard, grad)  # Note [parameter hooks]
                 for grad, shard in zip(grads, ctx.unit.shard_params)]
        ctx.engine.post_backward(ctx.unit, grads)
        return (None, None) + (None,) * ctx.num_shards


class WindowState(enum.Enum):
    """Where a step's window is (Note [window states])."""

    CLOSED = "closed"  # between steps: the shards are installed, no window's views in use
    FORWARD = "forward"  # a forward pass runs (its outermost hooked module has not returned)
    OPEN = "open"  # forwards returned; their graphs may be backwarded, the next forward joins
    BACKWARD = "backward"  # the window's backward runs: _finalize_backward is queued on its graph task


_TRANSITIONS = {
    WindowState.CLOSED: {WindowState.FORWARD, WindowState.BACKWARD},  # backward: a graph kept from a closed window
    WindowState.FORWARD: {WindowState.OPEN, WindowState.CLOSED},  # closed: the pass made no graph (no_grad)
    WindowState.OPEN: {WindowState.FORWARD, WindowState.BACKWARD, WindowState.CLOSED},  # closed: requires_grad changed
    WindowState.BACKWARD: {WindowState.CLOSED},  # its end, or a forward after it raised (Note [aborted backward])
}
_PHASES = {WindowState.CLOSED: Phase.BETWEEN_STEPS, WindowState.FORWARD: Phase.FORWARD,
           WindowState.BACKWARD: Phase.BACKWARD}  # OPEN leaves the clock in forward, where it was

# The transitions a user can ask for that no window takes, in the words of what they did.
_REFUSED = {
    (WindowState.FORWARD, WindowState.BACKWARD): (
        "a backward through the sharded model ran while its forward was still running (loss.backward() or "
        "torch.autograd.backward called inside a module's forward or a forward hook): the forward's units are "
        "still in use and its gradients would be reduced before the forward ends. Call backward after the "
        "model's forward returns."),
}


@dataclass
class Window:
    """A step's window (Note [unit window]): its state, changed only by `move` (Note [window states]), and
    what the engine tracks while it is not CLOSED; `move(CLOSED)` forgets all of it."""

    clock: Clock
    state: WindowState = WindowState.CLOSED
    fulls: dict[int, tuple] = field(default_factory=dict)  # GatherUnit's outputs, by unit, for this window
    trainable: dict[int, tuple] = field(default_factory=dict)  # the trainable indices each GatherUnit carries
    order: list[int] = field(default_factory=list)  # units in the order this forward pass first used them
    open_units: list[FlatUnit] = field(default_factory=list)  # units whose forward is running
    reduced: set[int] = field(default_factory=set)  # units whose GatherUnit.backward ran in this backward
    graph_task: int = -1  # the autograd graph task running this window's backward
    outer_call: object = None  # the module whose call opened this pass, when not the root (Note [outer calls])

    def move(self, to: WindowState) -> None:
        """The one place the window's state changes (Note [window states])."""
        if to not in _TRANSITIONS[self.state]:
            refused = _REFUSED.get((self.state, to))
            if refused is not None:
                raise ShardwiseError(refused)
            raise RuntimeError(f"shardwise engine bug: the window cannot go from {self.state.value} to {to.value}")
        self.state = to
        if to is WindowState.CLOSED:
            self.fulls, self.trainable, self.order, self.open_units, self.reduced = {}, {}, [], [], set()
            self.graph_task, self.outer_call = -1, None
        if to in _PHASES:
            self.clock.enter(_PHASES[to])

    def open_or_join(self, units: list[FlatUnit]) -> None:
        """A forward begins (outside any backward): close what cannot be joined, then enter FORWARD."""
        if self.state is WindowState.OPEN and any(tuple(unit.trainable()) != self.trainable[id(unit)]
                                                  for unit in units if id(unit) in self.trainable):
            self.move(WindowState.CLOSED)  # a GatherUnit made before the change would not carry its gradient
        self.move(WindowState.FORWARD)
        self.order = []

    def gather_unit(self, engine, unit: FlatUnit, trainable: list[int]) -> tuple:
        """The window's full views of `unit` for a use with grad: its GatherUnit's outputs, made at the first."""
        if id(unit) not in self.fulls:
            self.fulls[id(unit)] = GatherUnit.apply(engine, unit, *[unit.shard_params[i] for i in trainable])
            self.trainable[id(unit)] = tuple(trainable)
        return self.fulls[id(unit)]

    def enter_backward(self) -> bool:
        """A unit's backward hook ran in the step's backward: True when it is the backward's first (the
        window moves to BACKWARD on this graph task); raises inside a backward nested in the window's."""
        if self.state is WindowState.BACKWARD:
            refuse_nested_backward(self)
            return False
        self.move(WindowState.BACKWARD)
        self.graph_task = graph_task_id()
        return True

    def reduce_once(self, unit: FlatUnit) -> None:
        """`unit`'s GatherUnit.backward ran: refuse a second one in the same backward (two windows' graphs)."""
        if id(unit) in self.reduced:
            raise ShardwiseError(
                f"one backward reached two forward windows' graphs of the sharded unit {unit.label}: a loss kept "
                "from before an earlier backward (backwarded with retain_graph=True, or added into a running "
                "total) was backwarded together with a newer one, and shardwise would reduce that unit's "
                "gradients twice. Backward the kept loss on its own (kept.backward()), or sum the losses before "
                "the first backward and call it once; for logging keep loss.detach() or loss.item() "
                "(Note [window states]).")
        self.reduced.add(id(unit))


def in_backward() -> bool:
    """Inside autograd's backward: a unit's forward hooks then come from a recompute."""
    return graph_task_id() != -1


def refuse_nested_backward(window: Window, recompute: bool = False) -> None:
    """Note [one backward at a time]: raise inside a backward nested in the window's own, or, for
    a `recompute`, inside a reentrant checkpoint's (which runs in the window's task, just before
    its own backward; only then is the call stack walked: backward hooks run per unit per step)."""
    nested = recompute and in_reentrant_backward()
    if nested or window.state is WindowState.BACKWARD and graph_task_id() != window.graph_task:
        raise ShardwiseError(
            "a backward ran inside the model's backward (a reentrant activation checkpoint: "
            "torch.utils.checkpoint(..., use_reentrant=True), torch's default when the flag is not given); "
            "shardwise would not see the gradients it computes. Pass use_reentrant=False to "
            "torch.utils.checkpoint (Hugging Face: activation_checkpointing_enable("
            "activation_checkpointing_kwargs={'use_reentrant': False})), or use sw.shard(..., "
            "checkpoint_activations=True) (Note [one backward at a time])."
        )


def in_grad_call(unit: FlatUnit) -> bool:
    """Note [gradients of inputs]: whether the autograd task reaching `unit` leaves its parameters
    alone (`autograd.grad(out, inputs)`), so it is not the step's backward."""
    shard = next((s for s in unit.shard_params if s.requires_grad), None)
    return shard is not None and reach(get_gradient_edge(shard).node) is Reach.SKIPS
