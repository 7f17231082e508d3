"""`shard(..., frozen="host")`: one read-only copy of the frozen weights per host, mapped by every local rank.

Note [host copy]: fine-tuning a large frozen base with a small trainable part is the common
case; DDP keeps a full copy of the base on every rank and FSDP2 / zero3 all-gather it every
step, though it never changes. Here the frozen parameters (`requires_grad=False` when
`shard()` runs) become views of one safetensors file that every rank of the host maps with
`mmap(PROT_READ)`: the kernel keeps each page once, however many ranks map it.

- Where the file comes from: `HostFrozen(source=PATH)` maps a file the user has (an
  `sw.export` output, a downloaded `model.safetensors`) on every rank, with no copy at all,
  so a model built under `sw.deferred_init()` never materializes its base. Without a source,
  the host's local rank 0 (torchrun's `LOCAL_RANK`; without it, the lowest rank on the host
  name) writes its own frozen values into `HostFrozen.directory` (default `/dev/shm`, which
  is memory), every local rank maps it, and the file is unlinked once all have: the mapping
  lives on, and nothing is left behind when the job ends or dies.
- Several hosts each write and map their own copy; the leaders compare a crc32 of what they
  wrote, so hosts whose models differ (an unseeded init) are refused instead of trained.
- The engine leaves host-shared parameters alone: no unit owns them (no shard, no gather,
  no reduce), DDP is told to ignore them. They stay registered in the model, so forwards,
  `state_dict()` and `sw.export` see them as full tensors.
- Writes are refused (host_param.py, Note [read-only host weights]); a parameter unfrozen
  after `shard()` is refused at the next forward (the strategy was set up without it).
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import HostFrozen
from shardwise.engine.host_param import HostParameter, is_host_shared
from shardwise.errors import ShardwiseError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_CODES = {code: dtype for dtype, code in _DTYPES.items()}


@dataclass
class HostMapping:
    """The file the host's ranks map, and the parameters that are views of it."""

    path: Path
    device: int  # st_dev and st_ino: two ranks with the same pair map the same file
    inode: int
    names: list[str] = field(default_factory=list)
    num_bytes: int = 0


def frozen_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]]:
    """Each distinct frozen parameter by its first name: (param, every (module, attribute), every name)."""
    found: dict[int, tuple[str, nn.Parameter, list, list]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.requires_grad:
            continue
        module_path, _, attribute = name.rpartition(".")
        entry = found.setdefault(id(param), (name, param, [], []))
        if not any(m is modules[module_path] and a == attribute for m, a in entry[2]):
            entry[2].append((modules[module_path], attribute))
        entry[3].append(name)
    return {name: (param, holders, names) for name, param, holders, names in found.values()}


def place_frozen_on_host(model: nn.Module, policy: HostFrozen, group) -> HostMapping:
    """Make every frozen parameter of `model` a read-only view of the host's one mapped copy
    (Note [host copy]); every rank of `group` calls it."""
    frozen = frozen_params(model)
    if not frozen:
        raise ShardwiseError("frozen='host' shares the frozen parameters, but none is frozen: set "
                             "requires_grad=False on the base (e.g. model.base.requires_grad_(False)) before sw.shard")
    if policy.source is not None:
        path, unlink = Path(policy.source).absolute(), False
    else:
        meta = [name for name, (param, _, _) in frozen.items() if param.device.type == "meta"]
        if meta:
            raise ShardwiseError(f"{meta[0]!r} is frozen and still on the meta device (sw.deferred_init): a "
                                 "deferred model's frozen weights come from a file, "
                                 "frozen=sw.HostFrozen(source='base.safetensors')")
        path, unlink = _write_on_leader(frozen, policy, group), True
    mapping, error = None, None
    try:
        mapping = _map(path, frozen)
    except ShardwiseError as exc:
        error = str(exc)
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)  # every rank has mapped it, or all raise
    failed = [(rank, message) for rank, message in enumerate(errors) if message]
    if failed:
        if unlink and _is_local_leader(group):
            path.unlink(missing_ok=True)
        raise ShardwiseError(f"rank {failed[0][0]}: {failed[0][1]}")
    if unlink and _is_local_leader(group):
        path.unlink(missing_ok=True)  # the mappings keep the pages; nothing is left behind
    _refuse_unfreezing_after_shard(model, frozen)
    return mapping


def _write_on_leader(frozen, policy: HostFrozen, group) -> Path:
    token = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, group_src=0, group=group)
    path = Path(policy.directory or _default_directory()).absolute() / f"shardwise-host-{token[0]}.safetensors"
    leader = _is_local_leader(group)
    crc, error = None, None
    if leader:
        try:
            crc = write_safetensors(path, {name: param for name, (param, _, _) in frozen.items()})
        except OSError as exc:
            error = f"{path}: {exc}"
    reports = [None] * dist.get_world_size(group)
    dist.all_gather_object(reports, (socket.gethostname(), leader, crc, error), group=group)
    errors = [r[3] for r in reports if r[3]]
    if errors:
        raise ShardwiseError(f"writing the host copy of the frozen weights failed: {errors[0]} "
                             "(set frozen=sw.HostFrozen(directory=...) to a directory with room, on every host)")
    crcs = {r[2] for r in reports if r[1]}
    if len(crcs) > 1:
        if leader:
            path.unlink(missing_ok=True)  # refused: leave nothing behind in shared memory
        raise ShardwiseError("the hosts' frozen weights differ (crc32 of each host's copy), so each host would train "
                             "against another base: seed the model identically on every rank, or map one file "
                             "with frozen=sw.HostFrozen(source=...)")
    return path


def _default_directory() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else os.environ.get("TMPDIR", "/tmp")


def _is_local_leader(group) -> bool:
    """Local rank 0 (torchrun's LOCAL_RANK), else the lowest rank of the group on this host name."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return int(local) == 0
    names = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return names.index(socket.gethostname()) == dist.get_rank(group)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` as one safetensors file, one tensor at a time (no copy of the whole);
    the widest dtypes first, so every tensor starts at a multiple of its element size.
    Returns the crc32 of the data."""
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header, offset = {}, 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    crc = 0
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as out:
            out.write(len(raw).to_bytes(8, "little") + raw)
            for name in order:
                data = memoryview(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
                out.write(data)
                crc = zlib.crc32(data, crc)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)  # a full /dev/shm must not stay full of our half file
        raise
    return crc


def _map(path: Path, frozen) -> HostMapping:
    """Map `path` read-only and make each frozen parameter a view of its bytes."""
    try:
        with open(path, "rb") as file:
            stat = os.fstat(file.fileno())
            buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ShardwiseError(f"cannot map the frozen weights' file {path}: {exc} (every rank of a host must "
                             "see HostFrozen.directory: a local directory such as /dev/shm)") from None
    header_len = int.from_bytes(buffer[:8], "little")
    header = json.loads(bytes(buffer[8 : 8 + header_len]))
    aliases = header.pop("__metadata__", None) or {}  # sw.export stores a tied weight once: other name -> stored
    mapping = HostMapping(path, stat.st_dev, stat.st_ino)
    for name, (param, holders, names) in frozen.items():
        stored = next((n for n in names if n in header), None) or next((aliases[n] for n in names if n in aliases
                                                                        and aliases[n] in header), None)
        if stored is None:
            raise ShardwiseError(f"frozen parameter {name!r} is not in {path} (it holds {len(header)} tensors, e.g. "
                                 f"{sorted(header)[:3]}); freeze only what the file holds, or export it with sw.export")
        entry = header[stored]
        dtype, shape = _CODES.get(entry["dtype"]), tuple(entry["shape"])
        if dtype != param.dtype or shape != tuple(param.shape):
            raise ShardwiseError(f"{name!r} is {tuple(param.shape)} {param.dtype} in the model but {shape} "
                                 f"{entry['dtype']} in {path}")
        begin, end = entry["data_offsets"]
        start = 8 + header_len + begin
        if start % param.element_size():
            raise ShardwiseError(f"{stored!r} starts at byte {start} of {path}, not a multiple of its element size: "
                                 "re-write the file with sw.export")
        with warnings.catch_warnings():  # "the buffer is not writable": HostParameter refuses writes itself
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(buffer, dtype=dtype, count=param.numel(), offset=start) if end > begin \
                else torch.empty(0, dtype=dtype)
        shared = HostParameter(view.view(shape), name)
        for module, attribute in holders:
            module._parameters[attribute] = shared
        mapping.names.append(name)
        mapping.num_bytes += end - begin
    return mapping


def _refuse_unfreezing_after_shard(model: nn.Module, frozen) -> None:
    """A host weight unfrozen after shard() was copied out (copy-on-unfreeze) but no strategy
    reduces its gradient: refuse at the next forward rather than let ranks drift apart."""
    shared = [(name, module._parameters[attribute]) for name, (_, holders, _) in frozen.items()
              for module, attribute in holders[:1]]

    def check(module, args):
        for name, param in shared:
            if not is_host_shared(param) or param.requires_grad:
                raise ShardwiseError(f"{name!r} was shared read-only on the host (frozen='host') and was unfrozen "
                                     "after sw.shard(...), so the strategy does not synchronize its gradient. Unfreeze "
                                     "it before sw.shard, on a fresh model (or sw.load a checkpoint into one)")

    model.register_forward_pre_hook(check)


def host_param_names(model: nn.Module) -> list[str]:
    """Every registered name of a host-shared parameter (DDP is told to ignore them)."""
    return [name for name, param in model.named_parameters(remove_duplicate=False) if is_host_shared(param)]
