"""What a steady-state forward sends and reads (Note [agreement rides the traffic], agreement.py): the
collectives it issues, counted by wrapping torch.distributed's, and the host reads the engine makes,
counted by helpers/host_reads.py, in the order they happen."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.host_reads import HOST_VALUES, count_host_reads
from shardwise.engine import engine_of
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice, watch_collectives


class _Reads(collections.Counter):
    """A Counter of host reads that also logs each one, in order, beside the collectives."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def __setitem__(self, where, count):
        if where != "torch or the test":
            self.log.append(("read", where))
        super().__setitem__(where, count)


@contextlib.contextmanager
def _traffic(header_group, tag_group=None):
    """A log of every collective (("header" | "tag" | "payload", name)) and every engine host read (("read",
    where)) in the block, in order. Tags: zero3's gather tags (Note [gather tags], gather_tags.py)."""
    log = []

    def record(name: str, arguments: dict) -> None:
        group = arguments.get("group")
        log.append(("header" if group is header_group else "tag" if tag_group is not None and group is tag_group
                    else "payload", name))

    with watch_collectives(record), count_host_reads(_Reads(log)):
        yield log


def _device_reads(log) -> list:
    return [where for kind, where in log if kind == "read" and where not in HOST_VALUES]


def _forwards(strategy: str):
    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    header_group = engine_of(model).agreement.group
    tags = engine_of(model).driver.gathers.tags  # zero3's (Note [gather tags]); None for zero1/zero2
    tag_group = tags.group if tags is not None else None
    optim = torch.optim.AdamW(model.parameters(), foreach=True)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    for _ in range(2):  # set-up and first-call work done
        model(x, y).backward()
        optim.step()
        optim.zero_grad()
    with _traffic(header_group, tag_group) as train:  # a steady-state training forward, after a step
        loss = model(x, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    model.eval()
    evals = []
    with torch.no_grad():
        model(x, y)  # the first evaluation after the step re-gathers (zero1/zero2)
        for _ in range(2):
            with _traffic(header_group, tag_group) as log:
                model(x, y)
            evals.append(log)
    return train, evals


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_steady_state_forwards_wait_for_no_barrier(ranks, strategy):
    """Catches a barrier before every forward (a blocking all-gather read on the host: each training
    step, evaluation batch and generate() token waited for every rank before its first collective): a
    training forward now issues its re-gathers or gathers before the engine reads anything, and
    reads no device value; a zero1/zero2 evaluation forward with nothing to re-gather issues no
    collective at all (as DDP's), zero3's only its gathers (each with its tag) and one header."""
    for train, evals in ranks.run(_forwards, 2, strategy):
        assert _device_reads(train) == [], train
        first_payload = next(i for i, (kind, _) in enumerate(train) if kind == "payload")
        assert not any(kind == "read" for kind, _ in train[:first_payload]), train
        assert [name for kind, name in train if kind == "header"] == ["all_gather_single"], train
        # zero3: one small tag beside each unit's gather (the 3 units not kept from the last backward);
        # zero1/zero2 gather in one fixed order, untagged
        assert [name for kind, name in train if kind == "tag"] == ["all_gather_single"] * (
            3 if strategy == "zero3" else 0), train
        for log in evals:
            if strategy == "zero3":
                assert [entry for entry in log if entry[0] == "header"] == [("header", "all_gather_single")], log
                assert {name for kind, name in log if kind == "payload"} == {"broadcast"}, log  # gloo's gathers
                assert _device_reads(log) == [], log
            else:
                assert log == [], log


def _generate_traffic():
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)).eval()
    sw.shard(model, strategy="zero3")
    engine = engine_of(model)
    prompt = torch.tensor([[1 + sw.get_rank(), 2, 3]])
    model.generate(prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)  # first-call work
    before = engine.num_forwards
    with _traffic(engine.agreement.group, engine.gathers.tags.group) as log:
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    return log, engine.num_forwards - before


@pytest.mark.slow  # transformers' import and generate(): 14 s on 2 cores
def test_generate_sends_one_header_per_token_and_reads_no_device_value(ranks):
    """Catches generate() paying a barrier per token (a blocking all-gather on the model's group, read on
    the host, before each token's gathers): each forward of generate() now sends its gathers and one
    header on the agreement's own group, and the engine reads no device value."""
    for log, forwards in ranks.run(_generate_traffic, 2, timeout=120):
        assert forwards == 4
        assert [entry for entry in log if entry[0] == "header"] == [("header", "all_gather_single")] * 4, log
        assert {name for kind, name in log if kind == "payload"} == {"broadcast"}, log
        assert _device_reads(log) == [], log


def _freeze_on_rank_1_before_a_backward(strategy: str):
    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    if dist.get_rank() == 1:  # a parameter of the last unit: the first one backward reduces
        engine_of(model).units[-1].shard_params[0].requires_grad_(False)
    try:
        model(x, y).backward()  # zero2: a forward with nothing to gather; the backward's header refuses it
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_a_freeze_on_one_rank_is_refused_before_the_first_reduce(ranks):
    """Catches the backward's header checked after its first reduce was issued (or not at all): a rank
    that froze a parameter reduces a unit of another size, which gloo mis-pairs or hangs on; every rank
    raises instead, before it."""
    for message in ranks.run(_freeze_on_rank_1_before_a_backward, 2, "zero2", timeout=60):
        assert message is not None and "requires_grad was changed" in message, message
