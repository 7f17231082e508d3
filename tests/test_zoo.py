"""In-process checks of the model zoo and of the reference-run helpers that every
distributed test compares against. No process groups here."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.models import GPT, ZOO, GPTConfig, build
from shardwise.testing import (
    RunResult,
    assert_close_runs,
    global_batch,
    make_optimizer,
    micro_batches,
    rank_slice,
    reference_run,
)

NAMES = sorted(ZOO)


@pytest.mark.parametrize("name", NAMES)
def test_build_is_deterministic(name):
    """Same seed, same parameters; another seed, other parameters. Catches init that
    reads unseeded state, which would make every rank's model different."""
    a, b, c = build(name, seed=0), build(name, seed=0), build(name, seed=1)
    pa, pb, pc = dict(a.named_parameters()), dict(b.named_parameters()), dict(c.named_parameters())
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key
    assert any(not torch.equal(pa[k], pc[k]) for k in pa if pa[k].numel() > 1)


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name):
    """A scalar finite loss whose backward reaches every trainable parameter that the
    step uses. Catches a zoo model that silently detaches part of itself."""
    model = build(name)
    model.begin_step(0)
    x, y = global_batch(ZOO[name], 0, 8)
    loss = model(x, y)
    assert loss.ndim == 0 and math.isfinite(loss.item())
    loss.backward()
    for key, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, key
        elif not key.startswith(tuple(model.unused_now())):
            assert p.grad is not None, key


@pytest.mark.parametrize("name", NAMES)
def test_loss_is_mean_over_batch(name):
    """The mean of the losses of equal rank slices is the full-batch loss. Catches a
    sum-reduced loss, which would make every rank count its gradients world_size times."""
    model = build(name)
    model.begin_step(0)
    batch = global_batch(ZOO[name], 0, 8)
    with torch.no_grad():
        full = model(*batch)
        parts = [model(*rank_slice(batch, r, 4)) for r in range(4)]
    torch.testing.assert_close(torch.stack(parts).mean(), full, rtol=1e-5, atol=1e-6)


def test_gpt_head_is_tied_and_config_validates():
    """The output head's weight is the token embedding's (one Parameter, counted once),
    and a bad config fails naming the field. Catches an untied copy, which would hide
    the tied-weight sharing case from every test."""
    model = GPT(GPTConfig())
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 64)
    with pytest.raises(ValueError, match="n_heads"):
        GPTConfig(d_model=30, n_heads=4)


@pytest.mark.parametrize("name", NAMES)
def test_reference_run_is_deterministic(name):
    """Two reference runs are bitwise equal. Catches any unseeded randomness (data, per-
    step choices, init) that would make the reference itself a moving target."""
    a, b = reference_run(name, clip=1.0), reference_run(name, clip=1.0)
    assert a.losses == b.losses and a.grad_norms == b.grad_norms
    for key in a.params:
        assert torch.equal(a.params[key], b.params[key]), key


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_accumulation_matches_full_batch(name, clip):
    """accum=2 matches accum=1 within DESIGN's fp32 bound: micro-batching is exact up to
    float rounding (see Note [adam eps] in testing.py for why that holds under Adam).
    Catches a loss not divided by accum, a per-step choice redrawn per micro-batch, or
    an optimizer whose rounding noise alone breaks the bound every strategy is held to."""
    ref = reference_run(name, clip=clip)
    assert_close_runs(ref, reference_run(name, accum=2, clip=clip))
    assert len(ref.losses) == 5 and len(ref.grad_norms) == (5 if clip else 0)


def test_unused_branch_is_used_and_unused():
    """In the default 5 steps the branch runs in some steps and not in others, so the
    sharing tests really cover a parameter with no gradient in a step."""
    model = build("unused_branch")
    used = []
    for step in range(5):
        model.begin_step(step)
        used.append(model.use_branch)
    assert any(used) and not all(used), used


def test_varying_depth_varies():
    """More than one depth is drawn in the default 5 steps, and the draw depends only on
    (seed, step). Catches a depth that is constant or drawn from global RNG."""
    model, other = build("varying_depth"), build("varying_depth")
    depths = []
    for step in range(5):
        model.begin_step(step)
        torch.rand(7)  # global RNG use in between must not matter
        other.begin_step(step)
        assert model.depth == other.depth
        depths.append(model.depth)
    assert len(set(depths)) > 1 and all(1 <= d <= 4 for d in depths), depths


def test_frozen_params_never_change():
    """Frozen parameters end exactly as built, trainable ones move, and the optimizer
    holds no frozen one. Catches weight decay or updates applied to frozen params."""
    model = build("frozen")
    initial = {k: p.detach().clone() for k, p in model.named_parameters()}
    frozen = {k for k, p in model.named_parameters() if not p.requires_grad}
    assert frozen and frozen != initial.keys()
    in_optimizer = {id(p) for group in make_optimizer(model).param_groups for p in group["params"]}
    assert not any(id(p) in in_optimizer for k, p in model.named_parameters() if k in frozen)
    final = reference_run("frozen").params
    for key, p in initial.items():
        assert torch.equal(final[key], p) == (key in frozen), key


def test_odd_shapes_trains():
    """The padding edge cases (0-D, 3 rows, odd 1-D, empty) build, have the shapes they
    promise, and every non-empty one trains. Catches a zoo change that drops a case."""
    shapes = {k: tuple(p.shape) for k, p in build("odd_shapes").named_parameters()}
    assert shapes["scale"] == () and shapes["few_rows"] == (3, 16)
    assert shapes["bias"] == (3,) and shapes["empty"] == (0, 16)
    initial = dict(build("odd_shapes").named_parameters())
    result = reference_run("odd_shapes")
    assert all(math.isfinite(loss) for loss in result.losses)
    for key, p in initial.items():
        if p.numel():
            assert not torch.equal(result.params[key], p), key


def test_optimizer_groups_by_name():
    """Matrices decay, the rest do not, decided by the full ndim when given. Catches
    groups chosen from shard shapes, which would put 1-D shards of matrices in the
    no-decay group."""
    model = build("odd_shapes")
    decay, no_decay = make_optimizer(model).param_groups
    assert {id(p) for p in decay["params"]} == {id(model.proj.weight), id(model.few_rows), id(model.empty)}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    all_2d = {k: 2 for k, _ in model.named_parameters()}
    decay, no_decay = make_optimizer(model, ndim_by_name=all_2d).param_groups
    assert not no_decay["params"]


def test_slicing_helpers():
    """Rank slices and micro-batches tile the batch in order; uneven sizes fail clearly.
    Catches ranks that overlap or skip examples."""
    x, y = torch.arange(8), torch.arange(8) * 10
    parts = [rank_slice((x, y), r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in micro_batches((x, y), 2)]), y)
    with pytest.raises(ValueError, match="divisible by world_size 3"):
        rank_slice((x, y), 0, 3)
    with pytest.raises(ValueError, match="accum 3"):
        micro_batches((x, y), 3)


def test_assert_close_runs_can_fail():
    """A perturbation of one element by 1e-4 fails and is named; so do a different loss
    and a missing key. Catches a comparison that always passes."""
    ref = reference_run("reused_block", steps=2)
    assert_close_runs(ref, ref)
    params = {k: v.clone() for k, v in ref.params.items()}
    params["head.bias"][3] += 1e-4
    with pytest.raises(AssertionError, match=r"head\.bias: max abs diff 0\.0001"):
        assert_close_runs(ref, RunResult(ref.losses, ref.grad_norms, params))
    with pytest.raises(AssertionError, match="loss differs at step 1"):
        assert_close_runs(ref, RunResult([ref.losses[0], ref.losses[1] + 1e-3], [], ref.params))
    del params["head.bias"]
    with pytest.raises(AssertionError, match=r"missing from got: \['head\.bias'\]"):
        assert_close_runs(ref, RunResult(ref.losses, ref.grad_norms, params))
