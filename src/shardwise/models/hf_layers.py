"""Hugging Face decoders as pipeline layers, with no `pipeline_layers()` written by the user: what
`chain_layers` cuts a transformers causal LM into.

Note [Hugging Face decoder layers]: the standard decoder families share one structure, an embedding, a
list of decoder layers, a final norm and a head, and differ in where they keep the positions: the
rotary families (Llama, Mistral, Qwen2, Qwen3) hand each decoder layer the rotary embedding of the
positions (`model.model.rotary_emb`, computed once per forward by transformers; here by each stage's
layer from the same positions, the same values), GPT-2 adds learned position embeddings to the token
embedding. Each layer built here is the model's own modules (no copies: training the chain trains the
model), runs what transformers' own forward runs for it, and builds the causal mask with transformers'
own `create_causal_mask` (or the sliding-window one, per `config.layer_types`), so any attention
implementation sees the mask it would see in `model(input_ids)`. The chain's input is the token ids
(batch, seq) from position 0, with no padding mask and no cache (training); its output is the logits.
A tied head (`tie_word_embeddings`) holds the embedding's parameter: the first and the last layer hold
one parameter (Note [tied params] in layers.py). Families with another structure (OPT, Phi, BERT, ...)
are refused with the fix: a `pipeline_layers()` method on a wrapper.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ShardwiseError

ROTARY = ("llama", "mistral", "qwen2", "qwen3")
LEARNED = ("gpt2",)


class _Positions(nn.Module):
    """Base of the layers below: the positions of a sequence that starts at 0."""

    @staticmethod
    def positions(hidden: torch.Tensor) -> torch.Tensor:
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _TokenEmbedding(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class _GPT2Embedding(_Positions):
    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.wte(tokens)
        return self.drop(hidden + self.wpe(self.positions(hidden)))


class _Decoder(_Positions):
    """One decoder layer with the mask (and, for a rotary family, the position embeddings) it is given in
    transformers' own forward."""

    def __init__(self, layer: nn.Module, config, kind: str, rotary: nn.Module | None):
        super().__init__()
        self.layer, self.rotary = layer, rotary
        self.config, self.kind = config, kind  # not modules: no parameters

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        positions = self.positions(hidden)
        make = create_sliding_window_causal_mask if self.kind == "sliding_attention" else create_causal_mask
        mask = make(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                    position_ids=positions)
        if self.rotary is None:
            return self.layer(hidden, attention_mask=mask, position_ids=positions)
        return self.layer(hidden, attention_mask=mask, position_ids=positions,
                          position_embeddings=self.rotary(hidden, positions))


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """`model` (a transformers causal LM of a family in ROTARY or LEARNED) as pipeline layers: the embedding,
    one per decoder layer, the final norm with the head (Note [Hugging Face decoder layers])."""
    config = model.config
    family = getattr(config, "model_type", None)
    head = model.get_output_embeddings()
    if family in ROTARY and head is not None:
        body = model.base_model
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(body.layers)
        return [_TokenEmbedding(body.embed_tokens),
                *(_Decoder(layer, config, kind, body.rotary_emb) for layer, kind in zip(body.layers, kinds)),
                _Head(body.norm, head)]
    if family in LEARNED and head is not None:
        body = model.base_model
        return [_GPT2Embedding(body.wte, body.wpe, body.drop),
                *(_Decoder(block, config, "full_attention", None) for block in body.h), _Head(body.ln_f, head)]
    raise ShardwiseError(
        f"chain_layers cuts the Hugging Face causal LMs of families {', '.join(ROTARY + LEARNED)} by itself; "
        f"{type(model).__name__} (model_type {family!r}) is not one of them. Wrap it in a module whose "
        "`pipeline_layers()` returns its layers in order (shardwise.interfaces.LayeredModel; "
        "shardwise/models/hf_layers.py shows the Llama and GPT-2 cuts)")
