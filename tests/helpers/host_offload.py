"""Rank functions for tests/test_host_offload.py (module level, so `ranks.run` can pickle them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.engine.protocol import engine_of
from shardwise.estimate.measure import model_state_by_place
from shardwise.models.gpt import GPT, Block, GPTConfig

# Odd vocabulary and sequence length: dim-0 padding shows at world size 2 (tests/test_estimate.py's model).
CONFIG = GPTConfig(vocab_size=501, seq_len=15, d_model=64, n_layers=4, n_heads=4)


def split_after_steps(strategy: str, precision: str, frozen: bool) -> dict:
    """After two AdamW steps under offload="host": where the model state is (Note [placement count]) and where
    sw.estimate said it would be, and the engine's copies each way."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if frozen:
        model.blocks[0].requires_grad_(False)
    predicted = sw.estimate(model, strategy, dist.get_world_size(), precision, "adamw", "host")
    sw.shard(model, strategy=strategy, units=Block, precision=precision, offload="host")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    for _ in range(2):
        model(x, x).backward()
        optimizer.step()  # measured after the step, before zero_grad: the most a step keeps
    engine = engine_of(model)
    return {"measured": model_state_by_place(model, optimizer),
            "estimated": {"device": predicted.model_state, "host": predicted.host},
            "copies": dict(engine.host.copies), "table": str(sw.describe(model))}


def muon_step_under_host_offload() -> str:
    """One Muon step (stepped on whole tensors, Note [whole-tensor step]) over a zero3 model with offload="host":
    the ShardwiseError it raised on this rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    sw.shard(model, strategy="zero3", offload="host")
    optimizer = torch.optim.Muon([p for p in model.parameters() if p.dim() == 2], lr=0.02)
    model(torch.randn(2, 8)).sum().backward()
    try:
        optimizer.step()
    except sw.ShardwiseError as error:
        return str(error)
    return "stepped"


def copy_order(strategy: str) -> dict:
    """Two steps under offload="host" with a device API that records every stream and event call
    (helpers/recording_streams.py), the optimizer's steps logged among them: what a GPU would be asked."""
    import shardwise.engine.comm.context as context
    from helpers.recording_streams import RecordingApi

    apis: list[RecordingApi] = []
    original, context.device_api = context.device_api, lambda device: apis.append(RecordingApi()) or apis[-1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    try:
        sw.shard(model, strategy=strategy, units=torch.nn.Linear, offload="host")
    finally:
        # the pool's rank processes run later files' tests: an engine built there must get the host order
        # (tests/test_comm.py read "recording" in sw.describe after this file had run in its worker)
        context.device_api = original
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (api,) = apis
    for step in range(2):
        model(torch.full((4, 32), 0.1 * (step + 1 + dist.get_rank()))).pow(2).mean().backward()
        api.log.append(("step",))
        optimizer.step()
        optimizer.zero_grad()
    engine = engine_of(model)
    streams = {"gather": engine.comm.streams.by_kind["gather"].name,
               **{direction: stream.name for direction, stream in engine.host._streams.items()}}
    return {"log": api.log, "streams": streams}


def step_in_backward(model, optimizer) -> None:
    """check_parity's `prepare`: sw.optimizer_in_backward (Note [optimizer in backward])."""
    sw.optimizer_in_backward(model, optimizer)


def three_steps(strategy: str, offload, fused: bool = False, deferred: bool = False, options=None) -> dict:
    """Three clipped AdamW steps of the zoo GPT under `strategy` and `offload`: the losses and the full parameters.
    `fused`: torch's fused AdamW (its CPU kernel, the fast CPU Adam torch itself ships); `deferred`: the model
    built under sw.deferred_init() (its values replayed into host rows); `options`: more of sw.shard's."""
    from shardwise.models.zoo import ZOO, build
    from shardwise.testing import forward_passes, global_batch, rank_slice

    spec, rank, world = ZOO["gpt"], dist.get_rank(), dist.get_world_size()
    if deferred:
        torch.manual_seed(0)
        with sw.deferred_init():
            model = spec.build()
    else:
        model = build("gpt", 0)
    sw.shard(model, strategy=strategy, units=spec.unit_class, offload=offload, **(options or {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    losses = []
    for step in range(3):
        x, y = rank_slice(global_batch(spec, step, 8), rank, world)
        loss = forward_passes(model, spec, x, y)
        loss.backward()
        sw.clip_grad_norm_(model, 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": sw.full_parameters(model)}
