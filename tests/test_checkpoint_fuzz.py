"""Fuzz: a real checkpoint's index.json and rank-file header, mutated (types, numbers, nesting,
names), must give a ShardwiseError or a load bitwise equal to the original: never another
exception, and never a changed model, optimizer, scheduler or sampler after an error. The same
mutant goes through sw.latest and every `shardwise ckpt` command. One process (world size 1)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch

import shardwise as sw
from helpers.damage import (
    RANK_FILE,
    copy,
    digest,
    edit_header,
    header_of,
    load_small,
    match_file_size,
    optimizers_of,
    same,
    snapshot,
    trained,
    trained_several,
)
from shardwise.checkpoint.interop import tools

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAMES = [RANK_FILE, "../" + RANK_FILE, "/etc/passwd", "index.json", "rank-00001-of-00002.safetensors", "a/b",
         "param/0.weight", "0.weight", "optim/0.weight/exp_avg",
         "optim1.whole/2.weight/row_var", "muon", "rng/torch", "F16", "I32", "BOOL", "F32", "",
         "sha256:" + "0" * 64, "__tensor__", "__tensor_bytes__", "float32", "uint8", "not base64!"]
NUMBERS = [0, 1, -1, 2, 7, 624, 2**31, 2**32, 2**63, 2**64, 2**80, -(2**63), 0.5, -0.0, 1e300, -1e300,
           math.inf, -math.inf, math.nan, 1e-300]
scalars = (st.none() | st.booleans() | st.sampled_from(NUMBERS) | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(NAMES) | st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=4), inner, max_size=3),
                      max_leaves=6)
# Fields a mutation aims at (a node under that key), else any node: an index has hundreds of crcs.
FIELDS = ["chunk", "rows", "shape", "dtype", "file", "key", "crcs", "bytes", "digest", "saved_at", "world_size",
          "lr", "betas", "weight_decay", "amsgrad", "step", "seed", "position", "epoch", "num_samples", "shuffle",
          "options", "scalars", "tensors", "slices", "params", "buffers", "files", "rng", "pos", "has_gauss",
          "numpy", "python", "cuda", "objects", "objects_by_rank", "extra", "scheduler", "optimizer",
          "param_groups", "aliases", "requires_grad", "id", "version", "format", "class", "strategy",
          "data_offsets", "__metadata__", "checkpoint_id", "step_size", "last_epoch", "_last_lr", "base_lrs",
          "whole", "optimizers", "name", "row_var", "col_var", "momentum_buffer"]
KINDS = ["replace", "delete", "similar", "similar", "similar", "wrap", "deep"]
mutation = st.tuples(st.sampled_from([*FIELDS, None]), st.integers(0, 2**31), st.sampled_from(KINDS), values,
                     st.integers(60, 70))
whole = st.sampled_from([True, True, True, False])  # mostly a whole (re-digested) index: its fields' checks


def _nodes(value, path=()):
    """Every (path, value) inside a parsed JSON value, the root first."""
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _nodes(child, (*path, key))


def _mutate(document, field, choice: int, kind: str, new, depth: int):
    """`document` with one node changed (one under key `field` when there is one); the root may be replaced."""
    nodes = list(_nodes(document))
    aimed = [node for node in nodes if node[0] and node[0][-1] == field]
    path, old = (aimed or nodes)[choice % len(aimed or nodes)]
    if kind == "similar":
        new = _similar(old, choice)
    elif kind == "wrap":
        new = [old] if choice % 2 else {"x": old}
    elif kind == "deep":
        for _ in range(depth):
            new = [new]
    if not path:
        return new
    parent = document
    for key in path[:-1]:
        parent = parent[key]
    if kind == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return document


def _similar(old, choice: int):
    """A value of `old`'s kind that type checks alone cannot refuse (a nearby number, another name)."""
    if type(old) is bool:
        return not old
    if type(old) is int:
        return [0, 0, 1, old + 1, old - 1, old * 2, -old, 2**32 - 1, float(old), str(old)][choice % 10]
    if type(old) is float:
        return [0.0, old * 10, -old, old + 1, int(old) if math.isfinite(old) else 0][choice % 5]
    if isinstance(old, str):
        return NAMES[choice % len(NAMES)]
    if isinstance(old, list) and old:
        return [old[:-1], old[1:], old[::-1], old + old[-1:]][choice % 4]
    if isinstance(old, dict) and old:
        return {key: old[key] for key in list(old)[: -1]}
    return NUMBERS[choice % len(NUMBERS)]


@pytest.fixture(scope="module")
def original(small):
    """The `small` checkpoint and what loading it writes (and how to build the parts it loads into)."""
    return small, snapshot(load_small(small)), trained


@pytest.fixture(scope="module")
def original_several(several):
    """The `several` checkpoint (two optimizers, whole records: Note [optimizer records]) likewise."""
    return several, snapshot(load_small(several, trained_several(seed=1))), trained_several


def _check(checkpoint: Path, mutant: Path, reference: dict, whole: bool, make=trained) -> None:
    """The fuzz's requirement on one mutant (see the module docstring). `whole`: the index was
    given a matching digest, so a load that succeeds may legitimately differ (a changed lr): it
    must then train a step without a TypeError (a value that fails later is refused up front)."""
    parts = make(seed=1)
    before = snapshot(parts)
    try:
        load_small(mutant, parts)
    except sw.ShardwiseError:
        assert same(snapshot(parts), before), "a refused load changed what it loads into"
    else:
        if not whole:
            assert same(snapshot(parts), reference), "a damaged checkpoint loaded other values"
        else:
            _train_a_step(parts)
    assert sw.latest(mutant.parent) in (None, mutant)
    for command in (lambda: tools.inspect(mutant), lambda: tools.diff(mutant, checkpoint, values=True),
                    lambda: tools.export_checkpoint(mutant, mutant.parent / "out.safetensors")):
        try:
            command()
        except sw.ShardwiseError:
            pass


def _train_a_step(parts) -> None:
    model, optim, scheduler, sampler = parts
    try:
        model(torch.randn(5, 4)).sum().backward()
        for one in optimizers_of(optim).values():
            one.step()
        scheduler.step()
        list(sampler)
    except TypeError as error:
        raise AssertionError(f"a loaded value failed later: {error}") from error
    except Exception:  # noqa: BLE001 - a consistent but odd setting (amsgrad switched on) is not a type error
        pass


def _fuzz_index(original, mutations: list, whole: bool) -> None:
    checkpoint, reference, make = original
    with tempfile.TemporaryDirectory() as tmp:
        mutant = copy(checkpoint, Path(tmp) / "ckpt")
        index = json.loads((mutant / "index.json").read_text())
        for field, choice, kind, new, depth in mutations:
            index = _mutate(index, field, choice, kind, new, depth)
        if whole and isinstance(index, dict):
            try:
                index["digest"] = digest(index)
            except (RecursionError, ValueError):
                pass
        try:
            text = json.dumps(index)
        except (RecursionError, ValueError):
            return
        (mutant / "index.json").write_text(text)
        _check(checkpoint, mutant, reference, whole, make)


def _fuzz_header(original, mutations: list, fix_index: bool) -> None:
    checkpoint, reference, make = original
    with tempfile.TemporaryDirectory() as tmp:
        mutant = copy(checkpoint, Path(tmp) / "ckpt")
        header = header_of(mutant / RANK_FILE)
        for field, choice, kind, new, depth in mutations:
            header = _mutate(header, field, choice, kind, new, depth)
        try:
            encoded = json.dumps(header, separators=(",", ":")).encode()
        except (RecursionError, ValueError):
            return
        edit_header(mutant / RANK_FILE, lambda _: encoded)
        if fix_index:  # the index agrees with the new file's size: the header's own checks must hold
            match_file_size(mutant)
        _check(checkpoint, mutant, reference, False, make)


# make test's share (derandomized: the same mutants every run, about 30 s on 2 cores); the `_long` ones below run
# 2,100 random mutants more under `make test-all`.
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


@settings(FUZZ, max_examples=100)
@given(st.lists(mutation, min_size=1, max_size=3), whole)
def test_fuzz_index(original, mutations, whole):
    """Catches any index.json mutation that raises something other than a ShardwiseError, loads
    other values from a damaged index, or changes the model after refusing it."""
    _fuzz_index(original, mutations, whole)


@settings(FUZZ, max_examples=50)
@given(st.lists(mutation, min_size=1, max_size=2), st.booleans())
def test_fuzz_header(original, mutations, fix_index):
    """Catches any rank-file header mutation that raises something other than a ShardwiseError or
    loads other values (a dtype, a shape, an offset, metadata changed)."""
    _fuzz_header(original, mutations, fix_index)


@settings(FUZZ, max_examples=60)
@given(st.lists(mutation, min_size=1, max_size=3), whole)
def test_fuzz_index_several_optimizers(original_several, mutations, whole):
    """As test_fuzz_index on a checkpoint of two optimizers by name whose state has whole records
    (Adafactor's row and column factors): their shapes, dtypes, slices, names, the list itself."""
    _fuzz_index(original_several, mutations, whole)


@settings(FUZZ, max_examples=30)
@given(st.lists(mutation, min_size=1, max_size=2), st.booleans())
def test_fuzz_header_several_optimizers(original_several, mutations, fix_index):
    """As test_fuzz_header on the checkpoint of two optimizers with whole records."""
    _fuzz_header(original_several, mutations, fix_index)


@pytest.mark.slow
@settings(FUZZ, derandomize=False, max_examples=1500)
@given(st.lists(mutation, min_size=1, max_size=4), whole)
def test_fuzz_index_long(original, mutations, whole):
    """As test_fuzz_index, 1,500 random (not derandomized) mutants."""
    _fuzz_index(original, mutations, whole)


@pytest.mark.slow
@settings(FUZZ, derandomize=False, max_examples=600)
@given(st.lists(mutation, min_size=1, max_size=3), st.booleans())
def test_fuzz_header_long(original, mutations, fix_index):
    """As test_fuzz_header, 600 random mutants."""
    _fuzz_header(original, mutations, fix_index)
