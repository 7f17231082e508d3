"""Mixed precision: bf16/fp16 compute tracking fp32, and an fp16 overflow every rank agrees on."""

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice


def _train_gpt(strategy, precision, steps):
    spec = ZOO["gpt"]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ndim = {n: p.ndim for n, p in model.named_parameters()}
    sw.shard(model, strategy=strategy, units=spec.unit_class, precision=precision)
    optimizer = make_optimizer(model, ndim_by_name=ndim)
    losses = []
    for step in range(steps):
        x, y = rank_slice(global_batch(spec, step, 8), rank, world_size)
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(value.item())
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
