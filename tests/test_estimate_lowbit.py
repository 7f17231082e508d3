"""sw.estimate's low-bit optimizer state (torchao's AdamW8bit, AdamW4bit) against what the engine holds after a
real step at world size 2: each tensor quantized or fp32 by torchao's rule, each parameter's whole state on its
owner rank under zero2/zero3, the whole state on every rank under ddp (Note [low-bit estimate] in
estimate/lowbit_bytes.py). The state bytes are exact: codes, block scales and code maps are sizes, not guesses.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import shardwise as sw
from helpers.lowbit import HAS_TORCHAO, NO_TORCHAO, Block, Net, lowbit_pool
from shardwise.errors import ShardwiseError
from shardwise.estimate.lowbit_bytes import (
    LOW_BIT,
    TORCHAO_COLD_COMPILE_BYTES,
    TORCHAO_RUNTIME_BYTES,
    lowbit_terms,
    quantized,
    tensors_of_model,
)


@pytest.fixture(scope="module")
def ranks():
    """Two ranks with torchao on their path (helpers/lowbit.py's lowbit_pool); the estimates need none."""
    if not HAS_TORCHAO:
        pytest.skip(NO_TORCHAO)
    with lowbit_pool(2) as pool:
        yield pool


def _meta_net():
    with torch.device("meta"):
        return Net()


# Each strategy once, and each optimizer's format under zero3 (the owners') and ddp (every rank's): a few
# seconds a row.
@pytest.mark.parametrize("strategy, name, in_backward", [
    ("zero3", "adamw8bit", False), ("zero3", "adamw4bit", False), ("zero2", "adamw8bit", False),
    ("zero1", "adamw4bit", False), ("ddp", "adamw8bit", False), ("ddp", "adamw4bit", False),
    ("zero3", "adamw8bit", True), ("zero2", "adamw4bit", True)])
def test_lowbit_state_equals_what_each_rank_holds(ranks, strategy, name, in_backward):
    """Catches the estimator counting a low-bit optimizer's state as AdamW's (8 bytes an element, split by rows),
    quantizing tensors torchao keeps in fp32 (the 130 x 32 head: 4160 elements, not a multiple of the block) or
    the other way, leaving out the scales, code maps or step counters, or putting the state on other ranks than
    the engine's owners (after backward, or unit by unit under sw.optimizer_in_backward, Note [whole step per
    unit]): every rank's state bytes after a real step equal the estimate's for that rank, and the
    estimate's optimizer_state is the busiest rank's. Also catches sw.estimate.measure failing on quantized
    state (a tensor subclass with no storage of its own): the busiest rank's model state within 5% of the estimate."""
    from helpers.estimate_lowbit import held_after_step

    model = _meta_net()
    est = sw.estimate(model, strategy, 2, optimizer=name, units=Block, optimizer_in_backward=in_backward)
    predicted = lowbit_terms(tensors_of_model(model, Block, 1 if strategy == "ddp" else 2), strategy, 2, name, 4,
                             copies_values=strategy in ("zero1", "zero2"), in_backward=in_backward).state_by_rank
    held = ranks.run(held_after_step, 2, strategy, name, in_backward, timeout=300)
    assert [h["state"] for h in held] == list(predicted), ([h["state"] for h in held], predicted)
    assert est.optimizer_state == max(h["state"] for h in held), (est.optimizer_state, held)
    busiest = max(h["model_state"] for h in held)  # the estimate is the busiest rank's (its owners' state)
    # In backward each unit's gradient is stepped and dropped: none is left after it (`gradients` is the one
    # unit's held while it steps, Note [gradients stepped in backward]).
    expected = est.model_state - (est.gradients if in_backward else 0)
    assert abs(expected - busiest) <= 0.05 * busiest, (expected, held)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("strategy, name", [("zero3", "adamw8bit"), ("zero2", "adamw4bit")])
def test_step_buffers_within_10_percent_of_the_steps_peak(ranks, strategy, name):
    """Catches the whole-tensor step's buffers counted as the owner's whole values and gradients alone (zero3's
    gather also holds every rank's sent rows and the owner's receive buffers: 3x that), or torchao's own buffers
    for the tensor it steps left out (4-bit's 6.5x its fp32 size outweigh zero2's gather): each rank's peak
    over its RSS during a steady optimizer.step() against `step_buffers`, the busiest rank's."""
    from helpers.estimate_lowbit import step_peak, wide

    with torch.device("meta"):
        model = wide()
    predicted = sw.estimate(model, strategy, 2, optimizer=name, units=Block).step_buffers
    measured = max(ranks.run(step_peak, 2, strategy, name, timeout=300))
    assert abs(predicted - measured) <= 0.1 * measured, (predicted / 2**20, measured / 2**20)


def test_the_model_mixes_quantized_and_fp32_state():
    """Catches the test above losing its point: a model whose tensors are all quantized (or none) cannot tell
    torchao's size rule from a flat rate."""
    model = _meta_net()
    for kind in LOW_BIT.values():
        kinds = {quantized(p.numel(), kind) for p in model.parameters()}
        assert kinds == {True, False}, kind


def test_lowbit_adds_the_step_buffers_and_torchaos_runtime():
    """Catches the whole-tensor step's owner buffers or torchao's runtime left out of the peak, or counted under
    optimizer_in_backward as after backward: the step's gathers count once, at the step or (in backward) one
    unit's at a time with the backward's buffers; ddp steps in place (only the step's own buffers)."""
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.models.gpt import Block as GPTBlock

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, seq_len=16, d_model=64, n_layers=4, n_heads=4))
    adamw = sw.estimate(model, "zero3", 4, units=GPTBlock)
    low = sw.estimate(model, "zero3", 4, optimizer="adamw8bit", units=GPTBlock)
    assert low.step_buffers > 0 and low.optimizer_runtime > TORCHAO_RUNTIME_BYTES + TORCHAO_COLD_COMPILE_BYTES
    assert low.optimizer_state < adamw.optimizer_state / 3
    step_phase = low.parameters + low.optimizer_state + low.gradients + low.step_buffers
    assert low.total >= step_phase + low.runtime + low.optimizer_runtime
    stepped = sw.estimate(model, "zero3", 4, optimizer="adamw8bit", units=GPTBlock, optimizer_in_backward=True)
    assert stepped.step_buffers == 0 and stepped.gather_buffers > low.gather_buffers
    ddp = sw.estimate(model, "ddp", 4, optimizer="adamw8bit")
    largest = max(p.numel() for p in model.parameters())
    assert ddp.step_buffers == 2 * 4 * largest, ddp.step_buffers  # torchao's own buffers for one tensor


@pytest.mark.parametrize("offload", ["host", "disk:/tmp/shardwise-offload"])
def test_lowbit_with_offload_is_refused(offload):
    """Catches the estimator pricing low-bit state under offload, which it does not model (the engine refuses
    offload='host' for a whole-tensor step and cannot spill quantized state to disk), as if it did."""
    with pytest.raises(ShardwiseError, match="not modelled"):
        sw.estimate(10**6, "zero3", 2, optimizer="adamw8bit", offload=offload)


def test_the_commands_take_the_lowbit_optimizers(capsys):
    """Catches `--optimizer adamw8bit` refused by the commands, its rows missing from `shardwise estimate`'s
    table, or the offload rows it does not model priced anyway (or crashing `plan --json`) instead of marked."""
    from shardwise import cli

    model = ["gpt", "d_model=64", "n_layers=2", "vocab_size=512", "seq_len=16", "--world-size", "2"]
    assert cli.main(["estimate", *model, "--strategy", "zero3", "--optimizer", "adamw8bit"]) == 0
    out = capsys.readouterr().out
    assert "whole-step buffers" in out and "optimizer runtime (torchao)" in out and "adamw8bit" in out, out
    assert cli.main(["plan", *model, "--memory", "4GiB", "--optimizer", "adamw4bit", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    offloaded = [row for row in rows if "offload" in row["label"]]
    assert offloaded and all(row["estimate"] is None and "not modelled" in row["reason"] for row in offloaded), rows
    assert all(row["estimate"]["optimizer"] == "adamw4bit" for row in rows if row not in offloaded)
