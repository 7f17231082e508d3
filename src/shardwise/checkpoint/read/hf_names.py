"""The names Hugging Face weights take in a model: transformers' own key renames, the base-model prefix and the
keys transformers ignores, so that `sw.load` of a Hugging Face file matches what `from_pretrained` would load.

Note [transformers names]: `from_pretrained` does not match a file's keys to the model's one for one. It
first applies the model's conversion mapping (transformers.conversion_mapping: per-model `WeightRenaming`s
and the "legacy" ones every model gets, `LayerNorm.gamma` -> `LayerNorm.weight`, `.weight_g` ->
`.parametrizations.weight.original0`, ...), then adds or drops the base-model prefix (`model.`,
`transformer.`) so that a `LlamaModel`'s file loads into a `LlamaForCausalLM` and the reverse, and it
ignores the keys the class lists in `_keys_to_ignore_on_load_unexpected` (GPT-2's old `attn.bias` masks;
and, as transformers adds them for any model holding such buffers, the `rotary_emb.inv_freq` and
`position_ids` that older releases stored), and lets the model's tensors its class lists in
`_keys_to_ignore_on_load_missing` (Pegasus' `final_logits_bias`, BatchNorm's `num_batches_tracked`) be absent
from the files: they keep their values, and the load report's notes name them (`may_be_absent`).
We take the mapping from transformers itself (`get_model_conversion_mapping`, the function PEFT calls
too), so a model whose renames change with a transformers release stays right. A `WeightConverter`
(Mixtral's per-expert tensors merged into one, a fused qkv split in three) builds a tensor out of
several stored ones: a rank cannot read its rows of it as a byte range of one file, so a key needing
one is refused with the fix instead of loaded half. Tied weights need nothing here: the model's tied
names are aliases of one parameter (`ShardInfo.aliases`) and the file stores one of them.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torch import nn

from shardwise.checkpoint.format.names import clean_names
from shardwise.checkpoint.read.source_base import SourceNames
from shardwise.errors import ShardwiseError


def pretrained_model(model: nn.Module):
    """`model` when it is a transformers `PreTrainedModel`, else None (transformers not imported: none is)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return None
    return model


@dataclass
class KeyNames:
    """What `HFNames.source_names` found: the name of each key read, the aliases of tied weights stored once
    (name -> its other names) and the keys transformers ignores (not read)."""

    names: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


class HFNames:
    """How a Hugging Face file's keys map to `model`'s names (Note [transformers names]): `source_names(keys)`,
    every key of a source named in one call (hf_dir.py's): the keys cleaned (`clean_names`), each renamed
    (`rename`: the user's `renamer` first, as transformers applies its `key_mapping` first, then transformers'
    renames, then the base-model prefix), the keys transformers drops unread set apart, then every name
    registered (`SourceNames`). `targets`: the model's names (`model_names`)."""

    def __init__(self, model: nn.Module | None, renamer: Callable[[str], str], targets: set[str]):
        self.renamer, self.targets = renamer, targets  # the model's names (names.py's `model_names`)
        hf = pretrained_model(model) if model is not None else None
        self.prefix = getattr(hf, "base_model_prefix", "") or ""
        self.renamings, self.converters = _transforms(hf)
        self._ignore = _patterns(hf, "_keys_to_ignore_on_load_unexpected") + _legacy_buffers(hf)
        self._absent = _patterns(hf, "_keys_to_ignore_on_load_missing")

    def may_be_absent(self, name: str) -> bool:
        """True for a model tensor transformers lets be absent from the files (`_keys_to_ignore_on_load_missing`)."""
        return any(p.search(name) for p in self._absent)

    def rename(self, key: str, clean: str) -> str:
        """`key` (`clean` once wrapper components are dropped, `clean_names`) under the model's name."""
        name = self.renamer(clean)
        if name in self.targets or not self.targets:
            return name
        for renaming in self.renamings:
            name, _ = renaming.rename_source_key(name)
        name = self._with_prefix(name)
        if name in self.targets:
            return name
        for converter in self.converters:
            converted, pattern = converter.rename_source_key(name)
            if pattern is not None:
                raise ShardwiseError(
                    f"{key!r} is one of the tensors transformers {type(converter).__name__} {pattern!r} combines into "
                    f"{self._with_prefix(converted)!r} when it loads (several stored tensors made into one): a rank "
                    "cannot read its rows of that as a byte range of the file, and shardwise does not convert it. "
                    "Convert the checkpoint once (from_pretrained in one process, then save_pretrained writes the "
                    "model's own names), then load that")
        return name

    def source_names(self, keys, tied: dict[str, str], where: Path) -> KeyNames:
        """A file's `keys` under the model's names, each name once (`SourceNames`), the keys transformers ignores
        set apart; `tied` ({dropped: kept}: tied weights stored once) adds each dropped name as an alias of the
        kept tensor's."""
        clean = clean_names([*keys, *tied])  # every key, wrapper components dropped, in one call
        renamed = {key: self.rename(key, clean[key]) for key in keys}  # a converter's key refused before a clash
        found = KeyNames(ignored=[key for key in keys if self._ignored(renamed[key])])
        skipped = set(found.ignored)
        read = {key: name for key, name in renamed.items() if key not in skipped}
        read_names = set(read.values())
        aliases = {dropped: self.rename(dropped, clean[dropped]) for dropped, kept in tied.items()
                   if renamed[kept] in read_names}
        seen = SourceNames(where)  # every name once: the names read, then the aliases
        found.names = seen.add_all(read)
        for dropped, alias in seen.add_all(aliases).items():
            target = renamed[tied[dropped]]
            found.aliases[target] = found.aliases.get(target, ()) + (alias,)
        return found

    def _ignored(self, name: str) -> bool:
        """True for a key (renamed: `name`) transformers ignores when it loads (`_keys_to_ignore_on_load_unexpected`)
        that names nothing in the model."""
        return name not in self.targets and any(p.search(name) for p in self._ignore)

    def _with_prefix(self, name: str) -> str:
        """`name` with the base-model prefix dropped or added where that names one of the model's tensors."""
        prefix = self.prefix + "."
        if not self.prefix or name in self.targets:
            return name
        if name.startswith(prefix) and name[len(prefix):] in self.targets:
            return name[len(prefix):]
        if prefix + name in self.targets:
            return prefix + name
        return name


def _patterns(hf, attribute: str) -> list[re.Pattern]:
    """The regexes `hf`'s class lists under `attribute` (transformers gathers its sub-models' at post_init)."""
    return [re.compile(p) for p in (getattr(hf, attribute, None) or ())]


def _legacy_buffers(hf) -> list[re.Pattern]:
    """The keys transformers ignores in a file of any model that holds such buffers (modeling_utils, beside its
    `_keys_to_ignore_on_load_unexpected`): rotary frequencies and position ids older releases stored."""
    buffers = [name for name, _ in hf.named_buffers()] if hf is not None else []
    return ([re.compile(r"rotary_emb\.inv_freq")] if any(b.endswith("rotary_emb.inv_freq") for b in buffers) else []) \
        + ([re.compile(r"(^|\.)position_ids$")] if any(b.endswith("position_ids") for b in buffers) else [])


def _transforms(hf) -> tuple[list, list]:
    """transformers' renames and converters for `hf` (Note [transformers names]); none for another model."""
    if hf is None:
        return [], []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    transforms = get_model_conversion_mapping(hf)
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])
