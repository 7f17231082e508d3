"""`shard(..., frozen="host")`: one read-only copy of the frozen weights per host, mapped by every local rank.
Uses: host_file, host_param.

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
  is memory), every local rank maps it, and the file is removed once all have: the mapping
  lives on. How that file is kept private and never left behind: host_file.py, Note [host
  copy file].
- Every file is mapped only after its header is checked against the file (st_header.py):
  offsets that do not tile the data exactly are refused, never mapped shifted.
- A `source=` file is the same bytes on every host or `shard()` refuses it: the lowest rank
  mapping each distinct file (host, device, inode) computes its crc32 (one read per host), and
  the ranks compare them, so hosts holding different frozen values never train together.
- A `source=` file that shrinks while mapped would kill the rank with SIGBUS at its next
  read, and one rewritten in place would change the weights under the model; each rank keeps
  the file open and checks its size and modification time before every forward, so the
  forward raises a ShardwiseError instead. What this cannot catch: a shrink during a
  forward or between a forward and its backward (autograd keeps views of the weights), or a
  read outside a forward (`p.sum()`, `state_dict()`, `sw.export`). Replace a mapped file by
  writing a new one and renaming it over the old: the ranks keep the old inode.
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
import stat as stat_mode
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import HostFrozen
from shardwise.engine.memory.host_file import (
    PREFIX,
    create_private_file,
    new_private_directory,
    new_token,
    remove,
)
from shardwise.engine.memory.host_param import HostParameter, is_host_shared
from shardwise.errors import ShardwiseError
from shardwise.wire.messages import all_gather_json, broadcast_json
from shardwise.wire.st_header import CODE_OF_DTYPE, parse_header

_FILE_NAME = "frozen.safetensors"


@dataclass
class HostMapping:
    """The file the host's ranks map, and the parameters that are views of it."""

    path: Path
    device: int  # st_dev and st_ino: two ranks with the same pair map the same file
    inode: int
    names: list[str] = field(default_factory=list)
    num_bytes: int = 0
    size: int = 0  # the file's size when mapped
    fd: int | None = None  # kept open for a `source=` file, to see it shrink (Note [host copy])
    mtime_ns: int = 0  # its modification time when mapped: a write in place changes it

    def check_size(self) -> None:
        """Raise before a read of a mapping whose file shrank (that read would be a SIGBUS) or was
        rewritten in place (the weights changed under the model)."""
        if self.fd is None:
            return
        info = os.fstat(self.fd)
        size = info.st_size
        if size >= self.size and info.st_mtime_ns != self.mtime_ns:
            raise ShardwiseError(
                f"{self.path} was written to while its frozen weights are mapped (frozen=sw.HostFrozen(source=...)): "
                "the model's frozen values changed under it. Never rewrite a mapped file in place; write a new file "
                "and rename it over the old one")
        if size < self.size:
            raise ShardwiseError(
                f"{self.path} shrank from {self.size} to {size} bytes while its frozen weights are mapped "
                "(frozen=sw.HostFrozen(source=...)): reading them would kill this rank with SIGBUS. Never truncate "
                "or rewrite a mapped file in place; write a new file and rename it over the old one")


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
        path, private = Path(policy.source).absolute(), None
    else:
        meta = [name for name, (param, _, _) in frozen.items() if param.device.type == "meta"]
        if meta:
            raise ShardwiseError(f"{meta[0]!r} is frozen and still on the meta device (sw.deferred_init): a "
                                 "deferred model's frozen weights come from a file, "
                                 "frozen=sw.HostFrozen(source='base.safetensors')")
        path, private = _write_on_leader(frozen, policy, group)
    mapping, error = None, None
    try:
        try:
            mapping = _map(path, frozen, watch=policy.source is not None)
        except ShardwiseError as exc:
            error = str(exc)
        errors = all_gather_json(error, group)  # every rank has mapped it, or all raise
    finally:
        if private is not None:  # the writer: mapped by all, or the handshake failed (Note [host copy file])
            remove(private)
    failed = [(rank, message) for rank, message in enumerate(errors) if message]
    if not failed and policy.source is not None:
        failed = _compare_sources(mapping, group)
    if failed:
        for param, holders, _ in frozen.values():  # another rank could not map: this one's model as it was
            for module, attribute in holders:
                module._parameters[attribute] = param
        raise ShardwiseError(f"rank {failed[0][0]}: {failed[0][1]}")
    _check_before_forward(model, frozen, mapping)
    return mapping


def _compare_sources(mapping: HostMapping, group) -> list[tuple[int, str]]:
    """[(rank, why)] when the ranks' `source=` files hold different bytes, else [] (Note [host copy]):
    the lowest rank of each distinct file reads it once for its crc32; every rank compares."""
    mine = [socket.gethostname(), mapping.device, mapping.inode]
    files = all_gather_json(mine, group)
    crc = _crc_of_file(mapping.fd, mapping.size) if files.index(mine) == dist.get_rank(group) else None
    crcs = all_gather_json(crc, group)
    readers = [rank for rank, value in enumerate(crcs) if value is not None]
    if len({crcs[rank] for rank in readers}) <= 1:
        return []
    shown = ", ".join(f"rank {rank} on {files[rank][0]!r}: crc32 {crcs[rank]:08x}" for rank in readers[:4])
    return [(readers[0], f"the frozen weights' file {mapping.path} holds different bytes on different hosts ({shown}): "
                         "each host would train against another base. Give every host the same file")]


def _crc_of_file(fd: int, size: int) -> int:
    crc = 0
    for offset in range(0, size, 2**24):
        crc = zlib.crc32(os.pread(fd, min(2**24, size - offset), offset), crc)
    return crc


def _write_on_leader(frozen, policy: HostFrozen, group) -> tuple[Path, Path | None]:
    """Local rank 0 of each host writes the copy (Note [host copy file]); every rank learns its
    host's path. Returns the path, and on a writer its private directory to remove."""
    token = [broadcast_json(new_token() if dist.get_rank(group) == 0 else None, group)]
    directory, leader = policy.directory or _default_directory(), _is_local_leader(group)
    private, path, crc, error = None, None, None, None
    try:
        if leader:
            try:
                private = new_private_directory(directory, token[0])
                path = private / _FILE_NAME
                crc = write_safetensors(path, {name: param for name, (param, _, _) in frozen.items()})
            except OSError as exc:
                error = f"{path or directory}: {exc}"
        reports = all_gather_json([socket.gethostname(), leader, crc, error, str(private) if private else None],
                                  group)
        errors = [r[3] for r in reports if r[3]]
        if errors:
            raise ShardwiseError(f"writing the host copy of the frozen weights failed: {errors[0]} "
                                 "(set frozen=sw.HostFrozen(directory=...) to a directory with room, on every host)")
        if len({r[2] for r in reports if r[1]}) > 1:
            raise ShardwiseError("the hosts' frozen weights differ (crc32 of each host's copy), so each host would "
                                 "train against another base: seed the model identically on every rank, or map one "
                                 "file with frozen=sw.HostFrozen(source=...)")
    except BaseException:
        if private is not None:
            remove(private)  # refused or failed: leave nothing behind in shared memory
        raise
    if private is None:  # the leader's directory, by the name it sent (Note [host copy file]); _map refuses a
        here = [Path(r[4]) for r in reports if r[1] and r[0] == socket.gethostname() and r[4]]  # missing one
        found = next((p for p in here if p.is_dir()), None)
        return (found or Path(directory).absolute() / f"{PREFIX}*-{token[0]}") / _FILE_NAME, None
    return path, private


def _default_directory() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else os.environ.get("TMPDIR", "/tmp")


def _is_local_leader(group) -> bool:
    """Local rank 0 (torchrun's LOCAL_RANK), else the lowest rank of the group on this host name."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None:
        return int(local) == 0
    names = all_gather_json(socket.gethostname(), group)
    return names.index(socket.gethostname()) == dist.get_rank(group)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` as one new safetensors file, private to this user (Note [host copy file]),
    one tensor at a time (no copy of the whole); the widest dtypes first, so every tensor starts
    at a multiple of its element size. Returns the crc32 of the data."""
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header, offset = {}, 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": CODE_OF_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    crc = 0
    with os.fdopen(create_private_file(path), "wb") as out:
        out.write(len(raw).to_bytes(8, "little") + raw)
        for name in order:
            data = memoryview(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            out.write(data)
            crc = zlib.crc32(data, crc)
    return crc


def _map(path: Path, frozen, watch: bool) -> HostMapping:
    """Check `path`'s header against the file, map it read-only and make each frozen parameter a
    view of its bytes. `watch`: keep the file open to see it shrink (Note [host copy])."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ShardwiseError(f"cannot map the frozen weights' file {path}: {exc} (every rank of a host must "
                             "see HostFrozen.directory: a local directory such as /dev/shm)") from None
    try:
        mapping = _map_open_file(fd, path, frozen, watch)
    except BaseException:
        os.close(fd)
        raise
    if not watch:
        os.close(fd)  # the mapping keeps the pages
    return mapping


def _map_open_file(fd: int, path: Path, frozen, watch: bool) -> HostMapping:
    try:
        stat = os.fstat(fd)
        if not stat_mode.S_ISREG(stat.st_mode):
            raise ShardwiseError(f"the frozen weights' file {path} is not a regular file")
        header, aliases = parse_header(lambda offset, length: os.pread(fd, length, offset), stat.st_size, path)
        buffer = mmap.mmap(fd, stat.st_size, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise ShardwiseError(f"cannot map the frozen weights' file {path}: {exc}") from None
    mapping = HostMapping(path, stat.st_dev, stat.st_ino, size=stat.st_size, fd=fd if watch else None,
                          mtime_ns=stat.st_mtime_ns)
    views = {name: _view(param, names, name, header, aliases, buffer, path)  # every check before any change
             for name, (param, _, names) in frozen.items()}
    for name, (param, holders, _) in frozen.items():
        for module, attribute in holders:
            module._parameters[attribute] = views[name]
        mapping.names.append(name)
        mapping.num_bytes += param.numel() * param.element_size()
    return mapping


def _view(param, names, name, header, aliases, buffer, path) -> HostParameter:
    """`param` as a read-only view of its bytes in `buffer`, once its entry matches it."""
    stored = next((n for n in names if n in header), None) or next((aliases[n] for n in names if n in aliases
                                                                    and aliases[n] in header), None)
    if stored is None:
        raise ShardwiseError(f"frozen parameter {name!r} is not in {path} (it holds {len(header)} tensors, e.g. "
                             f"{sorted(header)[:3]}); freeze only what the file holds, or export it with sw.export")
    entry = header[stored]
    if entry.dtype != param.dtype or entry.shape != tuple(param.shape):
        raise ShardwiseError(f"{name!r} is {tuple(param.shape)} {param.dtype} in the model but {entry.shape} "
                             f"{entry.dtype} in {path}")
    if entry.begin % param.element_size():
        raise ShardwiseError(f"{stored!r} starts at byte {entry.begin} of {path}, not a multiple of its element "
                             "size: re-write the file with sw.export")
    with warnings.catch_warnings():  # "the buffer is not writable": HostParameter refuses writes itself
        warnings.simplefilter("ignore", UserWarning)
        view = torch.frombuffer(buffer, dtype=entry.dtype, count=param.numel(), offset=entry.begin) \
            if entry.end > entry.begin else torch.empty(0, dtype=entry.dtype)
    return HostParameter(view.view(entry.shape), name)


def _check_before_forward(model: nn.Module, frozen, mapping: HostMapping) -> None:
    """Before every forward: a `source=` file that shrank is an error, not a SIGBUS (Note [host
    copy]); and a host weight unfrozen after shard() was copied out (copy-on-unfreeze) but no
    strategy reduces its gradient: refuse it rather than let ranks drift apart."""
    shared = [(name, module._parameters[attribute]) for name, (_, holders, _) in frozen.items()
              for module, attribute in holders[:1]]

    def check(module, args):
        mapping.check_size()  # one fstat
        for name, param in shared:
            if not is_host_shared(param) or param.requires_grad:
                raise ShardwiseError(f"{name!r} was shared read-only on the host (frozen='host') and was unfrozen "
                                     "after sw.shard(...), so the strategy does not synchronize its gradient. Unfreeze "
                                     "it before sw.shard, on a fresh model (or sw.load a checkpoint into one)")

    model.register_forward_pre_hook(check)


def host_param_names(model: nn.Module) -> list[str]:
    """Every registered name of a host-shared parameter (DDP is told to ignore them)."""
    return [name for name, param in model.named_parameters(remove_duplicate=False) if is_host_shared(param)]
