"""Options in a canonical JSON form that every rank computes alike from equal options, and its leaves by path.
Uses: nothing of the engine (it sits below it).

Note [options by construction]: ranks that pass different options (`sw.shard`'s, a `PipelineConfig`) run
different collectives and pair them wrongly: a hang, a gloo abort or a wrong value. So each entry point
compares the canonical form of *everything* it was given, as one object, rather than a list of the options
someone remembered: a dataclass is walked through `dataclasses.fields` (so a field added later, in a nested
policy too, is compared the day it lands), any other object through its attributes, and only what cannot
be equal across processes is reduced to what can (a module to its place in the model, a function to its
qualified name, a tensor to its shape and dtype: its values are another check's, and memory addresses are
dropped from a repr). The one exception is declared on the field itself: `field(metadata={PER_RANK: True})`
marks a path on this host that ranks may choose apart (only whether it is given is compared).
tests/test_options_agree.py adds a field and sees it compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import torch
from torch import nn

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# A dataclass field's metadata key: where on this host a rank keeps its files (an offload directory, a cache
# directory), which ranks may choose apart; the field is compared as given or not, never by value.
PER_RANK = "shardwise_per_rank"


def canonical(value, module_names: dict[int, str] | None = None):
    """`value` as JSON data (dicts, lists, strings, numbers, booleans, None) that equal options give alike on
    every rank (Note [options by construction]). `module_names`: id(module) -> its name in the model."""
    names = module_names or {}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # JSON has no nan or inf
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _per_rank(getattr(value, f.name)) if f.metadata.get(PER_RANK) else
                  canonical(getattr(value, f.name), names) for f in dataclasses.fields(value)}
        return {"type": type(value).__qualname__, **fields}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [canonical(item, names) for item in value]
        return sorted(items, key=json.dumps) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, dict):
        return {str(key): canonical(item, names) for key, item in value.items()}
    if isinstance(value, nn.Module):
        where = names.get(id(value))
        return f"module {where!r}" if where is not None else f"a {type(value).__qualname__} outside the model"
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {value.dtype}"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, type) or callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    if hasattr(value, "__dict__"):
        return {"type": type(value).__qualname__, **{key: canonical(item, names) for key, item in vars(value).items()}}
    return _ADDRESS.sub("", repr(value))


def _per_rank(value):
    """A field each rank may set its own way (PER_RANK): only whether it is given is compared."""
    return None if value is None else "(given; may differ per rank)"


def first_difference(forms: list, path: str = "") -> tuple[str, list] | None:
    """Where canonical forms first differ: (the dotted path, "compression.reduce", and each form's value there),
    at the deepest level every form has (a policy given on one rank and None on another differs at the option
    itself), or None when they are equal."""
    if all(form == forms[0] for form in forms):
        return None
    if all(isinstance(form, dict) for form in forms) and all(form.keys() == forms[0].keys() for form in forms):
        parts = [(key, [form[key] for form in forms]) for key in forms[0]]
    elif all(isinstance(form, list) and len(form) == len(forms[0]) for form in forms):
        parts = [(f"[{index}]", [form[index] for form in forms]) for index in range(len(forms[0]))]
    else:
        return path, forms
    for key, values in parts:
        found = first_difference(values, key if not path else f"{path}{key}" if key.startswith("[") else
                                 f"{path}.{key}")
        if found is not None:
            return found
    return path, forms


def shown(form) -> str:
    """A canonical form as a reader would write it: Compression(gather=None, reduce='int8', block=256)."""
    if isinstance(form, dict):
        kind = form.get("type")
        fields = ", ".join(f"{key}={shown(item)}" for key, item in form.items() if key != "type")
        return f"{kind}({fields})" if kind is not None else "{" + fields + "}"
    if isinstance(form, list):
        return "[" + ", ".join(shown(item) for item in form) + "]"
    return repr(form)  # a string quoted, None, True, 256
