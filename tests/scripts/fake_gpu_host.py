"""Run by tests/test_fake_gpu_offload.py (helpers/fake_cuda.run_in_child with this script): host offload
(`offload="host"`, Note [host offload]) on the fake accelerator (Note [fake accelerator]), over a MIXED world,
which reads to the engine as the "cpu:gloo,cuda:nccl" group host offload needs on a GPU; its device/host split
and sw.estimate's; sw.dcp_state_dict's meshes; a pipeline stage. Prints fake_gpu_run.py's REPORT lines, with
more fields where a scenario has them."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import fake_gpu_run as base  # tests/scripts/ (this script's folder) is on the path; installs the fake device
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.fake_gpu import DEVICE, MIXED, is_pinned
from shardwise.engine.protocol import engine_of
from shardwise.engine.unit.info import as_dtensor as _as_dtensor

ONLY_NCCL = f"{DEVICE}:fake"  # reads as "fakegpu:nccl": a device backend and none for the host


def _deferred(cls=base.Tiny):
    """Built under sw.deferred_init: shard() makes the master rows in host memory and nothing whole on the device
    (a fake device parameter cannot hand its object to host rows: FakeTensors hold weak references, so
    `swap_tensors` refuses, where a CUDA parameter's `.data` takes host memory)."""
    with sw.deferred_init():
        return cls()


def _model_state(model, optimizer) -> list[torch.Tensor]:
    """The tensors of the model state: parameters, gradients, optimizer state and the engine's unit buffers."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for unit in engine_of(model).units:
        tensors += [t for t in (unit.full_flat, unit.shard_flat, unit.grads.full) if t is not None]
    return tensors


def counted_bytes(model, optimizer) -> dict[str, int]:
    """Bytes of the model state's distinct storages by where they are: the fake device's, the host's."""
    seen: dict[int, tuple[str, int]] = {}
    for tensor in _model_state(model, optimizer):
        storage = tensor.untyped_storage()
        seen[storage._cdata] = ("device" if tensor.device.type == DEVICE else "host", storage.nbytes())
    return {place: sum(n for where, n in seen.values() if where == place) for place in ("device", "host")}


def placement(model, optimizer) -> dict:
    """Where each role of the model state is: devices by role, and whether the master rows are pinned."""
    engine = engine_of(model)
    return {"params": sorted({p.device.type for p in model.parameters()}),
            "grads": sorted({p.grad.device.type for p in model.parameters() if p.grad is not None}),
            "state": sorted({v.device.type for s in optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0}),
            "full": sorted({u.full_flat.device.type for u in engine.units if u.full_flat is not None}),
            "pinned": all(is_pinned(p) for p in model.parameters()),
            "copies": dict(engine.host.copies)}


def train_host(strategy: str, precision: str = "fp32", dcp: bool = False):
    """Three steps of the AdamW step with clipping and norms (fake_gpu_run._step) under offload="host"; then one
    more kept (no zero_grad: the most a step holds, as tests/test_host_offload.py measures), where the state is."""
    model = _deferred()
    predicted = sw.estimate(model, strategy, dist.get_world_size(), precision, "adamw", "host")
    sw.shard(model, strategy=strategy, units=base.Block, precision=precision, offload="host")
    optimizer = base._adamw(model)
    checks = base._counted(base._step(model, optimizer))
    with base.StepChecks():  # not counted; its host reads answered as in the counted steps
        model(base._batch()).backward()
        optimizer.step()
    checks.extra = {"placement": placement(model, optimizer),
                    "bytes": {"measured": counted_bytes(model, optimizer),
                              "estimated": {"device": predicted.model_state, "host": predicted.host}}}
    if dcp:  # model.state_dict() first: a layout keeps the first DTensor mesh it made (ParallelLayout._flat_mesh)
        from_model = list(model.state_dict().values())
        state = sw.dcp_state_dict(model, optimizer)
        tensors = list(state["model"].values()) + [v for entry in state["optim"].values() for v in entry.values()
                                                   if hasattr(v, "device_mesh")]
        rows = {t.untyped_storage()._cdata for t in _model_state(model, optimizer)}
        for what, found in (("dcp", tensors), ("state_dict", from_model)):
            checks.extra[what] = {"mesh": sorted({t.device_mesh.device_type for t in found}),
                                  "local": sorted({t.to_local().device.type for t in found}),
                                  "views": all(t.to_local().untyped_storage()._cdata in rows for t in found)}
    return checks


def train_stage_host(strategy: str):
    """A ShardedStage under offload="host", run by torch's ScheduleGPipe (fake_gpu_run.train_stage's set-up)."""
    model = _deferred(base.TinyLogits)
    sw.shard(model, strategy=strategy, units=base.Block, offload="host")
    optimizer = base._adamw(model)
    checks = base._counted_pipeline_step(model, optimizer)
    checks.extra = {"placement": placement(model, optimizer)}
    return checks


def round_trip(strategy: str, how: str):
    """Two steps under offload="host" on the device, `how` ("save" or "save_async") into $SW_FAKE_CKPT/device,
    sw.load into a fresh model and optimizer, sw.save again into $SW_FAKE_CKPT/reloaded (one rank: the fake
    world's other ranks write nothing)."""
    root = os.environ["SW_FAKE_CKPT"]
    model = _deferred()
    sw.shard(model, strategy=strategy, units=base.Block, offload="host")
    optimizer = base._adamw(model)
    checks = base._counted(base._step(model, optimizer))
    (sw.save_async(f"{root}/device", model, optimizer).wait() if how == "save_async"
     else sw.save(f"{root}/device", model, optimizer))
    _reload(f"{root}/device", f"{root}/reloaded", _deferred(), strategy, {"offload": "host"})
    return checks


def cpu_reload(strategy: str):
    """The same checkpoint loaded by a CPU run (real values, no offload) and saved again: $SW_FAKE_CKPT/cpu."""
    root = os.environ["SW_FAKE_CKPT"]
    _reload(f"{root}/device", f"{root}/cpu", base.Tiny(), strategy, {})
    return base.StepChecks()


def _reload(source: str, target: str, model, strategy: str, options: dict) -> None:
    sw.shard(model, strategy=strategy, units=base.Block, **options)
    optimizer = base._adamw(model)
    on_cpu = not options  # the CPU run's batch is a real host tensor
    model(torch.zeros(2, 4, dtype=torch.long) if on_cpu else base._batch()).backward()
    optimizer.step()  # the state exists, as after training, before the load replaces it
    optimizer.zero_grad()
    sw.load(source, model, optimizer)
    sw.save(target, model, optimizer)


SCENARIOS = {f"{s}-host": (2, lambda s=s: train_host(s), MIXED) for s in ("zero1", "zero2", "zero3")}
SCENARIOS["zero2-host-save"] = (1, lambda: round_trip("zero2", "save"), MIXED)
SCENARIOS["zero3-host-save-async"] = (1, lambda: round_trip("zero3", "save_async"), MIXED)
SCENARIOS["zero2-cpu-reload"] = (1, lambda: cpu_reload("zero2"))
# without offload on the same group: the engine's streams per collective on the device (Note [streams per collective])
SCENARIOS["zero2-streams"] = (2, lambda: base.train("zero2"), MIXED)
SCENARIOS["zero3-streams-prefetch1"] = (2, lambda: base.train("zero3", shard={"prefetch": 1}), MIXED)
SCENARIOS["zero3-streams-ws4"] = (4, lambda: base.train("zero3"), MIXED)
SCENARIOS["zero3-cpu-reload"] = (1, lambda: cpu_reload("zero3"))
SCENARIOS["zero3-host-ws4"] = (4, lambda: train_host("zero3"), MIXED)
SCENARIOS["zero2-host-bf16"] = (2, lambda: train_host("zero2", "bf16"), MIXED)
SCENARIOS["zero2-host-dcp"] = (2, lambda: train_host("zero2", dcp=True), MIXED)
SCENARIOS["zero3-host-stage"] = (2, lambda: train_stage_host("zero3"), MIXED)
SCENARIOS["zero3-host-nccl-only"] = (2, lambda: train_host("zero3"), ONLY_NCCL)


@contextlib.contextmanager
def _old_group_check():
    """CommContext.for_group before Note [group backends]: a mixed group read as a CPU one (`== "nccl"`)."""
    from shardwise.engine.comm.context import CommContext

    def for_group(cls, group, compression=None):
        on_device = dist.get_backend(group) == "nccl"
        return cls(torch.device(DEVICE, 0) if on_device else torch.device("cpu"), compression=compression)
    with base._patched(CommContext, "for_group", classmethod(for_group)):
        yield


@contextlib.contextmanager
def _no_host_wait():
    """The host never waits for the copies before the CPU step (HostCopies.synchronize does nothing)."""
    from shardwise.engine.memory.host_offload import HostCopies

    with base._patched(HostCopies, "synchronize", lambda self: None):
        yield


@contextlib.contextmanager
def _blocking_copies():
    """Every gradient copy to the host made blocking (the host waits for each, as a `.cpu()` would)."""
    from shardwise.engine.memory.host_offload import HostCopies

    real = HostCopies.to_host
    with base._patched(HostCopies, "to_host", lambda self, unit, rows, blocking: real(self, unit, rows, True)):
        yield


@contextlib.contextmanager
def _item_in_copy():
    """A host read of a device value in every copy of rows to the device (a logging line, say)."""
    from shardwise.engine.memory.host_offload import HostCopies

    real = HostCopies.to_device

    def to_device(self, unit, flat, dtype):
        cast = real(self, unit, flat, dtype)
        cast.sum().item()
        return cast
    with base._patched(HostCopies, "to_device", to_device):
        yield


@contextlib.contextmanager
def _unpinned():
    """Host rows and gradient buffers in pageable memory: every `non_blocking` copy then blocks the host."""
    from shardwise.engine.memory import host_offload

    with base._patched(host_offload, "_pinned", lambda policy, device: False):
        yield


@contextlib.contextmanager
def _rows_not_copied():
    """The gather fed the host rows as they are, not their copy on the device."""
    from shardwise.engine.unit.shard_storage import HostRows, OwnShards

    with base._patched(HostRows, "own_parts", OwnShards.own_parts):
        yield


@contextlib.contextmanager
def _dcp_on_compute_device():
    """sw.dcp_state_dict's and model.state_dict()'s meshes on the compute device (the accelerator) rather than on
    the rows' own (both: a layout keeps the first mesh it made)."""
    from shardwise.checkpoint.interop import dcp
    from shardwise.engine import state_dict

    def on_device(tensor, info, device_type):
        return _as_dtensor(tensor, info, DEVICE)
    with base._patched(dcp, "as_dtensor", on_device), base._patched(state_dict, "as_dtensor", on_device):
        yield


@contextlib.contextmanager
def _load_skipped():
    """sw.load that reads nothing (the reloaded model keeps its own values): the comparison must see it."""
    with base._patched(sw, "load", lambda *args, **kwargs: None):
        yield


base.MUTATIONS.update({"load-skipped": base._mutated(_load_skipped), "item-in-copy": base._mutated(_item_in_copy),
                       "old-group-check": base._mutated(_old_group_check), "no-host-wait": base._mutated(_no_host_wait),
                       "unpinned": base._mutated(_unpinned),
                       "blocking-copies": base._mutated(_blocking_copies),
                       "rows-not-copied": base._mutated(_rows_not_copied),
                       "dcp-on-device": base._mutated(_dcp_on_compute_device)})
base.SCENARIOS.update(SCENARIOS)

if __name__ == "__main__":
    for scenario_name in sys.argv[1:]:
        print("REPORT " + json.dumps(base.run(scenario_name)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # as fake_gpu_run.py
