"""bench/memory/max_model.py's pipeline arms: shardwise.pipeline's PipeTrainer at 2 stages, how each is built,
estimated and described in the report (Note [pipeline arms]).

Note [pipeline arms]: PipeTrainer at 2 stages (world size / 2 ranks each), the global batch of the flat
rows (batch × world size sequences) in one GPipe micro-batch, so each rank runs as many sequences through
its layers as a flat rank does through all of them. One micro-batch is the schedule that keeps the fewest
activations alive here, so it is the fair arm for memory: a stage rank runs batch × 2 sequences, which
splits into at most 2 micro-batches, and 1F1B keeps up to S = 2 micro-batches in flight on the first
stage, all of them: the same bytes as GPipe's one micro-batch of both (1F1B keeps fewer than GPipe only
when M > S). pipe2_zero3 shards each stage zero3 over its 2 ranks and builds the model under
sw.deferred_init() (each rank materializes its stage's rows, Note [stage init]), with keep_gathered=False:
the default keeps the whole stage gathered through a step (one micro-batch gains nothing from it; at 132
blocks that peaked at 2568 MiB, 2045 estimated without it). pipe2_whole is the whole-copy route
(strategy=None): every rank builds and keeps every layer, and its stage's gradients and optimizer state.
Estimated: sw.estimate_pipe for pipe2_zero3; for pipe2_whole, which no estimator models, shardwise ddp's
(the search then steers by measured peaks).
"""

from __future__ import annotations

import torch

# config: (label, estimator strategy, precision, offload), as max_model.CONFIGS
PIPE_CONFIGS = {
    "pipe2_zero3": ("shardwise pipeline: pipe 2 × zero3 2", "zero3", "fp32", False),
    "pipe2_whole": ("shardwise pipeline: pipe 2 × 2 replicas, whole copy per rank", "ddp", "fp32", False),
}
PIPELINES = {"pipe2_zero3": "zero3", "pipe2_whole": None}  # each arm's PipelineConfig.strategy
REPORT_NOTE = ("pipeline rows (Note [pipeline arms], bench/memory/max_model_pipe.py): PipeTrainer at 2 stages over "
               "the 4 ranks, the flat rows' global batch in one GPipe micro-batch (1F1B would keep as many: a stage "
               "rank's 2 sequences are at most 2 = S micro-batches); pipe 2 × zero3 2 built under "
               "sw.deferred_init() (each rank materializes its stage's rows only) with keep_gathered=False, "
               "estimated by sw.estimate_pipe; the whole-copy row (strategy=None) has no estimator: its estimated "
               "MiB is shardwise ddp's.")


def build_pipeline(args, cfg, world_size: int, adamw: dict):
    """Note [pipeline arms]: a step function over the trainer's sampler's batches, no optimizer (the trainer
    steps its own), and how the model was built."""
    import torch.nn.functional as F

    import shardwise as sw
    from shardwise.models.gpt import GPT
    from shardwise.pipeline import PipelineConfig, PipeTrainer, chain_layers, grouped_adamw

    strategy = PIPELINES[args.config]
    if strategy is None:
        model = GPT(cfg)
    else:
        with sw.deferred_init():
            model = GPT(cfg)
    global_batch = args.batch * world_size
    tokens = torch.randint(args.vocab, (global_batch * args.steps, args.seq + 1),
                           generator=torch.Generator().manual_seed(1000))  # the same on every rank
    config = PipelineConfig(num_stages=2, num_microbatches=1, schedule="gpipe", cache=False, strategy=strategy,
                            keep_gathered=False)  # zero3: one unit whole at a time (Note [pipeline arms])
    trainer = PipeTrainer(chain_layers(model), lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
                          grouped_adamw(lr=(adamw["lr"], adamw["lr"]), weight_decay=(adamw["weight_decay"], 0.0)),
                          tokens[:, :-1], tokens[:, 1:], global_batch_size=global_batch, config=config)
    batches = iter(trainer.sampler.batches(0))
    return (lambda: trainer.step(next(batches))), None, "deferred" if strategy else "eager"


def estimated_pipe_total(model, world_size: int) -> int:
    """sw.estimate_pipe's per-rank peak of pipe2_zero3 (Note [pipeline arms])."""
    import shardwise as sw

    return sw.estimate_pipe(model, "zero3", world_size, 2, keep_gathered=False).total
