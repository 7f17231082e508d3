"""sw.optimizer_in_backward: each unit stepped as its gradient lands (Note [optimizer in backward])."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.parity import check_parity
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice

# (accum, clip): plain steps, and 2 micro-batches under no_sync (stepped once, in the synced backward).
CONFIGS = [(1, None), (2, None)]


def _step_in_backward(model, optimizer):
    sw.optimizer_in_backward(model, optimizer)


@pytest.mark.parametrize("name", ["gpt", "reused_block", "shared_branch", "unused_branch", "frozen",
                                  "non_consecutive", "two_tower"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_parity_with_single_process(ranks, strategy, name):
    """Catches a unit stepped before all its uses' gradients arrived, a unit stepped twice (the
    loop still calls optimizer.step() after backward), a step in a no_sync micro-batch, or a
    parameter no rank used being stepped: 5 AdamW steps must equal the single process."""
    check_parity(ranks, strategy, name, 2, CONFIGS, prepare=_step_in_backward)


def test_parity_zero3_four_ranks(ranks):
    check_parity(ranks, "zero3", "gpt", 4, CONFIGS, prepare=_step_in_backward)


def _model(strategy="zero3", **kwargs):
    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=spec.unit_class, **kwargs)
    return spec, model


def _batch(spec):
    return rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())


def _grads_after_backward():
    spec, model = _model()
    optimizer = make_optimizer(model)
    sw.optimizer_in_backward(model, optimizer)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(*_batch(spec)).backward()
    held = [name for name, p in model.named_parameters() if p.grad is not None]
    changed = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    optimizer.step()  # finds no gradient: changes nothing
    after_step = [name for name, p in model.named_parameters() if not torch.equal(p, before[name])]
    return held, changed, after_step


def test_no_gradient_outlives_the_backward(ranks):
    """Catches gradients kept after their unit's step (the memory the option exists to save)."""
    for held, changed, after_step in ranks.run(_grads_after_backward, 2):
        assert held == [], held
        assert changed and changed == after_step, (changed, after_step)


class _OwnAdamW(torch.optim.AdamW):
    """An optimizer from outside torch.optim: optimizer_in_backward cannot know it is per-parameter."""


def _error_of(case):
    spec, model = _model()
    optimizer = make_optimizer(model)
    x, y = _batch(spec)
    try:
        if case == "no optimizer param":
            sw.optimizer_in_backward(model, torch.optim.AdamW(list(model.parameters())[1:]))
        elif case == "ddp":
            plain = build("gpt")
            sw.shard(plain, strategy="ddp")
            sw.optimizer_in_backward(plain, optimizer)
        elif case == "own optimizer":
            sw.optimizer_in_backward(model, _OwnAdamW(model.parameters()))
        elif case == "scaler first":
            sw.LossScaler(model)
        sw.optimizer_in_backward(model, optimizer)
        if case == "scaler after":
            sw.LossScaler(model)
        if case == "penalty before forward":
            # autograd reaches these terms last, after the units were stepped (a linear term: one
            # that saved the parameters would instead stop at torch's in-place-modification check)
            penalty = 1e-3 * sum(p.sum() for p in model.parameters())
            (penalty + model(x, y)).backward()
        elif case == "two backwards, one step":  # accumulation without sw.no_sync
            model(x, y).backward()
            model(x, y).backward()
        elif case == "new optimizer":
            model(x, y).backward()
            optimizer = make_optimizer(model)  # never passed to optimizer_in_backward
            optimizer.step()
            model(x, y).backward()
        else:
            model(x, y).backward()
        if case == "sw clip":
            sw.clip_grad_norm_(model, 1.0)
        elif case == "torch clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        elif case == "torch clip value":
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        elif case == "lr set after backward":
            optimizer.param_groups[0]["lr"] *= 0.5
        optimizer.step()
    except sw.ShardwiseError as error:
        return str(error)
    return None


@pytest.mark.parametrize("case, words", [
    ("sw clip", "nothing left to clip"),
    ("torch clip", "nothing left to clip"),
    ("torch clip value", "nothing left to clip"),
    ("penalty before forward", "stepped twice"),
    ("two backwards, one step", "second backward before optimizer.step()"),
    ("new optimizer", "second backward before optimizer.step()"),
    ("lr set after backward", "settings (lr"),
    ("no optimizer param", "does not hold the trainable parameter"),
    ("own optimizer", "any_optimizer=True"),
    ("scaler first", "loss scaler"),
    ("scaler after", "loss scaler"),
    ("ddp", "strategy='zero1'"),
])
def test_what_cannot_be_exact_is_refused_on_every_rank(ranks, case, words):
    """Catches a clip that silently clips nothing, a shard stepped twice (a late gradient, two
    synced backwards per step, a step() that reaches another optimizer), settings that came too
    late, a parameter no optimizer steps, an optimizer or scaler it cannot serve exactly."""
    for message in ranks.run(_error_of, 2, case):
        assert message is not None and words in message, (case, message)


def _two_phases():
    """A new optimizer passed again (a second phase) is stepped; a plain loop keeps working."""
    spec, model = _model()
    first = make_optimizer(model)
    sw.optimizer_in_backward(model, first)
    x, y = _batch(spec)
    model(x, y).backward()
    first.step()
    second = make_optimizer(model)
    sw.optimizer_in_backward(model, second)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(x, y).backward()
    second.step()
    return sum(not torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_new_optimizer_passed_again_takes_over(ranks):
    for changed in ranks.run(_two_phases, 2):
        assert changed > 0


def _fp16_error():
    _, model = _model(precision="fp16")
    try:
        sw.optimizer_in_backward(model, make_optimizer(model))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_fp16_loss_scaling_is_refused(ranks):
    for message in ranks.run(_fp16_error, 1):
        assert message is not None and "bf16" in message, message


def _whole_in_backward_against_after(strategy, kind):
    """3 steps of a whole-tensor optimizer (`kind`) under sw.optimizer_in_backward beside the same one
    stepping after backward (same seed, data and world size): the names whose values differ, per step."""
    spec = ZOO["gpt"]
    models = []
    for in_backward in (True, False):
        torch.manual_seed(0)
        _, model = _model(strategy)
        optimizer = getattr(torch.optim, kind)(model.parameters(), lr=1e-2)
        if in_backward:
            sw.optimizer_in_backward(model, optimizer)
        models.append((model, optimizer))
    differ = []
    for step in range(3):
        x, y = rank_slice(global_batch(spec, step, 8), dist.get_rank(), dist.get_world_size())
        for model, optimizer in models:
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        full, full_after = (sw.full_parameters(model) for model, _ in models)
        differ += [f"step {step}: {n}" for n in full_after if not torch.equal(full[n], full_after[n])]
    return differ


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_whole_tensor_optimizer_in_backward(ranks, strategy):
    """Catches torch's Adafactor (row and column statistics of each whole matrix: Note [whole-tensor step])
    refused by sw.optimizer_in_backward, stepped on a unit's rows, or with its owners moved between units
    (Note [whole step per unit]): bitwise the same optimizer stepping after backward at the same world size."""
    for differ in ranks.run(_whole_in_backward_against_after, 2, strategy, "Adafactor"):
        assert differ == [], differ[:4]
