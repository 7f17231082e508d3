"""Small models, data and optimizer classes that several test files share."""

from __future__ import annotations

import torch


def tiny_gpt2():
    """A 2-block Hugging Face GPT-2 (vocab 128, width 32, 16 positions, no dropout), seed 0: the model
    the Trainer and Accelerate tests train."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def tiny_lm_data(samples: int = 32, seq: int = 8) -> list[dict]:
    """`samples` token sequences below tiny_gpt2's vocabulary, each its own labels (seed 1)."""
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (samples, seq), generator=g)]


class PerParameter(torch.optim.Optimizer):
    """An optimizer class as repositories write one, which shardwise has never seen: `lr` its only
    setting, `update(p, state, lr)` called for each parameter that has a gradient."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, self.state[p], group["lr"])

    def update(self, p, state, lr) -> None:
        raise NotImplementedError
