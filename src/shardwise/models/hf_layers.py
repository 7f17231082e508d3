"""Hugging Face decoders as pipeline layers, with no `pipeline_layers()` written by the user: what
`chain_layers` cuts a transformers causal LM into.

Note [Hugging Face decoder layers]: the standard decoder families share one structure, an embedding, a
list of decoder layers, a final norm and a head, and differ in where they keep the positions: the
rotary families (Llama, Mistral, Qwen2, Qwen3, Phi) hand each decoder layer the rotary embedding of the
positions (`model.model.rotary_emb`, computed once per forward by transformers; here by each stage's
layer from the same positions, the same values), GPT-2 and OPT add learned position embeddings to the
token embedding (OPT's table is offset by 2, and may project the embedding in and the output out of a
narrower width). Each layer built here is the model's own modules (no copies: training the chain trains
the model), runs what transformers' own forward runs for it (Phi's embedding dropout, GPT-2's and OPT's
position sum, OPT's projections, the final norm where the config keeps one), and builds the causal mask
with transformers' own `create_causal_mask` (or the sliding-window one, per `config.layer_types`), so any
attention implementation sees the mask it would see in `model(input_ids)`. The chain's input is the token
ids (batch, seq) from position 0, with no padding mask and no cache (training); its output is the logits.
A tied head (`tie_word_embeddings`) holds the embedding's parameter: the first and the last layer hold
one parameter (Note [tied params] in layers.py). OPT's LayerDrop (skipping a layer at random while
training) has no place in a fixed schedule of stages and is refused unless `config.layerdrop` is 0.
Families with another structure (BERT, T5, ...) are refused with the fix: a `pipeline_layers()` method
on a wrapper.
"""

from __future__ import annotations

import torch
from torch import nn

from shardwise.errors import ShardwiseError


class _Positions(nn.Module):
    """Base of the layers below: the positions of a sequence that starts at 0."""

    @staticmethod
    def positions(hidden: torch.Tensor) -> torch.Tensor:
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _TokenEmbedding(nn.Module):
    """The rotary families' first layer: the token embedding (then Phi's embedding dropout)."""

    def __init__(self, embed: nn.Module, drop: nn.Module | None = None):
        super().__init__()
        self.embed, self.drop = embed, drop or nn.Identity()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.embed(tokens))


class _LearnedEmbedding(_Positions):
    """GPT-2's and OPT's first layer: the token embedding (OPT: projected in) plus the learned positions."""

    def __init__(self, embed: nn.Module, positions: nn.Module, drop: nn.Module | None = None,
                 project_in: nn.Module | None = None, offset: int = 0):
        super().__init__()
        self.embed, self.wpe = embed, positions
        self.drop, self.project_in = drop or nn.Identity(), project_in or nn.Identity()
        self.offset = offset  # OPT's table starts 2 rows in (OPTLearnedPositionalEmbedding.offset)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.project_in(self.embed(tokens))
        # nn.Embedding's own forward: OPT's subclass takes an attention mask and adds its offset itself
        where = nn.Embedding.forward(self.wpe, self.positions(hidden) + self.offset)
        return self.drop(hidden + where)


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
    """The last layer: the final norm (OPT: where the config keeps one, then the projection out), the head."""

    def __init__(self, head: nn.Module, *before: nn.Module | None):
        super().__init__()
        self.before = nn.ModuleList([m for m in before if m is not None])
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for module in self.before:
            hidden = module(hidden)
        return self.head(hidden)


def _decoders(layers, config, rotary: nn.Module | None) -> list[nn.Module]:
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * len(layers)
    return [_Decoder(layer, config, kind, rotary) for layer, kind in zip(layers, kinds)]


def _rotary(body, config, head) -> list[nn.Module]:
    return [_TokenEmbedding(body.embed_tokens), *_decoders(body.layers, config, body.rotary_emb),
            _Head(head, body.norm)]


def _phi(body, config, head) -> list[nn.Module]:
    return [_TokenEmbedding(body.embed_tokens, body.embed_dropout), *_decoders(body.layers, config, body.rotary_emb),
            _Head(head, body.final_layernorm)]


def _gpt2(body, config, head) -> list[nn.Module]:
    return [_LearnedEmbedding(body.wte, body.wpe, body.drop), *_decoders(body.h, config, None),
            _Head(head, body.ln_f)]


def _opt(body, config, head) -> list[nn.Module]:
    if config.layerdrop:
        raise ShardwiseError(
            f"this OPT model skips decoder layers at random while training (config.layerdrop={config.layerdrop}), "
            "which a pipeline's fixed stages cannot do; set config.layerdrop = 0 before building the model to cut "
            "it into stages (Note [Hugging Face decoder layers])")
    decoder = body.decoder
    return [_LearnedEmbedding(decoder.embed_tokens, decoder.embed_positions, None, decoder.project_in,
                              decoder.embed_positions.offset),
            *_decoders(decoder.layers, config, None), _Head(head, decoder.final_layer_norm, decoder.project_out)]


CUTS = {"llama": _rotary, "mistral": _rotary, "qwen2": _rotary, "qwen3": _rotary, "phi": _phi,
        "gpt2": _gpt2, "opt": _opt}


def hf_pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """`model` (a transformers causal LM of a family in CUTS) as pipeline layers: the embedding, one per
    decoder layer, the final norm with the head (Note [Hugging Face decoder layers])."""
    family = getattr(model.config, "model_type", None)
    head = model.get_output_embeddings()
    if family in CUTS and head is not None:
        return CUTS[family](model.base_model, model.config, head)
    raise ShardwiseError(
        f"chain_layers cuts the Hugging Face causal LMs of families {', '.join(CUTS)} by itself; "
        f"{type(model).__name__} (model_type {family!r}) is not one of them. Wrap it in a module whose "
        "`pipeline_layers()` returns its layers in order (shardwise.interfaces.LayeredModel; "
        "shardwise/models/hf_layers.py shows the cuts of these families)")
