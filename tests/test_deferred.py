"""Deferred init: nothing allocated at build time; shard() brings each rank's rows to life with
exactly the values eager init gives, at any world size, within shards + one unit of memory."""

import json
import os
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import shardwise as sw
from helpers.launch import run
from shardwise.models.zoo import ZOO


def _deferred_rows_equal_eager(strategy, name, mesh_shape=None):
    spec = ZOO[name]
    torch.manual_seed(7)
    eager = dict(spec.build().named_parameters())
    after_eager = torch.rand(3)
    torch.manual_seed(7)
    with sw.deferred_init():
        model = spec.build()
    allocated_at_build = {p.device.type for p in model.parameters()}
    kwargs = {"find_unused_parameters": spec.skips_params} if strategy == "ddp" else {"units": spec.unit_class}
    if mesh_shape is not None:  # hybrid sharding: rows over the "shard" dimension (Note [mesh info])
        kwargs["mesh"] = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    sw.shard(model, strategy=strategy, **kwargs)
    after_deferred = torch.rand(3)
    mismatched = []
    # Compare this rank's own rows with the same rows of the eager model: a gather cannot hide it.
    for param_name, info in sw.shard_info(model).items():
        full = eager[param_name].detach()
        rows = slice(info.row_start, info.row_end)
        expected = full.reshape(-1)[rows] if full.dim() == 0 else full[rows]
        if not torch.equal(info.rows.reshape(expected.shape), expected):
            mismatched.append(param_name)
    return allocated_at_build, mismatched, torch.equal(after_eager, after_deferred)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zero3_deferred_values_equal_eager(ranks, name, world_size):
    """Catches deferred init drawing random numbers in another order than eager init (values
    would then depend on how the model was built or on the world size), a constant such as
    torch.tensor(1.0) lost on the meta device, or the RNG stream left elsewhere afterwards."""
    for allocated, mismatched, rng_continues in ranks.run(_deferred_rows_equal_eager, world_size, "zero3", name):
        assert allocated == {"meta"}
        assert mismatched == [] and rng_continues


@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_deferred_values_equal_eager_on_a_mesh(ranks, strategy, mesh_shape):
    """Catches deferred init under a replicate x shard mesh keeping rows cut over every rank of the mesh, or
    replicas that replay to different values: each rank's rows equal the eager model's same rows."""
    for allocated, mismatched, rng_continues in ranks.run(_deferred_rows_equal_eager, 4, strategy, "gpt", mesh_shape):
        assert allocated == {"meta"}
        assert mismatched == [] and rng_continues


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_other_strategies_deferred_values_equal_eager(ranks, strategy):
    """Catches a strategy that materializes a deferred model with zeros or garbage."""
    for _, mismatched, _ in ranks.run(_deferred_rows_equal_eager, 2, strategy, "gpt"):
        assert mismatched == []


def _with_init_fn():
    def init_fn(model):
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.5)
    torch.manual_seed(3)
    eager = ZOO["reused_block"].build()
    init_fn(eager)
    torch.manual_seed(3)
    with sw.deferred_init():
        model = ZOO["reused_block"].build()
    sw.shard(model, strategy="zero3", init_fn=init_fn)
    full = sw.full_parameters(model)
    return [n for n, p in eager.named_parameters() if not torch.equal(p.detach(), full[n])]


def test_user_init_fn_is_replayed_after_construction(ranks):
    """Catches an init_fn that is ignored, or run in an order that changes its random draws."""
    assert ranks.run(_with_init_fn, 2) == [[], []]


def test_model_on_meta_outside_deferred_init_gets_a_clear_error(ranks):
    """Catches a plain meta-device model being sharded into zeros without a word."""
    with pytest.raises(AssertionError, match="not built inside `sw.deferred_init\\(\\)`"):
        ranks.run(_shard_plain_meta_model, 1)


def _shard_plain_meta_model():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    sw.shard(model, strategy="zero3")


class _UnwrittenWeight(nn.Module):
    """A weight `torch.empty` made and nothing wrote (every nn.Linear under transformers' `no_init_weights`, as
    `sw.from_pretrained` builds it), beside a layer whose init draws."""

    def __init__(self):
        super().__init__()
        self.unwritten = nn.Parameter(torch.empty(96, 40))
        self.drawn = nn.Linear(8, 8)


def _shapes_made_while_sharding(strategy):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Factories(TorchDispatchMode):
        shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket.__name__ in {"empty", "empty_strided", "zeros", "new_empty", "empty_like"}:
                Factories.shapes.add(tuple(out.shape))
            return out

    torch.manual_seed(5)
    eager = _UnwrittenWeight().drawn.weight.detach()
    after_eager = torch.rand(3)
    torch.manual_seed(5)
    with sw.deferred_init():
        model = _UnwrittenWeight()
    with Factories():
        sw.shard(model, strategy=strategy)
    full = sw.full_parameters(model)
    return ((96, 40) in Factories.shapes, torch.count_nonzero(full["unwritten"]).item(),
            torch.equal(full["drawn.weight"], eager), torch.equal(torch.rand(3), after_eager))


@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_unwritten_weight_is_never_made_whole(ranks, strategy):
    """Catches shard() making a full tensor of a deferred weight nothing wrote, only to keep its rows (Note [rows
    without a full tensor]: 762 MiB made and freed per rank by sw.from_pretrained's Llama), or skipping it in a way
    that moves the random stream or the drawn layer's values. Its rows are zeros, as ddp's full copy."""
    made_whole, nonzero, drawn_equal, rng_continues = ranks.run(_shapes_made_while_sharding, 2, strategy)[0]
    assert made_whole == (strategy == "ddp")  # ddp keeps every full parameter: its own, not the replay's
    assert nonzero == 0 and drawn_equal and rng_continues


PEAK_SCRIPT = textwrap.dedent("""
    import faulthandler, json, pathlib, resource, signal, sys, torch, shardwise as sw
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a timed-out launch asks each rank for its stacks
    from shardwise.engine import engine_of
    from shardwise.models.gpt import GPT, GPTConfig, Block
    torch.set_num_threads(1)
    sw.init(timeout=240)  # past the launch's 200 s: a rank that hangs is caught with every rank's stacks
    config = GPTConfig(vocab_size=8192, seq_len=128, d_model=512, n_layers=8, n_heads=8)
    # One-off process costs are not the model's: the first meta-device op imports torch's
    # meta kernels (~30 MB), the first shard() its collectives' and hooks' machinery (~5 MB).
    # A tiny model pays them before the baseline is taken.
    with sw.deferred_init():
        warm_up = torch.nn.Linear(2, 2)
    sw.shard(warm_up, strategy="zero3")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with sw.deferred_init():
        model = GPT(config)
    sw.shard(model, strategy="zero3", units=Block)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    units = engine_of(model).units
    shards = sum(u.shard_flat.numel() * 4 for u in units)
    largest_unit = max(u.full_flat.numel() * 4 for u in units)
    with torch.device("meta"):  # its size only: nothing allocated, no init drawn
        full = sum(p.numel() for p in GPT(config).parameters()) * 4
    # One file per rank: four ranks printing to one pipe can interleave their lines.
    report = dict(rank=sw.get_rank(), growth=peak - before, shards=shards, unit=largest_unit, full=full)
    pathlib.Path(sys.argv[1], f"rank{sw.get_rank()}.json").write_text(json.dumps(report))
    sw.shutdown()
""")


def test_deferred_zero3_peak_is_shards_plus_one_unit(tmp_path):
    """Catches shard() materializing the whole model (or several units) on some rank before
    keeping its rows: the model is 4x one rank's share; each rank's peak RSS growth while
    building and sharding must stay within 110% of its shards plus one unit.

    Run in fresh processes (ru_maxrss is a lifetime peak) with MALLOC_MMAP_THRESHOLD_=65536,
    so freed blocks leave RSS (glibc keeps them resident otherwise)."""
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
    launch = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(script),
                  str(tmp_path)], tmp_path / "launch.log", timeout=200, env=env)
    assert launch.ok, launch.tail(80)
    reports = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    assert len(reports) == 4
    full = max(r["full"] for r in reports)
    for r in reports:
        assert r["shards"] * 4 <= full * 1.01  # the model really is 4x one rank's share
        assert r["growth"] <= 1.10 * (r["shards"] + r["unit"]), r
