"""A small GPT: the math only, no parallelism (shardwise applies that from outside).

Pre-LN transformer blocks with causal self-attention and a GELU MLP; the output
head shares its weight with the token embedding (tied), which is the sharing case
every real language model has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. The defaults make a ~30k-parameter model that runs fast on CPU."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for field in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{field} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); pick n_heads that divides d_model"
            )


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        # No bias: a key bias adds the same q.b to every score of a row, which softmax
        # ignores, so its true gradient is 0 and its computed one is rounding noise,
        # which Adam scales up to updates that no two runs agree on.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.attn_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self._attend(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

    def _attend(self, x: Tensor) -> Tensor:
        batch, seq, d_model = x.shape
        # (batch, seq, 3*d) -> three tensors of (batch, heads, seq, head_dim)
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class GPT(nn.Module):
    """Token + position embedding, `n_layers` Blocks, final LayerNorm, tied output head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Parameter(torch.empty(cfg.seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Tied: one Parameter object, reached from two modules. named_parameters()
        # yields it once, as "tok_emb.weight".
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        nn.init.normal_(self.pos_emb, mean=0.0, std=0.02)

    def _init_weights(self, module: nn.Module) -> None:
        # The head is skipped: its weight is tok_emb's, already drawn once.
        if module is self.head:
            return
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Logits of shape (batch, seq, vocab), or the mean cross-entropy if `targets` is given."""
        seq = idx.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx) + self.pos_emb[:seq]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # Mean over every token: equal-size batch slices average to the full-batch loss.
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        """Number of distinct parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())
