"""Rank functions for the resume, export, plain-source, failure and memory checkpoint tests."""

from __future__ import annotations

import contextlib
import errno
import os
import random
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import shardwise as sw
from helpers.ckpt_ranks import build_model, run_steps
from shardwise.checkpoint.write import writer as _ckpt_files

# ---- resume ----------------------------------------------------------------------------


def resume_run(strategy: str, total: int, save_at: int | None = None, path: str | None = None,
               load: bool = False) -> dict:
    """Train the reused-block model on a shuffled dataset through a ResumableSampler, with
    augmentation noise from torch, numpy and python RNGs and a StepLR schedule.

    `save_at`: save to `path` after that many steps and stop. `load`: start from `path`
    in a model built with another seed and RNGs seeded differently (as a new process
    would be). Returns this rank's losses, the sample indices it saw, and the params.
    """
    rank = dist.get_rank()
    for seed_fn in (torch.manual_seed, np.random.seed, random.seed):
        seed_fn(1234 + rank)
    model, optim = build_model("reused_block", strategy, seed=7 if load else 0)
    schedule = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.arange(48), torch.randn(48, 16, generator=g), torch.randn(48, 16, generator=g))
    sampler = sw.ResumableSampler(data, seed=5)
    # Its own generator: creating a DataLoader iterator otherwise draws a seed from torch's
    # global RNG, and the resumed run creates one at step 5 that the full run never did.
    loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator())
    start = 0
    if load:
        for seed_fn in (torch.manual_seed, np.random.seed, random.seed):
            seed_fn(999)
        report = sw.load(path, model, optim, schedule, sampler=sampler)
        assert report.rng_restored, str(report)
        start = report.extra["step"]
    batches = iter(loader)
    losses, seen = [], []
    for step in range(start, total):
        try:
            index, x, y = next(batches)
        except StopIteration:  # the sampler moved to the next epoch by itself
            batches = iter(loader)
            index, x, y = next(batches)
        x = x + 0.1 * torch.randn_like(x) * float(np.random.rand()) + 0.01 * random.random()
        model.zero_grad(set_to_none=True)
        optim.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        optim.step()
        schedule.step()
        losses.append(loss.item())
        seen.append(index.tolist())
        if save_at == step + 1:
            sw.save(path, model, optim, schedule, sampler=sampler, step=step + 1)
            break
    return {"losses": losses, "seen": seen, "params": sw.full_parameters(model)}


# ---- export and plain sources ----------------------------------------------------------


def train_and_export(strategy: str, path: str, duplicate_tied: bool = False) -> dict:
    """Two steps of the tied GPT under `strategy`, then export; the full parameters."""
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, 2)
    sw.export(model, path, duplicate_tied=duplicate_tied)
    return sw.full_parameters(model)


def load_plain(strategy: str, path: str, rename=None) -> dict:
    """A GPT under `strategy` loads `path` (a state dict file or safetensors file) strictly."""
    model, _ = build_model("gpt", strategy, seed=3)
    report = sw.load(path, model, rename=rename)
    assert report.ok, str(report)
    return sw.full_parameters(model)


# ---- failures ---------------------------------------------------------------------------


def save_gpt(strategy: str, path: str, steps: int = 1) -> None:
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, steps)
    sw.save(path, model, optim, step=steps)


def load_gpt_error(strategy: str, path: str) -> str:
    """Load `path` into a GPT; the ShardwiseError's message (or "" when it loads)."""
    model, optim = build_model("gpt", strategy, seed=3)
    try:
        sw.load(path, model, optim)
    except sw.ShardwiseError as error:
        return str(error)
    return ""


@contextlib.contextmanager
def _writes_fail_on(rank: int, fail) -> Iterator[None]:
    """On `rank`, let the save write three chunks, then call `fail(file)` instead of writing
    (so the file exists and is partly written). Restored after: rank processes are reused."""
    original = _ckpt_files._write_chunk
    calls = [0]

    def failing(file, data):
        calls[0] += 1
        if calls[0] > 3:
            fail(file)
        original(file, data)

    if dist.get_rank() == rank:
        _ckpt_files._write_chunk = failing
    try:
        yield
    finally:
        _ckpt_files._write_chunk = original


def _disk_full(file) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _die(file) -> None:
    file.flush()
    os._exit(17)


def save_with_full_disk(strategy: str, path: str, failing_rank: int) -> str:
    """Save while `failing_rank`'s writes fail with ENOSPC; the error message every rank got."""
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, 1)
    with _writes_fail_on(failing_rank, _disk_full):
        try:
            sw.save(path, model, optim, step=1)
        except sw.ShardwiseError as error:
            return str(error)
    return ""


def save_and_die(strategy: str, path: str, dying_rank: int) -> None:
    """Save, and kill `dying_rank`'s process partway through writing its file."""
    model, optim = build_model("gpt", strategy)
    run_steps(model, optim, "gpt", strategy, 0, 1)
    with _writes_fail_on(dying_rank, _die):
        sw.save(path, model, optim, step=1)


# ---- memory ----------------------------------------------------------------------------

_MIB = 2**20


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_growth(fn) -> int:
    """Peak RSS during `fn()` minus RSS before it (the kernel's high-water mark, reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_bytes("VmRSS")
    fn()
    return _rss_bytes("VmHWM") - before


def build_stack(num_units: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(num_units)])


def memory_during_checkpoint(root: str, num_units: int, width: int) -> dict:
    """zero3 stack of Linear units: peak RSS growth of save, a same-layout load and a
    reshard load (from a 1-rank checkpoint), with optimizer state."""
    import ctypes

    # Note [mmap threshold]: glibc keeps freed heap blocks resident and raises its mmap
    # threshold as big blocks are freed, so RSS would show old garbage, not what is
    # live. A fixed 64 KiB threshold maps every big block and returns it on free.
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    model = build_stack(num_units, width)
    sw.shard(model, strategy="zero3", units=nn.Linear)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    sw.save(f"{root}/warm", model, optim)  # first call imports and caches what it needs
    sw.load(f"{root}/warm", model, optim)
    out = {"save": _peak_growth(lambda: sw.save(f"{root}/measured", model, optim)),
           "load": _peak_growth(lambda: sw.load(f"{root}/measured", model, optim)),
           "reshard_load": _peak_growth(lambda: sw.load(f"{root}/one-rank", model, optim)),
           "export": _peak_growth(lambda: sw.export(model, f"{root}/model.safetensors"))}
    out["rank_state_bytes"] = sum(p.numel() * 4 * 3 for p in model.parameters())  # params + 2 AdamW moments
    return out


def save_one_rank_stack(root: str, num_units: int, width: int) -> None:
    model = build_stack(num_units, width)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optim.step()
    sw.save(f"{root}/one-rank", model, optim)


# ---- torch.distributed.checkpoint -------------------------------------------------------


def dcp_save(strategy: str, path: str) -> dict:
    """Train 2 steps, save through DCP with sw.dcp_state_dict; the full params and state."""
    import torch.distributed.checkpoint as dcp

    from helpers.ckpt_ranks import full_optimizer_state

    model, optim = build_model("odd_shapes", strategy)
    run_steps(model, optim, "odd_shapes", strategy, 0, 2)
    dcp.save(sw.dcp_state_dict(model, optim), checkpoint_id=path)
    return {"params": sw.full_parameters(model), "optim": full_optimizer_state(model, optim)}


def dcp_load(strategy: str, path: str) -> dict:
    """A fresh model (another seed) with one step of optimizer state, loaded in place through DCP."""
    import torch.distributed.checkpoint as dcp

    from helpers.ckpt_ranks import full_optimizer_state

    model, optim = build_model("odd_shapes", strategy, seed=4)
    run_steps(model, optim, "odd_shapes", strategy, 5, 6)  # creates the state DCP loads into
    dcp.load(sw.dcp_state_dict(model, optim), checkpoint_id=path)
    return {"params": sw.full_parameters(model), "optim": full_optimizer_state(model, optim)}
