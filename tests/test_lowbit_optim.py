"""torchao's low-bit AdamW (8-bit and 4-bit block-quantized moments) on a sharded model, against the same
optimizer stepping whole tensors in one process, and its state through a checkpoint across world sizes.

Note [low-bit state] (engine/optim/lowbit.py): torchao quantizes a state in blocks of the flattened
tensor, and only for a tensor of at least 4096 elements that its block size divides; rows of a shard
are other tensors (128 x 32 is quantized whole, its 64 x 32 rows would be kept in fp32). So shardwise
steps it on whole tensors, one owner rank per parameter (Note [whole-tensor step]), and each step is
checked bitwise against a plain model fed the same reduced gradients: the gradients' own rounding
across world sizes is the same for every optimizer and is no part of this check.
"""

from __future__ import annotations

import pytest
import torch

from helpers.lowbit import (
    HAS_TORCHAO,
    NO_TORCHAO,
    against_one_process,
    in_backward_against_after,
    load_and_step,
    load_other_blocks,
    lowbit_pool,
    offloaded_against_plain,
    owner_buffers_peak,
    replacing_step_against_one_process,
    save_after,
    save_in_backward,
)

if not HAS_TORCHAO:
    pytest.skip(NO_TORCHAO, allow_module_level=True)


@pytest.fixture(scope="module")
def ranks():
    """A pool of ranks of this module's own, with torchao on its path (helpers/lowbit.py's lowbit_pool)."""
    with lowbit_pool(4) as pool:
        yield pool


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_lowbit_steps_shards_as_one_process_steps_whole_tensors(ranks, strategy, name):
    """Catches a low-bit optimizer stepped on rows (Note [low-bit state]): each rank's rows quantized in
    other blocks, or kept in fp32 under torchao's size threshold, where one process quantizes the whole
    tensor; bitwise at every step. Also counts the state: each parameter's state on one rank only (the
    ranks' bytes sum to one process's), none duplicated."""
    for world in (2, 4):
        results = ranks.run(against_one_process, world, strategy, name, timeout=300)
        for rank, result in enumerate(results):
            assert result["differ"] == [], f"ws {world} rank {rank}: {result['differ'][:4]}"
        one_process = results[0]["one_process"]
        assert sum(r["bytes"] for r in results) == one_process, ([r["bytes"] for r in results], one_process)
        assert max(r["bytes"] for r in results) < one_process, [r["bytes"] for r in results]


@pytest.mark.parametrize("saved_by, loaded_by", [("zero3", "zero3"), ("zero2", "zero3")])
def test_lowbit_state_resumes_at_another_world_size(ranks, tmp_path, saved_by, loaded_by):
    """Catches torchao's quantized state (tensor subclasses of codes, block scales and a code map) refused
    by sw.save, or stored and loaded as something else: dequantized, rebuilt from zero, put on a rank that
    does not own the parameter at the new world size. Saved at 2 ranks, loaded at 4: every state tensor's
    parts bitwise the saved ones, each on one rank, and 2 more steps bitwise a plain model that loaded the
    same checkpoint."""
    path = str(tmp_path / "ckpt")
    saved = {}
    for state in ranks.run(save_after, 2, saved_by, "adamw8bit", path, timeout=300):
        saved.update(state)
    loaded = {}
    for result in ranks.run(load_and_step, 4, loaded_by, "adamw8bit", path, timeout=300):
        assert result["differ"] == [], result["differ"][:4]
        assert not set(loaded) & set(result["state"]), "a parameter's state on two ranks"
        loaded.update(result["state"])
    assert loaded.keys() == saved.keys()
    for param, parts in saved.items():
        assert parts.keys() == loaded[param].keys(), (param, parts.keys(), loaded[param].keys())
        assert any(key.endswith(".codes") for key in parts) or "head" in param or "bias" in param or "inp" in param
        for key, tensor in parts.items():
            assert torch.equal(loaded[param][key], tensor), f"{param} {key} differs after the load"


@pytest.mark.parametrize("saved_block, loaded_block", [(256, 8192), (8192, 256)])
def test_lowbit_state_of_another_block_size_is_refused(ranks, tmp_path, saved_block, loaded_block):
    """Catches a quantized state loaded into an optimizer that keeps that tensor in fp32 (or the other way:
    another block size quantizes other tensors): its parts or its plain moment stored under keys the step
    never reads, the next step a KeyError or a fresh moment. Refused on every rank, naming the fix."""
    for message in ranks.run(load_other_blocks, 2, str(tmp_path / "ckpt"), saved_block, loaded_block, timeout=300):
        assert "Note [low-bit state]" in message and "Build the optimizer the checkpoint was saved with" in message, \
            message


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_lowbit_in_backward_is_the_step_after_backward(ranks, strategy):
    """Catches sw.optimizer_in_backward stepping a low-bit optimizer on a unit's rows (quantized in other
    blocks than one process's, Note [low-bit state]) instead of its parameters whole on their owners (Note
    [whole step per unit]): bitwise the same optimizer stepping after backward at the same world size, every
    step; the same state bytes in all, split over ranks; no gradient left after a backward; and the user's
    step() moving no tensor (Note [no gradient, no traffic]: it gathered every owned parameter whole); the
    states balanced over the model's parameters, not unit by unit (Note [kept owners])."""
    for world in (2, 4):
        results = ranks.run(in_backward_against_after, world, strategy, "adamw8bit", timeout=300)
        for rank, result in enumerate(results):
            assert result["differ"] == [], f"ws {world} rank {rank}: {result['differ'][:4]}"
            assert result["left"] == 0, f"ws {world} rank {rank}: {result['left']} gradients outlived backward"
            moved = {call for call in result["calls"] if call in ("gather", "scatter", "broadcast")}
            assert not moved, f"ws {world} rank {rank}: the user's step() called {result['calls']}"
        # the same states, each on one rank (the owners are balanced unit by unit here, over the model there)
        assert sum(r["bytes"] for r in results) == sum(r["after_bytes"] for r in results), results
        assert max(r["bytes"] for r in results) < sum(r["bytes"] for r in results), results
    # Note [kept owners]: owners balanced over the model, not unit by unit (where every block's two matrices
    # went to ranks 0 and 1): at 4 ranks the 4 quantized matrices' states lie one on each rank
    assert [r["quantized"] for r in results] == [1, 1, 1, 1], [r["quantized"] for r in results]


@pytest.mark.parametrize("loaded_at", [2, 4])
def test_lowbit_in_backward_state_resumes(ranks, tmp_path, loaded_at):
    """Catches the owners of a low-bit state stepped in backward forgotten between units (each unit's step
    assigning only its own parameters, Note [kept owners]): the checkpoint then looks for a state on a rank
    that never held it; and, at the same world size, the recorded owners (assigned in backward's order) not
    taken by the fresh optimizer that loads them (Note [recorded owners]): the load was refused. Saved at 2
    ranks under optimizer in backward, loaded at 2 and 4 without it: every state tensor's parts bitwise the
    saved ones, and 2 more steps bitwise a plain model that loaded the same checkpoint."""
    path = str(tmp_path / "ckpt")
    saved = {}
    for state in ranks.run(save_in_backward, 2, "zero3", "adamw8bit", path, timeout=300):
        assert not set(saved) & set(state), "a parameter's state on two ranks"
        saved.update(state)
    loaded = {}
    for result in ranks.run(load_and_step, loaded_at, "zero3", "adamw8bit", path, timeout=300):
        assert result["differ"] == [], result["differ"][:4]
        loaded.update(result["state"])
    assert loaded.keys() == saved.keys()
    for param, parts in saved.items():
        for key, tensor in parts.items():
            assert torch.equal(loaded[param][key], tensor), f"{param} {key} differs after the load"


@pytest.mark.parametrize("in_backward", [False, True], ids=["after_backward", "in_backward"])
# 4-bit takes the same refusal by the same check (quantizes_state): under `make test-all`.
@pytest.mark.parametrize("name", ["adamw8bit", pytest.param("adamw4bit", marks=pytest.mark.slow)])
def test_lowbit_with_offload_is_exact_or_refused(ranks, tmp_path, name, in_backward):
    """Catches a low-bit optimizer under offload that fails deep inside torch or trains another model: disk
    offload's chunked step copied torchao's quantized state into a plain mapped file (a bare RuntimeError at
    one rank) and, over ranks, stepped each rank's rows where one process steps the whole tensor (another
    model, silently). offload='disk:...' is refused at the first step on every rank, naming the fix (Note
    [what a chunk can step], offload.py); offload='host' is bitwise the same run without offload at one rank
    (rows are the whole tensor) and refused over ranks (Note [host offload])."""
    disk = f"disk:{tmp_path}"
    for world, offload in ((1, disk), (2, disk), (1, "host"), (2, "host")):
        results = ranks.run(offloaded_against_plain, world, name, offload, in_backward, timeout=300)
        if world == 1 and offload == "host":
            assert results[0] == {"refused": None, "differ": []}, results
            continue
        for rank, result in enumerate(results):
            message = result["refused"]
            assert message is not None, f"ws {world} {offload} rank {rank} stepped: {result}"
            fix = "Drop offload=" if offload == disk else "drop offload="
            assert "offload='" in message and fix in message, message


@pytest.mark.parametrize("world, model, alone", [(2, "net", 2048), (4, "net", 2048), (2, "many", 1024)])
def test_lowbit_after_backward_owner_buffers_are_bounded(ranks, world, model, alone):
    """Catches the owners' traffic holding more than the wholes a rank steps (Note [owner memory], owner_traffic.py):
    the gather's received parts and packed rows beside the wholes cut from them, every transfer in flight at once,
    the scatter's padded copies: up to three times the owned values and gradients at the peak, above torch AdamW's.
    Counted through the traffic's one allocator, with a small alone threshold (`alone`: on the Net the blocks'
    matrices travel alone, the rest packed; on 40 layers of 8 x 8 everything packed, in many transfers): the peak at
    most the owned wholes (padded) plus WINDOW transfers of 3 * threshold + the largest whole / N each (Note [owner
    memory]'s bound), at least the owned wholes (every buffer counted), and the steps bitwise one process's. The
    packed step, counted so, peaked at 3.2x the owned wholes on the Net (226 KiB against 71 at rank 0 of 2) and 3.0x
    on the 40 layers; this one at 1.03x and 1.12x."""
    from shardwise.engine.comm.owner_traffic import WINDOW

    results = ranks.run(owner_buffers_peak, world, "zero3", "adamw8bit", alone, model == "many", timeout=300)
    for rank, result in enumerate(results):
        assert result["differ"] == [], f"rank {rank}: {result['differ'][:4]}"
        bound = result["owned"] + WINDOW * (3 * alone + result["largest"] // world)
        assert result["owned"] <= result["peak"] <= bound, (rank, result)


def test_whole_step_scatters_a_replaced_tensor(ranks):
    """Catches the update lost when the step gives a parameter a new tensor (`p.data = ...`) and its whole travelled
    alone (Note [owner memory]: scattered from the buffer it was gathered into): bitwise one process's at 4 ranks
    (the head padded to 132 rows), the blocks' matrices alone, the rest packed."""
    for rank, differ in enumerate(ranks.run(replacing_step_against_one_process, 4, 2048, timeout=300)):
        assert differ == [], f"rank {rank}: {differ[:4]}"
