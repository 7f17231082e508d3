"""Host offload (`offload="host"`): master rows, their gradients and the optimizer state in host memory, the
optimizer stepped there (Note [host offload], engine/memory/host_offload.py). On this host the compute device is
the CPU too, so the same code copies host to host: these tests hold its arithmetic and its bookkeeping to one
process's."""

import pytest
import torch

from helpers.ckpt_ranks import load_then_continue, save_then_continue
from helpers.host_offload import (
    copy_order,
    muon_step_under_host_offload,
    split_after_steps,
    step_in_backward,
    three_steps,
)
from helpers.parity import check_parity, run_on_rank
from shardwise.testing import RunResult, assert_close_runs


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", ["gpt", "reused_block", "unused_branch"])
def test_host_offload_equals_one_process(ranks, strategy, name):
    """Catches host rows that the gather does not read (stale full values after a step), gradients copied to the
    host before their reduce landed or added twice (tied and reused parameters, accumulation), a clip that misses
    the host gradients, zero1's gradients left in the device's kept rows instead of the host's, or a parameter no
    rank used given a gradient on the host (unused_branch)."""
    check_parity(ranks, strategy, name, 2, [(1, None), (2, 0.5)], steps=3, shard_kwargs={"offload": "host"})


@pytest.mark.parametrize("strategy, precision, frozen", [
    ("zero1", "fp32", False), ("zero2", "bf16", False), ("zero3", "fp32", True), ("zero3", "bf16", False)])
def test_estimate_splits_device_and_host_within_10_percent(ranks, strategy, precision, frozen):
    """Catches offloaded bytes counted as the device's (or twice), master rows still aliasing the device's full
    values, optimizer state created on the device, or gradients kept on the device after their copy to the host:
    sw.estimate's device and host figures each within 10% of the storages counted after a step."""
    for rank, got in enumerate(ranks.run(split_after_steps, 2, strategy, precision, frozen)):
        for place in ("device", "host"):
            measured, estimated = got["measured"][place], got["estimated"][place]
            assert abs(estimated - measured) <= 0.10 * max(measured, 1), (rank, place, got)
        assert got["measured"]["host"] > 0 and got["copies"]["h2d"] > 0 and got["copies"]["d2h"] > 0, got
        assert "offload='host'" in got["table"], got["table"]


# (model, saved by, on N ranks, loaded by, on M): to and from runs without offload, across stages, and from a
# hybrid mesh (2 replicas x 2 shards, Note [mesh info]) whose replica average lands before the rows go to the host.
ROUND_TRIPS = [("gpt", "zero3+host", 2, "zero3", 2), ("gpt", "zero1", 2, "zero2+host", 2),
               ("gpt", "zero2+host", 2, "zero3+host", 2), ("gpt", "zero3@2x2+host", 4, "zero2", 2)]


@pytest.mark.parametrize("name, a, n, b, m", ROUND_TRIPS)
def test_checkpoint_round_trip_with_and_without_host_offload(ranks, tmp_path, name, a, n, b, m):
    """Catches a checkpoint of host rows that writes or reads the wrong rows, optimizer state lost or left on the
    wrong device on load, or a load into host rows that the device's kept full values never see (no re-gather):
    the loaded parameters and state equal the saved ones bitwise, and the next 3 steps equal the saving run's,
    bitwise where the stage is the same (offload changes where the values live, never the arithmetic)."""
    path = str(tmp_path / "ckpt")
    expected = ranks.run(save_then_continue, n, name, a, path, timeout=120)[0]
    for rank, got in enumerate(ranks.run(load_then_continue, m, name, b, path, timeout=120)):
        for pname, value in expected["params"].items():
            assert torch.equal(got["params"][pname], value), (rank, pname)
        for pname, state in expected["optim"].items():
            for key, value in state.items():
                loaded = torch.as_tensor(got["optim"][pname][key])
                assert torch.equal(loaded, torch.as_tensor(value)), (rank, pname, key)
        if (a.split("+")[0], n) == (b.split("+")[0], m):
            assert got["losses"] == expected["losses"], rank
            for pname, value in expected["final"].items():
                assert torch.equal(got["final"][pname], value), (rank, pname)
        else:
            assert_close_runs(RunResult(expected["losses"], [], expected["final"]),
                              RunResult(got["losses"], [], got["final"]))


def test_whole_tensor_optimizer_is_refused_on_every_rank(ranks):
    """Catches a whole-tensor optimizer (Muon) stepping host rows as if they were the device's whole tensors, or
    refused on one rank while the other waits in a collective."""
    for rank, message in enumerate(ranks.run(muon_step_under_host_offload, 2)):
        assert "offload='host'" in message and "elementwise optimizer" in message, (rank, message)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_copies_wait_for_their_events_and_the_step_for_the_copies(ranks, strategy):
    """Catches, on the calls a GPU's queues would get (recorded on CPU): a gather that does not wait for its
    rows' host-to-device copy (it would send stale or half-copied rows), a copy to the host issued before the
    compute stream (and the reduce it waited for) had made the rows, or an optimizer step (on the CPU) that
    reads gradients or writes master rows before the host waited for the last copy each way."""
    for got in ranks.run(copy_order, 2, strategy, timeout=60):
        log, streams = got["log"], got["streams"]
        assert {"h2d", "d2h"} <= streams.keys(), streams
        recorded = {entry[1]: entry[2] for entry in log if entry[0] == "record"}
        h2d = [event for event, stream in recorded.items() if stream == streams["h2d"]]
        d2h = [event for event, stream in recorded.items() if stream == streams["d2h"]]
        assert h2d and d2h, log
        for event in h2d:  # the gathers' stream waits for each copy of rows to the device
            assert ("wait_event", streams["gather"], event) in log, (event, log)
        previous = 0
        for index, entry in enumerate(log):  # each copy to the host queued after the compute stream's work
            if entry[0] == "record" and entry[2] == streams["d2h"]:
                assert ("wait_stream", streams["d2h"], "compute") in log[previous:index], log[previous:index]
                previous = index
        for index in [i for i, entry in enumerate(log) if entry == ("step",)]:
            before = log[:index]
            last = {direction: max((i for i, e in enumerate(before) if e[0] == "record" and e[2] == streams[direction]),
                                   default=None) for direction in ("h2d", "d2h")}
            assert last["d2h"] is not None, before  # zero1's first forward gathers nothing: no h2d copy yet
            for direction, at in last.items():
                if at is not None:
                    assert ("synchronize", before[at][1]) in before[at:], (direction, before[at:])


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_optimizer_in_backward_steps_host_rows(ranks, strategy):
    """Catches a unit stepped in backward (sw.optimizer_in_backward) before its gradient rows reached the host,
    or a step that writes host rows the device's next gather does not read."""
    check_parity(ranks, strategy, "reused_block", 2, [(1, None), (2, None)], steps=3, shard_kwargs={"offload": "host"},
                 prepare=step_in_backward)


@pytest.mark.parametrize("strategy, options", [
    ("zero1", {"precision": "bf16"}), ("zero3", {"precision": "bf16"}), ("zero2", {}),
    ("zero3", {"compression": {"gather": "int8", "reduce": "int8"}, "prefetch": 1})])
def test_host_offload_changes_no_bit(ranks, strategy, options):
    """Catches host offload changing the arithmetic (a cast before the copy where the engine casts after, the step
    reading gradients in another dtype, a clip norm over other tensors, quantized gathers fed other rows): losses,
    grad norms and parameters bitwise those of the same options without offload, with accumulation and clipping."""
    configs = [(2, 0.5)]
    runs = [ranks.run(run_on_rank, 2, strategy, "gpt", configs, 3, 8, 0, {**options, **extra})
            for extra in ({}, {"offload": "host"})]
    for plain, offloaded in zip(*runs):
        assert plain[0].losses == offloaded[0].losses and plain[0].grad_norms == offloaded[0].grad_norms
        for name, value in plain[0].params.items():
            assert torch.equal(offloaded[0].params[name], value), name


@pytest.mark.parametrize("strategy, world, fused, deferred, options", [
    ("zero1", 2, True, False, None), ("zero3", 2, True, False, None), ("zero2", 2, False, True, None),
    ("zero3", 2, False, True, None), ("zero3", 4, False, False, {"reshard_after_forward": 2})])
def test_fused_adamw_deferred_init_and_hpz_under_host_offload(ranks, strategy, world, fused, deferred, options):
    """Catches host rows that torch's fused AdamW kernel (`fused=True`, its fast CPU step) cannot step or steps
    apart from the same kernel without offload (a view it refuses, state on another device, a skipped clip), a
    deferred model (sw.deferred_init) whose replayed values miss the host rows, and hpZ's in-node re-gather
    (reshard_after_forward=2) reading other rows than forward did: bitwise the run without offload."""
    plain, offloaded = (ranks.run(three_steps, world, strategy, offload, fused, deferred, options)
                        for offload in (None, "host"))
    for mine, theirs in zip(plain, offloaded):
        assert mine["losses"] == theirs["losses"]
        for name, value in mine["params"].items():
            assert torch.equal(theirs["params"][name], value), name
