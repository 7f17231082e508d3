"""A small GPT: the math only, no parallelism (shardwise applies that from outside).

Pre-LN transformer blocks with causal self-attention and a GELU MLP; the output
head shares its weight with the token embedding (tied), which is the sharing case
every real language model has.

It implements shardwise's two model interfaces (shardwise/interfaces.py): `GPT.pipeline_layers()`
for the pipeline and `GPTConfig.activation_bytes()` (also on `GPT`) for the estimator.

Note [activations]: with B sequences of T tokens per rank, width D, L blocks,
vocabulary V, in the compute dtype's c bytes:
    activations = c · B · T · (16.5·D·L + 2·D + 3·V)
16.5·D per block is what autograd saves (LayerNorm inputs, the qkv output, attention
output and its re-layout, the MLP's 4·D input and GELU output: measured 16.4·D at fp32
and bf16 with `saved_tensors_hooks`), 2·D the final LayerNorm, 3·V the logits, their
log-softmax and its gradient at the start of backward. With checkpointed blocks a
block keeps only its input (D) and one block at a time is recomputed in backward: its
16.5·D plus the gradients its backward makes, 36·D in all (measured), so
    activations = c · B · T · (D·L + 36·D + 2·D + 3·V).
Both constants were measured at mlp_ratio 4, where the MLP's share is 8·D; another ratio
moves it by 8·D·(ratio/4 - 1). Calibrated against peak RSS with MALLOC_MMAP_THRESHOLD_=65536
(tests/test_estimate.py checks both within 25%).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.errors import ShardwiseError

_ACT_PER_BLOCK = 16.5  # saved elements per token per block, in units of D (Note [activations])
_ACT_RECOMPUTE = 36  # checkpointed: one block recomputed in backward, in units of D
_ACT_LOGITS = 3  # logits, log-softmax, and the logits' gradient, in units of V


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

    def activation_bytes(self, batch: int, seq: int | None, dtype_bytes: int, checkpointed: bool) -> int:
        """Bytes autograd keeps per rank for one step (Note [activations])."""
        seq = seq if seq is not None else self.seq_len
        d, layers, vocab = self.d_model, self.n_layers, self.vocab_size
        mlp_change = 8 * self.mlp_ratio / 4 - 8
        if checkpointed:
            per_token = d * layers + (_ACT_RECOMPUTE + mlp_change) * d + 2 * d + _ACT_LOGITS * vocab
        else:
            per_token = (_ACT_PER_BLOCK + mlp_change) * d * layers + 2 * d + _ACT_LOGITS * vocab
        return int(dtype_bytes * batch * seq * per_token)


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
        batch, seq, _ = x.shape
        # (batch, seq, 3*width) -> three tensors of (batch, heads, seq, head_dim). The width is read
        # from qkv's output, not from x: a sliced block holds only its own heads (sw.slice).
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).reshape(batch, seq, -1))


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

    def slice_plan(self) -> dict[str, str]:
        """How `sw.slice` cuts this model across a tensor group: the tied embedding/head by vocabulary,
        q/k/v (one fused Linear, three parts) by heads and the attention output back, the MLP's up
        projection by features and its down projection back; each block's head count divided."""
        heads = self.cfg.n_heads
        return {"tok_emb": "vocab", "head": "vocab", "blocks.*": "divide(n_heads)",
                "blocks.*.qkv": f"colwise(parts=3, heads={heads})", "blocks.*.attn_proj": f"rowwise(heads={heads})",
                "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def pipeline_layers(self) -> list[nn.Module]:
        """Embedding, one layer per block, head: the chain the pipeline cuts into stages."""
        return [GPTEmbedding(self), *self.blocks, GPTHead(self)]

    def activation_bytes(self, batch: int, seq: int | None, dtype_bytes: int, checkpointed: bool) -> int:
        """Bytes autograd keeps per rank for one step (Note [activations])."""
        return self.cfg.activation_bytes(batch, seq, dtype_bytes, checkpointed)

    def example_inputs(self, batch: int, seq: int | None, device) -> tuple[Tensor, Tensor]:
        """`(idx, targets)` for the estimator's probe (shardwise.interfaces.ExampleInputs): the loss comes out."""
        seq = seq if seq is not None else self.cfg.seq_len
        if seq > self.cfg.seq_len:
            raise ShardwiseError(f"seq={seq} exceeds the GPT's seq_len={self.cfg.seq_len}: pass a smaller seq "
                                 f"(--seq), or build it with seq_len={seq}")
        idx = torch.zeros(batch, seq, dtype=torch.long, device=device)
        return idx, idx

    def num_params(self) -> int:
        """Number of distinct parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())


class GPTEmbedding(nn.Module):
    """The GPT's first pipeline layer: token plus position embedding (the model's own modules)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.tok_emb = model.tok_emb
        self.pos_emb = model.pos_emb

    def forward(self, idx: Tensor) -> Tensor:
        return self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]


class GPTHead(nn.Module):
    """The GPT's last pipeline layer: final LayerNorm and the output head (tied to the token embedding)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.ln_f = model.ln_f
        self.head = model.head

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.ln_f(x))
