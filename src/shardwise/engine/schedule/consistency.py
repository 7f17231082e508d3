"""Ranks agree on the model at `shard()`: the same options (every one: Note [options by construction],
wire/canonical.py), the same parameters (and which are trainable) and the same starting values. What they
agree on during training rides the traffic (agreement.py). Uses: flat_unit, small.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn

from shardwise.engine.comm.small import all_gather_list, all_reduce_max, broadcast_from
from shardwise.engine.unit.flat_unit import FlatUnit
from shardwise.errors import ShardwiseError
from shardwise.wire.backends import host_values_device
from shardwise.wire.canonical import canonical, first_difference, shown
from shardwise.wire.messages import all_gather_json


def check_same_model_on_every_rank(model: nn.Module, group) -> None:
    """Fail at shard() — not with a hang mid-step — when ranks built different models. (Different mesh=
    layouts are refused before this, by shard()'s options check: Note [options by construction].)

    Ranks first compare a hash of (name, shape, dtype, requires_grad) of every parameter: one small all-gather.
    Only when the hashes differ are the full lists exchanged, to name the first difference (as JSON: nothing
    from another rank is unpickled)."""
    mine = [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in model.named_parameters()]
    device = host_values_device(group)  # a set-up read: on the host where the group takes host tensors
    signatures = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    all_gather_list(signatures, torch.tensor([digest(repr(mine))], device=device), group)
    if all(torch.equal(s, signatures[0]) for s in signatures):
        return
    everyone = all_gather_json({"params": [list(entry) for entry in mine]}, group)  # JSON, never a pickle
    reference = everyone[0]["params"]
    for rank, theirs in enumerate((item["params"] for item in everyone[1:]), start=1):
        if theirs == reference:
            continue
        for index in range(max(len(theirs), len(reference))):
            a = reference[index] if index < len(reference) else None
            b = theirs[index] if index < len(theirs) else None
            if a != b:
                raise ShardwiseError(
                    f"ranks 0 and {rank} built different models: parameter #{index} is "
                    f"{_describe(a)} on rank 0 but {_describe(b)} on rank {rank}. Build the model "
                    "from the same code and config, and freeze the same parameters, on every rank (only the "
                    "data should differ)."
                )


def check_same_options(what: str, options: dict, group, fixes: dict[str, str] | None = None,
                       module_names: dict[int, str] | None = None) -> None:
    """Fail on every rank alike, naming the option and each rank's value, when the ranks of `group` were given
    different `options` (`what`: "sw.shard options"; `fixes`: the fix for a top-level option, else "pass the
    same ..."; an option "refused": a rank's refusal of its own options, quoted). The whole object is compared
    in its canonical form (Note [options by construction], wire/canonical.py): one all-gather of a digest, and
    only when digests differ, the forms themselves (JSON)."""
    form = canonical(options, module_names)
    world = dist.get_world_size(group)
    if world == 1:
        return
    device = host_values_device(group)
    signatures = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    all_gather_list(signatures, torch.tensor([digest(json.dumps(form, sort_keys=True))], device=device), group)
    if all(torch.equal(s, signatures[0]) for s in signatures):
        return
    everyone = all_gather_json(form, group)  # JSON, never a pickle between ranks
    path, values = first_difference(everyone)
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(shown(value), []).append(rank)
    per_rank = "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                         for value, ranks in by_value.items())
    top = path.split(".")[0].split("[")[0]
    fix = (fixes or {}).get(top, f"Pass the same {what} on every rank (only the data should differ)")
    refused = "".join(f" Rank {rank} also refused its own: {form['refused']}" for rank, form in enumerate(everyone)
                      if isinstance(form, dict) and form.get("refused") and top != "refused")
    raise ShardwiseError(f"the ranks were given different {what}: {path or 'the options'} is {per_rank}. {fix}; a "
                         "rank with other options runs other collectives, which would pair with the wrong ones "
                         f"(a hang or a wrong value).{refused}")


def differs_across_ranks(tensors: list[torch.Tensor], group) -> bool:
    """Whether the ranks of `group` hold different `tensors` (inputs that must be the same everywhere: a
    tensor group's batch, Note [same inputs] in parallel/slicing; a pipeline's dataset): one all-reduce of
    four float64 numbers, the max and the negated min of two sums, plain and position-weighted (equal
    tensors give equal bits). Read in chunks, so a large dataset is never copied whole."""
    device = tensors[0].device if tensors else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    weighted = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        flat = tensor.detach().flatten()
        for start in range(0, flat.numel(), _CHUNK):
            piece = flat[start:start + _CHUNK].double().nan_to_num()
            total += piece.sum()
            positions = torch.arange(start + 1, start + piece.numel() + 1, dtype=torch.float64, device=device)
            weighted += piece.mul(positions).sum()
    both = torch.stack([total, -total, weighted, -weighted])
    all_reduce_max(both, group, "the check that every rank holds the same values")
    return not (both[0] == -both[1] and both[2] == -both[3])


_CHUNK = 1 << 20


def layout_words(mesh) -> str:
    """The layout `shard(mesh=...)` was given, in words every rank computes alike from the same mesh: the
    flat layout (no mesh=) or the mesh's dimensions and its grid of ranks."""
    if mesh is None:
        return "no mesh= (every rank holds a shard)"
    names = " x ".join(mesh.mesh_dim_names or ("?",) * mesh.ndim)
    return f"a {' x '.join(str(n) for n in mesh.mesh.shape)} mesh ({names}) of ranks {mesh.mesh.tolist()}"


def _describe(entry) -> str:
    if entry is None:
        return "absent"
    name, shape, dtype, requires_grad = entry
    return f"{name!r} shape {list(shape)} {dtype} {'trainable' if requires_grad else 'frozen'}"


def digest(text: str) -> int:
    """56 bits of a SHA-256 of `text`: an int64 every rank computes alike."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def broadcast_from_rank0(unit: FlatUnit, group) -> None:
    """Every rank starts from rank 0's values (as DDP does), one unit at a time."""
    with torch.no_grad():
        for layout in unit.layouts:
            broadcast_from(layout.owned.param.data, 0, group)
