"""`shard(..., offload="host")`: master rows, their gradients and the optimizer state in host memory, the
optimizer stepped on the CPU. Uses: streams.

Note [host offload]: FSDP2's `CPUOffloadPolicy` and DeepSpeed's ZeRO-Offload keep a GPU's model state off
the GPU: the device holds only full values (zero3: of the units in use; zero1/zero2: kept) and what
autograd makes. Here:

- Master rows. Each unit's fp32 rows of this rank live in one host `shard_flat` (pinned where the compute
  device is an accelerator), and the registered parameters are views of it, so the user's ordinary torch
  optimizer steps host tensors: its state is created on the host by torch itself, its step runs on the CPU.
  The fast CPU Adam is torch's own: `torch.optim.AdamW(..., fused=True)` has a fused CPU kernel (torch
  >= 2.4), steps host rows like any row optimizer and needs nothing installed (tests/test_host_offload.py:
  bitwise the same kernel without offload). DeepSpeed 0.19.8's `DeepSpeedCPUAdam` does build here without
  a GPU (`DS_ACCELERATOR=cpu`: a C++ op compiled on first use, 11 minutes on this 2-core host) and lands
  6e-7 from torch's AdamW after 3 steps (its own arithmetic); shardwise does not know its class, so it
  would be stepped on whole tensors (Note [whole-tensor step]), which offload="host" refuses.
- `HostRows` (zero3) and `HostRowsKeptFull` (zero1/zero2, whose full values stay on the device) are the
  unit's storage (shard_storage.py), chosen by the stage's policy (stage.py).
- Host -> device. A gather's input, this rank's rows, is copied to the device on a copy stream of its
  own and cast there to the compute dtype (as FSDP2 copies then casts), and the gathers' stream waits for
  that copy's event only (Note [streams per collective]): the next unit's copy runs while this unit
  computes and while the previous gather is in flight, since gathers are issued `prefetch` units ahead.
- Device -> host. Each parameter's averaged rows are copied to a host buffer (pinned) on a second copy
  stream as its unit's reduce lands (`grad_rows`), after the compute stream, which waited for the reduce's
  event; the copy is asynchronous, except where a host add reads it at once (a gradient accumulated into
  an existing one: FSDP2's rule too). Before the host reads any of them (the end of backward: the reducer's
  `finish`, or each unit stepped in backward) one `synchronize` waits for the last copy's event; since
  each copy stream is in order, the last event covers every earlier copy, and the host-to-device copies
  of the step (their last event is waited too), so the CPU step never writes rows a copy still reads.
- Accounting. The estimator (`sw.estimate`) reports these bytes as `host`, the rest as the device's;
  `estimate.measure.model_state_by_place` counts them after a step (Note [placement count] there).

Device choices, all of them (Note [one device path], streams.py):
- The host is `HOST` (the CPU); the compute device is the unit's (`unit.device`, from its parameters
  or, for a deferred model, from the accelerator), where the gathers land and autograd runs.
- Pinned memory only where the compute device is an accelerator (`_pinned`): page-locked memory needs
  one, and a CPU run copies host to host.
- The copy streams come from the engine's device API (`unit.comm.api`): on a CPU device they are the
  host's order, where the copies run at once and every wait is a no-op, so the same code runs on this host.
- The state dict's DTensors (state_dict.py, dcp.py) are views of the host rows over a mesh of the host's device
  type: `DTensor.from_local` moves a local tensor to its mesh's device, so a mesh of the accelerator would hand
  out copies (FSDP2 builds its CPU-offloaded DTensors without that move, through a private constructor).

The process group (Note [group backends], wire/backends.py): `sw.clip_grad_norm_` and `sw.grad_norms`
all-reduce norms of host gradients, which NCCL alone cannot, so the group needs a CPU backend beside the
device's (`sw.init(backend="cpu:gloo,cuda:nccl")`, as FSDP2's CPU offload asks): `check_group` refuses a
group without one when the first unit takes its rows, on every rank. Such a mixed group runs the gathers on
the accelerator with the engine's streams (CommContext.for_group reads it as NCCL). `sw.dcp_state_dict`'s
and `model.state_dict()`'s DTensors take a mesh on the rows' own device (the host's): one of the compute device
would make `from_local` hand DCP device copies, which `dcp.load` fills while the rows stay as they were.

Where it does not apply (refused with the fix, config.py and optim_hooks.py): ddp (torch's reducer keeps
everything on the device), disk offload at once (one place per run), an optimizer stepped on whole tensors
(whole_step.py gathers a whole tensor onto its owner's device).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from shardwise.config import HostOffload
from shardwise.engine.comm.streams import GATHER
from shardwise.errors import ShardwiseError
from shardwise.wire.backends import has_host_backend

HOST = torch.device("cpu")


def _pinned(policy: HostOffload, device: torch.device) -> bool:
    """Page-locked host buffers: asked for, and a device to copy to that is not the host."""
    return policy.pin_memory and device.type != HOST.type and torch.accelerator.is_available()


class HostCopies:
    """One engine's copies between host rows and the device (Note [host offload]): two copy streams and
    the last event of each, which `synchronize` waits for before the host reads or writes rows."""

    def __init__(self, policy: HostOffload) -> None:
        self.policy = policy
        self._streams: dict[str, object] = {}
        self._events: dict[str, object] = {}  # "h2d" / "d2h" -> the last copy's event, until synchronized
        self.copies = {"h2d": 0, "d2h": 0}  # counted: tests and sw.describe

    def _stream(self, api, direction: str):
        if direction not in self._streams:
            self._streams[direction] = api.new_stream()
        return self._streams[direction]

    def _record(self, api, direction: str, stream) -> object:
        event = api.new_event()
        event.record(stream)
        self._events[direction] = event
        self.copies[direction] += 1
        return event

    def check_group(self, group) -> None:
        """Refuse, on every rank alike (the group is the same everywhere), a group whose collectives cannot take
        the host gradients' norms: NCCL alone (Note [host offload])."""
        if has_host_backend(group):
            return
        raise ShardwiseError(
            f"offload='host' keeps gradients in host memory, and sw.clip_grad_norm_ / sw.grad_norms all-reduce their "
            f"norms there, but this process group's backend ({dist.get_backend(group)!r}) has none for CPU tensors. "
            "Start the job with a CPU backend beside the device's: sw.init(backend='cpu:gloo,cuda:nccl') (or "
            "torch.distributed.init_process_group('cpu:gloo,cuda:nccl')), or drop offload='host'.")

    def host_empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A host buffer for rows of a unit computing on `device` (pinned where that copies faster)."""
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=_pinned(self.policy, device))

    def to_device(self, unit, flat: Tensor, dtype: torch.dtype) -> Tensor:
        """`flat` (host rows) on the unit's device in `dtype`, copied on the host-to-device stream; the
        gathers' stream waits for it (Note [host offload])."""
        api = unit.comm.api
        stream = self._stream(api, "h2d")
        with stream:
            on_device = torch.empty(flat.shape, dtype=flat.dtype, device=unit.device)
            on_device.copy_(flat, non_blocking=_pinned(self.policy, unit.device))
            cast = on_device.to(dtype)  # a no-op at full precision (FSDP2 copies, then casts)
        gathers = unit.comm.streams.by_kind[GATHER]
        gathers.wait_event(self._record(api, "h2d", stream))
        api.keep_for(cast, gathers)  # made on the copy stream, read on the gathers'
        return cast

    def to_host(self, unit, rows: Tensor, blocking: bool) -> Tensor:
        """`rows` (the device's averaged gradient rows) in a new host buffer; `blocking`: done on return,
        because the host reads it at once (an add into a kept gradient)."""
        api = unit.comm.api
        host = self.host_empty(rows.numel(), rows.dtype, unit.device).view(rows.shape)
        if blocking:
            host.copy_(rows)
            return host
        stream = self._stream(api, "d2h")
        stream.wait_stream(api.current())  # the rows are the compute stream's once the reduce's event passed
        with stream:
            host.copy_(rows, non_blocking=_pinned(self.policy, unit.device))
        api.keep_for(rows, stream)
        self._record(api, "d2h", stream)
        return host

    def synchronize(self) -> None:
        """The host waits for the last copy each way (Note [host offload]); nothing to wait for costs nothing."""
        for direction in ("d2h", "h2d"):
            event = self._events.pop(direction, None)
            if event is not None:
                event.synchronize()


def open_host(offload) -> HostCopies | None:
    """The engine's copies for `offload="host"`, else None."""
    return HostCopies(offload) if isinstance(offload, HostOffload) else None


def refuse_whole_step(optimizer, sharded: list) -> None:
    """An optimizer stepped on whole tensors (Muon, Adafactor, ...: Note [whole-tensor step]) gathers each
    whole parameter onto its owner's compute device, which host rows do not feed: refused at its first
    step, on every rank (every rank holds the same optimizer class and the same option)."""
    if not any(param._sw_unit.storage.host is not None for param in sharded):
        return
    raise ShardwiseError(
        f"{type(optimizer).__name__} steps whole tensors (Note [whole-tensor step]) and this model was sharded "
        "with offload='host', whose optimizer steps this rank's rows in host memory. Use an elementwise optimizer "
        "(AdamW, Adam, SGD, ...) with offload='host', or drop offload= to step whole tensors on the device."
    )
