"""The forward/backward window as a state machine (Note [window states], engine/schedule/window.py): losses
kept alive across steps, graphs kept from closed windows, requires_grad changed while a window is open, and
each transition the window refuses. Every pattern against one process, or refused on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.engine.phase import Clock
from shardwise.engine.schedule.window import _TRANSITIONS, Window, WindowState
from test_engine_patterns import Block, Midway, Net


def _kept(model, optim, x, case: str) -> None:
    """The loop of one user who keeps a loss (or an evaluation's output) alive past the step it belongs to."""
    if case == "the_loop_variable_and_a_list":  # `loss` alive at the next forward; every graph in `losses`
        losses = []
        for step in range(3):
            loss = model(x * (step + 1))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss)
    elif case == "an_evaluation_kept_with_grad":  # no backward for it: its window is joined by the next step
        for step in range(3):
            evaluation = model(x - step)  # noqa: F841 (kept alive on purpose)
            model(x * (step + 1)).backward()
            optim.step()
            optim.zero_grad()
    elif case == "kept_on_one_rank_only":  # a weak reference dies on one rank only: each rank chose differently
        for step in range(2):
            evaluation = model(x + step)
            kept = evaluation if not dist.is_initialized() or dist.get_rank() == 0 else None  # noqa: F841
            del evaluation
            model(x).backward()
            optim.step()
            optim.zero_grad()
    elif case == "a_backward_that_raised_and_its_loss_kept":  # Note [aborted backward], without `del loss`
        try:
            loss = model(x, boom=True)
            loss.backward()
        except RuntimeError:
            pass
        optim.zero_grad(set_to_none=True)  # the engine drops the aborted step's gradients: the same here
        model(x).backward()
        optim.step()
    elif case == "requires_grad_changed_while_a_loss_is_kept":  # the window's GatherUnit would not carry it
        kept = model(x)  # noqa: F841
        for param in optim.param_groups[0]["params"]:  # the shards (model.parameters() are the window's views)
            param.requires_grad_(True)
        model(x * 2).backward()
        optim.step()
    elif case == "two_windows_in_one_backward":
        first = model(x)
        first.backward(retain_graph=True)
        (first + model(x * 2)).backward()
        optim.step()
    elif case == "a_backward_inside_the_forward":
        model.h[0].register_forward_hook(lambda module, args, out: out.sum().backward(retain_graph=True))
        model(x).backward()
        optim.step()
    else:
        raise KeyError(case)


def _after(case: str, strategy: str | None):
    torch.manual_seed(0)
    model = Midway() if "raised" in case else Net()
    if case.startswith("requires_grad"):
        model.h[0].a.weight.requires_grad_(False)
    if strategy:
        sw.shard(model, strategy=strategy, units=Block)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    try:
        _kept(model, optim, x, case)
    except sw.ShardwiseError as error:
        return str(error)
    return sw.full_parameters(model) if strategy else {n: p.detach().clone() for n, p in model.named_parameters()}


EXACT = ["the_loop_variable_and_a_list", "an_evaluation_kept_with_grad", "kept_on_one_rank_only",
         "a_backward_that_raised_and_its_loss_kept", "requires_grad_changed_while_a_loss_is_kept"]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("case", EXACT)
def test_a_loss_kept_alive_past_its_step_is_exact(ranks, case, strategy):
    """Catches a window closed by the death of a weak reference: a loss kept on one rank only made that rank
    join the window and the other close it (zero3: different gathers, a rank died); a backward that raised with
    its loss still alive left the window mid-backward (the next backward refused as a reentrant checkpoint); a
    parameter unfrozen while an earlier forward's loss lived got no gradient (the window's GatherUnit was made
    without it: 0.1 off one process after a step)."""
    reference = _after(case, None)
    for got in ranks.run(_after, 2, case, strategy, timeout=90):
        assert not isinstance(got, str), got
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{case} {strategy} {key}")


@pytest.mark.parametrize(("case", "words"), [("two_windows_in_one_backward", "two forward windows"),
                                             ("a_backward_inside_the_forward", "inside a module's forward")])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_what_no_window_can_hold_is_refused_on_every_rank(ranks, case, words, strategy):
    """Catches a graph kept from a closed window (retain_graph=True) backwarded together with a newer one:
    each unit reduced twice, every parameter wrong without a word; and a backward run from inside the
    model's forward, whose reduce began before that forward ended."""
    for message in ranks.run(_after, 2, case, strategy, timeout=90):
        assert isinstance(message, str) and words in message, message


def test_the_window_takes_only_its_transitions():
    """Catches a transition the table does not hold going through unchecked (a skipped state read as
    another), and a refused one that raises without naming what the user did."""
    for start in WindowState:
        for to in WindowState:
            window = Window(Clock())
            window.state = start
            if to in _TRANSITIONS[start]:
                window.move(to)
                assert window.state is to
            elif (start, to) == (WindowState.FORWARD, WindowState.BACKWARD):
                with pytest.raises(sw.ShardwiseError, match="inside a module's forward"):
                    window.move(to)
            else:
                with pytest.raises(RuntimeError, match="engine bug"):
                    window.move(to)


def test_closing_forgets_the_window():
    """Catches a closed window that keeps the last one's views, order or backward task (a later forward would
    join a window that no longer exists)."""
    window = Window(Clock())
    window.move(WindowState.FORWARD)
    window.fulls[1], window.trainable[1], window.order = (torch.ones(1),), (0,), [1]
    window.move(WindowState.OPEN)
    window.move(WindowState.BACKWARD)
    window.graph_task, window.reduced = 7, {1}
    window.move(WindowState.CLOSED)
    assert (window.fulls, window.trainable, window.order, window.reduced, window.graph_task) == ({}, {}, [], set(), -1)
