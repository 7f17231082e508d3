"""The machinery of Note [fake accelerator] (helpers/fake_cuda.py): import it only in a process of its own
(tests/scripts/fake_gpu_run.py), since `install()` changes torch for the rest of the process."""

from __future__ import annotations

import collections
import contextlib
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

DEVICE = "fakegpu"
aten = torch.ops.aten


def install() -> None:
    """Register the accelerator, the subclass redirection and the mirror collectives (once per process)."""
    from torch.utils.backend_registration import _DummyBackendModule, _setup_privateuseone_for_python_backend

    class Module(_DummyBackendModule):
        """torch.fakegpu: what torch's pipelining asks of a device module (its RNG state) besides the basics."""

        def get_rng_state(self, device=None):
            return torch.zeros(8, dtype=torch.uint8)

        def set_rng_state(self, state, device=None):
            pass

    _setup_privateuseone_for_python_backend(rename=DEVICE, backend_module=Module())
    FakeTensor.__setattr__ = _set_class_too
    torch.Tensor.as_subclass = _as_subclass
    _mirror_collectives()


# ---- tensor subclasses -------------------------------------------------------------------------------

_flavours: dict[type, type] = {}


def _fake_flavour(cls: type) -> type:
    """`cls` and FakeTensor in one class: the engine's subclass behaviour over a fake tensor."""
    if issubclass(cls, FakeTensor):
        return cls
    if cls not in _flavours:
        _flavours[cls] = type(f"Fake{cls.__name__}", (cls, FakeTensor), {"__module__": cls.__module__})
    return _flavours[cls]


def _set_class_too(self, name, value):
    if name == "__class__" and not issubclass(value, FakeTensor):
        value = _fake_flavour(value)
    object.__setattr__(self, name, value)


_real_as_subclass = torch.Tensor.as_subclass


def _as_subclass(self, cls):
    if not isinstance(self, FakeTensor):
        return _real_as_subclass(self, cls)
    alias = aten.alias.default(self)
    if cls is not torch.Tensor:
        alias.__class__ = _fake_flavour(cls)
    return alias


# ---- ranks: the mirror collectives ---------------------------------------------------------------------

HOST_GROUPS: set = set()  # groups the engine made as gloo groups (host values, Note [host values])
COLLECTIVE_ERRORS: list[str] = []


class _Done:
    """A collective's handle: already complete (the mirror ran at the call)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result(None)
        return future


def _world(group) -> int:
    return dist.get_world_size(group)




def _check_devices(name, group, tensors):
    """A collective's tensors share one device; a host group's are on the CPU (gloo's); a mixed group's
    (MIXED) device tensors go to its device backend and CPU ones to its host backend; another's anywhere."""
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        COLLECTIVE_ERRORS.append(f"{name} mixes devices {sorted(devices)}:\n{_where()}")
    if group in HOST_GROUPS and devices - {"cpu"}:
        COLLECTIVE_ERRORS.append(f"{name} on a host group with {sorted(devices)} tensors:\n{_where()}")
    served = _real_get_backend(group)
    if ":" in served and devices - {spec.split(":")[0] for spec in served.split(",")}:
        COLLECTIVE_ERRORS.append(f"{name} of {sorted(devices)} tensors on a group with backends {served}:\n{_where()}")


_real_get_backend = dist.get_backend


def _reported_backend(group=None):
    """What the engine reads of a group: MIXED as the mixed NCCL group it stands in for (Note [fake accelerator])."""
    return _real_get_backend(group).replace(f"{DEVICE}:fake", f"{DEVICE}:nccl").replace("cpu:fake", "cpu:gloo")


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/shardwise/" in f.filename]
    return "".join(traceback.format_list(frames[-4:]))


def _scale(tensor, op, world):
    if op in (dist.ReduceOp.SUM, None) and world > 1:
        tensor.mul_(world)


def _mirror_collectives() -> None:
    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        _check_devices("all_gather_single", group, [output_tensor, input_tensor])
        output_tensor.view(_world(group), -1).copy_(input_tensor.reshape(1, -1).expand(_world(group), -1))
        return _Done() if async_op else None

    def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check_devices("reduce_scatter_single", group, [output, input])
        output.view(-1).copy_(input.view(_world(group), -1)[dist.get_rank(group)])
        _scale(output, op, _world(group))
        return _Done() if async_op else None

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        _check_devices("all_reduce", group, [tensor])
        _scale(tensor, op, _world(group))
        return _Done() if async_op else None

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        _check_devices("broadcast", group, [tensor])
        return _Done() if async_op else None

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        _check_devices("all_gather", group, [tensor, *tensor_list])
        for out in tensor_list:
            out.copy_(tensor)
        return _Done() if async_op else None

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        _check_devices("all_to_all_single", group, [output, input])
        mine = input.reshape(_world(group), -1)[dist.get_rank(group)]
        output.view(_world(group), -1).copy_(mine.reshape(1, -1).expand(_world(group), -1))
        return _Done() if async_op else None

    def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
        _check_devices("gather", group, [tensor, *(gather_list or [])])
        for out in gather_list or []:
            out.copy_(tensor)
        return _Done() if async_op else None

    def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
        _check_devices("scatter", group, [tensor, *(scatter_list or [])])
        if scatter_list:
            tensor.copy_(scatter_list[dist.get_rank(group)])
        return _Done() if async_op else None

    def barrier(group=None, async_op=False, device_ids=None):
        return _Done() if async_op else None

    real_new_group = dist.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                  group_desc=None, device_id=None):
        made = "fake" if backend == "gloo" else backend
        if made and f"{DEVICE}:nccl" in made:  # a group like one of the fake world's (as reported)
            made = made.replace(f"{DEVICE}:nccl", f"{DEVICE}:fake").replace("cpu:gloo", "cpu:fake")
        group = real_new_group(ranks, timeout=timeout, backend=made,
                               use_local_synchronization=use_local_synchronization)
        if backend == "gloo":
            HOST_GROUPS.add(group)
        return group

    for name, function in dict(all_gather_single=all_gather_single, all_gather_into_tensor=all_gather_single,
                               reduce_scatter_single=reduce_scatter_single, reduce_scatter_tensor=reduce_scatter_single,
                               all_reduce=all_reduce, broadcast=broadcast, all_gather=all_gather,
                               all_to_all_single=all_to_all_single, gather=gather, scatter=scatter,
                               barrier=barrier, new_group=new_group, get_backend=_reported_backend).items():
        setattr(dist, name, function)


# torch's fake process group registered for the accelerator as well as the host: to the engine it reads as
# "cpu:gloo,fakegpu:nccl" (`_reported_backend`), a mixed group as `sw.init(backend="cpu:gloo,cuda:nccl")` makes on
# a GPU: the accelerator's tensors on a device backend, the host's on gloo (Note [host offload]).
MIXED = f"cpu:fake,{DEVICE}:fake"


@contextlib.contextmanager
def fake_world(world_size: int, backend: str = "fake"):
    """torch's fake process group at `world_size`, this process rank 0 (destroyed after); `backend=MIXED`: the
    mixed group a GPU run with host values on the CPU uses (the default reads as no device backend at all)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend, store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        HOST_GROUPS.clear()
        dist.destroy_process_group()


# ---- host tensors stay real -----------------------------------------------------------------------------

def tensors_of(args, kwargs):
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]


PINNED: dict[int, torch.Tensor] = {}  # host storages made "pinned" (page-locked on a GPU), by storage


def is_pinned(tensor: torch.Tensor) -> bool:
    return not isinstance(tensor, FakeTensor) and tensor.untyped_storage()._cdata in PINNED


class HostStaysReal(TorchDispatchMode):
    """Above a FakeTensorMode: an op on real CPU tensors only (or a CPU factory call) runs for real; one that
    moves real tensors to the device gets them as fakes (FakeTensorMode would run it for real: no kernel).
    Pinned host memory (`pin_memory=True`, `.pin_memory()`), which a Python backend cannot allocate, is
    ordinary host memory noted in PINNED: `is_pinned` answers from it, and StepChecks counts a
    `non_blocking` copy from or into host memory that is not pinned as the blocking copy torch makes of it."""

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.is_pinned.default and not isinstance(args[0], FakeTensor):
            return is_pinned(args[0])
        if func is aten._pin_memory.default and not isinstance(args[0], FakeTensor):
            with _disable_current_modes():
                return _pinned(args[0].clone())
        if kwargs.get("pin_memory"):
            return _pinned(self.__torch_dispatch__(func, types, args, {**kwargs, "pin_memory": False}))
        tensors = tensors_of(args, kwargs)
        device = kwargs.get("device")
        to_device = device is not None and torch.device(device).type != "cpu"
        if all(not isinstance(t, FakeTensor) and t.device.type == "cpu" for t in tensors):
            if not to_device:
                with _disable_current_modes():
                    return func(*args, **kwargs)
            args, kwargs = tree_map_only(torch.Tensor, self.fake_mode.from_tensor, (args, kwargs))
        return func(*args, **kwargs)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    PINNED[tensor.untyped_storage()._cdata] = tensor  # kept alive: the key is never another storage's
    return tensor


@contextlib.contextmanager
def fake_device():
    """FakeTensorMode with host tensors kept real (HostStaysReal)."""
    # torch.tensor(data, device=DEVICE) builds on the CPU and lifts: FakeTensorMode does this only where no
    # accelerator is available, and ours says it is (its autograd nodes need streams).
    lift_cpu_only = torch._C._only_lift_cpu_tensors()
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, HostStaysReal(mode):
            yield
    finally:
        torch._C._set_only_lift_cpu_tensors(lift_cpu_only)


def fake_parameters(model: nn.Module) -> nn.Module:
    """A model built on the meta device, given fake parameters (and buffers) on DEVICE (random init cannot
    run on a fake device; values do not exist here). Call inside `fake_device()`."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=DEVICE),
                                               requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=DEVICE)
    return model


# ---- checks over counted steps ---------------------------------------------------------------------------

_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.nonzero.default,
          aten.item.default}


def _caller() -> str:
    frames = [f for f in traceback.extract_stack() if "/shardwise/" in f.filename]
    if not frames:
        return "torch or the test"
    f = frames[-1]
    return f"{f.filename.split('shardwise/')[-1]}:{f.name}"


_active: list = []  # the StepChecks entered, innermost last


def note_host_wait(what: str) -> None:
    """The host waits for the device (an event's or a stream's `synchronize`): a sync, counted where checked."""
    if _active:
        _active[-1].syncs[f"{what} at {_caller()}"] += 1


class StepChecks(TorchDispatchMode):
    """Counts, per shardwise caller, reads of device values on the host and host waits for the device
    (`syncs`), and real CPU tensors of more than one element meeting a device tensor (`host_tensors`).
    Entered above `fake_device()`."""

    def __init__(self):
        super().__init__()
        self.syncs = collections.Counter()
        self.host_tensors = collections.Counter()
        self.device_ops = collections.Counter()  # what the checks saw: every op on device tensors, by name

    def __enter__(self):
        _active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_of(args, kwargs)
        on_device = [t for t in tensors if isinstance(t, FakeTensor) and t.device.type == DEVICE]
        if _from_host(func, args, kwargs):
            self.syncs[f"host-to-device {func.__name__} at {_caller()}"] += 1
        if on_device:
            self.device_ops[func.__name__] += 1
            if func in _READS:
                self.syncs[f"{func.__name__} at {_caller()}"] += 1
                return _dummy(func, on_device[0])
            if _to_host(func, args, kwargs):
                self.syncs[f"device-to-host {func.__name__} at {_caller()}"] += 1
            # a copy between host and device memory is a transfer, not a host tensor in the device's arithmetic:
            # counted above where the host waits for it
            if func is not aten.copy_.default and any(
                    not isinstance(t, FakeTensor) and t.device.type == "cpu" and t.dim() > 0 for t in tensors):
                self.host_tensors[f"{func.__name__} at {_caller()}"] += 1
        return func(*args, **kwargs)


def _non_blocking(func, args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking") or (func is aten.copy_.default and len(args) > 2 and args[2]))


def _to_host(func, args, kwargs) -> bool:
    """A copy from the device into host memory that the host waits for: all but a `non_blocking` one into pinned
    memory. A `non_blocking` `_to_copy` (`.to("cpu", non_blocking=True)`) makes its new host memory pinned (torch's
    `_to_copy` pins the output of a non-blocking copy from an accelerator), so the host does not wait for it: the
    read that follows waits, for an event (counted where it waits)."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and not kwargs.get("non_blocking")
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and not (_non_blocking(func, args, kwargs) and is_pinned(args[0]))
    return False


def _from_host(func, args, kwargs) -> bool:
    """A blocking copy of host memory to the device: torch waits for the device's stream to finish it
    (`memcpy_and_sync`), as `torch.tensor(data, device=...)` does; `non_blocking=True` waits too unless the
    host memory is pinned."""
    if func is aten._to_copy.default:
        device = kwargs.get("device")
        source = args[0]
    elif func is aten.copy_.default:
        device, source = args[0].device, args[1]
    else:
        return False
    if device is None or torch.device(device).type != DEVICE or source.device.type != "cpu":
        return False
    return not (_non_blocking(func, args, kwargs) and is_pinned(source))


def _dummy(func, tensor):
    """What a host read returns here: no value exists (the count is the finding)."""
    if func is aten.nonzero.default:
        return torch.empty((0, tensor.dim()), dtype=torch.long, device=tensor.device)
    if func in (aten.is_nonzero.default, aten.equal.default):
        return False
    return 0 if not tensor.dtype.is_floating_point else 0.0
