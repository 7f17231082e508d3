"""Forward/backward patterns found by a second reading of the engine: each against one process
(same input on every rank, so the averaged gradients equal the single process's; one SGD step
turns gradients into parameters that `sw.full_parameters` compares)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint as cp
from torch import nn

import shardwise as sw
import shardwise.engine.comm.collectives as coll
from helpers.forms import coll_threshold
from shardwise.engine import engine_of


class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x)


class NoGradFirst(nn.Module):
    """A unit's first use under no_grad, then a use with grad in the same forward."""

    def __init__(self):
        super().__init__()
        self.e1, self.e2, self.head = Enc(), Enc(), nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            target = self.e1(x + 1)
        return (self.head(self.e2(self.e1(x))) - target.sum()).pow(2).sum()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b=True):
        y = self.a(x)
        return self.b(y) if use_b else y


class Net(nn.Module):
    """A root LayerNorm before checkpointable blocks (what HF's gradient checkpointing does)."""

    def __init__(self, outer_checkpoint=False):
        super().__init__()
        self.pre, self.h, self.outer = nn.LayerNorm(4), nn.ModuleList([Block(), Block()]), outer_checkpoint

    def forward(self, x, use_b=True):
        x = self.pre(x)
        for block in self.h:
            x = cp.checkpoint(block, x, use_b, use_reentrant=False) if self.outer else block(x, use_b)
        return x.pow(2).sum()


class Embedded(nn.Module):
    """An embedding in the root unit before two blocks: what T5's encoder and HF's
    `get_input_embeddings()` expose to calls outside the model's forward."""

    def __init__(self):
        super().__init__()
        self.emb, self.h = nn.Embedding(10, 4), nn.ModuleList([Block(), Block()])

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.h:
            x = block(x)
        return x.pow(2).sum()


IDS = torch.tensor([[0, 3, 4], [1, 2, 4]])  # below 5: this rank's half of the rows would index silently


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom")


def scenario(name: str):
    """(model, units, shard kwargs, a function running the step's forwards and backwards)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    if name == "no_grad_first_use":
        return NoGradFirst(), Enc, {}, lambda m: m(x).backward()
    if name == "two_backwards_different_branches":
        def run(m):
            m(x, True).backward()
            m(x, False).backward()
        return Net(), Block, {}, run
    if name == "checkpoint_around_a_unit":
        return Net(outer_checkpoint=True), Block, {}, lambda m: m(x).backward()
    if name == "two_backwards_through_one_window_checkpointed":
        def run(m):
            la, lb = m(x), m(x * 2)
            la.backward()
            lb.backward()
        return Net(), Block, {"checkpoint_activations": True}, run
    if name == "a_backward_that_raised_then_a_step":
        def run(m):
            try:
                loss = Boom.apply(m(x)).sum()  # raises inside backward
                loss.backward()
            except RuntimeError:
                pass
            del loss
            for p in m.parameters():
                p.grad = None
            m(x).backward()
        return Net(), Block, {}, run
    if name == "submodules_called_outside_the_forward":
        # Note [outer calls]: a root module and a unit, each called on its own, join the backward.
        return Embedded(), Block, {}, lambda m: (m(IDS) + m.h[1](m.emb(IDS + 1)).pow(2).sum()).backward()
    if name == "a_penalty_over_the_parameters_after_the_forward":
        # zero3 has freed most units by then: their names hold the shards, never freed storage
        # (reading that crashed the process); an elementwise penalty's gradient is exact.
        return Embedded(), Block, {}, lambda m: (m(IDS) + sum(p.pow(2).sum() for p in m.parameters())).backward()
    if name == "a_penalty_over_the_parameters_before_the_forward":
        def run(m):
            penalty = sum(p.pow(2).sum() for p in m.parameters())
            (m(IDS) + penalty).backward()
        return Embedded(), Block, {}, run
    raise KeyError(name)


SCENARIOS = ["submodules_called_outside_the_forward", "a_penalty_over_the_parameters_after_the_forward",
             "a_penalty_over_the_parameters_before_the_forward",
             "no_grad_first_use", "two_backwards_different_branches", "checkpoint_around_a_unit",
             "two_backwards_through_one_window_checkpointed", "a_backward_that_raised_then_a_step"]


def _after_one_step(name: str, strategy: str | None):
    torch.manual_seed(0)
    model, units, kwargs, run = scenario(name)
    if strategy:
        sw.shard(model, strategy=strategy, units=units, **kwargs)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    run(model)
    optim.step()
    return sw.full_parameters(model) if strategy else {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_pattern_matches_one_process(ranks, name, strategy):
    """Catches a no_grad first use that left a unit without gradient, zero1 dropping gradients of
    an earlier backward, a recompute that freed the root (zero3), a second backward through a
    checkpointed window, and a backward that raised leaving the reduce order broken."""
    reference = _after_one_step(name, None)
    for params in ranks.run(_after_one_step, 2, name, strategy):
        for key, value in reference.items():
            torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6, msg=f"{name} {strategy} {key}")


def _outer_calls_after_a_step(strategy: str | None):
    torch.manual_seed(0)
    model = Embedded()
    if strategy:
        sw.shard(model, strategy=strategy, units=Block)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(IDS).backward()
    optim.step()
    with torch.no_grad():
        outputs = [model.h[1](torch.ones(3, 4))]  # a unit alone first: its own pass
        engine = engine_of(model)
        resident = [unit.label for unit in engine.units[1:] if unit.resident] if strategy == "zero3" else []
        outputs += [model.emb(IDS), model.h[0](model.emb(IDS)), model.h[1](model.emb(IDS))]
    return outputs, resident


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_submodules_called_outside_the_forward_see_the_stepped_values(ranks, strategy):
    """Catches a root-unit module called on its own reading this rank's rows (an embedding then
    indexes the wrong rows without a word), a zero1/zero2 unit called on its own after a step
    using the values from before it, and a zero3 unit called alone left gathered after it
    returns (Note [outer calls])."""
    reference, _ = _outer_calls_after_a_step(None)
    for outputs, resident in ranks.run(_outer_calls_after_a_step, 2, strategy):
        assert resident == [], f"zero3 units still gathered after a call on their own: {resident}"
        for got, expected in zip(outputs, reference):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _frozen_peak():
    class Blk(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.l(x))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), *[Blk() for _ in range(6)])
    for block in model[1:]:
        block.requires_grad_(False)
    sw.shard(model, strategy="zero3", units=Blk)
    model(torch.randn(2, 8)).sum().backward()
    return engine_of(model).peak_resident_units


def test_zero3_frees_frozen_units_during_backward(ranks):
    """Catches frozen zero3 units kept gathered through backward (no GatherUnit frees them):
    6 frozen blocks under a trainable layer held 6 at once; one plus the prefetched one is the bound."""
    assert all(peak <= 2 for peak in ranks.run(_frozen_peak, 2))


def _extra_forward_on_rank_0(strategy: str, one_unit: bool):
    torch.manual_seed(0)
    model = Net()
    sw.shard(model, strategy=strategy, units=[model] if one_unit else Block)
    assert one_unit == (len(engine_of(model).units) == 1)
    x = torch.randn(3, 4)
    try:
        if dist.get_rank() == 0:
            with torch.no_grad():
                model(x)  # an evaluation only rank 0 runs
        model(x).backward()
    except sw.ShardwiseError as error:
        return str(error)
    return None


@pytest.mark.parametrize(("strategy", "one_unit"), [("zero2", False), ("zero3", True)])
def test_a_forward_only_some_ranks_run_is_refused_on_every_rank(ranks, strategy, one_unit):
    """Catches `if rank == 0: evaluate(model)`, whose collectives paired with the other ranks'
    next forward and mis-paired everything after; zero3 with one unit, which sends no gather tags
    (Note [gather tags]), refused by the header alone."""
    for message in ranks.run(_extra_forward_on_rank_0, 2, strategy, one_unit, timeout=60):
        assert message is not None and "run different forwards" in message, message


class ReentrantInside(Block):
    """A reentrant checkpoint inside a unit's forward, around part of it."""

    def forward(self, x, use_b=True):
        return self.b(cp.checkpoint(self.a, x, use_reentrant=True))


def _reentrant_checkpoint(where: str, strategy: str):
    torch.manual_seed(0)
    if where == "around_units":
        model, units = Net(), Block
        model.forward = lambda x: sum(cp.checkpoint(b, model.pre(x), use_reentrant=True).sum() for b in model.h)
    else:
        model, units = nn.Sequential(nn.LayerNorm(4), ReentrantInside(), ReentrantInside()), ReentrantInside
    sw.shard(model, strategy=strategy, units=units)
    loss = model(torch.randn(3, 4)).pow(2).sum()
    try:
        loss.backward()
    except sw.ShardwiseError as error:
        return str(error)
    return None


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
@pytest.mark.parametrize("where", ["around_units", "inside_a_unit"])
def test_a_reentrant_checkpoint_is_refused_on_every_rank(ranks, where, strategy):
    """Catches a reentrant checkpoint (torch's default), whose nested backward computed gradients
    the engine never reduced: parameters 0.43 off one process after a step, without a word."""
    for message in ranks.run(_reentrant_checkpoint, 2, where, strategy, timeout=60):
        assert message is not None and "use_reentrant=False" in message, message


class EncoderDecoder(nn.Module):
    """The decoder is registered first but runs second."""

    def __init__(self):
        super().__init__()
        self.dec = nn.ModuleList(Enc() for _ in range(3))
        self.enc = nn.ModuleList(Enc() for _ in range(3))

    def forward(self, x):
        for layer in [*self.enc, *self.dec]:
            x = layer(x)
        return x.sum()


def _gathers_per_step():
    model = EncoderDecoder()
    sw.shard(model, strategy="zero3", units=Enc)
    real, counts = coll.all_gather, []  # the engine's unit gathers, whatever the backend

    def counting(*args, **kwargs):
        counts[-1] += 1
        return real(*args, **kwargs)

    coll.all_gather = counting
    try:
        for _ in range(2):
            counts.append(0)
            model(torch.randn(2, 4)).backward()
    finally:
        coll.all_gather = real
    return counts, len(engine_of(model).units)


def test_zero3_prefetches_in_the_forward_order_it_saw(ranks):
    """Catches prefetching in registration order when the forward runs in another: every unit
    registered before the running one was gathered at once (a memory spike) and gathered again."""
    for counts, num_units in ranks.run(_gathers_per_step, 2):
        # Once the order is known: each unit once in forward, each but the last once more in backward.
        assert counts[1] <= 2 * num_units - 1 < counts[0], (counts, num_units)


def _after_one_step_in_gloo_forms(name: str, strategy: str | None):
    with coll_threshold(0):  # zero1 averages into its kept gradients (Note [kept gradients rank-major])
        return _after_one_step(name, strategy)


@pytest.mark.parametrize("name", SCENARIOS)
def test_zero1_patterns_with_kept_gradients_in_gloo_forms(ranks, name):
    """Catches zero1's kept gradients losing a gradient carried from an earlier backward, averaging
    twice, or keeping a partial sum after a backward that raised, where the all-to-all averages
    into them (units under GLOO_FORMS_FROM_BYTES per rank keep torch's form, so this forces it)."""
    reference = _after_one_step(name, None)
    for got in ranks.run(_after_one_step_in_gloo_forms, 2, name, "zero1"):
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


class Midway(nn.Module):
    """Two blocks with a backward that can raise between them: the last block's gradients are
    reduced (and handed out) before the error."""

    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([Block(), Block()])

    def forward(self, x, boom=False):
        x = self.h[0](x)
        return self.h[1](Boom.apply(x) if boom else x).pow(2).sum()


def _after_a_backward_that_raised_midway(strategy: str | None):
    torch.manual_seed(0)
    model = Midway()
    if strategy:
        sw.shard(model, strategy=strategy, units=Block)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="boom"):
        model(x, boom=True).backward()
    if strategy is None:
        model.zero_grad(set_to_none=True)  # what the engine does for the user (Note [aborted backward])
    model(x).backward()  # no zero_grad: the aborted step's partial gradients must not be added
    optim.step()
    return sw.full_parameters(model) if strategy else {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_backward_that_raised_midway_leaves_no_partial_gradient(ranks, strategy):
    """Catches the engine keeping the gradients a backward reduced (and handed out) before it
    raised: the next backward would add to them (Note [aborted backward])."""
    reference = _after_a_backward_that_raised_midway(None)
    for got in ranks.run(_after_a_backward_that_raised_midway, 2, strategy):
        for key, value in reference.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=f"{strategy} {key}")
