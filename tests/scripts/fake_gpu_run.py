"""Run by tests/test_fake_gpu.py (helpers/fake_cuda.run_in_child): each scenario named on the command line
trains a tiny model a few steps on the fake accelerator (Note [fake accelerator], helpers/fake_cuda.py) and
prints one `REPORT {json}` line: whether it ran, and what the checks counted over the counted steps."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
from torch import nn  # noqa: E402

from helpers import fake_gpu, fake_streams  # noqa: E402
from helpers.fake_gpu import DEVICE, StepChecks, fake_device, fake_parameters, fake_world  # noqa: E402

fake_gpu.install()
fake_streams.install()
import shardwise as sw  # noqa: E402
import shardwise.engine.schedule.agreement_device as agreement_device  # noqa: E402
import shardwise.engine.schedule.consistency as consistency  # noqa: E402
import shardwise.engine.schedule.gather_tags as gather_tags  # noqa: E402
import shardwise.engine.schedule.used_flags as used_flags  # noqa: E402
from shardwise.testing import Optimizers  # noqa: E402

# The device forms of the headers, zero3's tags and the used flags (Note [headers on the device], Note [tags on the
# device], Note [used flags on the device]: a MIXED world, or the forms forced) read their rows on the host from
# copies that have no values here (fake tensors); the mirror collectives fill every rank's row with this rank's,
# so each reads what this rank sent.
agreement_device.HeadersOnDevice.rows_of = lambda self, header: [header.row] * self.world
gather_tags.TagsOnDevice.rows_of = lambda self, tag: [tag.row] * self.world
used_flags.UsedFlagsOnDevice.result_of = lambda self, exchange: exchange.flags
_real_send = gather_tags.TagsOnDevice.send


def _send_keeping_row(self, unit):
    """TagsOnDevice.send, keeping this rank's row on the tag for `rows_of` (the mirror's rows)."""
    row = self._row(unit)
    _real_send(self, unit)
    self.in_flight[-1].row = row


gather_tags.TagsOnDevice.send = _send_keeping_row
# shard()'s consistency check reads its digests on the host; on a group with no host backend (NCCL alone) they
# travel on the device, whose values do not exist here: the mirror's digests are this rank's on every rank, which
# the host compares alike
consistency.host_values_device = lambda group: torch.device("cpu")

WIDTH = 8
STEPS = 3  # the first is set-up (first-call work); the others are counted


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Tiny(nn.Module):
    """Two units and a root with a tied embedding/head: sharing stays exercised."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


class TinyLogits(Tiny):
    """Tiny whose output is its logits (a pipeline stage's output, cut into micro-batches and merged)."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()


def _model(cls=Tiny):
    with torch.device("meta"):
        model = cls()
    return fake_parameters(model)


def _batch():
    return torch.zeros(2, 4, dtype=torch.long, device=DEVICE)


def _counted(one_step) -> StepChecks:
    """STEPS calls of `one_step`; the checks count over every one but the first (its set-up reads are
    answered, not counted)."""
    checks = StepChecks()
    for step in range(STEPS):
        with checks if step else StepChecks():
            one_step()
    return checks


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _step(model, optimizer, *, norms=True, clip=True, sharded=None):
    """One step: forward and backward, sw.clip_grad_norm_, sw.grad_norms and sw.param_norms, the update
    (`sharded`: the sharded model, where `model` is its compiled handle)."""
    def one_step():
        model(_batch()).backward()
        if clip:
            sw.clip_grad_norm_(sharded or model, 1.0)
        if norms:
            sw.grad_norms(sharded or model)
            sw.param_norms(sharded or model)
        optimizer.step()
        optimizer.zero_grad()
    return one_step


def train(strategy, *, shard=None, optim=None):
    model = _model()
    sw.shard(model, strategy=strategy, units=Block, **(shard or {}))
    return _counted(_step(model, (optim or _adamw)(model)))


def train_scaled(strategy):
    """fp16 with sw.LossScaler: its overflow verdict is the one host read a step makes (as torch's GradScaler)."""
    model = _model()
    sw.shard(model, strategy=strategy, units=Block, precision="fp16")
    optimizer, scaler = _adamw(model), sw.LossScaler(model)

    def one_step():
        scaler.scale(model(_batch())).backward()
        scaler.unscale_(optimizer)
        sw.clip_grad_norm_(model, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return _counted(one_step)


def train_in_backward(strategy):
    """sw.optimizer_in_backward: each unit stepped as its gradient lands (clipping is refused there)."""
    model = _model()
    sw.shard(model, strategy=strategy, units=Block, precision="bf16")
    optimizer = _adamw(model)
    sw.optimizer_in_backward(model, optimizer)
    return _counted(_step(model, optimizer, clip=False))


def train_deferred(strategy):
    """Built under sw.deferred_init (meta), materialized by shard(): the shards are born on the accelerator."""
    with sw.deferred_init():
        model = Tiny()
    sw.shard(model, strategy=strategy, units=Block)
    devices = {str(p.device) for p in model.parameters()}
    assert devices == {f"{DEVICE}:0"}, f"deferred init put the shards on {devices}, not the accelerator"
    return _counted(_step(model, _adamw(model)))


def train_compiled(strategy):
    """torch.compile of the sharded model (dynamo's eager backend: inductor has no code for a fake device)."""
    model = _model()
    sw.shard(model, strategy=strategy, units=Block)
    return _counted(_step(torch.compile(model, backend="eager"), _adamw(model), sharded=model))


def train_stage(strategy):
    """A ShardedStage run by torch's ScheduleGPipe, two micro-batches (one stage: no point-to-point traffic)."""
    model = _model(TinyLogits)
    sw.shard(model, strategy=strategy, units=Block)
    optimizer = _adamw(model)
    return _counted_pipeline_step(model, optimizer)


def _counted_pipeline_step(model, optimizer):
    """`model` as one GPipe stage of a one-rank pipe, a step of two micro-batches, clipped, counted."""
    from torch.distributed.pipelining import ScheduleGPipe

    from shardwise.pipeline.sharded import ShardedStage

    pipe = torch.distributed.new_group([0], use_local_synchronization=True)  # this rank's pipe: one stage
    stage = ShardedStage(model, 0, 1, torch.device(DEVICE, 0), group=pipe)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda logits, _: logits.square().mean())
    tokens = torch.zeros(4, 4, dtype=torch.long, device=DEVICE)

    def one_step():
        schedule.step(tokens, target=tokens)
        sw.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return _counted(one_step)


def _hybrid():
    from torch.distributed.device_mesh import init_device_mesh

    return {"mesh": init_device_mesh(DEVICE, (2, 2), mesh_dim_names=("replicate", "shard"))}


def _muon(model):
    """Muon (a whole-tensor step: Note [whole-tensor step]) on the blocks' matrices, AdamW on the rest."""
    named = list(model.named_parameters())
    return Optimizers([torch.optim.Muon([p for name, p in named if name.endswith("lin.weight")], lr=0.02),
                  torch.optim.AdamW([p for name, p in named if not name.endswith("lin.weight")], lr=1e-3)])


def side_stream_read(wait=True):
    """A buffer written on the current stream, read on a side stream, freed on the current stream after it
    waited for the side stream (`wait=False`: freed before the reader's event, the mutation)."""
    buffer = torch.empty(64, device=DEVICE).fill_(1.0)
    side, compute = torch.Stream(DEVICE), torch.accelerator.current_stream()
    side.wait_stream(compute)
    with side:
        sent = buffer * 2  # the reader: a collective's copy-in, say
        done = torch.Event(DEVICE)
        done.record(side)
    if wait:
        compute.wait_event(done)
    buffer.untyped_storage().resize_(0)
    del sent
    return StepChecks()


SCENARIOS = {}
for _strategy in ("zero1", "zero2", "zero3"):
    for _ws in (2, 4):
        SCENARIOS[f"{_strategy}-ws{_ws}"] = (_ws, lambda s=_strategy: train(s))
for _strategy in ("zero1", "zero3"):
    SCENARIOS[f"{_strategy}-bf16"] = (2, lambda s=_strategy: train(s, shard={"precision": "bf16"}))
    SCENARIOS[f"{_strategy}-muon"] = (2, lambda s=_strategy: train(s, optim=_muon))
for _strategy in ("zero2", "zero3"):
    SCENARIOS[f"{_strategy}-hybrid"] = (4, lambda s=_strategy: train(s, shard=_hybrid()))
SCENARIOS["zero2-fp16-scaler"] = (2, lambda: train_scaled("zero2"))
SCENARIOS["zero3-in-backward"] = (2, lambda: train_in_backward("zero3"))
SCENARIOS["zero3-deferred"] = (2, lambda: train_deferred("zero3"))
SCENARIOS["zero2-compiled"] = (2, lambda: train_compiled("zero2"))
SCENARIOS["zero3-stage"] = (2, lambda: train_stage("zero3"))
SCENARIOS["streams"] = (2, side_stream_read)
SCENARIOS["zero3-hpz"] = (4, lambda: train("zero3", shard={"reshard_after_forward": 2}))
SCENARIOS["zero3-compressed"] = (2, lambda: train("zero3", shard={"compression": {"gather": "int8", "reduce": "int4"}}))


def run(name: str) -> dict:
    base, _, mutation = name.partition(":")
    world_size, scenario, *backend = SCENARIOS[base]  # backend: fake_world's (the default, or MIXED)
    report = {"name": name, "ok": False, "syncs": {}, "host_tensors": {}, "collectives": [], "error": ""}
    fake_gpu.COLLECTIVE_ERRORS.clear()
    fake_streams.reset()
    try:
        with fake_world(world_size, *backend), fake_device(), fake_streams.StreamOrder():
            checks = scenario() if not mutation else MUTATIONS[mutation](scenario)
        report.update(ok=True, syncs=dict(checks.syncs), host_tensors=dict(checks.host_tensors),
                      device_ops=dict(checks.device_ops), **getattr(checks, "extra", {}))
    except Exception as error:  # reported, not raised: the test says which scenario failed and where
        frames = [f for f in traceback.extract_tb(error.__traceback__) if "/shardwise/" in f.filename
                  or "/tests/" in f.filename]
        report["error"] = f"{type(error).__name__}: {str(error)[:300]}\n" + "".join(traceback.format_list(frames[-8:]))
    report["collectives"] = list(fake_gpu.COLLECTIVE_ERRORS)
    report["hazards"] = list(fake_streams.HAZARDS)
    return report


@contextlib.contextmanager
def _cpu_mask(on_device=False):
    """grad_norms' row mask built on the CPU and handed to torch.where (the code before issue 58's fix), or
    copied to the device first (`on_device`: the first fix tried, a host-to-device copy per call)."""
    import shardwise.engine.optim.grads as grads

    def per_parameter_norms(model, read, norm_type):
        engine = sw.engine.protocol.engine_of(model)
        named = [(name, p, read(p)) for name, p in model.named_parameters() if read(p) is not None]
        norms = grads.tensor_norms([value for _, _, value in named], norm_type)
        rows = torch.tensor([getattr(p, "_sw_unit", None) is not None for _, p, _ in named],
                            device=norms.device if on_device else None)
        summed = torch.where(rows, norms.pow(norm_type), torch.zeros_like(norms))
        grads.all_reduce_sum(summed, engine.mesh.norm_group, "the per-parameter norms")
        norms = torch.where(rows, summed.pow(1.0 / norm_type), norms)
        return {name: norm for (name, _, _), norm in zip(named, norms)}

    with _patched(grads, "_per_parameter_norms", per_parameter_norms):
        yield


@contextlib.contextmanager
def _item_in_step():
    """A host read of the global gradient norm in every clip (as a logging line would do)."""
    import shardwise.engine.optim.grads as grads

    real = grads._global_norm

    def global_norm(*args):
        total = real(*args)
        total.item()
        return total

    with _patched(grads, "_global_norm", global_norm):
        yield


@contextlib.contextmanager
def _patched(owner, name, value):
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, real)


def _mutated(mutation):
    def run_mutated(scenario):
        with mutation():
            return scenario()
    return run_mutated


MUTATIONS = {"cpu-mask": _mutated(_cpu_mask), "copied-mask": _mutated(lambda: _cpu_mask(on_device=True)),
             "item": _mutated(_item_in_step), "free-early": lambda scenario: side_stream_read(wait=False)}

if __name__ == "__main__":
    for scenario_name in sys.argv[1:]:
        print("REPORT " + json.dumps(run(scenario_name)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # torch's autograd device threads of the fake accelerator abort at interpreter exit
