"""The engine on an accelerator that exists only as metadata, in one process (Note [fake accelerator]).

Use `run_in_child` from a test: it runs `tests/scripts/fake_gpu_run.py` in a fresh interpreter, since what
`install()` does to torch (a PrivateUse1 backend, patched collectives) lasts as long as the process.

Note [fake accelerator]: issue 58 point 5 asks for every engine path on a CUDA device that exists only as
metadata. Measured on this CPU-only torch 2.13: FakeTensorMode makes `device="cuda"` tensors, but no CUDA
backward can run (the autograd engine asks `at::getAccelerator()` for the CUDA tensors' streams, and a CPU
build has no CUDA hooks: "Cannot access accelerator device when none is available"; registering a
PrivateUse1 backend makes the accelerator PrivateUse1 and CUDA nodes then have no stream:
`opt_ready_stream && opt_parent_stream` in engine.cpp), and indexing or `copy_` of a fake CUDA tensor
needs a CUDA device guard the build lacks. So the device here is torch's PrivateUse1 accelerator renamed
`DEVICE` ("fakegpu"): to torch it is an accelerator like CUDA (`torch.accelerator` names it, autograd
gives its nodes streams, `torch.Stream`/`torch.Event` take it), its tensors are FakeTensors (shapes,
dtypes, devices; no values), and a CPU tensor meeting one is a device mismatch as on CUDA. What it does
not reach: code that tests `device.type == "cuda"`, calls `torch.cuda.*`, or asks whether the backend is
exactly "nccl" (docs/status.md lists those branches). A world made with `backend=fake_gpu.MIXED` reads to the
engine as "cpu:gloo,fakegpu:nccl", the mixed group host offload needs on a GPU (Note [group backends]): the
engine then runs its streams on the accelerator. Pinned host memory is ordinary host memory noted as pinned.

The parts:
- ranks: torch's `fake` process group at world size N in one process, with every collective replaced by
  its "mirror" (what it returns when every rank holds what this rank holds): an all-gather fills each
  rank's slot with this rank's input, a SUM multiplies by N. Host values (agreement headers, gather tags,
  norms' flags) are then real and agree, and the data collectives still run their copies on the device
  tensors, so a collective mixing devices fails. A group the engine makes with backend "gloo" (a host
  group beside NCCL) is made as another fake group.
- host tensors stay real: `HostStaysReal` runs an op whose tensors are all real CPU tensors (and a CPU
  factory call) outside the fake mode, so a host read of a host value works as on a GPU machine.
- tensor subclasses: the engine's ShardParameter/RowsGrad are made by `__class__` assignment and
  `as_subclass`; a FakeTensor's behaviour lives in its class, so both are redirected to a class that is
  the engine's subclass and a FakeTensor (`_fake_flavour`).
- checks (`StepChecks`, a dispatch mode over the counted steps): a read of a device value on the host
  (`_local_scalar_dense`, `is_nonzero`, `equal`, `nonzero`, a device-to-host copy) is counted by the
  shardwise function that made it and answered with a dummy, so the run goes on and the test reports
  every site; a blocking host-to-device copy (torch waits for the stream) counts too, and so does a
  `non_blocking` copy from or into host memory that is not pinned, and every `synchronize`; a real CPU tensor of
  more than one element meeting a device tensor in one op is a tensor that belongs on the device (0-dim CPU
  scalars mix as torch allows); FakeTensorMode itself raises on a device mismatch.
- streams: torch's device-generic streams and events, modelled (helpers/fake_streams.py, Note [modelled
  streams]): a storage freed before every other stream's op on it is known done is a hazard.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "fake_gpu_run.py"


def run_in_child(*scenarios: str, timeout: float = 240, script: Path = SCRIPT) -> dict:
    """Run `scenarios` (names of `script`'s SCENARIOS, fake_gpu_run.py's by default, with ":mutation" where
    wanted) in one child: each one's report (a dict) by name."""
    proc = subprocess.run([sys.executable, str(script), *scenarios], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    reports = {}
    for line in lines:
        report = json.loads(line[len("REPORT "):])
        reports[report["name"]] = report
    missing = [name for name in scenarios if name not in reports]
    assert not missing, (f"no report for {missing} (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")
    return reports
