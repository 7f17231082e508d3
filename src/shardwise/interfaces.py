"""What the layers above the engine may ask of a model: two small, optional interfaces.

Model knowledge stays with the model. The pipeline and the estimator never read a
model's attribute names; a model (or its config) that wants their model-specific
paths implements these methods, as `shardwise.models.gpt` does. A model without
them gets the generic path (an `nn.Sequential` chain; a parameter-only estimate)
or an error that names the method to add.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class LayeredModel(Protocol):
    """A model the pipeline can run as a chain of layers, `x = layer(x)` for each in order.

    The layers must be built from the model's own modules (no copies), so training the
    chain trains the model; a tied parameter may appear in two layers (Note [tied params]
    in pipeline/layers.py).
    """

    def pipeline_layers(self) -> list[nn.Module]:
        """The model's layers in order: typically an embedding layer, one per block, a head layer."""
        ...


@runtime_checkable
class ActivationSized(Protocol):
    """A model (or its config) that can say how many bytes autograd keeps for one step."""

    def activation_bytes(self, batch: int, seq: int | None, dtype_bytes: int, checkpointed: bool) -> int:
        """Bytes of saved activations per rank for `batch` sequences of `seq` tokens (None: the
        model's own length) in a `dtype_bytes` compute dtype; `checkpointed`: each block recomputed."""
        ...


@runtime_checkable
class ExampleInputs(Protocol):
    """A model that can make its own inputs for the estimator's activation probe (Note [activation
    probe] in estimate/probe.py): shapes and dtypes matter, values are never read on meta."""

    def example_inputs(self, batch: int, seq: int | None, device):
        """The arguments of one training forward (a tuple, a dict of keyword arguments or a tensor) for
        `batch` samples of `seq` tokens (None: the model's own length) on `device`, such that the
        output is the loss (or holds it)."""
        ...
