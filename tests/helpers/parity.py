"""Strategy-agnostic parity check: a sharded run on N ranks against the single process.

`run_on_rank` trains one zoo model under one strategy on the rank it runs on (pass it
to `ranks.run`); `check_parity` runs it on `world_size` ranks and compares every
rank's result with `reference_run` in the test process. The reference always uses
accum=1: N ranks x `accum` micro-batches each must equal one process on the whole
global batch, so a wrong scale on either the rank average or the micro-batch sum shows.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import RunResult, assert_close_runs, make_optimizer, reference_run, train

Config = tuple[int, float | None]  # (accum, clip): micro-batches per step, max grad norm or None

# The single-process reference is a pure function of its arguments (plain torch in this process, no
# engine), and a grid asks for the same one once per strategy and world size: 9 times per zoo model in
# tests/test_zero_parity.py. Computed once per pytest worker; its result is only read (assert_close_runs).
cached_reference_run = functools.lru_cache(maxsize=None)(reference_run)


def _average_over_ranks(value: float) -> float:
    # float64 so the average adds no rounding the reference does not have.
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    return t.item()


def run_on_rank(
    strategy: str,
    name: str,
    configs: list[Config],
    steps: int = 5,
    global_batch_size: int = 8,
    seed: int = 0,
    shard_kwargs: dict | None = None,
    prepare=None,
) -> list[RunResult]:
    """On this rank: for each `(accum, clip)` in `configs`, build zoo model `name` fresh,
    shard it with `strategy`, call `prepare(model, optimizer)` if given (a module-level function:
    it travels to spawned ranks), train `steps` steps on this rank's slice; return the results."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    spec = ZOO[name]
    kwargs = dict(shard_kwargs or {})
    if strategy == "ddp":
        # The zero strategies need no flag for skipped parameters; ddp does.
        kwargs.setdefault("find_unused_parameters", spec.skips_params)
    else:
        # The zoo's repeated block is the natural unit; None falls back to shard()'s default.
        kwargs.setdefault("units", spec.unit_class)
    results = []
    for accum, clip in configs:
        model = build(name, seed)
        # Taken before sharding: a sharded matrix may be a 1-D shard, and the param
        # groups must be chosen by the full tensors' ndim, as the reference does.
        ndim_by_name = {n: p.ndim for n, p in model.named_parameters()}
        sw.shard(model, strategy=strategy, **kwargs)
        optimizer = make_optimizer(model, ndim_by_name=ndim_by_name)
        if prepare is not None:
            prepare(model, optimizer)
        results.append(
            train(
                model, spec, steps, global_batch_size,
                rank=rank, world_size=world_size, accum=accum, clip=clip, seed=seed,
                optimizer=optimizer,
                no_sync=lambda: sw.no_sync(model),
                clip_fn=lambda m, c: sw.clip_grad_norm_(m, c),
                all_reduce_loss=_average_over_ranks,
                gather_params=lambda: sw.full_parameters(model),
            )
        )
    return results


def check_parity(
    ranks,
    strategy: str,
    name: str,
    world_size: int,
    configs: list[Config],
    steps: int = 5,
    global_batch_size: int = 8,
    seed: int = 0,
    shard_kwargs: dict | None = None,
    timeout: float = 120.0,
    rank_fn=run_on_rank,
    prepare=None,
) -> None:
    """Run `rank_fn` (`run_on_rank` or a wrapper of it) on `world_size` ranks and assert every rank's result matches the
    single-process, full-batch reference (assert_close_runs' fp32 bound) for every config."""
    per_rank = ranks.run(
        rank_fn, world_size, strategy, name, configs, steps, global_batch_size, seed, shard_kwargs, prepare,
        timeout=timeout,
    )
    for i, (accum, clip) in enumerate(configs):
        ref = cached_reference_run(name, steps, global_batch_size, accum=1, clip=clip, seed=seed)
        if clip is not None:
            # A max norm no step exceeds would leave clipping untested.
            assert max(ref.grad_norms) > clip, (
                f"{name}: clip={clip} never triggers (reference grad norms {ref.grad_norms}); "
                f"use a smaller max norm so a wrong clip can fail the test"
            )
        for rank, results in enumerate(per_rank):
            try:
                assert_close_runs(ref, results[i])
            except AssertionError as error:
                raise AssertionError(
                    f"strategy={strategy!r} model={name!r} world_size={world_size} "
                    f"accum={accum} clip={clip}: rank {rank} differs from the single process\n{error}"
                ) from None


def assert_trainer_run_matches(logs, params, reference_logs, reference_params, steps: int) -> None:
    """A trainer integration's run (per step: loss, grad norm; final parameters) against the same
    trainer on one process: every step logged, clipping acted, losses and norms 1e-4, params 1e-5."""
    assert len(logs) == steps and max(norm for _, norm in reference_logs) > 0.5  # clipping acted
    for (loss, norm), (ref_loss, ref_norm) in zip(logs, reference_logs):
        assert abs(loss - ref_loss) < 1e-4 and abs(norm - ref_norm) < 1e-4 * max(1.0, ref_norm), (logs,
                                                                                               reference_logs)
    for name, value in reference_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-5)


def log_distance(a, b) -> float:
    """The largest difference between two trainer runs' logged (loss, grad norm) per step."""
    return max(max(abs(x - y), abs(m - n)) for (x, m), (y, n) in zip(a, b))
