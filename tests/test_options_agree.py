"""Ranks given different options (issue 60, items 5 and 6): `sw.shard` options and `PipeTrainer`'s
`PipelineConfig` that differ per rank are refused on every rank within seconds, naming the option and each
rank's value, and the check covers every option by construction (Note [options by construction],
wire/canonical.py): a field added to a policy is compared without anyone listing it."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
import shardwise.engine.api as api
from helpers.pipe import GLOBAL_BATCH, dataset, gpt, token_loss
from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Unit() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def timed(work):
    """(error text or None, seconds until it, losses) of `work()` (a list of losses)."""
    start = time.monotonic()
    try:
        return None, None, work()
    except sw.ShardwiseError as error:
        return str(error), time.monotonic() - start, None


def _shard_and_train(per_rank: list[dict]):
    """Each rank shards the same model with its own options, then trains two steps."""
    def work():
        torch.manual_seed(0)
        model = Net()
        sw.shard(model, **{"units": Unit, **per_rank[dist.get_rank()]})
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            loss = model(torch.ones(4, 8))
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        return losses
    return timed(work)


def assert_refused_alike(results, *words):
    for rank, (message, seconds, losses) in enumerate(results):
        assert message is not None, f"rank {rank} trained: {losses}"
        assert seconds < 15, f"rank {rank} refused after {seconds:.0f} s"
        for word in words:
            assert word in message, (word, message)
    assert len({message for message, _, _ in results}) == 1, "every rank names the same difference"


Z3 = {"strategy": "zero3"}
CASES = {
    "compression-on-rank-0-only": ([{**Z3, "compression": sw.Compression(reduce="int8")}, Z3],
                                   ["compression is Compression(gather=None, reduce='int8', block=256) on rank 0",
                                    "None on rank 1"]),
    "int4-vs-int8": ([{**Z3, "compression": {"reduce": "int4"}}, {**Z3, "compression": {"reduce": "int8"}}],
                     ["compression.reduce is 'int4' on rank 0; 'int8' on rank 1"]),
    "block": ([{**Z3, "compression": sw.Compression(gather="int8", block=128)},
               {**Z3, "compression": sw.Compression(gather="int8")}], ["compression.block is 128 on rank 0"]),
    "zero2-vs-zero3": ([{"strategy": "zero2"}, Z3], ["strategy is 'zero2' on rank 0; 'zero3' on rank 1"]),
    "hpz-on-rank-0": ([{**Z3, "reshard_after_forward": 2}, Z3], ["reshard_after_forward is 2 on rank 0"]),
    # one rank releasing its pool at the tail and the other keeping it would still train alike; refused so that
    # what sw.describe and sw.estimate say of one rank holds for all (Note [options by construction])
    "kept-buffers-on-rank-0": ([{**Z3, "keep_comm_buffers": True}, Z3], ["keep_comm_buffers is True on rank 0"]),
    "precision": ([{**Z3, "precision": "bf16"}, {**Z3, "precision": sw.MixedPrecision()}],
                  ["precision.param_dtype is 'torch.bfloat16' on rank 0; 'torch.float32' on rank 1"]),
    "units": ([{**Z3, "units": Unit}, {**Z3, "units": ["blocks.0", "blocks.1"]}],
              ["units is", "Unit' on rank 0; ['blocks.0', 'blocks.1'] on rank 1"]),
    # rank 0 refuses its own options: before, it raised alone and rank 1 waited for it
    "refused-on-rank-0": ([{**Z3, "reshard_after_forward": False}, Z3],
                          ["reshard_after_forward is False on rank 0; True on rank 1", "Rank 0 also refused its own"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sw_shard_options_that_differ_per_rank_are_refused_on_every_rank(ranks, case):
    """Catches issue 60 item 5: ranks passing different sw.shard options (compression on one rank, int4
    against int8, another block, zero2 against zero3, hpZ on one rank) hung until the group's timeout,
    aborted in gloo or ended in DistStoreError, since shard() compared the mesh and the parameters only.
    Now shard() refuses on every rank at once, naming the option and each rank's value."""
    per_rank, words = CASES[case]
    assert_refused_alike(ranks.run(_shard_and_train, 2, per_rank, timeout=60), *words)


def test_equal_options_spelled_differently_still_train(ranks, tmp_path):
    """Catches a comparison of spellings rather than options, or of what ranks may choose apart:
    precision='bf16' on one rank and the MixedPrecision it means on the other, compression as a dict and as a
    Compression, are the same options; each rank's own offload directory is its own disk's business."""
    per_rank = [{"strategy": "zero2", "precision": "bf16", "compression": {"reduce": "int8"}},
                {"strategy": "zero2", "precision": sw.MixedPrecision(param_dtype=torch.bfloat16),
                 "compression": sw.Compression(reduce="int8")}]
    results = ranks.run(_shard_and_train, 2, per_rank, timeout=60)
    assert [message for message, _, _ in results] == [None, None]
    per_rank = [{"strategy": "zero3", "offload": f"disk:{tmp_path / 'a'}"},
                {"strategy": "zero3", "offload": sw.DiskOffload(str(tmp_path / "b"))}]
    results = ranks.run(_shard_and_train, 2, per_rank, timeout=60)
    assert [message for message, _, _ in results] == [None, None]


def _shard_with_a_new_field(where: str):
    """Each rank's options carry a field nobody listed (its value: the rank), on ShardConfig or Compression."""
    rank = dist.get_rank()
    if where == "ShardConfig":
        extended = dataclasses.make_dataclass("ShardConfig", [("new_knob", int, dataclasses.field(default=rank))],
                                              bases=(sw.ShardConfig,), frozen=True)
        original, api.ShardConfig = api.ShardConfig, extended
        try:
            return _shard_and_train([{"strategy": "zero2"}] * 2)
        finally:
            api.ShardConfig = original
    extended = dataclasses.make_dataclass("Compression", [("new_knob", int, dataclasses.field(default=rank))],
                                          bases=(sw.Compression,), frozen=True)
    return _shard_and_train([{"strategy": "zero2", "compression": extended(reduce="int8")}] * 2)


@pytest.mark.parametrize("where", ["ShardConfig", "Compression"])
def test_a_field_added_to_the_options_is_compared_without_being_listed(ranks, where):
    """Catches a check over a list of remembered options: a field added to ShardConfig (one no shard()
    argument names) or to a nested policy (Compression) and set differently per rank is refused, naming it."""
    path = "new_knob" if where == "ShardConfig" else "compression.new_knob"
    assert_refused_alike(ranks.run(_shard_with_a_new_field, 2, where, timeout=60),
                          f"{path} is 0 on rank 0; 1 on rank 1")


# ---- the pipeline's PipelineConfig (item 6) ---------------------------------------------


def _pipe_trainer(per_rank: list[dict], extra_field: bool = False):
    """Each rank builds a PipeTrainer with its own PipelineConfig keywords (and, with `extra_field`, a
    PipelineConfig that carries a field nobody listed, its value the rank)."""
    def work():
        config_class = PipelineConfig
        if extra_field:
            config_class = dataclasses.make_dataclass(
                "PipelineConfig", [("new_knob", int, dataclasses.field(default=dist.get_rank()))],
                bases=(PipelineConfig,), frozen=True)
        inputs, targets = dataset()
        PipeTrainer(chain_layers(gpt(2)), token_loss, grouped_adamw(eps=1e-3), inputs, targets,
                    global_batch_size=GLOBAL_BATCH, config=config_class(**per_rank[dist.get_rank()]))
        return []
    return timed(work)


PIPE_CASES = {
    "num_microbatches": ([{"num_stages": 2, "num_microbatches": 4}, {"num_stages": 2, "num_microbatches": 2}],
                         "config.num_microbatches is 4 on rank 0; 2 on rank 1"),
    "schedule": ([{"num_stages": 2, "schedule": "gpipe"}, {"num_stages": 2, "schedule": "1f1b"}],
                 "config.schedule is 'gpipe' on rank 0; '1f1b' on rank 1"),
    "num_stages": ([{"num_stages": 2}, {"num_stages": 1}], "config.num_stages is 2 on rank 0; 1 on rank 1"),
    "strategy": ([{"num_stages": 1, "strategy": "zero3"}, {"num_stages": 1}],
                 "config.strategy is 'zero3' on rank 0; None on rank 1"),
}


@pytest.mark.parametrize("case", list(PIPE_CASES))
def test_pipeline_configs_that_differ_per_rank_are_refused_on_every_rank(ranks, case):
    """Catches issue 60 item 6: ranks building different PipelineConfigs (num_microbatches, schedule,
    num_stages) got a raw ValueError on one rank and "connection closed" on the other, or a hang and a raw
    gloo error. Now every rank refuses at once, naming the field and each rank's value."""
    per_rank, words = PIPE_CASES[case]
    assert_refused_alike(ranks.run(_pipe_trainer, 2, per_rank, timeout=60), words, "Build the same PipelineConfig")


def test_a_field_added_to_pipeline_config_is_compared_without_being_listed(ranks):
    """Catches a PipelineConfig check over a list of remembered fields: a new field set differently per rank
    is refused, naming it."""
    results = ranks.run(_pipe_trainer, 2, [{"num_stages": 2}] * 2, True, timeout=60)
    assert_refused_alike(results, "config.new_knob is 0 on rank 0; 1 on rank 1")

