"""Any optimizer's state in a checkpoint (Note [optimizer records] in checkpoint/format/optim_state.py).

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
        assert "saved from transformers.optimization.Adafactor" in message, message
        assert "into helpers.optim_ckpt.BlockQuant" in message, message


def test_another_number_of_optimizers_is_refused(ranks, saved):
    """Catches a checkpoint of Muon + AdamW loaded into one optimizer (or one into two)."""
    path, _ = saved("muon", "zero2")
    for message in ranks.run(load_into, 2, path, "zero2", "hf_adafactor", timeout=120):
        assert "holds the state of 2 optimizer(s) [muon: torch.optim.Muon, adamw: torch.optim.adamw.AdamW]" \
            in message, message
        assert "was given 1" in message, message


# ---- several optimizers, one process ----------------------------------------------------------


def test_owner_map_is_recorded_shown_and_checked(ranks, saved):
    """Catches the whole-tensor owner map not recorded in the index, not shown by `shardwise ckpt inspect`,
    not adopted or not checked on load (Note [recorded owners]): a fresh Muon built with its matrices in
    another order would put their momenta on other owners at the same shard group size; it takes the
    recorded map and resumes bitwise, while one that has stepped (its owners taken) is refused, not loaded."""
    from shardwise.checkpoint.format.schema import read_index
    from shardwise.checkpoint.interop.tools import inspect

    path, _ = saved("muon", "zero2")
    muon = read_index(Path(path)).optimizers[0]
    assert muon.owner_world == 2 and sorted(set(muon.owners.values())) == [0, 1], muon.owners
    assert any("whole-tensor owners (shard group of 2): rank 0" in line for line in inspect(path)[0])
    path, expected = saved("muon", "zero2")
    for got in ranks.run(load_then_continue, 2, "muon_swapped", "zero2", path, timeout=180):
        assert got["losses"] == expected["losses"], "a fresh Muon in another order: losses after resume differ"
        assert all(torch.equal(got["final"][name], value) for name, value in expected["final"].items())
    for message in ranks.run(load_into, 2, path, "zero2", "muon_swapped", True, timeout=120):
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
    from shardwise.checkpoint.interop import tools

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
    assert ok and "optimizer 'muon' torch.optim.Muon" in text and "optimizer 'factored' torch.optim.Adafactor" in text
    assert "whole state tensors" in text, text
    sw.save(tmp_path / "one", model, factored)
    lines, same = tools.diff(tmp_path / "step-2", tmp_path / "one")
    assert "optimizer state: muon: torch.optim.Muon, factored: torch.optim.Adafactor vs torch.optim.Adafactor" \
        in "\n".join(lines), lines


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
    from shardwise.checkpoint.format.schema import read_index

    path = save_small(tmp_path / "ckpt", trained_several)
    edit_index(path, lambda index: index["optimizers"][0].update(owners=owners))
    if problem is None:
        assert read_index(path).optimizers[0].owners == {"0.weight": 1}
        return
    with pytest.raises(sw.ShardwiseError, match="owners") as error:
        read_index(path)
    assert problem in str(error.value), str(error.value)


# ---- the optimizer a state belongs to (Note [optimizer class] in optim_plan.py) ------------------


class _LookalikeAdafactor(torch.optim.Optimizer):
    """Saves under torch's Adafactor's module, name, group keys and state keys, with other shapes:
    `row_var` [R, C] and `col_var` [C, C] where torch's are [R, 1] and [1, C]."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr, "beta2_decay": -0.8, "eps": (None, 1e-3), "d": 1.0,
                                  "weight_decay": 0.0, "foreach": None, "maximize": False})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), row_var=torch.zeros_like(p),
                                 col_var=p.new_zeros(p.shape[1], p.shape[1]))
                state["step"] += 1
                state["row_var"].add_(p.grad.square())
                state["col_var"].add_(p.grad.T @ p.grad)
                p.add_(p.grad, alpha=-group["lr"])


_LookalikeAdafactor.__module__, _LookalikeAdafactor.__qualname__ = "torch.optim", "Adafactor"


def _stepped(make):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5, bias=False)
    optim = make(model.parameters())
    model(torch.randn(4, 3)).square().sum().backward()
    optim.step()
    return model, optim


def test_whole_state_of_other_shapes_is_refused(tmp_path):
    """Catches a look-alike Adafactor's state (row_var [R, C], col_var [C, C]) loaded into torch's
    Adafactor because the names matched: its next step broadcast the wrong factors silently. The shapes
    are checked against the ones torch's class makes (a dry step), naming the key and both shapes."""
    model, optim = _stepped(_LookalikeAdafactor)
    sw.save(tmp_path / "ckpt", model, optim)
    fresh, torch_adafactor = _stepped(lambda params: torch.optim.Adafactor(params, lr=1e-2))
    torch.optim.lr_scheduler.StepLR(torch_adafactor, 10)  # patches torch_adafactor.step on the instance
    before = fresh.weight.detach().clone()
    with pytest.raises(sw.ShardwiseError) as caught:
        sw.load(tmp_path / "ckpt", fresh, torch_adafactor)
    assert torch.equal(fresh.weight, before), "the dry step stepped the real parameters"
    message = str(caught.value)
    assert "'row_var' [5, 3] where a torch.optim.Adafactor has [5, 1]" in message, message
    assert "'col_var' [3, 3] where a torch.optim.Adafactor has [1, 3]" in message, message
    sw.save(tmp_path / "good", fresh, torch_adafactor)  # torch's own shapes still load
    sw.load(tmp_path / "good", *_stepped(lambda params: torch.optim.Adafactor(params, lr=1e-2)))


def _hf_adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False)


def _torch_adafactor(params):
    return torch.optim.Adafactor(params, lr=1e-2)


@pytest.mark.parametrize("saved_with,loaded_with", [(_hf_adafactor, _torch_adafactor),
                                                    (_torch_adafactor, _hf_adafactor)])
def test_a_class_of_the_same_name_from_elsewhere_is_refused(tmp_path, saved_with, loaded_with):
    """Catches transformers' Adafactor state loaded into torch.optim.Adafactor because the bare names
    matched (its `clip_threshold`, `relative_step`... were added to torch's groups and the next step raised
    "state_steps argument must contain a list of singleton tensors"), and the other direction refused as
    "edited or damaged". The qualified class is recorded and compared; a checkpoint that records a bare
    name (an earlier shardwise) is refused on the group settings the loading optimizer lacks, named."""
    from helpers.damage import edit_index

    model, optim = _stepped(saved_with)
    sw.save(tmp_path / "ckpt", model, optim)
    fresh, other = _stepped(loaded_with)
    with pytest.raises(sw.ShardwiseError, match="one optimizer class's state means nothing to another") as caught:
        sw.load(tmp_path / "ckpt", fresh, other)
    assert "transformers.optimization.Adafactor" in str(caught.value), caught.value
    edit_index(tmp_path / "ckpt", lambda index: index["optimizer"].update({"class": "Adafactor"}))
    unknown = "beta1, clip_threshold, decay_rate" if saved_with is _hf_adafactor else "beta2_decay, d, foreach"
    with pytest.raises(sw.ShardwiseError, match=f"settings a .* does not have \\({unknown}"):
        sw.load(tmp_path / "ckpt", fresh, other)
