"""Note [plain rows step] (optim_hooks.py): an elementwise optimizer's own step body runs with the shard
checks off once its tensors cannot fault them, the user's step hooks still with them, and a full-shape
state still stops with a ShardwiseError on every rank. At 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from helpers.two_rows import TwoRows
from shardwise.engine.unit.shard_param import RowsGrad, ShardParameter

STRATEGIES = ["zero1", "zero2", "zero3"]


def _count_checks(strategy, kind):
    """Calls into the shards' __torch_function__ in the step body of the third step, and in a step pre-hook."""
    torch.manual_seed(0)
    model = TwoRows()
    sw.shard(model, strategy=strategy, units=[model])
    optimizer = kind(model.parameters(), lr=0.1)  # built after shard(): torch wraps its class with ours
    calls = {"count": 0}
    originals = {cls: cls.__dict__["__torch_function__"] for cls in (ShardParameter, RowsGrad)}

    def counting(original):
        def tf(cls, func, types, args=(), kwargs=None):
            calls["count"] += 1
            return original.__func__(cls, func, types, args, kwargs)
        return classmethod(tf)

    in_hook = {}

    def pre_hook(opt, args, kwargs):
        model.proj.weight.sum()  # a user's read in a hook: checked as ever
        in_hook["before"] = calls["count"]

    optimizer.register_step_pre_hook(pre_hook)
    try:
        for cls, original in originals.items():
            setattr(cls, "__torch_function__", counting(original))
        for _ in range(3):
            model(torch.ones(3, 4)).backward()
            in_hook.clear()
            calls["count"] = 0
            optimizer.step()
            after_step = calls["count"]
            optimizer.zero_grad()
    finally:
        for cls, original in originals.items():
            setattr(cls, "__torch_function__", original)
    return in_hook["before"], after_step


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.SGD])
def test_an_elementwise_step_body_skips_the_shard_checks_and_a_hook_does_not(ranks, strategy, kind):
    for in_hook, total in ranks.run(_count_checks, 2, strategy, kind):
        assert in_hook >= 1  # the user's pre-hook read p.sum(): checked as before
        assert total == in_hook  # nothing more: the body itself made no checked call


def _full_state(strategy):
    """AdamW state of the full shape, loaded with torch's own load_state_dict after shard()."""
    torch.manual_seed(0)
    model = TwoRows()
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    sw.shard(model, strategy=strategy, units=[model])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).backward()
    optimizer.step()
    state = optimizer.state_dict()
    for index, name in enumerate(n for n, _ in model.named_parameters()):
        state["state"][index]["exp_avg"] = torch.zeros_like(full[name])
        state["state"][index]["exp_avg_sq"] = torch.zeros_like(full[name])
    optimizer.load_state_dict(state)
    model(torch.ones(3, 4)).backward()
    try:
        optimizer.step()
    except sw.ShardwiseError as error:
        return str(error)
    return f"no error on rank {dist.get_rank()}"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_full_shape_optimizer_state_is_still_refused(ranks, strategy):
    """Fails with the state check of _rows_alike removed: the plain body broadcasts the [2, 4] state over the
    [1, 4] rows, and torch raises its own shape error from inside AdamW."""
    for message in ranks.run(_full_state, 2, strategy):
        assert "'proj.weight'" in message and "full shape [2, 4]" in message



_BUILT_BEFORE = """
import sys
import torch
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch wraps AdamW.step before shardwise is imported
import torch.distributed as dist
port, rank, world_size, tests = sys.argv[1:5]
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=int(rank), world_size=int(world_size))
sys.path.insert(0, tests)
from test_plain_rows_step import _count_checks
in_hook, total = _count_checks("zero2", torch.optim.AdamW)
print(in_hook, total)
"""


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_class_torch_wrapped_before_shardwise_was_imported_skips_the_checks_too(world_size):
    """compat.guard_step re-makes torch's wrapper of a class built before `import shardwise` (the pooled
    ranks import it first, so only fresh processes reach this), for every optimizer over shards, one rank's
    too: fails with that branch removed, or with guard_step called for tensors sharded over ranks only."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    argv = [sys.executable, "-c", _BUILT_BEFORE, str(port), "RANK", str(world_size), str(Path(__file__).parent)]
    ranks = [subprocess.Popen([str(rank) if word == "RANK" else word for word in argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world_size)]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (out, err) in zip(ranks, outputs):
        assert rank.returncode == 0, err[-3000:]
        in_hook, total = (int(word) for word in out.split()[-2:])
        assert in_hook >= 1 and total == in_hook  # the user's pre-hook read alone was checked
