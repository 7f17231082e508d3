"""Deferred initialization: build a model on the meta device, materialize it later, shard by shard.
Uses: nothing of the engine.

    with sw.deferred_init():
        model = GPT(cfg)                 # allocates nothing
    sw.shard(model, strategy="zero3")   # each rank keeps its rows; values equal eager init

Note [init replay]: inside `deferred_init()` every operation on a meta tensor is
recorded (a TorchDispatchMode), along with the RNG state at entry. `shard()` then
replays that log on real tensors, from the same RNG state, so every random draw
happens in the same order as it would have eagerly: the values equal eager init
with the same seed, at any world size. Peak memory stays small because a tensor is
only made real from the last operation that overwrites it completely (an in-place
fill: `normal_`, `uniform_`, `zero_`, `fill_`, ... over its whole storage) until
its last use; draws *before* that last overwrite (say `nn.Linear`'s default
kaiming init, later replaced by the model's own `normal_`) run on a scratch tensor
of the same shape, only to advance the generator exactly as eager did. A parameter
is handed to the engine right after its last operation, which keeps this rank's
rows and lets the rest go.

Note [rows without a full tensor]: a parameter made by `torch.empty` that no later op reads or writes (every
`nn.Linear` built under transformers' `no_init_weights`, as `sw.from_pretrained` builds a model the load then
overwrites) has no value to replay: eager would hold whatever memory it got. Making it real only to keep this
rank's rows cost a whole-model's worth of allocations per rank (762 MiB on bench/checkpoints/hf_load.py's
Llama). It is delivered as None instead, and the engine keeps the zeros its rows start with.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shardwise.errors import ShardwiseError

# In-place ops that overwrite every element of their target without reading it.
_FILLS = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_",
          "geometric_", "fill_", "zero_"}
# Factories whose tensor holds no values yet: eager holds whatever memory it got (Note [rows without a full tensor]).
_UNINITIALIZED = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
# Ops that draw from the generator (their draws must be replayed even when discarded).
_RANDOM = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_",
           "geometric_", "normal", "rand", "randn", "randint", "randperm", "bernoulli", "multinomial",
           "rand_like", "randn_like", "randint_like", "native_dropout", "dropout"}


@dataclass(frozen=True)
class _Ref:
    """A meta tensor in the log: which storage, and the view of it the op saw."""

    key: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype
    storage_nbytes: int

    @property
    def covers_storage(self) -> bool:
        numel = 1
        for n in self.size:
            numel *= n
        return self.offset == 0 and numel * self.dtype.itemsize == self.storage_nbytes and \
            self.stride == tuple(torch.empty(self.size, device="meta").stride())


@dataclass
class _Entry:
    func: object
    args: tuple
    kwargs: dict
    writes: list  # storage keys this op mutates or creates
    reads: list  # storage keys it only reads
    name: str
    outputs: list  # refs of the tensors it created


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def _to_ref(value):
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        return _Ref(_key(value), value.storage_offset(), tuple(value.shape), tuple(value.stride()),
                    value.dtype, value.untyped_storage().nbytes())
    return value


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.log: list[_Entry] = []
        # Storage keys are addresses: keeping every meta tensor seen alive (they cost
        # nothing) stops a freed temporary's address from being reused by a parameter.
        self.keepalive: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device.type == "meta"]
        input_keys = {_key(t) for t in inputs}
        mutated = _mutated_keys(func, args, kwargs)
        created = [_key(t) for t in outputs if _key(t) not in input_keys]
        self.keepalive += inputs + outputs
        if not mutated and not created:
            return out  # a view or a metadata query: nothing to replay
        self.log.append(_Entry(func, tree_map(_to_ref, args), tree_map(_to_ref, kwargs),
                               sorted(set(mutated) | set(created)), sorted(input_keys - set(mutated)),
                               func._overloadpacket.__name__, [_to_ref(t) for t in outputs]))
        return out


def _mutated_keys(func, args, kwargs) -> list[int]:
    keys = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            keys.append(_key(value))
    return keys


_INITIALIZER_NAMES = [name for name in dir(nn.init)
                      if name.endswith("_") and not name.startswith("_") and callable(getattr(nn.init, name))]


class _RealConstants(TorchFunctionMode):
    """`torch.tensor(1.0)` on the meta device keeps no value and runs no op the recorder
    could see; build such constants on the CPU first and move them to meta, so the move
    (which carries the value) is what gets recorded."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is None:
            value = func(*args, **dict(kwargs, device="cpu"))
            # Note [probes of the device]: an empty `torch.tensor([])` is how libraries ask which
            # device a context puts tensors on (transformers skips its whole weight init when the
            # answer is meta, so values would differ from eager). It holds nothing to record, so it
            # stays on the CPU and they run the init eagerly, which is recorded like any other.
            return value if value.numel() == 0 else value.to("meta")
        return func(*args, **kwargs)


@contextmanager
def _recording_initializers(recorder: "_Recorder"):
    """nn.init's initializers, recorded as one call each while recording.

    Some skip meta tensors outright and sample with data-dependent loops (trunc_normal_'s
    rejection sampling), so their operations cannot be recorded on meta: the call itself
    is, and replays whole on the real tensor, drawing exactly what eager drew. Modules look
    them up as `init.<name>` at call time, which is what this swaps for the duration."""
    originals = {name: getattr(nn.init, name) for name in _INITIALIZER_NAMES}

    def recorded(name, original):
        def initializer(tensor, *args, **kwargs):
            if not (isinstance(tensor, torch.Tensor) and tensor.device.type == "meta"):
                return original(tensor, *args, **kwargs)
            recorder.log.append(_Entry(original, tree_map(_to_ref, (tensor, *args)), tree_map(_to_ref, kwargs),
                                       [_key(tensor)], [], f"init:{name}", []))
            recorder.keepalive.append(tensor)
            return tensor
        return initializer

    for name, original in originals.items():
        setattr(nn.init, name, recorded(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


@contextmanager
def deferred_init():
    """Build modules on the meta device, recording their initialization (Note [init replay])."""
    recorder = _Recorder()
    rng_state = torch.get_rng_state()
    with torch.device("meta"), recorder, _RealConstants(), _recording_initializers(recorder):
        yield
    _DEFERRED_LOGS.append((recorder.log, rng_state, recorder.keepalive))


# The context manager cannot know which model the user builds in it, so a recording
# waits here until shard() finds it by its parameters' storage keys, and is then dropped.
_DEFERRED_LOGS: list = []


def is_deferred(model: nn.Module) -> bool:
    """True when the model's parameters live on the meta device (built under deferred_init)."""
    return any(p.device.type == "meta" for p in model.parameters())


def record(fn: Callable[[], None]) -> list:
    """Run `fn` on the (still meta) model and return its recorded operations, to be replayed
    after the construction's, as if it had been called right after the model was built."""
    recorder = _Recorder()
    with torch.device("meta"), recorder, _RealConstants(), _recording_initializers(recorder):
        fn()
    return recorder.log


def replay(params: dict[str, torch.Tensor], deliver: Callable[[str, torch.Tensor], None],
           device: torch.device | str = "cpu", extra_log: list | None = None) -> None:
    """Run the recorded initialization of the meta `params` (by name), calling
    `deliver(name, value)` once per parameter as soon as its final value exists
    (Note [init replay]); `value` is None for a parameter nothing wrote (Note [rows without a full tensor]):
    the caller gives it zeros. `extra_log` (from `record`) runs after the construction."""
    names_by_key = {}
    for name, param in params.items():
        names_by_key.setdefault(_key(param), []).append((name, param))
    log, rng_state = _take_log(set(names_by_key))
    log = log + (extra_log or [])
    last_fill, last_use, num_entries = {}, {}, {}
    for index, entry in enumerate(log):
        for key in entry.reads + entry.writes:
            last_use[key] = index
            num_entries[key] = num_entries.get(key, 0) + 1
        for key in entry.writes:
            target = _target_ref(entry, key)
            fills = entry.name in _FILLS or entry.name.startswith("init:")
            if _created(entry, key) or (fills and target is not None and target.covers_storage):
                last_fill[key] = index

    saved_rng = torch.get_rng_state()
    torch.set_rng_state(rng_state)
    slots: dict[int, torch.UntypedStorage] = {}
    delivered = set()
    try:
        for index, entry in enumerate(log):
            if entry.name in _UNINITIALIZED and all(num_entries[key] == 1 for key in entry.writes):
                continue  # made and never touched: no value, no draw (Note [rows without a full tensor])
            dead = all(index < last_fill.get(key, -1) for key in entry.writes)
            if dead:  # its result is overwritten later: only its random draws matter
                if entry.name in _RANDOM or entry.name.startswith("init:"):
                    _run(entry, slots, device, scratch=True)
            else:
                _run(entry, slots, device, scratch=False)
            for key in set(entry.reads + entry.writes):
                if last_use[key] == index:
                    for name, param in names_by_key.get(key, []):
                        deliver(name, _real_view(param, slots, key, device))
                        delivered.add(name)
                    slots.pop(key, None)
    finally:
        if not torch.equal(saved_rng, rng_state):
            torch.set_rng_state(saved_rng)  # the user drew in between: leave their stream alone
    for key, entries in names_by_key.items():
        for name, param in entries:
            if name not in delivered:  # never written: eager would hold garbage
                deliver(name, None)


def _take_log(keys: set[int]):
    for position in range(len(_DEFERRED_LOGS) - 1, -1, -1):
        log, rng_state, _ = _DEFERRED_LOGS[position]
        if keys & {key for entry in log for key in entry.writes}:
            del _DEFERRED_LOGS[position]
            return log, rng_state
    raise ShardwiseError(
        "this model is on the meta device but was not built inside `sw.deferred_init()`, so its "
        "initialization cannot be replayed; build it inside `with sw.deferred_init():`"
    )


def _created(entry: _Entry, key: int) -> bool:
    """The op made this storage. An in-place op returns its own input (`weight[0].zero_()`
    returns the row): that is a write to the storage, not its creation."""
    return _target_ref(entry, key) is None and any(isinstance(o, _Ref) and o.key == key for o in entry.outputs)


def _target_ref(entry: _Entry, key: int):
    for value in tree_flatten((entry.args, entry.kwargs))[0]:
        if isinstance(value, _Ref) and value.key == key:
            return value
    return None


def _real(ref: _Ref, slots, device) -> torch.Tensor:
    storage = slots.get(ref.key)
    if storage is None:
        storage = torch.zeros(ref.storage_nbytes, dtype=torch.uint8, device=device).untyped_storage()
        slots[ref.key] = storage
    base = torch.empty(0, dtype=ref.dtype, device=device).set_(storage)
    return base.as_strided(ref.size, ref.stride, ref.offset)


def _real_view(param: torch.Tensor, slots, key, device) -> torch.Tensor:
    ref = _to_ref(param)
    return _real(ref, slots, device) if key in slots else torch.zeros(param.shape, dtype=param.dtype, device=device)


def _run(entry: _Entry, slots, device, scratch: bool) -> None:
    def to_real(value):
        if isinstance(value, _Ref):
            if scratch:
                return torch.empty(value.size, dtype=value.dtype, device=device)
            return _real(value, slots, device)
        if isinstance(value, torch.device) and value.type == "meta":
            return torch.device(device)
        return value

    args = tree_map(to_real, entry.args)
    kwargs = tree_map(to_real, entry.kwargs)
    if kwargs.get("device") is not None and str(kwargs["device"]) == "meta":
        kwargs["device"] = torch.device(device)
    with torch.no_grad():
        out = entry.func(*args, **kwargs)
    if scratch:
        return
    for ref, value in zip(entry.outputs, [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]):
        if isinstance(ref, _Ref) and isinstance(value, torch.Tensor) and ref.key not in slots:
            slots[ref.key] = value.untyped_storage()


def materialize(model: nn.Module, init_fn: Callable[[nn.Module], None] | None = None,
                device: torch.device | str = "cpu") -> None:
    """Bring a whole deferred model to life in place (for ddp, which keeps full parameters).
    Parameters already real (host-shared frozen weights, Note [host copy]) are kept as they are."""
    aliases = {name: param.detach() for name, param in model.named_parameters() if param.device.type == "meta"}
    kept = [(module, attribute, param) for module in model.modules()
            for attribute, param in module._parameters.items() if param is not None and param.device.type != "meta"]
    buffers = meta_buffers(model)  # to_empty() would leave them uninitialized memory
    extra_log = record(lambda: init_fn(model)) if init_fn is not None else None
    # to_empty() makes a new Parameter per registration when leaving the meta device, which
    # would untie tied weights: remember who shares what, and tie them again after.
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    for module, attribute, _ in kept:  # to_empty() would replace them too: a placeholder keeps their place
        module._parameters[attribute] = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    model.to_empty(device=device)
    for module, attribute, param in kept:
        module._parameters[attribute] = param
    for names in groups.values():
        first = model.get_parameter(names[0])
        for other in names[1:]:
            module_name, _, attribute = other.rpartition(".")
            model.get_submodule(module_name)._parameters[attribute] = first
    current = dict(model.named_parameters())

    def deliver(name, value):
        if name in current:
            current[name].copy_(value) if value is not None else current[name].zero_()
        else:
            set_buffer(model, name, value if value is not None else zeros_like_meta(buffers[name], device))

    with torch.no_grad():
        replay({**aliases, **buffers}, deliver, device=device, extra_log=extra_log)


def meta_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers still on the meta device, by every name they are registered under."""
    return {name: b for name, b in model.named_buffers(remove_duplicate=False) if b.device.type == "meta"}


def zeros_like_meta(meta: torch.Tensor, device) -> torch.Tensor:
    """Zeros of a meta tensor's shape and dtype on `device`: a buffer nothing wrote (Note [rows without a full
    tensor])."""
    return torch.zeros(meta.shape, dtype=meta.dtype, device=device)


def set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Register `value` (a replayed buffer) under `name`, keeping the buffer's persistence."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._buffers[attribute] = value.clone()
