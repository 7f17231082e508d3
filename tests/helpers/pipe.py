"""The tied GPT, its data and its one-process reference, shared by the pipeline tests.

The reference is the same GPT trained in one process on the same global batches (the pipeline
sampler's), with the same optimizer (testing.make_optimizer's groups and eps=1e-3, Note [adam eps]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.pipeline import StickySampler, chain_layers
from shardwise.testing import RunResult, make_optimizer

NUM_SAMPLES = 64
GLOBAL_BATCH = 16
MICRO = 4
TIED = "tok_emb.weight"


def gpt(n_layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(seq_len=8, n_layers=n_layers))


def dataset(vocab: int = 64, seq: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (NUM_SAMPLES, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches_of(sampler: StickySampler, steps: int) -> list[torch.Tensor]:
    out, epoch = [], 0
    while len(out) < steps:
        out += sampler.batches(epoch)
        epoch += 1
    return out[:steps]


def reference_run(n_layers: int, num_homes: int, steps: int, freezes: dict[int, int] | None = None,
                  resume: tuple[str, int] | None = None, build=gpt) -> RunResult:
    """One process, whole global batch per step; from step s on, layers [0, freezes[s]) of
    the chain stop training (requires_grad=False: AdamW skips them). `resume=(path, s)`: the model and
    AdamW load checkpoint `path` (strictly) and run steps s.. only. `build(n_layers)`: the model (the tied
    GPT; pipe_llama.LlamaLayers), its forward(inputs, targets) the mean loss."""
    model = build(n_layers)
    inputs, targets = dataset()
    optimizer = make_optimizer(model)
    chain = chain_layers(model)
    losses, first = [], 0
    if resume is not None:
        report = sw.load(resume[0], model, optimizer)
        assert report.ok, str(report)
        first = resume[1]
    for step, batch in enumerate(batches_of(StickySampler(NUM_SAMPLES, GLOBAL_BATCH, num_homes=num_homes), steps)):
        if step < first:
            continue
        for i in range((freezes or {}).get(step, 0)):
            for _, p in chain.layer_params(i):
                p.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        loss = model(inputs[batch], targets[batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return RunResult(losses, [], {n: p.detach().clone() for n, p in model.named_parameters()})


