"""The options of `shard()` as typed policies, each rule written once.

`shard()`, the engine and the estimator all consume a `ShardConfig`; its `__post_init__`
is the one place that says which strategy allows which option (tests/test_config.py
holds one test per rule). String shortcuts map onto the policies: `precision="bf16"` is
`MixedPrecision(param_dtype=torch.bfloat16)`, `offload="disk:PATH"` is `DiskOffload(PATH)`, `offload="host"` is
`HostOffload()`.

What each strategy keeps, as the engine and the estimator read it:

| strategy | full params kept | full grads kept until the step | units |
|----------|------------------|--------------------------------|-------|
| ddp      | yes (torch DDP)  | yes (DDP's buckets)            | no    |
| zero1    | yes              | yes                            | yes   |
| zero2    | yes              | no: reduced per unit           | yes   |
| zero3    | no: per window   | no: reduced per unit           | yes   |
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field

import torch

from shardwise.errors import ShardwiseError
from shardwise.wire.canonical import PER_RANK

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ZERO_STRATEGIES = STRATEGIES[1:]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class MixedPrecision:
    """`param_dtype`: gathered parameters and compute. `reduce_dtype`: gradient reduction.
    `buffer_dtype`: module buffers (None keeps them as they are)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ShardwiseError(f"MixedPrecision.{name}={value!r} must be a floating torch.dtype, "
                                     "e.g. torch.bfloat16")

    @property
    def is_full(self) -> bool:
        """True when nothing is lowered: compute and reduction in fp32."""
        return self.param_dtype == torch.float32 and self.reduce_dtype == torch.float32 \
            and self.buffer_dtype in (None, torch.float32)

    @property
    def label(self) -> str:
        """The string shortcut for `param_dtype` ("fp32", "bf16", "fp16")."""
        names = {dtype: name for name, dtype in _DTYPES.items()}
        return names.get(self.param_dtype, str(self.param_dtype))


def resolve_precision(precision: str | MixedPrecision | None) -> MixedPrecision:
    """`"fp32" | "bf16" | "fp16"` (compute in that dtype, reduce in fp32) or a policy."""
    if precision is None:
        return MixedPrecision()
    if isinstance(precision, MixedPrecision):
        return precision
    if precision not in _DTYPES:
        raise ShardwiseError(f"precision={precision!r} is not one of {sorted(_DTYPES)} or a MixedPrecision(...)")
    return MixedPrecision(param_dtype=_DTYPES[precision])


@dataclass(frozen=True)
class DiskOffload:
    """fp32 master shards and optimizer state in memory-mapped files under `path` (zero3)."""

    path: str = field(metadata={PER_RANK: True})  # ranks may use their own disks (Note [options by construction])

    def __post_init__(self):
        if not isinstance(self.path, str) or not self.path:
            raise ShardwiseError(f"DiskOffload.path={self.path!r} must be a non-empty directory path")

    @property
    def spec(self) -> str:
        """The string form `shard(offload=...)` takes."""
        return f"disk:{self.path}"


@dataclass(frozen=True)
class HostOffload:
    """fp32 master rows, their gradients and the optimizer state in host memory, the optimizer stepped there
    (zero1/zero2/zero3): FSDP2's `CPUOffloadPolicy`, DeepSpeed's ZeRO-Offload. `pin_memory`: page-locked host
    buffers, so the copies to and from an accelerator run asynchronously (skipped where none exists).
    Note [host offload], engine/memory/host_offload.py."""

    pin_memory: bool = True

    def __post_init__(self):
        if not isinstance(self.pin_memory, bool):
            raise ShardwiseError(f"HostOffload.pin_memory={self.pin_memory!r} must be True or False")

    @property
    def spec(self) -> str:
        """The string form `shard(offload=...)` takes."""
        return "host"


def resolve_offload(offload: str | DiskOffload | HostOffload | None) -> DiskOffload | HostOffload | None:
    """`None`, `"host"`, `"disk:PATH"`, a `HostOffload` or a `DiskOffload` -> the policy (None: nothing offloaded)."""
    if offload is None or isinstance(offload, (DiskOffload, HostOffload)):
        return offload
    if isinstance(offload, str) and offload.startswith("disk:") and len(offload) > len("disk:"):
        return DiskOffload(offload[len("disk:"):])
    if offload == "host":
        return HostOffload()
    if offload == "cpu":
        raise ShardwiseError("offload='cpu' is spelled offload='host' here (FSDP2's CPUOffloadPolicy): masters, "
                             "gradients and optimizer state in host memory, the optimizer stepped on the CPU")
    if isinstance(offload, (list, tuple, set)):
        raise ShardwiseError(f"offload={offload!r}: offload takes one place, 'host' (host memory) or 'disk:PATH' "
                             "(memory-mapped files, zero3), not both; pick one")
    raise ShardwiseError(f"offload={offload!r} is not understood: use None, 'host' or 'disk:PATH'")


@dataclass(frozen=True)
class HostFrozen:
    """Frozen parameters as one read-only copy per host, mapped by every local rank (`frozen="host"`).

    `source`: a safetensors file holding them (an `sw.export` output), mapped by every rank
    with no copy; None: the host's local rank 0 writes the model's own frozen values into
    `directory` (default /dev/shm), which every rank of the host must see."""

    source: str | None = field(default=None, metadata={PER_RANK: True})  # a host's own path
    directory: str | None = field(default=None, metadata={PER_RANK: True})

    def __post_init__(self):
        for name in ("source", "directory"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not str(value)):
                raise ShardwiseError(f"HostFrozen.{name}={value!r} must be a path (or None)")
        if self.source is not None and self.directory is not None:
            raise ShardwiseError("HostFrozen takes source= (map that file) or directory= (where local rank 0 writes "
                                 "the copy), not both")


def resolve_frozen(frozen: str | HostFrozen | None) -> HostFrozen | None:
    """`None` (frozen parameters follow the strategy), `"host"` or a `HostFrozen`."""
    if frozen is None or isinstance(frozen, HostFrozen):
        return frozen
    if frozen == "host":
        return HostFrozen()
    raise ShardwiseError(f"frozen={frozen!r} is not understood: use None, 'host' or sw.HostFrozen(source=...)")


_CODES = {"int8": 8, "int4": 4}
MAX_BLOCK = 1 << 16  # elements per scale: DeepSpeed's ZeRO++ groups are hundreds to thousands of elements


@dataclass(frozen=True)
class Compression:
    """Quantized collectives, opt-in and not exact (Note [quantized collectives], engine/comm/quantize.py).

    `gather`: "int8" sends zero3's parameter all-gathers block-quantized (qwZ); the fp32 master shards are
    never quantized, only what travels. `reduce`: "int8" or "int4" sends the gradient reduce-scatter
    quantized over an all-to-all and sums it in fp32 (qgZ). `block`: elements per fp32 scale (even)."""

    gather: str | None = None
    reduce: str | None = None
    block: int = 256

    def __post_init__(self):
        if self.gather not in (None, "int8"):
            raise ShardwiseError(f"Compression.gather={self.gather!r}: use 'int8' (or None: gathers exact)")
        if self.reduce not in (None, "int8", "int4"):
            raise ShardwiseError(f"Compression.reduce={self.reduce!r}: use 'int8' or 'int4' (or None: exact)")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block % 2 \
                or not 2 <= self.block <= MAX_BLOCK:
            # Every unit's traffic is padded to whole blocks per rank: a block of 2**40 elements was accepted here
            # and asked the allocator for terabytes at the first gather.
            raise ShardwiseError(f"Compression.block={self.block!r}: use an even number of elements from 2 to "
                                 f"{MAX_BLOCK} (e.g. 256, the default): each rank's rows of a unit travel padded to "
                                 "whole blocks, so a larger block only pads and shares one scale over more values")
        if self.gather is None and self.reduce is None:
            raise ShardwiseError("Compression() compresses nothing: give gather='int8' and/or reduce='int8'|'int4', "
                                 "or pass compression=None")

    @property
    def gather_bits(self) -> int | None:
        return _CODES.get(self.gather)

    @property
    def reduce_bits(self) -> int | None:
        return _CODES.get(self.reduce)

    @property
    def label(self) -> str:
        """"qwZ int8 + qgZ int4 (blocks of 256)": what `sw.describe` and the checkpoint index record."""
        parts = ([f"qwZ {self.gather}"] if self.gather else []) + ([f"qgZ {self.reduce}"] if self.reduce else [])
        return f"{' + '.join(parts)} (blocks of {self.block})"

    def record(self) -> dict:
        """The JSON form the checkpoint index keeps."""
        return {"gather": self.gather, "reduce": self.reduce, "block": self.block}


def resolve_compression(compression: Compression | dict | None) -> Compression | None:
    """`None` (every collective exact), a `Compression`, or its fields as a dict."""
    if compression is None or isinstance(compression, Compression):
        return compression
    if isinstance(compression, dict):
        return Compression(**compression)
    raise ShardwiseError(f"compression={compression!r} is not understood: use None or "
                         "sw.Compression(gather='int8', reduce='int4')")


@dataclass(frozen=True)
class ShardConfig:
    """Everything `shard()` is asked for besides the model, validated once (module docstring)."""

    strategy: str
    precision: MixedPrecision = field(default_factory=MixedPrecision)
    offload: DiskOffload | HostOffload | None = None
    checkpoint_activations: bool = False
    find_unused_parameters: bool = False
    frozen: HostFrozen | None = None
    # zero3: True reshards to the shard group after forward; an int N keeps a secondary shard over N ranks
    # (hpZ: Note [secondary shards], engine/unit/secondary.py)
    reshard_after_forward: bool | int = True
    compression: Compression | None = None
    prefetch: int | None = None  # zero3: gathers issued ahead of use; None: 1 (Note [prefetch depth], stage.py)
    keep_comm_buffers: bool = False  # zero3: the comm pool kept between steps (Note [lean tail], comm/buffers.py)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            close = difflib.get_close_matches(str(self.strategy), STRATEGIES, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ShardwiseError(f"strategy={self.strategy!r} is not one of {STRATEGIES}{hint}")
        if self.strategy == "ddp" and not self.precision.is_full:
            raise ShardwiseError("precision is a zero-strategy option; with strategy='ddp' use torch.autocast "
                                 "around the forward")
        if isinstance(self.offload, DiskOffload) and self.strategy != "zero3":
            raise ShardwiseError(f"offload needs strategy='zero3' ({self.strategy} keeps full parameters in "
                                 "memory, which is most of what offload would move); offload='host' takes "
                                 "zero1/zero2 too")
        if isinstance(self.offload, HostOffload) and self.strategy == "ddp":
            raise ShardwiseError("offload='host' is a zero-strategy option: ddp keeps whole parameters, gradients "
                                 "and optimizer state on the device (torch's reducer). Use strategy='zero1' (or "
                                 "zero2/zero3) with offload='host', or drop offload")
        if self.checkpoint_activations and self.strategy == "ddp":
            raise ShardwiseError("checkpoint_activations needs units: use a zero strategy, or "
                                 "torch.utils.checkpoint inside the model with ddp")
        if self.find_unused_parameters and self.strategy != "ddp":
            raise ShardwiseError("find_unused_parameters is a ddp option; the zero strategies handle unused "
                                 "parameters themselves")
        if self.compression is not None and self.strategy == "ddp":
            raise ShardwiseError("compression is a zero-strategy option (ddp's all-reduce is torch's reducer): use "
                                 "strategy='zero3' (or zero1/zero2 for compression=sw.Compression(reduce=...))")
        if self.compression is not None and self.compression.gather and self.strategy != "zero3":
            raise ShardwiseError(f"Compression(gather=...) needs strategy='zero3': {self.strategy} keeps full "
                                 "parameters whose own rows are the fp32 masters, which a quantized gather would "
                                 "overwrite; use Compression(reduce=...) alone with it")
        self._check_reshard_after_forward()
        self._check_prefetch()
        self._check_keep_comm_buffers()

    def _check_keep_comm_buffers(self) -> None:
        value = self.keep_comm_buffers
        if not isinstance(value, bool):
            raise ShardwiseError(f"keep_comm_buffers={value!r}: pass True (zero3 keeps its comm buffers between "
                                 "steps: faster where freed memory costs page faults, the CPU) or False (the "
                                 "default: released at backward's tail, the smaller peak)")
        if value and self.strategy != "zero3":
            raise ShardwiseError(f"keep_comm_buffers=True is a zero3 option: {self.strategy} keeps its comm "
                                 "buffers between steps already. Use strategy='zero3', or drop keep_comm_buffers")

    def _check_prefetch(self) -> None:
        value = self.prefetch
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ShardwiseError(f"prefetch={value!r}: pass the number of unit gathers zero3 keeps issued ahead of "
                                 "use, an int of at least 1 (default 1), or leave it out")
        if self.strategy != "zero3":
            raise ShardwiseError(f"prefetch={value} is a zero3 option: {self.strategy} keeps every unit's full "
                                 "parameters, so there is nothing to gather ahead of use. Use strategy='zero3', or "
                                 "drop prefetch")

    def _check_reshard_after_forward(self) -> None:
        value = self.reshard_after_forward
        if value is True:
            return
        if value is False:
            raise ShardwiseError("reshard_after_forward=False (keep each unit's full parameters from forward to "
                                 "backward) is strategy='zero2''s memory: use strategy='zero2', or keep "
                                 "reshard_after_forward=True, or pass the ranks per node (an int) for zero3's hpZ")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ShardwiseError(f"reshard_after_forward={value!r}: pass True (zero3's default) or an int, the ranks "
                                 "per node that keep a secondary shard after forward (hpZ, DeepSpeed's "
                                 "zero_hpz_partition_size, FSDP2's reshard_after_forward=int)")
        if self.strategy != "zero3":
            raise ShardwiseError(f"reshard_after_forward={value} (hpZ) is a zero3 option: {self.strategy} keeps every "
                                 "unit's full parameters after forward, so backward gathers nothing. Use "
                                 "strategy='zero3', or drop reshard_after_forward")
        if value < 2:
            raise ShardwiseError(f"reshard_after_forward={value}: the secondary shard spans the ranks of a node, at "
                                 "least 2 (a node of one rank would keep whole parameters: use strategy='zero2')")

    @classmethod
    def of(cls, strategy: str, *, precision: str | MixedPrecision | None = None,
           offload: str | DiskOffload | HostOffload | None = None, checkpoint_activations: bool = False,
           find_unused_parameters: bool = False, frozen: str | HostFrozen | None = None,
           reshard_after_forward: bool | int = True,
           compression: Compression | dict | None = None, prefetch: int | None = None,
           keep_comm_buffers: bool = False) -> ShardConfig:
        """The policy for `shard()`'s keyword arguments (string shortcuts resolved)."""
        return cls(strategy, resolve_precision(precision), resolve_offload(offload),
                   bool(checkpoint_activations), bool(find_unused_parameters), resolve_frozen(frozen),
                   compression=resolve_compression(compression), reshard_after_forward=reshard_after_forward,
                   prefetch=prefetch, keep_comm_buffers=keep_comm_buffers)

    @property
    def label(self) -> str:
        """A short name, e.g. "zero3+bf16+offload"."""
        return config_label(self.strategy, self.precision.label, self.offload is not None)


def config_label(strategy: str, precision: str, offloaded: bool) -> str:
    """"zero3+bf16+offload": the strategy, a precision other than fp32, and whether state is offloaded."""
    parts = [strategy] + ([precision] if precision != "fp32" else [])
    return "+".join(parts + (["offload"] if offloaded else []))
