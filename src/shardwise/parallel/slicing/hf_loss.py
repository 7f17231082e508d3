"""Hugging Face's own loss, `model(input_ids, labels=labels).loss`, on a vocabulary-sliced head.

Note [hf loss]: transformers computes a model's loss in `model.loss_function` (for a causal LM,
`ForCausalLMLoss`), which flattens the logits with `view(-1, vocab_size)` where `vocab_size` is
the config's, the full vocabulary. On a head sliced by vocabulary (Note [sliced logits]) that view
does not fit this rank's columns, so `labels=` was refused. `sw.slice` therefore gives each
Hugging Face model whose head it slices by vocabulary a `loss_function` that passes the sliced
logits' own width as `vocab_size` and otherwise runs transformers' function unchanged: its label
shift, its `ignore_index`, its `num_items_in_batch` (gradient accumulation in the Trainer), and
its `F.cross_entropy`, which on sliced logits runs `sliced_cross_entropy` (three all-reduces of
batch x sequence numbers, the logits never gathered). tests/test_slicing.py holds the loss,
gradients and parameters of a Llama and a GPT-2 trained through `labels=` to one process's.
"""

from __future__ import annotations

from torch import nn

from shardwise.parallel.slicing.loss import SlicedLogits


class LocalVocabLoss:
    """A transformers loss function called with the sliced logits' width as `vocab_size`."""

    def __init__(self, loss_function) -> None:
        self.loss_function = loss_function

    def __call__(self, logits=None, labels=None, vocab_size=None, **kwargs):
        if isinstance(logits, SlicedLogits) and vocab_size is not None:
            vocab_size = logits.shape[-1]  # this rank's columns: transformers views the logits by it
        if vocab_size is None:
            return self.loss_function(logits=logits, labels=labels, **kwargs)
        return self.loss_function(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)


def use_sliced_loss(model: nn.Module) -> None:
    """Note [hf loss]: every Hugging Face model in `model` computes its `labels=` loss on the slices."""
    for module in model.modules():
        if not isinstance(getattr(type(module), "loss_function", None), property):
            continue  # not a transformers PreTrainedModel
        if not isinstance(getattr(module, "_loss_function", None), LocalVocabLoss):
            module.loss_function = LocalVocabLoss(_loss_function_of(module))


def _loss_function_of(module: nn.Module):
    """The loss transformers would use, without its warning for class names that name no loss (GPT-2)."""
    if getattr(module, "_loss_function", None) is not None:
        return module._loss_function
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING.get(getattr(module, "loss_type", None) or "ForCausalLM", LOSS_MAPPING["ForCausalLM"])
