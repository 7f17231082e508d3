"""A Hugging Face model's config in a checkpoint: recorded at save, written as config.json by an export.
Uses: nothing of shardwise.

Note [model config]: a Hugging Face model's config (`model.config`, as `config.json` holds it) is
recorded in the index as `model_config`, so `shardwise ckpt export` can write the config.json that
`from_pretrained` needs beside the weights; any other model records none.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from torch import nn


def model_config(model: nn.Module) -> dict | None:
    """Note [model config]: a Hugging Face model's config as JSON, or None for any other model."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_json_string"):
        return None
    try:
        return json.loads(config.to_json_string(use_diff=False))
    except (TypeError, ValueError):
        return None  # a config that does not serialize: the checkpoint then says it has none


CONFIG = "config.json"  # what `from_pretrained` reads beside model.safetensors


def write_config(config: dict, directory: Path) -> Path:
    """A Hugging Face config (JSON, as recorded at save) as `directory/config.json`, written whole or not at all,
    through a fresh name of its own (O_EXCL | O_NOFOLLOW: never through a file planted in a shared directory)."""
    target, partial = directory / CONFIG, directory / f".{CONFIG}.{uuid.uuid4().hex}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    os.replace(partial, target)
    return target
