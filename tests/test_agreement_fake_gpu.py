"""Host rendezvous per step on the device path (issue 58 point 3, Note [headers on the device] in
engine/schedule/agreement_device.py; Note [used flags on the device] in engine/schedule/used_flags.py): zero1/2/3
trained with AdamW and clipping on the fake accelerator (Note [fake accelerator], helpers/fake_cuda.py), the
headers, zero3's tags and the used-parameter flags in the form NCCL runs take. Every scenario runs
in one child process (tests/scripts/fake_agreement_run.py); each test reads its report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.fake_cuda import ROOT

SCRIPT = ROOT / "tests" / "scripts" / "fake_agreement_run.py"
DEVICE = [f"{strategy}-ws{ws}" for strategy in ("zero1", "zero2", "zero3") for ws in (2, 4)]
HOST_HEADERS = [f"{strategy}-ws2-host-headers" for strategy in ("zero1", "zero2", "zero3")]
UNUSED = [f"{strategy}-ws2-unused" for strategy in ("zero2", "zero3")]
MIXED = ["zero3-ws2-mixed", "zero3-ws4-mixed"]
# The used-parameter flags' host form (Note [unused params], unit_grads.py): one all-reduce on the host group after
# the backward's reduces, a host rendezvous a step on NCCL before Note [used flags on the device].
USED_FLAGS = "all_reduce at engine/comm/collectives.py:any_rank"


@pytest.fixture(scope="module")
def reports():
    proc = subprocess.run([sys.executable, str(SCRIPT), *DEVICE, *HOST_HEADERS, *UNUSED, *MIXED], capture_output=True,
                          text=True, timeout=400, cwd=ROOT)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
            found[report["name"]] = report
    missing = [name for name in DEVICE + HOST_HEADERS + UNUSED + MIXED if name not in found]
    assert not missing, (f"no report for {missing} (exit {proc.returncode}):"
                         f"\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return found


@pytest.mark.parametrize("name", DEVICE)
def test_a_step_on_the_device_makes_no_host_rendezvous(reports, name):
    """Catches a host rendezvous per phase on the device path: the headers' host form sends each phase's header
    as a collective of host tensors (a gloo group beside NCCL) and waits for it, 3 a step, and the flags' host
    form one all-reduce of host values a step. In the device form a zero1/2/3 step with AdamW and
    sw.clip_grad_norm_ waits for no header, no tag and no flags (0 a step), issues no collective of host tensors,
    reads no device value on the host, and still compares every header before the step (the forward's, the
    backward's, the previous step's: 3 a step)."""
    report = reports[name]
    assert report["ok"], report["error"]
    assert report["syncs"] == {} and report["host_tensors"] == {} and report["collectives"] == [], report
    assert report["header_waits"] == 0 and report["tag_waits"] == 0 and report["flag_waits"] == 0, report
    assert report["host_calls"] == {}, report["host_calls"]
    assert report["headers_compared"] == 3, report
    assert report["tagged"] == name.startswith("zero3")


@pytest.mark.parametrize("name", HOST_HEADERS)
def test_the_host_form_of_the_headers_is_three_rendezvous_a_step(reports, name):
    """Catches a count that cannot fail: the headers' and flags' host forms (this tree before Note [headers on the
    device] and Note [used flags on the device], on NCCL) are counted on the same path: 3 header waits and 3
    header collectives of host tensors a step, and the flags' all-reduce of host values, one a step."""
    report = reports[name]
    assert report["ok"], report["error"]
    assert report["header_waits"] == 3, report
    assert report["host_calls"] == {USED_FLAGS: 3, "all_gather_single at engine/comm/small.py:start_all_gather_rows": 9}


@pytest.mark.parametrize("name", UNUSED)
def test_a_rank_with_an_unused_parameter_reads_the_flags_once_a_step(reports, name):
    """Catches the flags' allowance grown or gone uncounted: a model whose second block no rank uses reads the
    flags' result on the host once a step (Note [used flags on the device]: a rank that skipped a parameter waits
    for the copy), through a non-blocking copy and its event (no blocking read counted), still no collective of
    host tensors, and no other wait."""
    report = reports[name]
    assert report["ok"], report["error"]
    assert report["flag_waits"] == 1 and report["header_waits"] == 0 and report["tag_waits"] == 0, report
    assert report["syncs"] == {} and report["host_calls"] == {}, report


@pytest.mark.parametrize("name", MIXED)
def test_a_mixed_group_takes_the_device_forms(reports, name):
    """Catches a site that reads a group's backend as `== "nccl"` (Note [group backends]): on the group
    `sw.init(backend="cpu:gloo,cuda:nccl")` makes, the forms not forced, zero3's tags went back to a host
    rendezvous per unit and the headers to three a step, the used flags to an all-reduce of host values. Asked
    through the one predicate, a zero3 step on a mixed group waits for no header, tag or flag and issues no
    collective of host tensors, and still compares every header before the step."""
    report = reports[name]
    assert report["ok"], report["error"]
    assert report["tagged"], report
    assert report["header_waits"] == 0 and report["tag_waits"] == 0 and report["flag_waits"] == 0, report
    assert report["host_calls"] == {}, report["host_calls"]
    assert report["syncs"] == {} and report["host_tensors"] == {} and report["collectives"] == [], report
    assert report["headers_compared"] == 3, report
