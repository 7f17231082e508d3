"""The option rules of shard(): each written once (shardwise/config.py), tested once here, and
enforced identically by `sw.shard` and `sw.estimate` (in this process: no ranks needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardwise as sw
from shardwise.config import ZERO_STRATEGIES, DiskOffload, ShardConfig
from shardwise.engine.unit.stage import policy_of

SRC = Path(__file__).resolve().parents[1] / "src" / "shardwise"

# (keyword arguments, a phrase of the error unique to that rule)
RULES = [
    ({"strategy": "zero4"}, "is not one of ('ddp', 'zero1', 'zero2', 'zero3')"),
    ({"strategy": "ddp", "precision": "bf16"}, "precision is a zero-strategy option"),
    ({"strategy": "zero2", "offload": "disk:/tmp/x"}, "offload needs strategy='zero3'"),
    ({"strategy": "ddp", "checkpoint_activations": True}, "checkpoint_activations needs units"),
    ({"strategy": "zero3", "find_unused_parameters": True}, "find_unused_parameters is a ddp option"),
    ({"strategy": "zero3", "offload": "ram"}, "is not understood: use None, 'host' or 'disk:PATH'"),
    ({"strategy": "zero3", "offload": "cpu"}, "is spelled offload='host' here"),
    ({"strategy": "ddp", "offload": "host"}, "offload='host' is a zero-strategy option"),
    ({"strategy": "zero3", "offload": ("host", "disk:/tmp/x")}, "not both; pick one"),
    ({"strategy": "zero3", "precision": "fp8"}, "or a MixedPrecision(...)"),
    ({"strategy": "zero2", "prefetch": 3}, "so there is nothing to gather ahead of use"),
    ({"strategy": "zero3", "prefetch": 0}, "an int of at least 1 (default 1)"),
    ({"strategy": "zero2", "keep_comm_buffers": True}, "buffers between steps already. Use strategy='zero3'"),
    ({"strategy": "zero3", "keep_comm_buffers": "yes"}, "default: released at backward's tail"),
]
# How a message is spelled in the source where it is formatted from a constant.
SOURCE_FORM = {RULES[0][1]: "is not one of {STRATEGIES}"}


@pytest.mark.parametrize("kwargs, phrase", RULES, ids=[phrase[:30] for _, phrase in RULES])
def test_each_rule_is_enforced_by_shard_and_estimate_alike(kwargs, phrase):
    """Catches a rule that one entry point forgot or words differently: shard()'s policy and the
    estimator must refuse the same options with the same message."""
    with pytest.raises(sw.ShardwiseError) as by_config:
        ShardConfig.of(**kwargs)
    assert phrase in str(by_config.value)
    estimate_kwargs = {k: v for k, v in kwargs.items() if k != "find_unused_parameters"}
    if len(estimate_kwargs) == len(kwargs):  # estimate has no find_unused_parameters
        with pytest.raises(sw.ShardwiseError) as by_estimate:
            sw.estimate(1000, world_size=2, **estimate_kwargs)
        assert str(by_estimate.value) == str(by_config.value)


@pytest.mark.parametrize("kwargs, phrase", RULES, ids=[phrase[:30] for _, phrase in RULES])
def test_each_rule_is_written_once(kwargs, phrase):
    """Catches a rule copied into a second module (it was in strategies.py, _zero.py and
    estimate.py): its message appears exactly once in the package's source."""
    in_source = SOURCE_FORM.get(phrase, phrase)
    found = [str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if in_source in path.read_text()]
    assert found == ["config.py"], found


def test_policies_validate_their_fields():
    """Catches a policy that accepts a value it cannot honour."""
    with pytest.raises(sw.ShardwiseError, match="param_dtype"):
        sw.MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(sw.ShardwiseError, match="DiskOffload.path"):
        DiskOffload("")
    with pytest.raises(sw.ShardwiseError, match="HostOffload.pin_memory=1 must be True or False"):
        sw.HostOffload(pin_memory=1)


def test_string_shortcuts_map_onto_the_policies():
    """Catches a shortcut that resolves to another policy than documented."""
    config = ShardConfig.of("zero3", precision="bf16", offload="disk:/scratch")
    assert config.precision == sw.MixedPrecision(param_dtype=torch.bfloat16)
    assert config.offload == DiskOffload("/scratch") and config.offload.spec == "disk:/scratch"
    assert config.label == "zero3+bf16+offload"
    for strategy in ZERO_STRATEGIES:  # host offload takes every zero stage (Note [host offload])
        assert ShardConfig.of(strategy, offload="host").offload == sw.HostOffload(pin_memory=True)
    # What each zero stage keeps is its policy's answer (Note [stages]), not a flag on the config.
    kept = torch.zeros(4)
    assert [policy_of(s).pooled_gathered_bytes(2, 8, 8) > 0 for s in ZERO_STRATEGIES] == [False, False, True]
    assert [policy_of(s).kept_grads(kept) is kept for s in ZERO_STRATEGIES] == [True, False, False]
