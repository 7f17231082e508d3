"""Host rendezvous per step on the device path (issue 58 point 3, Note [headers on the device] in
engine/schedule/agreement_device.py): zero1/2/3 trained with AdamW and clipping on the fake accelerator (Note [fake
accelerator], helpers/fake_cuda.py), the headers and zero3's tags in the form NCCL runs take. Every scenario runs
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
# The one host collective a step still makes, outside the agreement: which parameters any rank used (Note [unused
# params], unit_grads.py), one all-reduce on the host group after the backward's reduces.
USED_FLAGS = "all_reduce at engine/comm/collectives.py:any_rank"


@pytest.fixture(scope="module")
def reports():
    proc = subprocess.run([sys.executable, str(SCRIPT), *DEVICE, *HOST_HEADERS], capture_output=True, text=True,
                          timeout=400, cwd=ROOT)
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[len("REPORT "):])
            found[report["name"]] = report
    missing = [name for name in DEVICE + HOST_HEADERS if name not in found]
    assert not missing, (f"no report for {missing} (exit {proc.returncode}):"
                         f"\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return found


@pytest.mark.parametrize("name", DEVICE)
def test_a_step_on_the_device_makes_no_host_rendezvous_for_headers_or_tags(reports, name):
    """Catches a host rendezvous per phase on the device path: the headers' host form sends each phase's header
    as a collective of host tensors (a gloo group beside NCCL) and waits for it, 3 a step. In the device form a
    zero1/2/3 step with AdamW and sw.clip_grad_norm_ waits for no header and no tag (0 a step), issues no
    collective of host tensors but the used-parameter flags', reads no device value on the host, and still
    compares every header before the step (the forward's, the backward's, the previous step's: 3 a step)."""
    report = reports[name]
    assert report["ok"], report["error"]
    assert report["syncs"] == {} and report["host_tensors"] == {} and report["collectives"] == [], report
    assert report["header_waits"] == 0 and report["tag_waits"] == 0, report
    assert report["host_calls"] == {USED_FLAGS: 3}, report["host_calls"]  # 3 counted steps
    assert report["headers_compared"] == 3, report
    assert report["tagged"] == name.startswith("zero3")


@pytest.mark.parametrize("name", HOST_HEADERS)
def test_the_host_form_of_the_headers_is_three_rendezvous_a_step(reports, name):
    """Catches a count that cannot fail: the headers' host form (this tree before Note [headers on the device],
    on NCCL) is counted at 3 waits and 3 host collectives a step, on the same path."""
    report = reports[name]
    assert report["ok"], report["error"]
    assert report["header_waits"] == 3, report
    assert report["host_calls"] == {USED_FLAGS: 3, "all_gather_single at engine/comm/small.py:start_all_gather_rows": 9}
