"""Pipeline stages on the engine (issue 46): the layout's "pipe" dimension, stages sharded zero1/zero2/zero3
over their data-parallel ranks, micro-batches reduced once per step, and a weight tied across the first and
last stage kept one value. Real gloo ranks against one process (DESIGN's fp32 1e-5 / 1e-6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.pipe import GLOBAL_BATCH, MICRO, TIED, batches_of, dataset, gpt, reference_run, token_loss
from helpers.pipe_llama import LlamaLayers
from shardwise.engine import engine_of
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw, sharded
from shardwise.testing import RunResult, assert_close_runs

# ---- the layout's "pipe" dimension ---------------------------------------------------------


def _ranks_of(group) -> list[int] | None:
    return None if group is None else dist.get_process_group_ranks(group)


def _pipe_layout_on_rank(grid) -> dict:
    layout = ParallelLayout.pipelined(grid)
    return {"stage": layout.pipe_rank, "stages": layout.pipe_world, "pipe": _ranks_of(layout.pipe_group),
            "data": _ranks_of(layout.group), "shard": _ranks_of(layout.shard_group),
            "shard_rank": layout.shard_rank, "replicas": layout.replicate_world,
            "replicate": _ranks_of(layout.replicate_group), "mesh": layout.device_mesh is not None}


def test_the_layout_gains_a_pipe_dimension(ranks):
    """Catches a stage's data-parallel group that spans another stage, a pipe group that mixes shard
    coordinates (a tied weight's rows summed with other rows), and a hybrid stage without its mesh:
    pipe 2 x shard 2 and pipe 2 x replicate 2 at ws 4, each rank's groups by global rank."""
    pipe_shard = [[[0, 2]], [[1, 3]]]  # stage 0 on ranks 0 and 2 (the pipeline's replica-major numbering)
    for rank, got in enumerate(ranks.run(_pipe_layout_on_rank, 4, pipe_shard)):
        stage, shard = rank % 2, rank // 2
        assert (got["stage"], got["stages"], got["shard_rank"], got["replicas"]) == (stage, 2, shard, 1)
        assert got["data"] == got["shard"] == [stage, stage + 2]
        assert got["pipe"] == [2 * shard, 2 * shard + 1] and got["replicate"] is None and not got["mesh"]
    pipe_replicate = [[[0], [2]], [[1], [3]]]
    for rank, got in enumerate(ranks.run(_pipe_layout_on_rank, 4, pipe_replicate)):
        stage = rank % 2
        assert got["data"] == got["replicate"] == [stage, stage + 2] and got["shard"] == [rank]
        assert got["replicas"] == 2 and got["mesh"] and got["pipe"] == [rank - stage, rank - stage + 1]


def _bad_grid_on_rank(grid) -> str:
    with pytest.raises(sw.ShardwiseError) as error:
        ParallelLayout.pipelined(grid)
    return str(error.value)


def test_a_grid_that_misses_a_rank_is_refused_on_every_rank(ranks):
    """Catches a grid that leaves a rank out or is ragged: each rank would make other groups (a hang)."""
    for message in ranks.run(_bad_grid_on_rank, 2, [[[0]], [[0]]]) + ranks.run(_bad_grid_on_rank, 2, [[[0, 1]], [[1]]]):
        assert "pipeline grid" in message, message


# ---- sharded stages against one process --------------------------------------------------------

STEPS = 5
LLAMA_TIED = "hf.model.embed_tokens.weight"
MODELS = {"gpt": gpt, "llama": LlamaLayers}  # the tied GPT; a Hugging Face Llama from a config


def _sharded_trainer(strategy: str, schedule: str, keep_gathered: bool = True, shards: int | None = None,
                     repack: bool = True, model: str = "gpt", per_layer: bool = False) -> PipeTrainer:
    """`per_layer`: each layer a unit, as a stage over STAGE_UNIT_BYTES is cut (Note [a stage as one unit])."""
    inputs, targets = dataset()
    config = PipelineConfig(num_stages=2, num_microbatches=MICRO, schedule=schedule, cache=False,
                            strategy=strategy, keep_gathered=keep_gathered, shards=shards, repack=repack)
    bound = sharded.STAGE_UNIT_BYTES
    sharded.STAGE_UNIT_BYTES = -1 if per_layer else bound
    try:
        return PipeTrainer(chain_layers(MODELS[model](2)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                           global_batch_size=GLOBAL_BATCH, config=config)
    finally:
        sharded.STAGE_UNIT_BYTES = bound


def _sharded_on_rank(strategy: str, schedules: list[str], shards: int | None = None, model: str = "gpt",
                     per_layer: bool = False) -> list[tuple[RunResult, torch.Tensor | None]]:
    out = []
    for schedule in schedules:
        trainer = _sharded_trainer(strategy, schedule, shards=shards, model=model, per_layer=per_layer)
        losses = [trainer.step(b) for b in batches_of(trainer.sampler, STEPS)]
        # this rank's rows of the tied weight, on the first and the last stage
        tie = trainer.local_parameters().get(TIED if model == "gpt" else LLAMA_TIED)
        out.append((RunResult(losses, [], trainer.full_parameters()), None if tie is None else tie.clone()))
    return out


@pytest.mark.parametrize(("model", "strategy"), [
    ("gpt", "zero1"), ("gpt", "zero2"), ("gpt", "zero3"), ("llama", "zero3"),
    pytest.param("llama", "zero1", marks=pytest.mark.slow), pytest.param("llama", "zero2", marks=pytest.mark.slow)])
def test_sharded_stages_match_one_process(ranks, model, strategy):
    """Catches a stage whose gradients are not the mean over its shard ranks' samples, a micro-batch's
    gradient lost or counted twice, and a tied embedding/head whose gradient is not summed across the
    first and last stage (or summed on one of them only): pipe 2 x shard 2 at ws 4, GPipe and 1F1B with 4
    micro-batches, 5 AdamW steps equal one process (fp32 1e-5 / 1e-6), and each stage's rows of the tied
    weight are bitwise equal to the other stage's rows at the same shard coordinate. Models: the tied GPT,
    and a Hugging Face Llama built from a config (helpers/pipe_llama.py: 2 layers, hidden 32, vocab 64, its
    embedding tied to its head, rotary positions in every decoder stage), a model the pipeline did not
    write (its zero1 and zero2 runs are slow)."""
    _check_sharded_stages(ranks, strategy, model)


def test_sharded_stages_with_a_unit_per_layer_match_one_process(ranks):
    """The same run with each layer a unit, as a stage over STAGE_UNIT_BYTES is cut (Note [a stage as one
    unit]): zero3 keeps several units gathered across the micro-batches and reduces each once."""
    _check_sharded_stages(ranks, "zero3", "gpt", per_layer=True)


def _check_sharded_stages(ranks, strategy: str, model: str, per_layer: bool = False) -> None:
    schedules = ["gpipe", "1f1b"]
    results = ranks.run(_sharded_on_rank, 4, strategy, schedules, None, model, per_layer, timeout=300)
    reference = reference_run(2, num_homes=4, steps=STEPS, build=MODELS[model])
    for k, schedule in enumerate(schedules):
        for rank, r in enumerate(results):
            try:
                assert_close_runs(reference, r[k][0])
            except AssertionError as e:
                raise AssertionError(f"{model} {strategy} {schedule}, rank {rank}: {e}") from None
        # rank = shard * 2 + stage: ranks 0/1 hold shard 0 of stage 0/1, ranks 2/3 shard 1
        for first, last in [(0, 1), (2, 3)]:
            assert torch.equal(results[first][k][1], results[last][k][1]), f"{strategy} {schedule}: tie drifted"


def test_sharded_stages_with_replicas_match_one_process(ranks):
    """Catches a stage whose replicas do not average their gradients (the hybrid route's all-reduce over
    "replicate") and a tie summed over the wrong ranks when each stage has replicas: pipe 2 x replicate 2 x
    shard 1 (shards=1) at ws 4, zero3 under 1F1B, 4 micro-batches, equals one process; the tie bitwise equal."""
    results = ranks.run(_sharded_on_rank, 4, "zero3", ["1f1b"], 1, timeout=180)
    reference = reference_run(2, num_homes=4, steps=STEPS)
    for rank, r in enumerate(results):
        assert_close_runs(reference, r[0][0])
    for first, last in [(0, 1), (2, 3)]:
        assert torch.equal(results[first][0][1], results[last][0][1]), "tie drifted"


def _per_step_counts_on_rank(cases: list[tuple[str, bool, bool]]) -> list[dict]:
    """Each unit's gathers and reduces in one step (the second: the first also gathers what init left)."""
    from shardwise.engine.schedule.agreement import Agreement
    from shardwise.engine.schedule.reducer import Reducer
    from shardwise.engine.unit.flat_unit import FlatUnit

    out = []
    for strategy, keep_gathered, per_layer in cases:
        trainer = _sharded_trainer(strategy, "gpipe", keep_gathered, per_layer=per_layer)
        first, second = batches_of(trainer.sampler, 2)
        trainer.step(first)
        gathers, reduces, headers = {}, {}, []
        start_gather, launch, open_header = FlatUnit.start_gather, Reducer._launch, Agreement.announce

        def counted_gather(unit, *args, **kwargs):
            gathers[id(unit)] = gathers.get(id(unit), 0) + 1
            return start_gather(unit, *args, **kwargs)

        def counted_reduce(reducer, unit, grads):
            if unit.trainable():
                reduces[id(unit)] = reduces.get(id(unit), 0) + 1
            return launch(reducer, unit, grads)

        def counted_header(agreement, phase, *args):
            headers.append(phase)
            return open_header(agreement, phase, *args)

        FlatUnit.start_gather, Reducer._launch, Agreement.announce = counted_gather, counted_reduce, counted_header
        try:
            trainer.step(second)
        finally:
            FlatUnit.start_gather, Reducer._launch, Agreement.announce = start_gather, launch, open_header
        units = [id(u) for u in engine_of(trainer.stage_module).units if u.trainable()]
        out.append({"reduces": [reduces.get(u, 0) for u in units], "gathers": [gathers.get(u, 0) for u in units],
                    "headers": len(headers)})
    return out


def test_each_unit_is_reduced_once_per_step_and_zero3_gathers_once(ranks):
    """Catches a micro-batch's gradient reduced on its own (M reduces a step, or a unit reduced twice),
    zero3 gathering every unit again for each micro-batch when told to keep them (keep_gathered), and a
    small stage cut into a unit per layer (Note [a stage as one unit]): at pipe 2 x shard 2, 4 GPipe
    micro-batches, each unit of each stage is reduced exactly once in a step under zero1, zero2 and zero3;
    zero3 with keep_gathered gathers each unit once (the stage one unit, or one per layer when told to), without
    it at least once per micro-batch (the forward's gathers; backward's come on top), each layer a unit. Agreement
    headers (Note [agreement rides the traffic]): with the units kept, one for the step's first forward,
    one for its reducing backward and one for its optimizer step (Note [uneven work]), none for the backwards
    under no_sync that issue no collective."""
    cases = [("zero1", True, False), ("zero2", True, False), ("zero3", True, False), ("zero3", True, True),
             ("zero3", False, False)]
    for rank, counts in enumerate(ranks.run(_per_step_counts_on_rank, 4, cases, timeout=180)):
        for (strategy, keep, per_layer), got in zip(cases, counts):
            one_unit = keep and not per_layer
            assert got["headers"] == 3 if keep else got["headers"] >= 2 * MICRO + 1, f"rank {rank} {strategy}: {got}"
            assert (len(got["reduces"]) == 1) == one_unit, f"rank {rank} {strategy} keep={keep}: units {got}"
            assert got["reduces"] and all(n == 1 for n in got["reduces"]), f"rank {rank} {strategy}: {got}"
            if strategy == "zero3":
                expected = (lambda n: n == 1) if keep else (lambda n: n >= MICRO)
                assert all(expected(n) for n in got["gathers"]), f"rank {rank} {strategy} keep={keep}: {got}"
            else:  # zero1/zero2 gather once after the optimizer step changed the rows
                assert all(n == 1 for n in got["gathers"]), f"rank {rank} {strategy}: {got}"


# ---- a user's own loop: a sharded stage under torch's schedules ---------------------------------


def _four_layers() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)]


def _users_loop_on_rank(strategy: str, schedule: str, stage_class: str = "sharded") -> float:
    """pipe 2 x shard 2: this rank's two layers sharded over its stage, ShardedStage (or torch's own
    PipelineStage) under torch's schedule; returns the largest difference of its stage's parameters from
    one process after 2 SGD steps."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from shardwise.pipeline import ShardedStage

    layout = ParallelLayout.pipelined([[[0, 2]], [[1, 3]]])
    stage, shard = layout.pipe_rank, layout.shard_rank
    module = torch.nn.Sequential(*_four_layers()[2 * stage: 2 * stage + 2])
    sw.shard(module, strategy=strategy, units=list(module), process_group=layout.group)
    runner = {"sharded": ShardedStage, "torch": PipelineStage}[stage_class](
        module, stage, 2, torch.device("cpu"), group=layout.pipe_group)
    steps = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](
        runner, MICRO, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    reference = torch.nn.Sequential(*_four_layers())
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (module, reference))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 8, generator=g)
        mine = slice(8 * shard, 8 * shard + 8)  # each shard coordinate's half of the global batch
        steps.step(x[mine]) if stage == 0 else steps.step(target=y[mine])
        optimizer.step()
        optimizer.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    full = sw.full_parameters(module)
    expected = dict(torch.nn.Sequential(*list(reference)[2 * stage: 2 * stage + 2]).named_parameters())
    return max(float((full[name] - p).abs().max()) for name, p in expected.items())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_users_loop_runs_a_sharded_stage_under_torchs_schedules(ranks, schedule):
    """Catches a ShardedStage that breaks torch's own schedules on gloo (a pairing of sends, a reduce
    per micro-batch that loses accumulated rows, zero3 values freed under a pending micro-batch): a
    user's loop at pipe 2 x shard 2, zero3, 4 micro-batches, equals one process after 2 SGD steps."""
    for rank, diff in enumerate(ranks.run(_users_loop_on_rank, 4, "zero3", schedule, timeout=120)):
        assert diff <= 1e-6, f"rank {rank}: {diff}"


def test_torchs_own_stage_trains_a_sharded_module_exactly(ranks):
    """Catches the engine losing gradients when torch's own PipelineStage (which knows DDP and FSDP2, not
    shardwise) backwards each micro-batch as a step of its own: each backward is then reduced by itself
    (M reduces per unit per step, which ShardedStage avoids), and the rows must still sum them all. zero3
    at pipe 2 x shard 2, 1F1B, equals one process after 2 SGD steps."""
    for rank, diff in enumerate(ranks.run(_users_loop_on_rank, 4, "zero3", "1f1b", "torch", timeout=120)):
        assert diff <= 1e-6, f"rank {rank}: {diff}"


# ---- freezing on shards ---------------------------------------------------------------------------


def _freeze_on_rank(strategies: list[str]) -> list[dict]:
    """4 steps; before the third, layer 0 (the embedding, with the tied head weight) freezes in place
    (repack=False: tests/test_pipe_repack.py re-packs)."""
    out = []
    for strategy in strategies:
        trainer = _sharded_trainer(strategy, "1f1b", repack=False)
        losses, at_freeze = [], {}
        for step, batch in enumerate(batches_of(trainer.sampler, 4)):
            if step == 2:
                before = set(trainer.local_parameters())
                trainer.freeze(1)
                frozen = before - set(trainer.local_parameters())
                shards = {n: p for n, p in trainer.stage_module.named_parameters()}
                at_freeze = {n: p for n, p in shards.items() if not p.requires_grad}
                copies = {n: p.detach().clone() for n, p in at_freeze.items()}
            losses.append(trainer.step(batch))
        optimizer = trainer.optimizer
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out.append({
            "frozen": sorted(frozen),
            "untouched": all(p.grad is None and id(p) not in stepped and p not in optimizer.state
                             for p in at_freeze.values()),
            "unchanged": all(torch.equal(p.detach(), copies[n]) for n, p in at_freeze.items()),
            "result": RunResult(losses, [], trainer.full_parameters()),
        })
    return out


def test_a_frozen_prefix_drops_grads_and_optimizer_state_on_every_shard(ranks):
    """Catches a frozen shard that still trains (weight decay, a stale gradient, optimizer state kept) and
    a tied weight frozen on its first stage but still stepped on its last: at pipe 2 x shard 2, zero1 and
    zero3, the embedding (tied to the head) freezes after 2 of 4 steps; every rank's frozen shards have no
    gradient, no optimizer state and unchanged rows, and the run equals one process that stops training
    the same layer (fp32 1e-5 / 1e-6)."""
    strategies = ["zero1", "zero3"]
    reports = ranks.run(_freeze_on_rank, 4, strategies, timeout=180)
    reference = reference_run(2, num_homes=4, steps=4, freezes={2: 1})
    for rank, per_strategy in enumerate(reports):
        stage = rank % 2
        for strategy, report in zip(strategies, per_strategy):
            expected = [TIED, "pos_emb"] if stage == 0 else [TIED]
            assert sorted(report["frozen"]) == sorted(expected), f"rank {rank} {strategy}: {report['frozen']}"
            assert report["untouched"], f"rank {rank} {strategy}: a frozen shard has a gradient or optimizer state"
            assert report["unchanged"], f"rank {rank} {strategy}: a frozen shard changed"
            assert_close_runs(reference, report["result"])
