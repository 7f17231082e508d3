"""MODEL on the command line: one grammar for `estimate`, `plan` and `units`.

    MODEL [KEY=VALUE ...]

MODEL is, in this order: a zoo name (`shardwise.models.zoo`; `gpt` takes GPTConfig fields as
KEY=VALUE, or the older `gpt:key=value,...`); `module:function` or `path/to/file.py:function`
naming a function that returns a model (the current directory is importable); a Python file
(its `build()` function); a Hugging Face model type (`llama`, `gpt2`, ...) with its config's
sizes as KEY=VALUE, built through `AutoConfig.for_model`; or a directory (or config.json) holding
a Hugging Face config. Every model is built on the meta device: only shapes are read. Every
mistake is a ShardwiseError of one line that says what to write instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn

from shardwise.errors import ShardwiseError

HELP = ("a zoo name; module:function or path/to/file.py:function returning a model; a Hugging Face model type "
        "(llama, gpt2, ...) followed by its config's sizes as KEY=VALUE (e.g. `llama hidden_size=512 "
        "num_hidden_layers=4`); or a directory holding a Hugging Face config.json. Built on the meta device")


def build_model(spec: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[nn.Module, object]:
    """The model MODEL [KEY=VALUE ...] names, built on the meta device, and the unit spec to cut it with."""
    from shardwise.models.gpt import GPT, Block, GPTConfig
    from shardwise.models.zoo import ZOO

    values = parse_overrides(overrides)
    with torch.device("meta"):
        if spec == "gpt" or spec.startswith("gpt:"):
            values = {**parse_overrides(filter(None, spec[4:].split(","))), **values}
            return GPT(_gpt_config(values, GPTConfig)), Block
        if spec in ZOO:
            _no_overrides(spec, values)
            return ZOO[spec].build(), ZOO[spec].unit_class
        if ":" in spec:
            _no_overrides(spec, values)
            return _called(spec, load_function(spec)), None
        path = Path(spec)
        if spec.endswith(".py"):
            _no_overrides(spec, values)
            if not path.is_file():
                raise ShardwiseError(f"MODEL {spec}: no such file")
            return _called(f"{spec}:build", load_function(f"{spec}:build")), None
        if path.is_dir() or path.name == "config.json":
            return _hf_model(_hf_config_from(path, values)), None
        model_types = _hf_model_types()
        if spec in model_types:
            return _hf_model(_hf_config(spec, values)), None
    known = sorted(ZOO) + ["gpt"] + sorted(model_types)
    close = difflib.get_close_matches(spec, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ShardwiseError(
        f"MODEL {spec!r} is not a zoo name ({', '.join(sorted(ZOO))}), a Hugging Face model type (e.g. llama, "
        f"gpt2), module:function, a .py file or a directory with a config.json{hint}")


def depth_key(spec: str, model: nn.Module) -> str:
    """The config field MODEL's depth is: `n_layers` for gpt, the Hugging Face config's `num_hidden_layers`
    (under its own name: GPT-2's is `n_layer`); a one-line error for a model that is no family of sizes."""
    from shardwise.models.zoo import ZOO

    if spec == "gpt" or spec.startswith("gpt:"):
        return "n_layers"
    config = getattr(model, "config", None) if spec not in ZOO and ":" not in spec and not spec.endswith(".py") \
        else None
    if config is not None and hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        key = getattr(config, "attribute_map", {}).get("num_hidden_layers", "num_hidden_layers")
        if key in config.to_dict():
            return key
        raise ShardwiseError(f"MODEL {spec}: its config has no num_hidden_layers: name the size to search, "
                             "--max-model KEY (a field of its config)")
    raise ShardwiseError(f"MODEL {spec} is not a family of sizes: --max-model searches a size of `gpt` or of a "
                         "Hugging Face model type or config.json (e.g. `shardwise plan llama hidden_size=2048 "
                         "--max-model ...`); for your own model, call sw.max_model(lambda size: build(size), ...)")


def parse_overrides(items) -> dict:
    """KEY=VALUE strings -> {key: int | float | bool | str}."""
    values = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ShardwiseError(f"{item!r} is not KEY=VALUE (e.g. hidden_size=512)")
        values[key] = _value(text)
    return values


def _value(text: str):
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _no_overrides(spec: str, values: dict) -> None:
    if values:
        raise ShardwiseError(f"MODEL {spec} takes no KEY=VALUE ({', '.join(values)}): sizes are for `gpt` and "
                             "Hugging Face model types")


def _gpt_config(values: dict, config_class):
    fields = {f.name for f in dataclasses.fields(config_class)}
    for key, value in values.items():
        if key not in fields or not isinstance(value, int):
            raise ShardwiseError(f"gpt: {key}={value} is not KEY=int with KEY one of {sorted(fields)}")
    if "d_model" in values and "n_heads" not in values:  # 64-wide heads unless told otherwise
        values["n_heads"] = max(1, values["d_model"] // 64) if values["d_model"] % 64 == 0 else 1
    try:
        return config_class(**values)
    except ValueError as error:
        raise ShardwiseError(f"gpt: {error}") from None


def _hf_model_types() -> list[str]:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return []
    return list(CONFIG_MAPPING.keys())


def _hf_config(model_type: str, values: dict):
    from transformers import AutoConfig

    known = AutoConfig.for_model(model_type).to_dict()
    unknown = [key for key in values if key not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(known), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ShardwiseError(f"{model_type}: {unknown[0]!r} is not a field of its config{hint}; the fields: "
                             f"{', '.join(sorted(k for k in known if not k.startswith('_')))[:400]}")
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as error:  # noqa: BLE001 - transformers' validators raise several kinds: one line
        raise ShardwiseError(f"{model_type}: {str(error).strip().splitlines()[-1].strip()}") from None


def _hf_config_from(path: Path, values: dict):
    from transformers import AutoConfig

    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ShardwiseError(f"MODEL {path}: no config.json there (a Hugging Face model directory holds one)")
    try:
        return AutoConfig.from_pretrained(str(file.parent), **values)
    except (ValueError, OSError) as error:
        raise ShardwiseError(f"MODEL {path}: {file} is not a Hugging Face config "
                             f"({str(error).splitlines()[0]})") from None


def _hf_model(config) -> nn.Module:
    """A causal LM where the architecture has one (most do), else the bare model."""
    from transformers import AutoModel, AutoModelForCausalLM

    try:
        try:
            model = AutoModelForCausalLM.from_config(config)
            if getattr(model, "loss_type", "") is None:  # GPT-2's class name names no loss: transformers warns
                model.loss_type = "ForCausalLM"
            return model
        except ValueError as error:
            if "Unrecognized configuration class" not in str(error):
                raise
            return AutoModel.from_config(config)
    except Exception as error:  # noqa: BLE001 - sizes that do not fit together: one line, not a traceback
        raise ShardwiseError(f"{config.model_type}: building the model raised {type(error).__name__}: "
                             f"{str(error).splitlines()[0]}") from None


def _called(spec: str, function) -> nn.Module:
    try:
        model = function()
    except Exception as error:  # noqa: BLE001 - the user's code: one line, not a traceback
        raise ShardwiseError(f"{spec}() raised {type(error).__name__}: {error}") from None
    if not isinstance(model, nn.Module):
        raise ShardwiseError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def load_function(spec: str):
    """The function `module:function` or `path/to/file.py:function` names."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise ShardwiseError(f"{spec!r} is not module:function (e.g. my_model:build or path/to/file.py:build)")
    function = getattr(_import(module_name), function_name, None)
    if not callable(function):
        raise ShardwiseError(f"{module_name} has no function {function_name!r}")
    return function


def _import(name: str):
    # As `python -m` does: the current directory is importable (module:function from here).
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    try:
        if name.endswith(".py"):
            if not Path(name).is_file():
                raise ShardwiseError(f"{name}: no such file (write path/to/file.py:function, relative to here)")
            spec = importlib.util.spec_from_file_location("_shardwise_user_model", name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except ShardwiseError:
        raise
    except ImportError as error:
        raise ShardwiseError(f"cannot import {name!r} ({error}); module:function imports from the current "
                             "directory and the Python path, or pass a file: path/to/file.py:function") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed while importing: one line
        raise ShardwiseError(f"importing {name} raised {type(error).__name__}: {error}") from None
