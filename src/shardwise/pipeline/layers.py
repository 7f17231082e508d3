"""A model as a chain of layers: what a pipeline cuts into stages and freezing counts from the front.

A `LayerChain` is a list of modules applied one after another (`x = layer(x)`), plus the
model's own name for every parameter each layer holds. The layers are the model's own
modules (no copies), so training the chain trains the model, and the names are the
ones `model.named_parameters()` gives, so results compare name by name with a
single-process run.

Note [tied params]: a parameter held by two layers (the GPT's token embedding, which is
also its output head's weight) is one Parameter object in one process. Split over
stages, each stage's rank holds its own copy; the chain records every layer that holds
it (`tied()`), the pipeline sums the copies' gradients across those stages so both
take the same optimizer step and stay equal, and the first layer that holds it is its
*owner* (`owner_layer`): the one whose rank sends it when layers move between ranks,
and whose gradient norm counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from shardwise.checkpoint.read.hf_names import pretrained_model
from shardwise.engine.protocol import is_sliced_param
from shardwise.errors import ShardwiseError
from shardwise.interfaces import LayeredModel
from shardwise.models.hf_layers import hf_pipeline_layers


@dataclass
class LayerChain:
    """`layers` applied in order; `names[i]` the model's names of layer i's parameters;
    `params` every distinct parameter by name (a tied one once)."""

    layers: list[nn.Module]
    names: list[list[str]]
    params: dict[str, nn.Parameter] = field(repr=False)

    @property
    def num_layers(self) -> int:
        """Number of layers in the chain."""
        return len(self.layers)

    def owner_layer(self, name: str) -> int:
        """The first layer holding parameter `name` (Note [tied params])."""
        for i, names in enumerate(self.names):
            if name in names:
                return i
        raise KeyError(name)

    def tied(self) -> dict[str, list[int]]:
        """Parameters held by more than one layer, with the layers that hold each."""
        holders: dict[str, list[int]] = {}
        for i, names in enumerate(self.names):
            for name in names:
                holders.setdefault(name, []).append(i)
        return {name: layers for name, layers in holders.items() if len(layers) > 1}

    def names_by_id(self) -> dict[int, str]:
        """The model name of every parameter object any layer holds (after a re-pack of sharded stages, a
        frozen tied weight is two objects: its prefix copy and its stage's shard)."""
        return {id(p): name for layer, names in zip(self.layers, self.names)
                for p, name in zip(layer.parameters(), names)}

    def layer_params(self, i: int) -> list[tuple[str, nn.Parameter]]:
        """Layer i's parameters as (model name, parameter)."""
        return [(name, self.params[name]) for name in self.names[i]]


def chain_layers(model: nn.Module | list[nn.Module]) -> LayerChain:
    """Cut `model` into a `LayerChain`.

    Accepts a model that implements `pipeline_layers()` (shardwise.interfaces.LayeredModel,
    as the zoo GPT does: embedding layer, one layer per block, head layer), a Hugging Face
    causal LM of the standard decoder families (Llama, Mistral, Qwen2, Qwen3, Phi, GPT-2, OPT: cut by
    models/hf_layers.py, its input the token ids and its output the logits), an `nn.Sequential` or
    `nn.ModuleList` (one layer per child), or a plain list of modules (named as an
    `nn.ModuleList` of them would be: "0.weight", ...).
    """
    if isinstance(model, list):
        model = nn.ModuleList(model)
    if isinstance(model, LayeredModel):
        layers = list(model.pipeline_layers())
    elif isinstance(model, (nn.Sequential, nn.ModuleList)):
        layers = list(model)
    elif pretrained_model(model) is not None:  # Note [Hugging Face decoder layers] in models/hf_layers.py
        layers = hf_pipeline_layers(model)
    else:
        raise ShardwiseError(
            f"chain_layers does not know how to cut a {type(model).__name__} into layers; pass an "
            "nn.Sequential, a list of modules, or give the model a `pipeline_layers()` method that returns "
            "its layers in order (shardwise.interfaces.LayeredModel; shardwise.models.gpt.GPT has one)"
        )
    if not layers:
        raise ShardwiseError("the model has no layers to put in a pipeline")
    if any(is_sliced_param(p) for layer in layers for p in layer.parameters()):
        raise ShardwiseError("this model is sliced (sw.slice): a pipeline stage runs whole layers on one rank and "
                             "moves them between ranks, which a layer sliced across a tensor group cannot do. "
                             "Build the pipeline from an unsliced model (docs/slicing.md)")
    return _name_layers(model, layers)


def _name_layers(root: nn.Module, layers: list[nn.Module]) -> LayerChain:
    name_of = {id(p): name for name, p in root.named_parameters()}
    params = dict(root.named_parameters())
    names = []
    for i, layer in enumerate(layers):
        layer_names = []
        for p in layer.parameters():  # de-duplicated within the layer
            if id(p) not in name_of:
                raise ShardwiseError(f"layer {i} ({type(layer).__name__}) holds a parameter the model does not")
            layer_names.append(name_of[id(p)])
        names.append(layer_names)
    missing = set(params) - {n for layer_names in names for n in layer_names}
    if missing:
        raise ShardwiseError(
            f"parameters {sorted(missing)} belong to no layer of the chain; the pipeline would never train them"
        )
    return LayerChain(layers, names, params)
