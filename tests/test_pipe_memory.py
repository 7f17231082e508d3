"""Only your stage's layers (issue 46, Note [stage init] in pipeline/stage_init.py): a pipeline built under
`sw.deferred_init()` materializes on each rank its own stage's rows only, and trains as one process does."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.launch import run
from helpers.pipe import GLOBAL_BATCH, MICRO, batches_of, dataset, reference_run, token_loss
from shardwise.estimate.pipe import estimate_pipe
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw
from shardwise.testing import RunResult, assert_close_runs

STEPS = 3


def _deferred_trainer(strategy: str = "zero3", balance="params") -> PipeTrainer:
    torch.manual_seed(0)  # helpers.pipe.gpt's seed: the replay draws what eager init drew
    with sw.deferred_init():
        model = GPT(GPTConfig(seq_len=8, n_layers=2))
    inputs, targets = dataset()
    config = PipelineConfig(num_stages=2, num_microbatches=MICRO, schedule="1f1b", cache=False, strategy=strategy,
                            balance=balance)
    return PipeTrainer(chain_layers(model), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                       global_batch_size=GLOBAL_BATCH, config=config)


def _deferred_on_rank(strategies: list[str]) -> list[dict]:
    out = []
    for strategy in strategies:
        trainer = _deferred_trainer(strategy)
        start, end = trainer.layout.bounds[trainer.layout.coords(trainer.rank)[1]]
        mine = {n for i in range(start, end) for n in trainer.chain.names[i]}
        real = {n for n, p in trainer.chain.params.items() if p.device.type != "meta"}
        losses = [trainer.step(b) for b in batches_of(trainer.sampler, STEPS)]
        out.append({"others_real": sorted(real - mine), "result": RunResult(losses, [], trainer.full_parameters())})
    return out


def test_a_deferred_pipeline_materializes_its_stage_only_and_matches_one_process(ranks):
    """Catches a rank that materializes another stage's layers, and a deferred pipeline whose values are not
    eager init's (ranks replaying a different random stream, a parameter never delivered): pipe 2 x shard 2
    at ws 4, the tied GPT built under sw.deferred_init(), zero3, 3 AdamW steps under 1F1B with 4
    micro-batches equal the eagerly built one-process run (fp32 1e-5 / 1e-6); every parameter outside a
    rank's stage is still on the meta device."""
    strategies = ["zero3"]  # zero1 and zero2 take the same replay (engine/init/sharding.py)
    reports = ranks.run(_deferred_on_rank, 4, strategies, timeout=180)
    reference = reference_run(2, num_homes=4, steps=STEPS)
    for rank, per_strategy in enumerate(reports):
        for strategy, report in zip(strategies, per_strategy):
            assert report["others_real"] == [], f"rank {rank} {strategy}: {report['others_real']}"
            assert_close_runs(reference, report["result"])


def _refused_on_rank(strategy, balance) -> str:
    with pytest.raises(sw.ShardwiseError) as error:
        _deferred_trainer(strategy, balance)
    return str(error.value)


def test_a_deferred_pipeline_refuses_whole_copies_and_timed_balance(ranks):
    """Catches a deferred model handed to the whole-copy route (each rank would hold meta layers it cannot run)
    or balanced by measured time (nothing to run yet): a ShardwiseError naming the fix, on every rank."""
    for message in ranks.run(_refused_on_rank, 2, None, "params"):
        assert "needs sharded stages" in message, message
    for message in ranks.run(_refused_on_rank, 2, "zero3", "time"):
        assert "balance='params'" in message, message


PEAK_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[2])  # the test's own shardwise (a mutated copy under bench/correctness/mutations.py)
    import faulthandler, json, pathlib, resource, signal, torch, torch.nn.functional as F, shardwise as sw
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from shardwise.engine import engine_of
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw
    torch.set_num_threads(1)
    sw.init(timeout=240)
    inputs = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    def loss(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())
    def trainer(config):
        torch.manual_seed(0)
        with sw.deferred_init():
            model = GPT(config)
        full = sum(p.numel() for p in model.parameters()) * 4  # on meta: nothing allocated
        pipe = PipelineConfig(num_stages=2, num_microbatches=2, schedule="gpipe", cache=False, strategy="zero3")
        built = PipeTrainer(chain_layers(model), loss, grouped_adamw(), inputs, inputs.roll(-1, 1),
                            global_batch_size=8, config=pipe)
        return full, built
    trainer(GPTConfig(seq_len=8, d_model=16, n_layers=2))  # one-off costs: meta kernels, groups, pipelining
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config = GPTConfig(vocab_size=64, seq_len=8, d_model=512, n_layers=8, n_heads=8)
    full, built = trainer(config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    units = engine_of(built.stage_module).units
    shards = sum(u.shard_flat.numel() * 4 for u in units)
    largest_unit = max(u.full_flat.numel() * 4 for u in units)
    report = dict(rank=sw.get_rank(), growth=peak - before, shards=shards, unit=largest_unit, full=full)
    pathlib.Path(sys.argv[1], f"rank{sw.get_rank()}.json").write_text(json.dumps(report))
    sw.shutdown()
""")


def test_a_deferred_pipelines_peak_is_its_stage_shards_plus_one_unit(tmp_path):
    """Catches a rank that materializes the whole model, another stage's layers or its own stage whole before
    keeping its rows: pipe 2 x shard 2 at ws 4, zero3, a GPT of 8 blocks (d_model 512) built under
    sw.deferred_init(). Each rank's share is a quarter of the model; its peak RSS growth while the pipeline is
    built stays within 110% of its stage's shards plus one unit, below half the model, and within 10% of
    sw.estimate_pipe's build figure (whose parameters row is the shards' bytes exactly).

    Fresh processes (ru_maxrss is a lifetime peak) with MALLOC_MMAP_THRESHOLD_=65536, so freed blocks leave RSS,
    as in tests/test_deferred.py."""
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    launch = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script),
                  str(tmp_path), str(Path(sw.__file__).parents[1])], tmp_path / "launch.log", timeout=200, env=env)
    assert launch.ok, launch.tail(80)
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(reports) == 4
    with torch.device("meta"):
        predicted = estimate_pipe(GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=512, n_layers=8, n_heads=8)),
                                  "zero3", 4, 2)  # Note [pipe estimate]: against the measured peak
    for r in reports:
        stage = r["rank"] % 2  # the pipeline's replica-major numbering
        assert r["shards"] == predicted.stages[stage].parameters, (r, predicted.stages[stage])
        assert abs(r["growth"] - predicted.build_bytes[stage]) <= 0.10 * predicted.build_bytes[stage], r
        assert r["shards"] * 3.5 <= r["full"], r  # a quarter of the model (the tied weight on both stages)
        assert r["growth"] <= 1.10 * (r["shards"] + r["unit"]), r
        assert r["growth"] < r["full"] / 2, r
