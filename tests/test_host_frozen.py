"""`shard(..., frozen="host")`: one read-only copy of the frozen weights per host (Note [host copy]).

Checked from the kernel's side (/proc/self/smaps: the same file, the same inode, a PSS that
counts each page once), against a single process (the trainable parameters and the losses at
DESIGN's fp32 bound), and by trying every way of writing a shared weight."""

from __future__ import annotations

import copy
import io
import os
import zlib

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from helpers.parity import check_parity
from shardwise.engine.memory.host_param import is_host_shared
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, rank_slice

BASE = 256  # a frozen 256x256 base: 64 pages, enough for PSS to show how many ranks share them


def _base_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(BASE, BASE), nn.Tanh(), nn.Linear(BASE, 4))
    model[0].requires_grad_(False)
    return model


def _mapping_of(ptr: int) -> dict:
    """The /proc/self/smaps entry of the mapping that holds address `ptr`."""
    entry = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                entry = {"lo": lo, "hi": hi, "perms": fields[1], "dev": fields[3], "inode": int(fields[4]),
                         "path": " ".join(fields[5:])} if lo <= ptr < hi else None
            elif entry is not None and fields[0] in ("Rss:", "Pss:"):
                entry[fields[0][:-1].lower()] = int(fields[1])
                if "rss" in entry and "pss" in entry:
                    return entry
    return {}


def _shared_pages(strategy):
    model = _base_model()
    sw.shard(model, strategy=strategy, frozen="host")
    weight = model[0].weight
    assert is_host_shared(weight) and is_host_shared(model[0].bias)
    total = float(weight.sum())  # touch every page of the mapping on every rank
    dist.barrier()
    mapping = _mapping_of(weight.data_ptr())
    dist.barrier()  # no rank unmaps before every rank has read its smaps
    return mapping, total


@pytest.mark.parametrize("strategy, world_size", [("ddp", 2), ("zero3", 4)])
def test_ranks_map_one_copy_of_the_frozen_weights(ranks, strategy, world_size):
    """Catches a host copy that is really one copy per rank (a private load, a copy-on-write
    mapping written once, a clone at shard()): the ranks' weights must lie in one mapping of the
    same file (same device and inode), read-only, whose pages each rank's PSS counts 1/N of."""
    results = ranks.run(_shared_pages, world_size, strategy)
    mappings = [m for m, _ in results]
    assert all(m and "shardwise-host" in m["path"] for m in mappings), mappings
    assert len({(m["dev"], m["inode"]) for m in mappings}) == 1, mappings
    assert all(m["perms"].startswith("r--") for m in mappings), mappings  # PROT_READ: no write can land
    size_kb = BASE * BASE * 4 // 1024
    for m in mappings:
        assert m["rss"] >= size_kb, m
        assert m["pss"] <= m["rss"] / world_size + 4, m  # each resident page counted once across the ranks
    assert len({total for _, total in results}) == 1


def _under_no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)


def _try_writes():
    model = _base_model()
    sw.shard(model, strategy="zero2", frozen="host")
    weight = model[0].weight
    before = zlib.crc32(weight.numpy().tobytes())
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    attempts = {
        "add_": lambda: weight.add_(1.0),
        "no_grad mul_": lambda: _under_no_grad(weight.mul_, 2.0),
        "data.zero_": lambda: weight.data.zero_(),
        "detach view fill_": lambda: weight.detach()[0].fill_(1.0),
        "setitem": lambda: weight.__setitem__(0, 1.0),
        "copy_": lambda: weight.copy_(torch.zeros_like(ref["0.weight"])),
        "nn.init": lambda: nn.init.normal_(weight),
        "out=": lambda: torch.add(torch.ones(4, BASE), 1.0, out=weight.data[:4]),
        "data =": lambda: setattr(weight, "data", torch.zeros(BASE, BASE)),
        "half()": lambda: model.half(),
        "load_state_dict": lambda: model.load_state_dict(ref),
        "foreach": lambda: torch._foreach_add_([weight], 1.0),
        "iadd": lambda: weight.data.__iadd__(1.0),
    }
    refused = {}
    for what, attempt in attempts.items():
        try:
            attempt()
            refused[what] = None
        except (sw.ShardwiseError, RuntimeError) as error:  # load_state_dict wraps it in its RuntimeError
            refused[what] = "shared read-only" in str(error)
    model.to("cpu")  # a no-op move re-sets each parameter to itself: allowed
    array = weight.numpy()
    as_array = np.asarray(model[0].bias)
    dist.barrier()
    return (refused, zlib.crc32(weight.numpy().tobytes()) == before,
            array.__array_interface__["data"][0] == weight.data_ptr(), array.flags.writeable,
            as_array.__array_interface__["data"][0] == model[0].bias.data_ptr(), as_array.flags.writeable)


def test_every_write_to_a_host_weight_is_refused_and_numpy_reads_it_in_place(ranks):
    """Catches a write path that reaches the shared mapping (a SIGSEGV on PROT_READ pages, or,
    writable, every other rank's weights changed): in-place ops, views, `.data`, `out=`, init,
    `load_state_dict`, `model.half()`; and numpy views that copy or that could write."""
    for refused, unchanged, same_address, writable, same_address_2, writable_2 in ranks.run(_try_writes, 2):
        assert refused == {what: True for what in refused}, refused
        assert unchanged and same_address and same_address_2
        assert not writable and not writable_2


def _unfreeze_on_rank_1():
    model = _base_model()
    sw.shard(model, strategy="ddp", frozen="host")
    weight = model[0].weight
    original = weight.detach().clone()
    message = None
    if dist.get_rank() == 1:
        weight.requires_grad_(True)  # copy-on-unfreeze: rank 1's own copy from here on
        with torch.no_grad():
            weight.add_(1.0)
        try:
            model(torch.ones(2, BASE))
        except sw.ShardwiseError as error:
            message = str(error)
    dist.barrier()
    return (type(weight).__name__, weight is model[0].weight, torch.equal(weight.detach(), original), message)


def test_unfreezing_copies_out_of_the_mapping_and_a_forward_after_shard_is_refused(ranks):
    """Catches an unfreeze that writes the shared pages (rank 0's weight would change with rank 1's),
    that makes a new Parameter object (an optimizer holding the old one would train nothing), or a
    weight unfrozen after shard() trained without any gradient synchronization."""
    (name0, same0, equal0, msg0), (name1, same1, equal1, msg1) = ranks.run(_unfreeze_on_rank_1, 2)
    assert name0 == "HostParameter" and equal0 and msg0 is None
    assert name1 == "Parameter" and same1 and not equal1
    assert msg1 is not None and "unfrozen after sw.shard" in msg1, msg1


def _state_dict_round_trip():
    model = _base_model()
    sw.shard(model, strategy="ddp", frozen="host")
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    before = model[0].weight.detach().clone()
    copied = copy.deepcopy(model[0].weight.detach())
    copied.add_(1.0)  # a copy is the copier's own memory: writable, and the mapping is untouched
    return (sorted(type(v).__name__ for v in loaded.values()),
            all(torch.equal(loaded[k], v) for k, v in model.state_dict().items()),
            type(copied) is torch.Tensor and torch.equal(before, model[0].weight))


def test_state_dicts_and_copies_of_host_weights_are_plain_tensors(ranks):
    """Catches `torch.save(model.state_dict())` writing the guard class, which
    `torch.load(weights_only=True)` (torch's default) refuses, and a deepcopy that fails or
    hands out a tensor that still refuses writes."""
    for types, equal, copied in ranks.run(_state_dict_round_trip, 1):
        assert types == ["Tensor"] * 4 and equal and copied


@pytest.mark.parametrize("strategy, world_size", [("ddp", 2), ("zero1", 2), ("zero2", 2), ("zero3", 4)])
def test_trainable_parts_equal_one_process(ranks, strategy, world_size):
    """Catches a host copy that changes the math: gradients flowing through host-shared frozen
    layers, the trainable parameters' reduce and step, and the frozen values (rank 0's, as DDP
    broadcasts them) must all equal a single process at the fp32 bound."""
    check_parity(ranks, strategy, "frozen", world_size, [(1, None), (2, 0.05)], shard_kwargs={"frozen": "host"})


def _from_source(strategy, path):
    base = build("frozen", 3)  # the file's values: seed 3
    sw.export(base, path)  # every rank calls it; rank 0 writes
    torch.manual_seed(0)  # deferred init replays from the RNG state at its start, as eager build("frozen", 0)
    with sw.deferred_init():
        model = ZOO["frozen"].build()  # nothing allocated: the frozen part must come from the file
    shard_kwargs = {"units": ZOO["frozen"].unit_class} if strategy != "ddp" else {}
    sw.shard(model, strategy=strategy, frozen=sw.HostFrozen(source=path), **shard_kwargs)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    inode = os.stat(path).st_ino
    mapped = all(is_host_shared(p) and _mapping_of(p.data_ptr()).get("inode") == inode
                 for n, p in model.named_parameters() if n in frozen)
    got, from_file, eager = sw.full_parameters(model), sw.full_parameters(base), sw.full_parameters(build("frozen", 0))
    x, y = rank_slice(global_batch(ZOO["frozen"], 0, 8), dist.get_rank(), dist.get_world_size())
    model(x, y).backward()  # gradients flow through the mapped layers
    return (mapped, sorted(frozen), [n for n in frozen if not torch.equal(got[n], from_file[n])],
            [n for n in got if n not in frozen and not torch.equal(got[n], eager[n])])


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_deferred_model_maps_its_frozen_weights_from_an_exported_file(ranks, tmp_path, strategy):
    """Catches a frozen base materialized per rank before it is replaced (deferred init replaying
    it), a file read into private memory instead of mapped, tied/aliased names not found in
    sw.export's file, and trainable parameters whose init the host copy disturbs."""
    path = str(tmp_path / "base.safetensors")
    for mapped, frozen, wrong_frozen, wrong_trainable in ranks.run(_from_source, 2, strategy, path):
        assert mapped and frozen and all(n.startswith(("layers.0.", "layers.1.fc1.")) for n in frozen), frozen
        assert wrong_frozen == [] and wrong_trainable == []


def _shard_or_error(strategy, frozen, freeze=True, seed_by_rank=False, own_host=False):
    if own_host:  # each rank its own "host": its own leader and directory
        os.environ["LOCAL_RANK"] = "0"
    model = _base_model(seed=dist.get_rank() if seed_by_rank else 0)
    if not freeze:
        model.requires_grad_(True)
    if own_host:
        frozen = sw.HostFrozen(directory=f"{frozen}/host{dist.get_rank()}")
        os.makedirs(frozen.directory, exist_ok=True)
    try:
        sw.shard(model, strategy=strategy, frozen=frozen)
    except sw.ShardwiseError as error:
        return str(error)
    finally:
        os.environ["LOCAL_RANK"] = str(dist.get_rank())
    return [p.data_ptr() for p in model.parameters() if is_host_shared(p)] and "ok"


def test_misused_host_copies_are_refused_on_every_rank(ranks, tmp_path):
    """Catches frozen='host' with nothing frozen doing nothing silently, and hosts whose models
    differ (an unseeded init on two machines) each training against its own base."""
    assert all("none is frozen" in m for m in ranks.run(_shard_or_error, 2, "ddp", "host", False))
    same = ranks.run(_shard_or_error, 2, "zero2", str(tmp_path), True, False, True)
    assert same == ["ok", "ok"]  # two hosts, one copy each, the same values
    for message in ranks.run(_shard_or_error, 2, "zero2", str(tmp_path), True, True, True):
        assert "hosts' frozen weights differ" in message, message


def _source_without_bias(path):
    model = _base_model()
    if dist.get_rank() == 0:
        safetensors.torch.save_file({"0.weight": model[0].weight.detach().contiguous()}, path)
    dist.barrier()
    try:
        sw.shard(model, strategy="zero2", frozen=sw.HostFrozen(source=path))
    except sw.ShardwiseError as error:
        return str(error)
    return None


def test_a_source_file_without_a_frozen_weight_is_refused_on_every_rank(ranks, tmp_path):
    """Catches a frozen parameter missing from the file left as it was (a per-rank copy, silently)
    or an error on one rank while the others go on into the strategy's collectives and hang."""
    for message in ranks.run(_source_without_bias, 2, str(tmp_path / "base.safetensors")):
        assert message is not None and "'0.bias' is not in" in message, message


def test_frozen_option_is_validated():
    """Catches a typo'd frozen= or a contradictory HostFrozen accepted and ignored."""
    with pytest.raises(sw.ShardwiseError, match="frozen='shm'"):
        sw.ShardConfig.of("ddp", frozen="shm")
    with pytest.raises(sw.ShardwiseError, match="not both"):
        sw.HostFrozen(source="a.safetensors", directory="/dev/shm")
    assert sw.ShardConfig.of("zero3", frozen="host").frozen == sw.HostFrozen()


def _save_and_load_with_every_parameter(strategy, path):
    model = _base_model()
    sw.shard(model, strategy=strategy, frozen="host")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the host copy's weight too, as users write it
    x = torch.randn(4, BASE, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).sum().backward()
    optim.step()
    sw.save(path, model, optim)
    loaded = _base_model(seed=1)
    sw.shard(loaded, strategy=strategy, frozen="host")
    loaded_optim = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    report = sw.load(path, loaded, loaded_optim)
    want, got = sw.full_parameters(model), sw.full_parameters(loaded)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    return (not report.problems, all(torch.equal(got[name], want[name]) for name in trainable),
            len(loaded_optim.state) == len(optim.state))


@pytest.mark.slow  # 2 ranks, save and load: kept out of make test's budget
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_an_optimizer_over_every_parameter_saves_and_loads(ranks, tmp_path, strategy):
    """Catches sw.save refusing an optimizer built from model.parameters() under frozen="host" ("holds a
    tensor ... that is not a parameter of this model": the host copy's weights are left out of the
    checkpoint's parameters), and sw.load refusing it back: the trainable rows and their state round-trip."""
    for clean, equal, same_state in ranks.run(_save_and_load_with_every_parameter, 2, strategy, str(tmp_path / "c")):
        assert clean and equal and same_state
