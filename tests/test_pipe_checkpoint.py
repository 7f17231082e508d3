"""Checkpoints of sharded pipeline stages (issue 46, point 6; pipeline/checkpoint/): saved under pipe x
shard, they load into the same layout (a resume, bitwise), into one process, into flat zero3 and into another
pipe x shard layout, and back, optimizer state included. fp32 against one process (DESIGN's 1e-5 / 1e-6)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.pipe import GLOBAL_BATCH, MICRO, TIED, batches_of, dataset, gpt, reference_run, token_loss
from shardwise.pipeline import (
    PipelineConfig,
    PipeTrainer,
    chain_layers,
    grouped_adamw,
    load_pipeline,
    save_pipeline,
)
from shardwise.testing import RunResult, assert_close_runs, make_optimizer

STEPS, SAVED_AT = 4, 2  # each run saves after SAVED_AT of STEPS steps


def _trainer(strategy: str, stages: int = 2, n_layers: int = 2) -> PipeTrainer:
    inputs, targets = dataset()
    config = PipelineConfig(num_stages=stages, num_microbatches=MICRO, schedule="1f1b", cache=False,
                            strategy=strategy)
    return PipeTrainer(chain_layers(gpt(n_layers)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                       global_batch_size=GLOBAL_BATCH, config=config)


def _steps(trainer: PipeTrainer, first: int, last: int) -> list[float]:
    return [trainer.step(b) for b in batches_of(trainer.sampler, STEPS)[first:last]]


def _resume_on_rank(directory: str, strategy: str, stages: list[int]) -> dict:
    """A run of STEPS steps in `stages[0]` stages, saved after SAVED_AT; each later layout in `stages` loads
    the previous one's checkpoint (every value bitwise) and saves it again (a round trip through it); the
    last loads it and runs the remaining steps. A layout in between also runs them, after its save (the
    run as that layout ends it)."""
    trainer = _trainer(strategy, stages[0])
    losses = _steps(trainer, 0, SAVED_AT)
    at_save = trainer.full_parameters()
    path = Path(directory) / f"{strategy}-0"
    save_pipeline(path, trainer, step=SAVED_AT)
    between = {}
    for hop, num_stages in enumerate(stages[1:], 1):
        trainer = _trainer(strategy, num_stages)
        report = load_pipeline(path, trainer)
        assert report.missing == [] and report.mismatched == [], str(report)
        loaded = trainer.full_parameters()
        assert all(torch.equal(loaded[n], at_save[n]) for n in at_save), f"hop {hop}: values changed on the way"
        if hop < len(stages) - 1:
            path = path.with_name(f"{strategy}-{hop}")
            save_pipeline(path, trainer, step=SAVED_AT)
            ended = _steps(trainer, SAVED_AT, STEPS)
            between[num_stages] = RunResult(losses + ended, [], trainer.full_parameters())
    losses += _steps(trainer, SAVED_AT, STEPS)
    tie = trainer.local_parameters().get(TIED)
    return {"result": RunResult(losses, [], trainer.full_parameters()), "tie": None if tie is None else tie.clone(),
            "path": str(path), "between": between}


def _uninterrupted_on_rank(strategy: str) -> RunResult:
    trainer = _trainer(strategy)
    return RunResult(_steps(trainer, 0, STEPS), [], trainer.full_parameters())


def _same_layout_on_rank(directory: str, strategies: list[str]) -> list[dict]:
    return [{"straight": _uninterrupted_on_rank(s), **_resume_on_rank(directory, s, [2, 2])} for s in strategies]


def _assert_bitwise(got: RunResult, want: RunResult, what: str) -> None:
    assert got.losses == want.losses, f"{what}: losses {got.losses} != {want.losses}"
    for name, value in want.params.items():
        assert torch.equal(got.params[name], value), f"{what}: {name} differs"


def test_a_pipeline_resumes_bitwise_and_loads_into_one_process(ranks, tmp_path):
    """Catches a stage that saves or loads another stage's rows, a tie written twice or its optimizer rows
    lost, optimizer state (AdamW's moments and step) not restored, and a checkpoint only a pipeline can read
    (stage-local names, one stage's param groups): zero1 and zero3 at pipe 2 x shard 2 (ws 4) save after 2
    of 4 steps; a fresh pipeline of the same layout loads it and runs the last 2, bitwise equal to the run
    never stopped, the tie bitwise equal on both stages; one process loads the zero3 checkpoint strictly
    (model and AdamW) and its last 2 steps equal one process never stopped (1e-5)."""
    strategies = ["zero1", "zero3"]
    results = ranks.run(_same_layout_on_rank, 4, str(tmp_path), strategies, timeout=240)
    for rank, per_strategy in enumerate(results):
        for strategy, got in zip(strategies, per_strategy):
            _assert_bitwise(got["result"], got["straight"], f"{strategy} rank {rank}")
    for k, strategy in enumerate(strategies):
        for first, last in [(0, 1), (2, 3)]:
            assert torch.equal(results[first][k]["tie"], results[last][k]["tie"]), f"{strategy}: tie drifted"
    saved = Path(results[0][1]["path"])
    index = json.loads((saved / "index.json").read_text())
    assert index["world_size"] == 4 and TIED in index["params"] and "head.weight" not in index["params"]
    tie_rows = [tuple(s["rows"]) for s in index["params"][TIED]["slices"]]
    assert len(tie_rows) == len(set(tie_rows)) == 2, f"the tie's rows written {tie_rows}: by both stages?"
    assert [set(g["params"]) for g in index["optimizer"]["param_groups"]] == _one_process_groups()
    reference = reference_run(2, num_homes=4, steps=STEPS)
    one_process = reference_run(2, num_homes=4, steps=STEPS, resume=(str(saved), SAVED_AT))
    assert_close_runs(RunResult(reference.losses[SAVED_AT:], [], reference.params), one_process)


def _one_process_groups() -> list[set[str]]:
    optimizer = make_optimizer(model := gpt(2))
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in g["params"]} for g in optimizer.param_groups]


def _through_flat_zero3(directory: str) -> dict:
    """pipe 2 x shard 2 saves after 2 steps; flat zero3 over the 4 ranks loads it (strict, with AdamW) and
    saves it again; pipe 2 x shard 2 loads that and runs the last 2 steps."""
    trainer = _trainer("zero3")
    losses = _steps(trainer, 0, SAVED_AT)
    at_save = trainer.full_parameters()
    first, second = Path(directory) / "pipe", Path(directory) / "flat"
    save_pipeline(first, trainer, step=SAVED_AT)
    model = gpt(2)
    sw.shard(model, strategy="zero3")
    optimizer = grouped_adamw(eps=1e-3)(list(model.named_parameters()))
    sw.load(first, model, optimizer)
    flat = sw.full_parameters(model)
    same = all(torch.equal(flat[n], v) for n, v in at_save.items())
    sw.save(second, model, optimizer, step=SAVED_AT)
    trainer = _trainer("zero3")
    load_pipeline(second, trainer)
    losses += _steps(trainer, SAVED_AT, STEPS)
    return {"same": same, "result": RunResult(losses, [], trainer.full_parameters())}


def _layouts_on_rank(directory: str) -> dict:
    through_pipe_1 = _resume_on_rank(str(Path(directory) / "a"), "zero3", [2, 1, 2])
    return {"straight": _uninterrupted_on_rank("zero3"), "pipe 1 and back": through_pipe_1["result"],
            "ends in pipe 1": through_pipe_1["between"][1],
            "flat zero3 and back": _through_flat_zero3(str(Path(directory) / "b"))}


def test_a_pipeline_checkpoint_loads_into_flat_zero3_and_another_pipe_layout_and_back(ranks, tmp_path):
    """Catches a load that assumes the layout it was saved from (rows of another shard count, names of
    another stage cut, a stage without a param group the checkpoint has, a flat model's tie alias) and
    optimizer state lost on the way: zero3 at pipe 2 x shard 2 saves after 2 of 4 steps; (a) pipe 1 x
    shard 4 loads it (every value bitwise), saves it, and ends the run equal to one process (1e-5); (b)
    flat zero3 over the 4 ranks loads it (every value bitwise, strict, with AdamW) and saves it; pipe 2 x
    shard 2 loads either and ends the run bitwise equal to the run never stopped."""
    reference = reference_run(2, num_homes=4, steps=STEPS)
    for rank, got in enumerate(ranks.run(_layouts_on_rank, 4, str(tmp_path), timeout=240)):
        _assert_bitwise(got["pipe 1 and back"], got["straight"], f"pipe 1 and back, rank {rank}")
        assert_close_runs(reference, got["ends in pipe 1"])
        assert got["flat zero3 and back"]["same"], f"rank {rank}: flat zero3 loaded other values"
        _assert_bitwise(got["flat zero3 and back"]["result"], got["straight"], f"flat zero3 and back, rank {rank}")


def _refusals_on_rank(other_model: str, no_optimizer: str) -> dict:
    trainer = _trainer("zero3")
    before = {n: p.clone() for n, p in trainer.local_parameters().items()}
    messages = []
    for path in (other_model, no_optimizer):
        with pytest.raises(sw.ShardwiseError) as error:
            load_pipeline(path, trainer)
        messages.append(str(error.value))
    unchanged = all(torch.equal(p, before[n]) for n, p in trainer.local_parameters().items())
    return {"messages": messages, "unchanged": unchanged}


def test_a_checkpoint_that_does_not_fit_the_stages_is_refused_on_every_rank(ranks, tmp_path):
    """Catches a load that fills the names it finds and leaves the rest (a checkpoint of another model,
    one saved without the optimizer state the stages would then start fresh), or that refuses on one stage
    only (the others would hang in the next step): every rank raises a ShardwiseError naming the problem,
    and no rank's shards change."""
    other, bare = tmp_path / "gpt3", tmp_path / "bare"
    bigger = gpt(3)
    sw.save(other, bigger, make_optimizer(bigger))
    sw.save(bare, gpt(2))
    for rank, got in enumerate(ranks.run(_refusals_on_rank, 4, str(other), str(bare), timeout=180)):
        names, optimizer = got["messages"]
        assert "does not hold this pipeline's model" in names and "blocks.2" in names, f"rank {rank}: {names}"
        assert "no optimizer state" in optimizer, f"rank {rank}: {optimizer}"
        assert got["unchanged"], f"rank {rank}: a refused load changed the shards"
