"""A tiny Hugging Face Llama built from a config (tied embedding and head), cut into pipeline layers by the
library's own cut (shardwise/models/hf_layers.py): the embedding, each decoder layer with the rotary position
embedding it needs, and the final norm with the head. Its forward runs the same layers in one process (the
pipeline tests' one-process reference)."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from helpers.pipe import token_loss
from shardwise.models.hf_layers import hf_pipeline_layers


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
        return hf_pipeline_layers(self.hf)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden = tokens
        for layer in self.pipeline_layers():
            hidden = layer(hidden)
        return token_loss(hidden, targets)
