"""A tiny Hugging Face Llama built from a config (tied embedding and head), cut into pipeline layers: the
embedding, each decoder layer with the rotary position embedding it needs, and the final norm with the head.
Its forward runs the same layers in one process (the pipeline tests' one-process reference)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from helpers.pipe import token_loss


class _Embedding(nn.Module):
    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.embed = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class _Decoder(nn.Module):
    """One decoder layer; causal by sdpa's own rule (no mask given, more than one query)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.layer(hidden, position_embeddings=self.rotary(hidden, positions))


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Linear):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(hidden))


class LlamaLayers(nn.Module):
    """`LlamaForCausalLM` (vocab 64, hidden 32, `n_layers` layers, tied embedding) as pipeline layers."""

    def __init__(self, n_layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=n_layers, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=16, tie_word_embeddings=True,
                                          attn_implementation="sdpa")
        self.hf = transformers.LlamaForCausalLM(config)

    def pipeline_layers(self) -> list[nn.Module]:
        model = self.hf.model
        return [_Embedding(model.embed_tokens), *(_Decoder(layer, model.rotary_emb) for layer in model.layers),
                _Head(model.norm, self.hf.lm_head)]

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = tokens
        for layer in self.pipeline_layers():
            hidden = layer(hidden)
        return token_loss(hidden, targets)
