"""A Hugging Face model's config in a checkpoint: recorded at save, written as config.json by an export.
Uses: names.py.

Note [model config]: a Hugging Face model's config (`model.config`, as `config.json` holds it) is
recorded in the index as `model_config`, so `shardwise ckpt export` can write the config.json that
`from_pretrained` needs beside the weights; any other model records none. Four rules keep that
config.json from making `from_pretrained` build the wrong model:
- *Own names only.* A config is recorded only when the model's state-dict names are the Hugging Face
  model's own, up to the wrapper components `clean_name` drops (`_orig_mod.`, `module.`): a PeftModel
  (`base_model.model.model...`) or a user's wrapper holding `self.config = hf_model.config`
  (`net.model...`) records none, since `from_pretrained` would load 0 of its tensors and leave every
  weight random.
- *Checked against the tensors.* Before config.json is written, its layer count, hidden size,
  vocabulary (`vocab_size`: the input embedding's rows) and positions (`n_positions` /
  `max_position_embeddings`: a learned position table's rows, `wpe` or `position_embeddings`) are
  compared with the tensors the export writes (an index edited to say 3 layers where 2 are stored
  would build one random layer; another vocabulary fails only in `from_pretrained`), and an output
  head tied to the input embedding (stored once, under the embedding's name) is refused under
  `tie_word_embeddings=False`: `from_pretrained` would not tie it and would build a random `lm_head`.
  What the tensors cannot show (`rms_norm_eps`) is the index's digest's to protect.
- *No code references.* `auto_map` and `custom_pipelines` name code that `from_pretrained(...,
  trust_remote_code=True)` imports, from another repository if the reference says so. An export never
  writes them (the index is anyone's text); it says which it dropped.
- *The user's file stays.* A config.json already beside the export that says something else is not
  replaced unless asked (`replace_config=True`, `--replace-config`); one that agrees is rewritten.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import defaultdict
from pathlib import Path

from torch import nn

from shardwise.checkpoint.format.names import clean_name
from shardwise.errors import ShardwiseError


def model_config(model: nn.Module) -> dict | None:
    """Note [model config]: a Hugging Face model's config as JSON, or None for any other model and for a
    model that only holds one under names of its own (see `held_config`)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string") or held_config(model):
        return None
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return None  # a config that does not serialize: the checkpoint then says it has none


def held_config(model: nn.Module) -> str | None:
    """Why `model`'s state-dict names are not those of the Hugging Face model its `config` belongs to
    (Note [model config]), as words that follow the model's class name: "holds its Hugging Face model as
    base_model.model (...)" for a PeftModel; None when the model is that Hugging Face model (up to dropped
    wrapper components), or has no Hugging Face config."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    for name, module in model.named_modules():
        # a PreTrainedModel: its class names its config class (PeftModel and wrappers only forward `config`)
        if getattr(module, "config", None) is config and hasattr(type(module), "config_class"):
            if not name or clean_name(f"{name}.x") == "x":
                return None
            return f"holds its Hugging Face model as {name}: its tensors are named {name}.…"
    return "is not a Hugging Face PreTrainedModel, though it has a Hugging Face config: its names are its own"


CONFIG = "config.json"  # what `from_pretrained` reads beside model.safetensors
CODE_KEYS = ("auto_map", "custom_pipelines")  # config keys that name code to import (Note [model config])
_LAYER_LISTS = ("layers", "layer", "h", "blocks", "block")  # the ModuleList names Hugging Face models use
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def _first(config: dict, keys: tuple[str, ...]):
    return next((config[key] for key in keys if isinstance(config.get(key), int)), None)


_POSITIONS = {"wpe.weight": ("n_positions", "max_position_embeddings"),
              "position_embeddings.weight": ("max_position_embeddings",)}  # learned tables: one row a position
_HEADS = ("lm_head.weight", "predictions.decoder.weight")  # output heads Hugging Face ties to the input embedding


def check_config(config: dict, shapes: dict[str, tuple[int, ...]], where: str,
                 aliases: dict[str, str] | None = None) -> None:
    """Refuse a config whose layer count, hidden size, vocabulary or positions the tensors `shapes` (name ->
    shape, as the export writes them) contradict, or that unties a head the export stores as an alias
    (`aliases`: alias -> the name stored; Note [model config]). What the tensors do not show (one layer
    list, an input embedding, a position table, a tied head) is not checked."""
    _check_vocabulary(config, shapes, where)
    _check_tied_head(config, aliases or {}, where)
    layers = _first(config, ("num_hidden_layers", "n_layer", "num_layers"))
    found = defaultdict(set)
    for name in shapes:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts[:-1]) if part in _LAYER_LISTS and parts[i + 1].isdigit()), None)
        if at is not None:
            found[".".join(parts[: at + 1])].add(int(parts[at + 1]))
    if layers is not None and len(found) == 1:
        (container, indices), = found.items()
        if sorted(indices) != list(range(layers)):
            raise ShardwiseError(
                f"{where} says the model has {layers} layers, and the tensors hold {len(indices)} under "
                f"{container}.N: from_pretrained would build a model whose layers are not these. No config.json "
                "was written; write the model's own config beside the weights (model.config.save_pretrained(DIR))")
    hidden = _first(config, ("hidden_size", "n_embd", "d_model"))
    widths = {shape[1] for name, shape in shapes.items() if name.endswith(_EMBEDDINGS) and len(shape) == 2}
    if hidden is not None and widths and hidden not in widths:
        raise ShardwiseError(
            f"{where} says the hidden size is {hidden}, and the input embedding is {sorted(widths)} wide: "
            "from_pretrained would refuse or mis-build these tensors. No config.json was written; write the "
            "model's own config beside the weights (model.config.save_pretrained(DIR))")


def _check_vocabulary(config: dict, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """`vocab_size` against the input embedding's rows, the positions against a learned position table's."""
    fix = ("No config.json was written; write the model's own config beside the weights "
           "(model.config.save_pretrained(DIR)), or fix the config before saving")
    vocab = _first(config, ("vocab_size",))
    rows = {shape[0] for name, shape in shapes.items() if name.endswith(_EMBEDDINGS) and len(shape) == 2}
    if vocab is not None and rows and vocab not in rows:
        raise ShardwiseError(f"{where} says vocab_size={vocab}, and the input embedding has {sorted(rows)} rows: "
                             f"from_pretrained would refuse these tensors or build another vocabulary. {fix}")
    for suffix, keys in _POSITIONS.items():
        positions = _first(config, keys)
        rows = {shape[0] for name, shape in shapes.items() if name.endswith(suffix) and len(shape) == 2}
        if positions is not None and rows and positions not in rows:
            key = next(key for key in keys if isinstance(config.get(key), int))
            raise ShardwiseError(f"{where} says {key}={positions}, and the position table ({suffix}) has "
                                 f"{sorted(rows)} rows: from_pretrained would refuse these tensors. {fix}")


def _check_tied_head(config: dict, aliases: dict[str, str], where: str) -> None:
    """An output head stored as an alias of the input embedding needs `tie_word_embeddings` (Note [model config])."""
    if config.get("tie_word_embeddings", True) is not False:
        return
    for alias, stored in sorted(aliases.items()):
        if any(name == head or name.endswith("." + head) for name in (alias, stored) for head in _HEADS):
            raise ShardwiseError(
                f"{where} says tie_word_embeddings=False, and the model ties {alias} to {stored} (one tensor, "
                f"stored once as {stored}): from_pretrained would not tie them and would build {alias} at random. "
                "Set config.tie_word_embeddings = True (the model as trained ties them) before saving, or export "
                "every name (sw.export(model, path, duplicate_tied=True) writes both tensors). Nothing was written")


def without_code(config: dict, at: str = "") -> tuple[dict, list[str]]:
    """`config` without the keys that name code to import, at any depth (Note [model config]); and those keys."""
    kept, dropped = {}, []
    for key, value in config.items():
        if key in CODE_KEYS:
            dropped.append(f"{at}{key}")
        elif isinstance(value, dict):
            kept[key], inner = without_code(value, f"{at}{key}.")
            dropped += inner
        else:
            kept[key] = value
    return kept, dropped


def check_replace(config: dict, directory: Path, replace: bool) -> None:
    """Refuse to replace a config.json in `directory` that says something else than `config` unless
    `replace` (Note [model config]): one `save_pretrained` wrote (non-default values only, `architectures`
    filled in) agrees."""
    existing = directory / CONFIG
    if replace or not existing.exists():
        return
    try:
        old = json.loads(existing.read_text())
    except (OSError, ValueError):
        old = None
    if isinstance(old, dict):  # a value the export does not know (None: `architectures` before from_pretrained) agrees
        differ = sorted(key for key in old if key != "transformers_version" and config.get(key) is not None
                        and config.get(key) != old[key])
        if not differ:
            return
    else:
        differ = ["(it is not a JSON object)"]
    raise ShardwiseError(
        f"{existing} already exists and says another model ({', '.join(differ[:4])}"
        f"{'...' if len(differ) > 4 else ''} differ): the export would replace it. Export into another directory, "
        "or pass replace_config=True (shardwise ckpt export --replace-config) to replace it")


def write_config(config: dict, directory: Path) -> Path:
    """A Hugging Face config (JSON, as recorded at save) as `directory/config.json`, written whole or not at all,
    through a fresh name of its own (O_EXCL | O_NOFOLLOW: never through a file planted in a shared directory)."""
    target, partial = directory / CONFIG, directory / f".{CONFIG}.{uuid.uuid4().hex}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(partial, target)
    return target


def prepare_config(config: dict | None, shapes: dict[str, tuple[int, ...]], directory: Path, *,
                   replace: bool, where: str, aliases: dict[str, str] | None = None) -> tuple[dict | None, list[str]]:
    """Every check before an export writes anything: the config.json it will write (None: none) and the
    code references dropped from it (Note [model config]). `aliases`: names the export stores only as
    another's (alias -> stored name)."""
    if config is None:
        return None, []
    check_config(config, shapes, where, aliases)
    config, dropped = without_code(config)
    check_replace(config, directory, replace)
    return config, dropped
