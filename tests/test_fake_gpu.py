"""The engine trained on an accelerator that exists only as metadata (issue 58 point 5; Note [fake accelerator]
in helpers/fake_cuda.py): FakeTensors on torch's PrivateUse1 accelerator, torch's `fake` process group at
world sizes 2 and 4 in one process, collectives that mirror this rank. Every scenario runs in one child
process (tests/scripts/fake_gpu_run.py); each test reads its report."""

from __future__ import annotations

import pytest

from helpers.fake_cuda import run_in_child

ZERO = [f"{strategy}-ws{ws}" for strategy in ("zero1", "zero2", "zero3") for ws in (2, 4)]
PATHS = ["zero1-bf16", "zero3-bf16", "zero1-muon", "zero3-muon", "zero2-hybrid", "zero3-hybrid",
         "zero3-in-backward", "zero3-hpz", "zero3-compressed", "zero2-compiled", "zero3-stage"]
DEFERRED = "zero3-deferred"
SCALER = "zero2-fp16-scaler"
MUTANTS = ["zero2-ws2:cpu-mask", "zero1-ws2:copied-mask", "zero3-ws4:item", "streams:free-early"]
COUNTED_STEPS = 2  # fake_gpu_run.STEPS less the first


@pytest.fixture(scope="module")
def reports():
    return run_in_child(*ZERO, *PATHS, DEFERRED, SCALER, "streams", *MUTANTS)


def _clean(report):
    assert report["ok"], report["error"]
    assert report["collectives"] == [], report["collectives"]
    assert report["host_tensors"] == {}, report["host_tensors"]
    assert report["hazards"] == [], report["hazards"]
    # the checks saw the step: its forward, its backward (run on autograd's device thread) and its update
    seen = report["device_ops"]
    for op in ("addmm.default", "threshold_backward.default", "embedding_dense_backward.default"):
        assert seen.get(op), (op, seen)


@pytest.mark.parametrize("name", ZERO)
def test_zero_step_on_the_device_never_syncs(reports, name):
    """Catches a device bug in a zero1/2/3 step with AdamW, sw.clip_grad_norm_, sw.grad_norms and
    sw.param_norms: a device mismatch (grad_norms' row mask was built on the CPU: every scenario here failed
    with "Expected all tensors to be on the same device" before issue 58's fix), a CPU tensor meeting the
    device, a collective mixing devices, or any read of a device value by the host in a step (0 per step)."""
    report = reports[name]
    _clean(report)
    assert report["syncs"] == {}, report["syncs"]


@pytest.mark.parametrize("name", PATHS)
def test_engine_paths_on_the_device(reports, name):
    """Catches the same device bugs in bf16, a whole-tensor optimizer (Muon), hybrid sharding, optimizer in
    backward, hpZ, compressed gathers/reduces, torch.compile (dynamo, eager backend) and a ShardedStage under
    torch's ScheduleGPipe."""
    report = reports[name]
    _clean(report)
    assert report["syncs"] == {}, report["syncs"]


def test_deferred_init_puts_the_shards_on_the_accelerator(reports):
    """Catches deferred init materializing the shards on the CPU on an accelerator other than CUDA (flat_unit
    asked `torch.cuda.is_available()` alone; now torch's current accelerator): this scenario failed with
    "deferred init put the shards on {'cpu'}" before."""
    report = reports[DEFERRED]
    _clean(report)
    assert report["syncs"] == {}, report["syncs"]


def test_loss_scaler_reads_the_host_once_per_step(reports):
    """Catches a host read the fp16 loss scaler adds beyond its overflow verdict (the one read that decides in
    Python whether to step, as torch's GradScaler makes it: the listed allowance)."""
    report = reports[SCALER]
    _clean(report)
    assert report["syncs"] == {"_local_scalar_dense.default at engine/memory/precision.py:unscale_": COUNTED_STEPS}


def test_a_cpu_mask_beside_device_norms_fails(reports):
    """Catches checks that cannot fail: grad_norms' row mask put back on the CPU (the code before issue 58)
    must fail the run as a device mismatch, and the CPU tensor meeting the device must be named."""
    report = reports["zero2-ws2:cpu-mask"]
    assert not report["ok"]
    assert "Expected all tensors to be on the same device" in report["error"], report["error"]
    assert "sw.grad_norms(" in report["error"] and "torch.where(rows" in report["error"], report["error"]


def test_an_item_in_a_step_is_counted(reports):
    """Catches a sync counter that cannot fail: an `.item()` of the global norm in each clip is counted once
    per counted step."""
    report = reports["zero3-ws4:item"]
    assert report["ok"], report["error"]
    assert sum(report["syncs"].values()) == COUNTED_STEPS, report["syncs"]


def test_a_host_to_device_copy_in_a_step_is_counted(reports):
    """Catches a sync counter blind to blocking host-to-device copies (torch waits for the stream): the row
    mask copied to the device in each grad_norms call is counted, twice per counted step (grad and param)."""
    report = reports["zero1-ws2:copied-mask"]
    assert report["ok"], report["error"]
    syncs = report["syncs"]
    assert all(where.startswith("host-to-device") for where in syncs), syncs
    assert sum(syncs.values()) == 2 * COUNTED_STEPS, syncs


def test_a_buffer_freed_before_its_readers_event_is_caught(reports):
    """Catches a stream model that cannot fail (Note [modelled streams], helpers/fake_streams.py): a buffer
    read on a side stream and freed on the compute stream after waiting for the reader's event is clean;
    freed without that wait it is a hazard. The runs above use the plain fake world, where the engine keeps the
    host's order (its group reads as no device backend); tests/test_fake_gpu_offload.py runs the engine's streams
    on the device (a group that reads as cpu:gloo,cuda:nccl)."""
    assert reports["streams"]["ok"] and reports["streams"]["hazards"] == [], reports["streams"]
    report = reports["streams:free-early"]
    assert report["ok"], report["error"]
    assert len(report["hazards"]) == 1 and "before stream" in report["hazards"][0], report["hazards"]
