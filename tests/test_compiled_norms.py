"""Issue 44 items 3 and 4: every sw.* function takes the handle `torch.compile(model)` returns, with the
numbers the module itself gives; per-parameter norms of a sharded model are the whole tensors' (sw.grad_norms,
sw.param_norms), and a read that would give this rank's rows' value is refused (Note [rows read whole])."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice

MODEL = "reused_block"


def _values(named: dict) -> dict:
    return {name: value.detach().clone() for name, value in named.items()}


def _run(strategy: str, handle: str, mesh_shape=None) -> dict:
    """Two steps (one with a no_sync micro-batch), clipped, then every sw.* read. `handle`: "reassigned"
    (`model = torch.compile(model)`, every call takes it) or "separate" (compiled for the forward only)."""
    torch.manual_seed(0)
    spec = ZOO[MODEL]
    model = build(MODEL)
    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    sw.shard(model, strategy=strategy, units=spec.unit_class, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = torch.compile(model, backend="eager")
    if handle == "reassigned":
        model = compiled
    out = {"losses": [], "norms": []}
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        x, y = rank_slice(global_batch(spec, step, 8), rank, world)
        with sw.no_sync(model):
            compiled(x[:1], y[:1]).backward()
        loss = compiled(x[1:], y[1:])
        loss.backward()
        out["losses"].append(loss.item())
        out["grad_norms"] = _values(sw.grad_norms(model))
        out["norms"].append(sw.clip_grad_norm_(model, 0.5).item())
        optim.step()
        optim.zero_grad()
    out["param_norms"] = _values(sw.param_norms(model))
    out["full"] = _values(sw.full_parameters(model))
    out["describe"] = str(sw.describe(model))
    out["shard_info"] = sorted(sw.shard_info(model))
    return out


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_the_compiled_handle_gives_the_numbers_of_the_module(ranks, strategy):
    """Catches sw.clip_grad_norm_(torch.compile(model), ...) refused with a message telling the user to call
    the call just made, sw.describe of the handle printing "world size 1" and half the parameters, and
    sw.full_parameters of it returning this rank's rows under `_orig_mod.` names: reassigning the handle
    and keeping a separate one now give the same numbers, bitwise (the same computation)."""
    separate = ranks.run(_run, 2, strategy, "separate")
    reassigned = ranks.run(_run, 2, strategy, "reassigned")
    for a, b in zip(separate, reassigned):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        assert a["describe"] == b["describe"] and "world size 2" in a["describe"]
        assert a["shard_info"] == b["shard_info"]
        for key in ("grad_norms", "param_norms", "full"):
            assert a[key].keys() == b[key].keys() and not any("_orig_mod" in name for name in a[key])
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, name)


@pytest.mark.slow  # 4 ranks on 2 cores
def test_the_compiled_handle_on_a_2x2_mesh(ranks):
    """Catches the handle losing the mesh (norms summed over every rank, counting each row twice)."""
    separate = ranks.run(_run, 4, "zero3", "separate", (2, 2))
    reassigned = ranks.run(_run, 4, "zero3", "reassigned", (2, 2))
    for a, b in zip(separate, reassigned):
        assert a["losses"] == b["losses"] and a["norms"] == b["norms"]
        for name in a["grad_norms"]:
            assert torch.equal(a["grad_norms"][name], b["grad_norms"][name])


def test_estimate_and_describe_take_the_compiled_handle():
    """Catches sw.estimate / sw.describe cutting the OptimizedModule (one root unit of `_orig_mod.` names)."""
    with torch.device("meta"):
        model = build(MODEL)
    compiled = torch.compile(model, backend="eager")
    assert str(sw.describe(compiled, units=ZOO[MODEL].unit_class)) == str(sw.describe(model,
                                                                                   units=ZOO[MODEL].unit_class))
    a = sw.estimate(compiled, "zero3", 2, units=ZOO[MODEL].unit_class)
    b = sw.estimate(model, "zero3", 2, units=ZOO[MODEL].unit_class)
    assert a == b
    assert list(sw.EMA(compiled).average) == list(sw.EMA(model).average)  # the module's names, no _orig_mod.


def _norms_and_refusals(strategy: str) -> dict:
    torch.manual_seed(0)
    spec = ZOO[MODEL]
    model = build(MODEL)
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    model(x, y).backward()
    out = {"grad_norms": _values(sw.grad_norms(model)), "param_norms": _values(sw.param_norms(model)),
           "max_norms": _values(sw.grad_norms(model, norm_type=float("inf"))), "refused": {}}
    p = next(model.parameters())
    reads = {"p.grad.norm()": lambda: p.grad.norm(), "p.grad.pow(2).sum()": lambda: p.grad.pow(2).sum(),
             "p.grad.abs().max()": lambda: p.grad.abs().max(), "p.grad.data.sum(0)": lambda: p.grad.data.sum(0),
             "p.norm()": lambda: p.norm(), "p.grad.sum(dim=1)": lambda: p.grad.sum(dim=1),
             "p.grad.mul(2)": lambda: p.grad.mul(2), "torch.max(p.grad, p.grad)": lambda: torch.max(p.grad, p.grad)}
    for text, read in reads.items():
        try:
            read()
            out["refused"][text] = None
        except sw.ShardwiseError as error:
            out["refused"][text] = str(error)
    return out


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_per_parameter_norms_are_the_whole_tensors_and_local_reads_are_refused(ranks, strategy):
    """Catches per-layer logging that returned this rank's rows' value: p.grad.pow(2).sum(),
    p.grad.abs().max() and p.norm() gave each rank its own number (p.grad.norm() was refused with no
    alternative). sw.grad_norms / sw.param_norms equal one process's per-parameter norms (fp32: the
    p-norm of the ranks' row norms, 1e-6), and every read across rows raises naming them."""
    torch.manual_seed(0)
    spec = ZOO[MODEL]
    plain = build(MODEL)
    x, y = global_batch(spec, 0, 8)
    plain(x, y).backward()
    expected = {name: p.grad.norm() for name, p in plain.named_parameters()}
    expected_params = {name: p.detach().norm() for name, p in plain.named_parameters()}
    expected_max = {name: p.grad.abs().max() for name, p in plain.named_parameters()}
    for out in ranks.run(_norms_and_refusals, 2, strategy):
        assert out["grad_norms"].keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(out["grad_norms"][name], expected[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["param_norms"][name], expected_params[name], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out["max_norms"][name], expected_max[name], rtol=1e-5, atol=1e-6)
        for text in ("p.grad.norm()", "p.grad.pow(2).sum()", "p.grad.abs().max()", "p.grad.data.sum(0)", "p.norm()"):
            assert out["refused"][text] is not None and "sw.grad_norms(model)" in out["refused"][text], text
        for text in ("p.grad.sum(dim=1)", "p.grad.mul(2)", "torch.max(p.grad, p.grad)"):  # each row's, elementwise
            assert out["refused"][text] is None, out["refused"][text]
