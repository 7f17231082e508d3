"""Any optimizer's state in a checkpoint (Note [optimizer records] in checkpoint/optim_state.py).

Muon + AdamW (two optimizers, Muon's momentum whole on one owner rank each), Hugging Face's
Adafactor (row and column factors: not parameter-shaped) and BlockQuant (tests/helpers/optim_ckpt.py:
int8 codes and a scale per block) were refused by sw.save on a sharded model, and Adafactor's
factors under ddp and at world size 1 too: a resume rebuilt them from zero, another run. Each is
saved at step 3 by 2 ranks, loaded into a fresh model (another seed) in a new process group, and
trained 3 more steps: bitwise the uninterrupted run at the same strategy and world size (the code is
deterministic there), and at world size 1 and 4 and under another strategy within the fp32 parity bound
(1e-5 / 1e-6), or for Muon, whose Newton-Schulz runs in bf16, within what DDP achieves across world sizes
(Note [bf16 bound], helpers/bounds.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import shardwise as sw
from helpers.bounds import bound_for
from helpers.optim_ckpt import load_into, load_then_continue, save_then_continue
from shardwise.testing import RunResult, assert_close_runs

STRATEGIES = ["zero1", "zero2", "zero3", "ddp"]


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """Checkpoints by (optimizer, strategy), saved once per module at world size 2, with the run after."""
    cache = {}

    def get(name, strategy):
        if (name, strategy) not in cache:
            path = str(tmp_path_factory.mktemp("optim") / f"{name}-{strategy}")
            cache[name, strategy] = (path, ranks.run(save_then_continue, 2, name, strategy, path, timeout=180)[0])
        return cache[name, strategy]

    return get


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", ["muon", "hf_adafactor"])
def test_resume_is_bitwise(ranks, saved, name, strategy):
    """Catches a whole-tensor optimizer's state refused, dropped or put on the wrong rank on resume:
    Muon's momentum on a rank that does not own the matrix, Adafactor's factors rebuilt from zero,
    the two optimizers' states crossed. Steps 3-5 after the load must be bitwise the saving run's."""
    path, expected = saved(name, strategy)
    for rank, got in enumerate(ranks.run(load_then_continue, 2, name, strategy, path, timeout=180)):
        assert got["losses"] == expected["losses"], f"{name} {strategy} rank {rank}: losses after resume differ"
        for param, value in expected["final"].items():
            assert torch.equal(got["final"][param], value), f"{name} {strategy} rank {rank}: {param} differs"


# (optimizer, saved by, loaded by, at world size)
RESHARDS = [
    ("muon", "zero2", "none", 1),
    ("muon", "zero3", "zero2", 4),
    ("muon", "ddp", "zero3", 4),
    ("hf_adafactor", "zero3", "zero1", 1),
    ("hf_adafactor", "zero2", "zero3", 4),
    ("hf_adafactor", "ddp", "zero2", 4),
    ("blockq", "zero2", "none", 1),
    ("blockq", "zero3", "zero1", 4),
]


@pytest.mark.parametrize("name,a,b,m", RESHARDS)
def test_load_at_another_world_size(ranks, saved, name, a, b, m):
    """Catches whole state read by the old owner map instead of the new one (a rank stepping a
    matrix with no momentum), factors or per-block scales not found at another world size, and
    parameter-shaped state (Muon's momentum, BlockQuant's int8 codes) read from the wrong rows. Every
    route changes the world size: Muon is held to Note [bf16 bound] (its Newton-Schulz's bf16 roundings
    flip with the gradient's summation order: 1.17e-4 on some hosts' kernels), the others to fp32's."""
    path, expected = saved(name, a)
    for rank, got in enumerate(ranks.run(load_then_continue, m, name, b, path, timeout=180)):
        try:
            assert_close_runs(RunResult(expected["losses"], [], expected["final"]),
                              RunResult(got["losses"], [], got["final"]), **bound_for(name))
        except AssertionError as error:
            raise AssertionError(f"{name}: saved by {a} on 2 ranks, loaded by {b} on {m} (rank {rank})\n{error}")


def test_block_quantized_state_round_trips_bitwise(ranks, saved):
    """Catches per-block scales (another shape than the parameter's) or int8 codes lost or cast."""
    path, expected = saved("blockq", "zero2")
    for got in ranks.run(load_then_continue, 2, "blockq", "zero2", path, timeout=180):
        assert got["losses"] == expected["losses"]
        assert all(torch.equal(got["final"][k], v) for k, v in expected["final"].items())


def test_another_optimizer_class_is_refused_naming_both(ranks, saved):
    """Catches one class's state loaded into another (Adafactor's factors read as BlockQuant's)."""
    path, _ = saved("hf_adafactor", "zero2")
    for message in ranks.run(load_into, 2, path, "zero2", "blockq", timeout=120):
        assert "saved from Adafactor" in message and "into BlockQuant" in message, message


def test_another_number_of_optimizers_is_refused(ranks, saved):
    """Catches a checkpoint of Muon + AdamW loaded into one optimizer (or one into two)."""
    path, _ = saved("muon", "zero2")
    for message in ranks.run(load_into, 2, path, "zero2", "hf_adafactor", timeout=120):
        assert "holds the state of 2 optimizer(s) [muon: Muon, adamw: AdamW]" in message, message
        assert "was given 1" in message, message


# ---- several optimizers, one process ----------------------------------------------------------


def test_owner_map_is_recorded_shown_and_checked(ranks, saved):
    """Catches the whole-tensor owner map not recorded in the index, not shown by `shardwise ckpt inspect`,
    or not checked on load (Note [recorded owners]): a Muon built with its matrices in another order puts
    their momenta on other owners at the same shard group size, which must be refused, not loaded."""
    from shardwise.checkpoint.schema import read_index
    from shardwise.checkpoint.tools import inspect

    path, _ = saved("muon", "zero2")
    muon = read_index(Path(path)).optimizers[0]
    assert muon.owner_world == 2 and sorted(set(muon.owners.values())) == [0, 1], muon.owners
    assert any("whole-tensor owners (shard group of 2): rank 0" in line for line in inspect(path)[0])
    for message in ranks.run(load_into, 2, path, "zero2", "muon_swapped", timeout=120):
        assert "whole-tensor owners differ from the ones recorded" in message and "saved on rank" in message, message


def _two(seed: int = 0):
    """A tiny model, Muon on its first matrix and torch's Adafactor (row and column factors) on
    the rest, after two steps: two optimizers of two classes, one with whole records."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    muon = torch.optim.Muon([model[0].weight], lr=0.02)
    factored = torch.optim.Adafactor([model[0].bias, model[2].weight, model[2].bias], lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).sum().backward()
        muon.step()
        factored.step()
    return model, muon, factored


def _states(*optims) -> list:
    return [{i: {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
             for i, state in enumerate(o.state.values())} for o in optims]


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[i].keys() == y[i].keys() and all(
            torch.equal(torch.as_tensor(x[i][k]), torch.as_tensor(y[i][k])) for k in x[i]) for i in x)
        for x, y in zip(a, b))


@pytest.mark.parametrize("form", ["list", "dict"])
def test_several_optimizers_round_trip(tmp_path, form):
    """Catches a second optimizer's state dropped, or two optimizers' states crossed."""
    model, muon, factored = _two()
    given = [muon, factored] if form == "list" else {"muon": muon, "factored": factored}
    sw.save(tmp_path / "ckpt", model, given)
    fresh, muon2, factored2 = _two(seed=1)
    assert not _equal(_states(muon, factored), _states(muon2, factored2))
    sw.load(tmp_path / "ckpt", fresh, [muon2, factored2] if form == "list" else {"factored": factored2,
                                                                                 "muon": muon2})
    assert _equal(_states(muon, factored), _states(muon2, factored2))
    assert any(v.dim() > 0 and v.shape != p.shape for p, s in factored2.state.items() for v in s.values()
               if torch.is_tensor(v)), "no factor was saved whole: the test lost its point"


def test_several_optimizers_save_async_keep_last_and_cli(tmp_path):
    """Catches sw.save_async or keep_last dropping a second optimizer, and `shardwise ckpt
    inspect`/`diff` showing one optimizer of several."""
    from shardwise.checkpoint import tools

    model, muon, factored = _two()
    for step in (1, 2):
        sw.save_async(tmp_path / f"step-{step}", model, {"muon": muon, "factored": factored},
                      keep_last=1).wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]
    fresh, muon2, factored2 = _two(seed=1)
    sw.load(sw.latest(tmp_path), fresh, {"muon": muon2, "factored": factored2})
    assert _equal(_states(muon, factored), _states(muon2, factored2))
    lines, ok = tools.inspect(tmp_path / "step-2")
    text = "\n".join(lines)
    assert ok and "optimizer 'muon' Muon" in text and "optimizer 'factored' Adafactor" in text, text
    assert "whole state tensors" in text, text
    sw.save(tmp_path / "one", model, factored)
    lines, same = tools.diff(tmp_path / "step-2", tmp_path / "one")
    assert "optimizer state: muon: Muon, factored: Adafactor vs Adafactor" in "\n".join(lines), lines


def test_optimizer_as_keyword_says_how_to_save_several(tmp_path):
    """Catches `sw.save(p, model, adamw, muon=muon)` failing on "a non-string key 0" with no way out."""
    model, muon, factored = _two()
    with pytest.raises(sw.ShardwiseError, match=r"muon= is an optimizer.*\[muon, adamw\]"):
        sw.save(tmp_path / "ckpt", model, factored, muon=muon)
    assert not (tmp_path / "ckpt").exists()


def test_other_names_are_refused(tmp_path):
    """Catches optimizers given under other names loading by position into the wrong one."""
    model, muon, factored = _two()
    sw.save(tmp_path / "ckpt", model, {"muon": muon, "factored": factored})
    fresh, muon2, factored2 = _two(seed=1)
    with pytest.raises(sw.ShardwiseError, match="holds optimizers named"):
        sw.load(tmp_path / "ckpt", fresh, {"muon": muon2, "adafactor": factored2})


@pytest.mark.parametrize("owners, problem", [({"shard_world": 2, "map": {"0.weight": 1}}, None),
                                             ({"shard_world": 2, "map": {"0.weight": 2}}, "not an integer in 0..1"),
                                             ({"shard_world": 1, "map": {}}, "not an integer in 2.."),
                                             ({"shard_world": 2, "map": {"9.weight": 0}}, "do not list"),
                                             ({"shard_world": 2, "map": []}, "not an object")])
def test_a_forged_owner_map_is_refused_naming_the_field(tmp_path, owners, problem):
    """Catches a recorded owner map (Note [recorded owners]) read without its checks: an owner outside the
    shard group, a group of one, a parameter the index does not hold, a map of another type."""
    from helpers.damage import edit_index, save_small, trained_several
    from shardwise.checkpoint.schema import read_index

    path = save_small(tmp_path / "ckpt", trained_several)
    edit_index(path, lambda index: index["optimizers"][0].update(owners=owners))
    if problem is None:
        assert read_index(path).optimizers[0].owners == {"0.weight": 1}
        return
    with pytest.raises(sw.ShardwiseError, match="owners") as error:
        read_index(path)
    assert problem in str(error.value), str(error.value)
