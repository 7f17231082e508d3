"""A pipeline checkpoint holds the whole model (issue 60, points 1 and 2; pipeline/checkpoint/): the frozen
prefix a re-pack took out of the stages is saved, resumed and exported with the rest (Note [the frozen prefix
in a checkpoint]); a model name two stages give to different tensors is refused at the save and the load,
never one of them lost (Note [one value per name])."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import shardwise as sw
from helpers.pipe import GLOBAL_BATCH, MICRO, batches_of, dataset, gpt, token_loss
from shardwise.checkpoint.interop.tools import export_checkpoint
from shardwise.engine.layout.parallel_layout import ParallelLayout
from shardwise.pipeline import (
    PipelineConfig,
    PipeTrainer,
    chain_layers,
    grouped_adamw,
    load_pipeline,
    load_stages,
    save_pipeline,
    save_stages,
)
from shardwise.pipeline.sharded import shard_stage

FROZEN_AT, SAVED_AT, STEPS = 3, 6, 8


def _trainer(num_homes: int | None = None) -> PipeTrainer:
    inputs, targets = dataset()
    config = PipelineConfig(num_stages=2, num_microbatches=MICRO, schedule="1f1b", cache=True, strategy="zero3")
    return PipeTrainer(chain_layers(gpt(2)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                       global_batch_size=GLOBAL_BATCH, config=config, **({"num_homes": num_homes} if num_homes else {}))


def _steps(trainer: PipeTrainer, first: int, last: int) -> list[float]:
    return [trainer.step(b) for b in batches_of(trainer.sampler, STEPS)[first:last]]


def _frozen_resume_on_rank(directory: str) -> dict:
    trainer = _trainer()
    losses = _steps(trainer, 0, FROZEN_AT)
    trainer.freeze(2)  # the embeddings and blocks.0 leave the stages (re-packed)
    losses += _steps(trainer, FROZEN_AT, SAVED_AT)
    at_save = trainer.full_parameters()
    path = save_pipeline(Path(directory) / "ckpt", trainer, step=SAVED_AT)
    straight = losses + _steps(trainer, SAVED_AT, STEPS)
    final = trainer.full_parameters()
    resumed = _trainer()
    report = load_pipeline(path, resumed)
    loaded = resumed.full_parameters()
    tail = _steps(resumed, SAVED_AT, STEPS)
    return {"at_save": at_save, "loaded": loaded, "straight": straight[SAVED_AT:], "tail": tail, "final": final,
            "resumed": resumed.full_parameters(), "frozen": resumed.layout.num_frozen, "missing": report.missing,
            "path": str(path)}


def test_a_frozen_prefix_is_saved_resumed_and_exported(ranks, tmp_path):
    """Catches a pipeline checkpoint that leaves out the layers a freeze took out of the stages (the
    embeddings and blocks.0 of the GPT at pipe 2 x zero3 2 after freeze(2)), a resume that does not freeze
    them again or loads them stale, and an export that writes part of the model: the index lists every
    parameter, a fresh trainer loads it (frozen again, every value bitwise) and ends the run bitwise equal to
    the run never stopped, and the export holds every tensor at its saved value."""
    results = ranks.run(_frozen_resume_on_rank, 4, str(tmp_path), timeout=300)
    names = set(dict(gpt(2).named_parameters()))
    for rank, got in enumerate(results):
        assert got["frozen"] == 2 and got["missing"] == [], f"rank {rank}: {got['frozen']} frozen, {got['missing']}"
        assert all(torch.equal(got["loaded"][n], v) for n, v in got["at_save"].items()), f"rank {rank}: loaded"
        assert got["tail"] == got["straight"], f"rank {rank}: losses {got['tail']} != {got['straight']}"
        assert all(torch.equal(got["resumed"][n], v) for n, v in got["final"].items()), f"rank {rank}: params"
    path = Path(results[0]["path"])
    index = json.loads((path / "index.json").read_text())
    assert set(index["params"]) == names, f"the index lacks {sorted(names - set(index['params']))}"
    export_checkpoint(path, tmp_path / "export" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert set(exported) >= names, f"the export lacks {sorted(names - set(exported))}"
    assert all(torch.equal(exported[n], results[0]["at_save"][n]) for n in names)


def _linear_stage(out_features: int, seed: int):
    """A stage of one Linear, sharded zero3 over its own rank (pipe 2 x shard 1), its names "layer.*" on both."""
    torch.manual_seed(seed)
    layer = nn.Linear(4, out_features)
    layout = ParallelLayout.pipelined([[[0]], [[1]]])
    module, local = shard_stage([layer], {id(layer.weight): "w", id(layer.bias): "b"}, "zero3", layout)
    return module, {n: f"layer.{n.rsplit('.', 1)[-1]}" for n in local}


def _one_name_on_rank(directory: str, same_shape: bool, plain: str) -> dict:
    rank = torch.distributed.get_rank()
    module, names = _linear_stage(4 if same_shape or rank == 0 else 3, seed=rank)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    out = {}
    with pytest.raises(sw.ShardwiseError) as error:
        save_stages(Path(directory) / "two", module, names=names, stage=rank)
    out["save"] = str(error.value)
    out["written"] = (Path(directory) / "two").exists()
    if same_shape:
        with pytest.raises(sw.ShardwiseError) as error:
            load_stages(plain, module, names=names)
        out["load"] = str(error.value)
    out["unchanged"] = all(torch.equal(p.detach(), before[n]) for n, p in module.named_parameters())
    return out


@pytest.mark.parametrize("same_shape", [True, False])
def test_two_stages_giving_one_name_to_different_tensors_are_refused(ranks, tmp_path, same_shape):
    """Catches a save_stages that takes a name held by two stages for a tie (each stage's own {"0.weight":
    "layer.weight"}): the index kept stage 0's tensor only and load_stages then gave stage 1 stage 0's
    weights, reporting ok. Same shape other values, and another shape: the save raises a ShardwiseError on
    every rank naming the name and the fix, writes nothing; a load into such stages is refused, nothing
    changed."""
    sw.save(plain := tmp_path / "layer", _named_layer())  # one process: "layer.weight", "layer.bias"
    for rank, got in enumerate(ranks.run(_one_name_on_rank, 2, str(tmp_path), same_shape, str(plain), timeout=120)):
        assert "'layer.weight'" in got["save"] and "own names" in got["save"], f"rank {rank}: {got['save']}"
        assert not got["written"], f"rank {rank}: a refused save left a checkpoint"
        if same_shape:
            assert "'layer.weight'" in got["load"], f"rank {rank}: {got['load']}"
        assert got["unchanged"], f"rank {rank}: a refused load changed the stage"


def _named_layer() -> nn.Module:
    holder = nn.Module()
    holder.layer = nn.Linear(4, 4)
    return holder


def _saved_at_4(directory: str) -> list[float]:
    trainer = _trainer()
    _steps(trainer, 0, 2)
    save_pipeline(Path(directory) / "at4", trainer, step=2)
    return _steps(trainer, 2, 4)


def _resumed_at_2(directory: str) -> dict:
    with pytest.raises(sw.ShardwiseError) as error:
        load_pipeline(Path(directory) / "at4", _trainer())
    trainer = _trainer(num_homes=4)
    load_pipeline(Path(directory) / "at4", trainer)
    return {"refusal": str(error.value), "losses": _steps(trainer, 2, 4)}


def test_a_pipeline_resumed_at_another_world_size_keeps_its_batches(ranks, tmp_path):
    """Catches a resume at another world size training on other batches: the sampler's homes were the
    world size, so a pipe 2 x zero3 2 checkpoint resumed at pipe 2 x 1 (2 ranks) drew other global batches
    (step-4 loss 4.8428 against 4.8276). The default trainer at 2 ranks is refused on every rank naming
    num_homes=4; built with num_homes=4 it trains on the run's batches (losses equal to 1e-5: the reduction
    order differs with the shard count)."""
    straight = ranks.run(_saved_at_4, 4, str(tmp_path), timeout=240)[0]
    for rank, got in enumerate(ranks.run(_resumed_at_2, 2, str(tmp_path), timeout=240)):
        assert "num_homes=4" in got["refusal"], f"rank {rank}: {got['refusal']}"
        assert got["losses"] == pytest.approx(straight, rel=1e-5), f"rank {rank}: {got['losses']} != {straight}"
