"""Offload to disk: fp32 master shards and optimizer state in memory-mapped files.
Uses: compat.

`shard(model, strategy="zero3", offload="disk:/fast/scratch")` puts each unit's master
shards in a file under `PATH/rank<r>/` and maps it shared, so the kernel can page it
out and the rank's resident set holds only what is in use: the gradient shards, the
unit being gathered, and the optimizer chunk being stepped.

Note [chunked step]: an ordinary torch optimizer (the user builds it as usual) would
step every parameter at once and fault all its state in. A step hook instead steps it
one unit at a time — the optimizer's param groups are narrowed to that unit's shards,
which gives the same result since Adam-style updates are per parameter — creating
Adam's moments directly in mapped files, moving any other large state there after its
first step, and dropping each chunk's pages from the resident set when it is done
(MADV_DONTNEED on a shared file mapping releases the pages; the data stays in the file).

Note [what a chunk can step]: the chunked step runs the optimizer on this rank's rows, and moves each state
tensor of a parameter's rows' size into a plain mapped file. So it takes an optimizer that steps rows
(torch's elementwise classes, Note [whole-tensor step] in whole_step.py), or, on one rank, where rows are the
whole tensor, one whose state is plain tensors. Two kinds cannot be: an optimizer stepped on whole tensors
at more than one rank (Muon, Adafactor, a user's class: chunked, each rank would step its own rows, a
different model, without a word), and one keeping quantized state (torchao's AdamW8bit/AdamW4bit, Note
[low-bit state]: tensor subclasses of codes and block scales that no plain file tensor holds, stepped whole
on owners). Both are refused at the first step, on every rank, with the fix (`refuse_disk_offload` in
whole_step.py), before anything is stepped. Spilling a quantized state's parts instead would still need
the whole-tensor step's owners, gathered unit by unit from the files, which this step does not do.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from shardwise.config import DiskOffload
from shardwise.engine.compat import undecorated_step
from shardwise.errors import ShardwiseError


class DiskStore:
    """Memory-mapped fp32 tensors for one rank, released from RSS on demand."""

    def __init__(self, root: str | os.PathLike, rank: int):
        self.root = Path(root) / f"rank{rank}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ShardwiseError(f"offload directory {self.root} cannot be created ({error}); "
                                 "pass offload='disk:PATH' with a writable PATH") from error
        self._maps: dict[int, mmap.mmap] = {}  # data_ptr of a tensor's storage -> its mapping

    def zeros(self, numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """A zero-filled tensor backed by a new file under this store."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.zeros(numel, dtype=dtype)
        descriptor, path = tempfile.mkstemp(prefix="shard-", suffix=".bin", dir=self.root)
        with os.fdopen(descriptor, "w+b") as file:
            file.truncate(nbytes)  # sparse: reads as zeros, takes no disk until written
            mapping = mmap.mmap(file.fileno(), nbytes, flags=mmap.MAP_SHARED)
        os.unlink(path)  # the mapping keeps the data; nothing is left behind when the run ends
        tensor = torch.frombuffer(mapping, dtype=dtype, count=numel)
        self._maps[tensor.untyped_storage().data_ptr()] = mapping
        return tensor

    def holds(self, tensor: Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._maps

    def release(self, tensor: Tensor) -> None:
        """Drop the tensor's pages from this process's resident set (the data stays on disk)."""
        mapping = self._maps.get(tensor.untyped_storage().data_ptr())
        if mapping is not None:
            mapping.madvise(mmap.MADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of this store's files currently resident in this process (from /proc/self/smaps)."""
        total, inside = 0, False
        prefix = str(self.root)
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                    inside = ".bin" in line and prefix in line
                elif inside and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
        return total


def open_store(offload, rank: int) -> DiskStore | None:
    """The rank's store for a disk offload policy (None: not offloaded to disk)."""
    return DiskStore(offload.path, rank) if isinstance(offload, DiskOffload) else None


_ADAM_LIKE = (torch.optim.Adam, torch.optim.AdamW)


def register_offloaded(store: DiskStore, chunks: list[list[torch.nn.Parameter]]) -> None:
    """Mark each chunk's shards (one unit's) for chunked, on-disk optimizer steps: the step hook
    (optim_hooks.py, Note [one step hook]) calls `chunked_step` and `restore_groups` around each step."""
    for index, chunk in enumerate(chunks):
        for param in chunk:
            param._sw_offload = (store, index)  # read by chunked_step


def offloaded_params(optimizer) -> list:
    """The optimizer's parameters whose shards live in a disk store (`register_offloaded`)."""
    return [param for group in optimizer.param_groups for param in group["params"] if hasattr(param, "_sw_offload")]


def chunked_step(optimizer, args, kwargs) -> None:
    """Before the optimizer's own step: step its offloaded shards one unit at a time, each unit's state
    mapped from disk, and leave the rest to the real call (`restore_groups` puts the groups back)."""
    chunks: dict[int, list] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if hasattr(param, "_sw_offload"):
                store, chunk = param._sw_offload
                chunks.setdefault(chunk, []).append((group_index, param, store))
    if not chunks:
        return None
    step = undecorated_step(optimizer)  # no hooks re-entered
    full_groups = [group["params"] for group in optimizer.param_groups]
    try:
        for chunk in chunks.values():
            members = {id(param) for _, param, _ in chunk}
            for group, params in zip(optimizer.param_groups, full_groups):
                group["params"] = [p for p in params if id(p) in members]
            for _, param, store in chunk:
                _state_on_disk(optimizer, param, store)
            step(*args, **kwargs)  # args already starts with the optimizer
            for _, param, store in chunk:
                _spill_state(optimizer, param, store)
                store.release(param.data)
                for value in optimizer.state[param].values():
                    if isinstance(value, Tensor):
                        store.release(value)
        # Parameters that are not offloaded still take their step in the real call.
        for group, params in zip(optimizer.param_groups, full_groups):
            group["params"] = [p for p in params if not hasattr(p, "_sw_offload")]
    finally:
        optimizer._sw_full_groups = full_groups
    return None


def restore_groups(optimizer) -> None:
    """After the step: the param groups `chunked_step` narrowed, whole again."""
    full_groups = getattr(optimizer, "_sw_full_groups", None)
    if full_groups is not None:
        for group, params in zip(optimizer.param_groups, full_groups):
            group["params"] = params
        del optimizer._sw_full_groups


def _state_on_disk(optimizer, param, store: DiskStore) -> None:
    """Create Adam's moments in mapped files before its first step creates them in RAM."""
    state = optimizer.state[param]
    if state or not isinstance(optimizer, _ADAM_LIKE) or param.grad is None:
        return
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = store.zeros(param.numel(), param.dtype).view(param.shape)
    state["exp_avg_sq"] = store.zeros(param.numel(), param.dtype).view(param.shape)
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = store.zeros(param.numel(), param.dtype).view(param.shape)


def _spill_state(optimizer, param, store: DiskStore) -> None:
    """Any other optimizer's param-sized state, moved to disk after the step that made it."""
    state = optimizer.state[param]
    for key, value in list(state.items()):
        if isinstance(value, Tensor) and value.numel() == param.numel() and value.numel() > 1 \
                and not store.holds(value):
            on_disk = store.zeros(value.numel(), value.dtype).view(value.shape)
            on_disk.copy_(value)
            state[key] = on_disk
