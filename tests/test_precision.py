"""Mixed precision: bf16/fp16 compute tracking fp32, and an fp16 overflow every rank agrees on."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.losses import train_losses
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice


def _train_gpt(strategy, precision, steps):
    spec = ZOO["gpt"]
    model = build("gpt")
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    sw.shard(model, strategy=strategy, units=spec.unit_class, precision=precision)
    optimizer = make_optimizer(model, ndim_by_name=ndim)
    losses = train_losses(model, optimizer, spec, steps)
    dtypes = {str(p.dtype) for p in model.parameters()}
    return losses, dtypes


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_tracks_fp32(ranks, strategy, precision):
    """Catches a low-precision path that trains differently (wrong casts, grads reduced in the
    wrong dtype, masters stored in bf16) — or does not run in low precision at all.

    Tolerance: the loss itself comes out of a bf16 cross-entropy, and bf16's spacing near a
    loss of 4 is 2**-5 = 0.031, so single steps may differ by a few spacings; averaged over
    50 steps the difference must stay under two spacings (0.06), and the last 10 steps' mean
    within 0.5% (measured: 0.034 and 0.26% for bf16, 0.017 and 0.06% for fp16).
    """
    fp32, _ = ranks.run(_train_gpt, 2, strategy, "fp32", 50)[0]
    low, dtypes = ranks.run(_train_gpt, 2, strategy, precision, 50)[0]
    assert dtypes == {"torch.float32"}  # the optimizer steps fp32 masters
    diffs = [abs(a - b) for a, b in zip(low, fp32)]
    assert sum(diffs) / len(diffs) < 0.06, diffs
    assert abs(sum(low[-10:]) - sum(fp32[-10:])) / abs(sum(fp32[-10:])) < 0.005
    assert low != fp32  # it really ran in low precision


def _fp16_overflow_on_one_rank():
    spec = ZOO["gpt"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    sw.shard(model, strategy="zero2", units=spec.unit_class, precision="fp16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = sw.LossScaler(model, init_scale=1024.0)
    record = []
    for step in range(3):
        x, y = rank_slice(global_batch(spec, step, 8), rank, world_size)
        scaler.scale(model(x, y)).backward()
        if step == 1 and rank == 1:  # an overflow only rank 1 sees
            next(p for p in model.parameters() if p.grad is not None).grad[0] = float("inf")
        before = sw.full_parameters(model)
        took = scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        after = sw.full_parameters(model)
        unchanged = all(torch.equal(before[n], after[n]) for n in before)
        record.append((took, unchanged, scaler.scale_value))
    return record


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(ranks):
    """Catches an overflow check that is not agreed across ranks: rank 1's inf must make
    both ranks skip step 1 (parameters unchanged) and halve the scale together."""
    records = ranks.run(_fp16_overflow_on_one_rank, 2)
    assert records[0] == records[1]
    assert [(took, unchanged) for took, unchanged, _ in records[0]] == [(True, False), (False, True), (True, False)]
    assert [scale for _, _, scale in records[0]] == [1024.0, 512.0, 512.0]


def test_precision_validation():
    """Catches a typo'd precision or an integer dtype getting past shard()."""
    with pytest.raises(sw.ShardwiseError, match="precision='bf8'"):
        from shardwise.config import resolve_precision
        resolve_precision("bf8")
    with pytest.raises(sw.ShardwiseError, match="param_dtype"):
        sw.MixedPrecision(param_dtype=torch.int8)


def _used_weights_after_steps(strategy, steps):
    """What the forward after `steps` bf16 steps computes with (each Linear's weight as its forward sees
    it) beside the fp32 masters, gathered whole."""
    spec = ZOO["gpt"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    sw.shard(model, strategy=strategy, units=spec.unit_class, precision="bf16")
    optimizer = make_optimizer(model, ndim_by_name=ndim)
    for step in range(steps):
        x, y = rank_slice(global_batch(spec, step, 8), rank, world_size)
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    used = {}

    def record(key):
        def hook(module, args):  # returns None: the forward's inputs stay its own
            used.setdefault(key, module.weight.detach().clone())
        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(record(f"{name}.weight"))
    with torch.no_grad():
        model(*rank_slice(global_batch(spec, steps, 8), rank, world_size))
    masters = sw.full_state_dict(model, rank0_only=False)
    return {key: (value.dtype, bool(torch.equal(value, masters[key].to(value.dtype)))) for key, value in used.items()}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_the_forward_computes_with_the_stepped_masters_cast(ranks, strategy):
    """Catches a gather that leaves this rank's own rows of a low-precision compute copy as they were
    before the step (its rows are a cast of the fp32 masters, not the shards themselves, so they must
    be copied in): the forward then mixes this step's rows of other ranks with last step's own. The
    loss-tracking test above does not see a one-step lag; this compares the weights used, bitwise."""
    for per_weight in ranks.run(_used_weights_after_steps, 2, strategy, 2):
        assert per_weight, "no Linear's forward was seen"
        assert {dtype for dtype, _ in per_weight.values()} == {torch.bfloat16}
        stale = [key for key, (_, equal) in per_weight.items() if not equal]
        assert stale == [], f"weights the forward used that are not the stepped masters' bf16 cast: {stale}"
