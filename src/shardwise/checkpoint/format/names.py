"""Names in a checkpoint: wrapper prefixes dropped, user renames, the buffers state_dict() holds."""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

from torch import Tensor, nn

from shardwise.engine.unit.info import shard_info
from shardwise.errors import ShardwiseError

# Note [wrapper prefixes]: wrappers add path components that are not part of the
# model: DDP's `module.` (leading), torch.compile's `_orig_mod.`, FSDP1's
# `_fsdp_wrapped_module.` and activation checkpointing's `_checkpoint_wrapped_module.`
# (anywhere). Both the checkpoint's names and the model's are cleaned the same way,
# so a checkpoint saved from any wrapping loads into any other.
_DROPPED_PARTS = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def clean_name(name: str) -> str:
    """`name` without wrapper components (Note [wrapper prefixes])."""
    parts = [part for part in name.split(".") if part not in _DROPPED_PARTS]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def clean_names(names) -> dict[str, str]:
    """Each of `names` -> its `clean_name`."""
    return {name: clean_name(name) for name in names}


Rename = Mapping[str, str] | Sequence[tuple[str, str]] | None


def make_renamer(rename: Rename) -> Callable[[str], str]:
    """`rename` as a function on (cleaned) checkpoint names: a mapping of exact names, or
    `(pattern, replacement)` regex pairs applied in order with `re.sub`."""
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        table = {clean_name(k): clean_name(v) for k, v in rename.items()}
        return lambda name: table.get(name, name)
    try:
        pairs = [(re.compile(pattern), replacement) for pattern, replacement in rename]
    except (TypeError, ValueError, re.error) as error:
        raise ShardwiseError(
            f"rename={rename!r} is not understood ({error}): pass a dict of exact names "
            "{'old.name': 'new.name'} or a list of (regex, replacement) pairs"
        ) from None

    def apply(name: str) -> str:
        for pattern, replacement in pairs:
            name = pattern.sub(replacement, name)
        return name

    return apply


def persistent_buffers(model: nn.Module) -> dict[str, Tensor]:
    """The buffers `state_dict()` holds (not the non-persistent ones), by cleaned name."""
    out = {}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is None or name in module._non_persistent_buffers_set:
                continue
            full = f"{module_name}.{name}" if module_name else name
            out.setdefault(clean_name(full), buffer)
    return out


def model_names(model: nn.Module) -> set[str]:
    """Every name the model's tensors go by in a state dict, cleaned (a tied weight's names all)."""
    names = set(map(clean_name, persistent_buffers(model)))
    for raw, info in shard_info(model).items():
        names.add(clean_name(raw))
        names.update(map(clean_name, info.aliases))
    return names
