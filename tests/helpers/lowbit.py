"""Rank functions for torchao's low-bit optimizers on a sharded model (module level, so `ranks.run`
can pickle them). Note [low-bit state] in engine/optim/lowbit.py says how shardwise steps and stores them.

torchao quantizes a state only for a tensor of at least 4096 elements whose count its block size
divides (`_new_buffer`), so the model here has both kinds: the blocks' matrices (128 x 32: 4096,
quantized whole, but 2048 elements as 2-rank rows, which it would keep in fp32) and a head of 130 x 32
(4160 elements, not a multiple of 256: fp32 whole).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from helpers.harness import RankPool

# `make` installs torchao into .lowbit beside the venv, not in it (the Makefile says why: transformers imports
# it whenever it can, and it prints at every import on a CPU host); a venv that has the extra serves as well.
LOWBIT_SITE = Path(__file__).resolve().parents[2] / ".lowbit"
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None or (LOWBIT_SITE / "torchao").is_dir()
NO_TORCHAO = "torchao (the `lowbit` extra) is not installed: `make setup` puts it in .lowbit"


@contextlib.contextmanager
def lowbit_pool(size: int):
    """A pool of ranks of a module's own, started with .lowbit first on the path (a rank started by the
    forkserver takes the parent's sys.path), and the path given back after: the session's pool and this worker
    never import torchao."""
    sys.path.insert(0, str(LOWBIT_SITE))
    pool = RankPool(size=size)
    try:
        yield pool
    finally:
        pool.close()
        sys.path.remove(str(LOWBIT_SITE))


GLOBAL_BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 128):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 128, out: int = 130, depth: int = 2):
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.blocks = nn.ModuleList([Block(width, hidden) for _ in range(depth)])
        self.head = nn.Linear(width, out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


class Many(nn.Module):
    """Many small tensors (40 layers of 8 x 8): the owners' transfers are many packed ones (Note [owner memory])."""

    def __init__(self, depth: int = 40):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(depth)])

    def forward(self, x):
        x = x[:, :8]
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x.square().mean()


def make_optimizer(params, name: str, **options):
    import torchao.optim

    kind = {"adamw8bit": torchao.optim.AdamW8bit, "adamw4bit": torchao.optim.AdamW4bit}[name]
    return kind(params, lr=1e-2, **options)


def build(strategy: str, name: str, seed: int = 0, kind: type = Net, **options):
    """The model (a `kind`, sharded under `strategy`, or plain for "none") and `name`'s optimizer, built after
    shard()."""
    torch.manual_seed(seed)
    model = kind()
    if strategy != "none":
        sw.shard(model, strategy=strategy, units=Block if kind is Net else nn.Linear)
    return model, make_optimizer(model.parameters(), name, **options)


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    x = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // world
    return x[rank * per:(rank + 1) * per]


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole reduced gradient, on every rank (a collective: zeros outside each rank's
    rows summed, which adds nothing to any bit)."""
    out = {}
    for name, info in sw.shard_info(model).items():
        full = torch.zeros(info.full_shape)
        if info.row_end > info.row_start:
            full[info.row_start:info.row_end] = info.param.grad[: info.row_end - info.row_start]
        dist.all_reduce(full)
        out[name] = full
    return out


def state_parts(value) -> dict[str, torch.Tensor]:
    """A state tensor as the plain tensors it holds (a quantized subclass's codes, scales, map)."""
    if type(value) is torch.Tensor:
        return {"": value}
    names, _ = value.__tensor_flatten__()
    return {f".{n}": getattr(value, n) for n in names}


def owned_state(optim, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's optimizer state by parameter name, each state tensor as its plain parts (copies)."""
    out = {}
    for param, state in optim.state.items():
        out[names[id(param)]] = {k + part: t.clone() for k, v in state.items() if isinstance(v, torch.Tensor)
                                 for part, t in state_parts(v).items()}
    return out


def state_bytes(optim) -> int:
    return sum(t.numel() * t.element_size() for state in optim.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0 for t in state_parts(v).values())


def lockstep(model, optim, reference, ref_optim, start: int, end: int) -> list[str]:
    """Steps start..end-1 of the sharded `model`, feeding `reference` (a plain model, whole tensors, one
    process's optimizer) the same reduced gradients: the names whose values differ in any bit, per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    differ = []
    for step in range(start, end):
        optim.zero_grad(set_to_none=True)
        model(batch(step, rank, world)).backward()
        grads = full_grads(model)
        for name, param in reference.named_parameters():
            param.grad = grads[name]
        optim.step()
        ref_optim.step()
        full = sw.full_parameters(model)
        differ += [f"step {step}: {n}" for n, p in reference.named_parameters() if not torch.equal(full[n], p)]
    return differ


def against_one_process(strategy: str, name: str, steps: int = 3) -> dict:
    """`steps` lockstep steps; what differs, this rank's optimizer-state bytes and the one process's."""
    model, optim = build(strategy, name)
    reference, ref_optim = build("none", name)
    differ = lockstep(model, optim, reference, ref_optim, 0, steps)
    return {"differ": differ, "bytes": state_bytes(optim), "one_process": state_bytes(ref_optim)}


def _names(model) -> dict[int, str]:
    return {id(info.param): name for name, info in sw.shard_info(model).items()}


def save_after(strategy: str, name: str, path: str) -> dict:
    """3 steps, save: this rank's state as saved."""
    model, optim = build(strategy, name)
    lockstep(model, optim, *build("none", name), 0, 3)
    sw.save(path, model, optim, step=3)
    return owned_state(optim, _names(model))


def load_and_step(strategy: str, name: str, path: str) -> dict:
    """A fresh model (another seed) loads `path`; its state as loaded on this rank, then 2 lockstep
    steps against a plain model that loaded the same checkpoint."""
    model, optim = build(strategy, name, seed=1)
    assert sw.load(path, model, optim).ok
    loaded = owned_state(optim, _names(model))
    reference, ref_optim = build("none", name, seed=1)
    assert sw.load(path, reference, ref_optim).ok
    return {"state": loaded, "differ": lockstep(model, optim, reference, ref_optim, 3, 5)}


def load_other_blocks(path: str, saved_block: int, loaded_block: int) -> str:
    """One step of AdamW8bit with `saved_block`, saved, then loaded into one with `loaded_block` (8192: no
    tensor here is quantized); the error's message, or "loaded"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = build("zero3", "adamw8bit", block_size=saved_block)
    model(batch(0, rank, world)).backward()
    optim.step()
    sw.save(path, model, optim, step=1)
    model, optim = build("zero3", "adamw8bit", seed=1, block_size=loaded_block)
    try:
        sw.load(path, model, optim)
    except sw.ShardwiseError as error:
        return str(error)
    return "loaded"


def in_backward_against_after(strategy: str, name: str, steps: int = 3) -> dict:
    """`steps` steps of `name` under sw.optimizer_in_backward beside the same optimizer stepping after backward
    (same seed, data and world size: the same reduced gradients, bit for bit). What differs after each step,
    each run's optimizer-state bytes on this rank, gradients left after the in-backward model's backwards, the
    collectives its user's step() called (Note [no gradient, no traffic]), and how many quantized states this
    rank holds."""
    from shardwise.testing import count_received

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = build(strategy, name)
    sw.optimizer_in_backward(model, optim)
    after, after_optim = build(strategy, name)
    differ, left, calls = [], 0, {}
    for step in range(steps):
        x = batch(step, rank, world)
        model(x).backward()
        left += sum(param.grad is not None for param in model.parameters())
        with count_received() as received:
            optim.step()
        for call, count in received.calls.items():
            calls[call] = calls.get(call, 0) + count
        optim.zero_grad(set_to_none=True)
        after(x).backward()
        after_optim.step()
        after_optim.zero_grad(set_to_none=True)
        full, full_after = sw.full_parameters(model), sw.full_parameters(after)
        differ += [f"step {step}: {n}" for n in full_after if not torch.equal(full[n], full_after[n])]
    quantized = sum(any(type(v) is not torch.Tensor for v in state.values()) for state in optim.state.values())
    return {"differ": differ, "bytes": state_bytes(optim), "after_bytes": state_bytes(after_optim), "left": left,
            "calls": calls, "quantized": quantized}


def save_in_backward(strategy: str, name: str, path: str) -> dict:
    """3 steps under sw.optimizer_in_backward, save: this rank's state as saved."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = build(strategy, name)
    sw.optimizer_in_backward(model, optim)
    for step in range(3):
        model(batch(step, rank, world)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    sw.save(path, model, optim, step=3)
    return owned_state(optim, _names(model))


def _trained(name: str, offload, in_backward: bool, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    sw.shard(model, strategy="zero3", units=Block, offload=offload)
    optim = make_optimizer(model.parameters(), name)
    if in_backward:
        sw.optimizer_in_backward(model, optim)
    for step in range(steps):
        model(batch(step, rank, world)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return sw.full_parameters(model)


def offloaded_against_plain(name: str, offload: str, in_backward: bool, steps: int = 3) -> dict:
    """`steps` steps of `name` on a zero3 model sharded with `offload` (stepped in backward or after it) beside
    the same without offload: the ShardwiseError's message on this rank, or the names whose values differ."""
    try:
        offloaded = _trained(name, offload, in_backward, steps)
    except sw.ShardwiseError as error:
        return {"refused": str(error)}
    plain = _trained(name, None, in_backward, steps)
    return {"refused": None, "differ": [n for n in plain if not torch.equal(plain[n], offloaded[n])]}


def _holders(tensors: list) -> list[tuple[int, int]]:
    """For each tensor (a new list of them), the references to its object (Python's count) and to its storage
    (torch's use count), as seen from here: compare only counts taken the same way."""
    return [(sys.getrefcount(t), torch._C._storage_Use_Count(t.untyped_storage()._cdata)) for t in tensors]


@contextlib.contextmanager
def counted_owner_buffers(alone_bytes: int):
    """Note [owner memory] (engine/comm/owner_traffic.py): every buffer the owners' traffic allocates, counted
    while anything but this counter holds it; yields a dict whose "peak" is the most bytes alive at once. A
    buffer's storage can outlive its tensor object (the step's parameter holds it through `.data`), so a buffer
    lives while its object or its storage has a holder beyond the counter's own (the counts of a tensor only the
    counter holds, measured the same way), sampled at each allocation, where the peak can only grow.
    `alone_bytes` replaces ALONE_BYTES meanwhile, so a tiny model's tensors travel alone and packed."""
    from shardwise.engine.comm import owner_traffic

    kept, counts = [torch.empty(1)], {"peak": 0, "allocated": 0}
    alone = _holders(kept[:1])[0]  # a tensor only the counter holds
    allocate, threshold = owner_traffic._buffer, owner_traffic.ALONE_BYTES

    def counted(numel, like):
        buffer = allocate(numel, like)
        holders = _holders(kept[1:])  # before any other list holds them
        kept[1:] = [t for t, held in zip(kept[1:], holders) if held[0] > alone[0] or held[1] > alone[1]]
        kept.append(buffer)
        live = sum(t.untyped_storage().nbytes() for t in kept[1:])
        counts["peak"], counts["allocated"] = max(counts["peak"], live), counts["allocated"] + 1
        return buffer

    owner_traffic._buffer, owner_traffic.ALONE_BYTES = counted, alone_bytes
    try:
        yield counts
    finally:
        owner_traffic._buffer, owner_traffic.ALONE_BYTES = allocate, threshold
        kept.clear()


def owner_buffers_peak(strategy: str, name: str, alone_bytes: int, many: bool = False, steps: int = 3) -> dict:
    """`steps` lockstep steps (after backward) with the owners' buffers counted, on a Net (or a Many): what differs
    from one process, the peak bytes of those buffers alive at once, the padded whole values and gradients this
    rank owns, and the largest whole tensor's bytes."""
    kind = Many if many else Net
    model, optim = build(strategy, name, kind=kind)
    reference, ref_optim = build("none", name, kind=kind)
    with counted_owner_buffers(alone_bytes) as counts:
        differ = lockstep(model, optim, reference, ref_optim, 0, steps)
    world, rank = dist.get_world_size(), dist.get_rank()
    wholes = {id(info.param): world * info.param.numel() * info.param.element_size()
              for info in sw.shard_info(model).values()}
    owned = sum(2 * wholes[key] for key, owner in optim._sw_owners.items() if owner == rank)
    return {"differ": differ, "peak": counts["peak"], "allocated": counts["allocated"], "owned": owned,
            "largest": max(wholes.values())}


class ReplacingSGD(torch.optim.Optimizer):
    """SGD that gives each parameter a new tensor (`p.data = ...`) instead of writing it in place: a class
    shardwise does not know, so stepped whole on owners."""

    def __init__(self, params, lr: float = 0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.data = param.data - group["lr"] * param.grad


def replacing_step_against_one_process(alone_bytes: int, steps: int = 2) -> list[str]:
    """`steps` lockstep steps of ReplacingSGD on a zero3 model, its tensors travelling alone from `alone_bytes`
    (Note [owner memory]): what differs from one process."""
    torch.manual_seed(0)
    model = Net()
    sw.shard(model, strategy="zero3", units=Block)
    torch.manual_seed(0)
    reference = Net()
    with counted_owner_buffers(alone_bytes):
        return lockstep(model, ReplacingSGD(model.parameters()), reference, ReplacingSGD(reference.parameters()),
                        0, steps)
