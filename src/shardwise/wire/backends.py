"""Which backend serves which device type in a process group, and where a group's collectives take the engine's
tensors: the one question every site asks of a group's backend (Note [group backends]). Below the engine, wire/
and dist.py (layer 0): they ask it too. Uses: torch alone.

Note [group backends]: a process group serves each device type with one backend. `dist.get_backend` spells a
group of one backend by its name ("nccl", "gloo") and a mixed one by device ("cpu:gloo,cuda:nccl", what
`init_process_group()` makes on a GPU machine with no backend named, what FSDP users pass to `sw.init(backend=)`,
and what offload="host" needs: the norms of host gradients meet on gloo while the gathers run on NCCL, Note [host
offload]). Reading only `== "nccl"` took a mixed group for a CPU one: no streams, host offload's copies to pinned
memory never waited for (the CPU optimizer stepped rows still in flight), zero3's tags, the headers and the used
flags back to a host rendezvous per unit or phase (Note [tags on the device]), the DTensor mesh of a hybrid layout
on the CPU, and a rank with no gradient joining a norm's all-reduce with a CPU tensor while its peers sent device
ones. So every site asks `device_of` (or `on_device`), here below everything that reads a backend (the layout's
groups and mesh, comm's context, the precision's norms, the schedule's agreement forms). A single name serves the
device types it is built for, which for NCCL is the accelerator alone (it has no CPU backend).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DEVICE_ONLY = frozenset({"nccl"})


def backends_of(group) -> dict[str, str]:
    """{device type: backend} of `group` ("*": a single backend named for every device type it serves; Note
    [group backends])."""
    return parse_backends(dist.get_backend(group))


def parse_backends(spelled: str) -> dict[str, str]:
    """{device type: backend} of a backend as `dist.get_backend` or `sw.init(backend=)` spells it."""
    spelled = spelled.lower()
    if ":" not in spelled:
        return {"*": spelled} if spelled not in DEVICE_ONLY else {_accelerator_type(): spelled}
    return dict(part.split(":", 1) for part in spelled.split(","))


def has_device_backend(spelled: str) -> bool:
    """Whether a backend so spelled gives a device-only backend (NCCL) the accelerator, alone or beside gloo:
    its ranks then each need their own device (sw.init sets it)."""
    return any(name in DEVICE_ONLY for name in parse_backends(spelled).values())


def has_host_backend(group) -> bool:
    """Whether `group` takes host (CPU) tensors: anything but a device-only backend such as NCCL."""
    backends = backends_of(group)
    return "cpu" in backends or "*" in backends


def device_of(group) -> torch.device:
    """Where `group`'s collectives take the engine's tensors: the current accelerator where the group serves it
    with a device backend (NCCL alone, or beside gloo in a mixed group), else the CPU (Note [group backends])."""
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and backends_of(group).get(accelerator.type) in DEVICE_ONLY:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def on_device(group) -> bool:
    """Whether `group` communicates on a device (`device_of`): its per-step exchanges then take their device
    forms, off the host's path (Note [headers on the device], Note [tags on the device])."""
    return device_of(group).type != "cpu"


def host_values_device(group) -> torch.device:
    """Where host values (a set-up digest) travel on `group` with no device sync: the CPU where the group has a
    host backend (gloo, alone or beside NCCL), else its device (NCCL alone)."""
    return torch.device("cpu") if has_host_backend(group) else device_of(group)


def _accelerator_type() -> str:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cuda"
