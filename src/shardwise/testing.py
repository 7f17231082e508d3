"""Reference runs and their comparison, shared by tests and benchmarks.

`train` is the one training loop: the single-process reference runs it as rank 0
of 1 on the whole global batch, and a distributed run calls it on every rank with
its slice, passing hooks for what only it knows (no_sync, clipping across shards,
averaging the loss, gathering full parameters). Because both sides run the same
loop on the same data, any difference in the results is the strategy's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager

import torch
from torch import Tensor, nn

from .collective_watch import COLLECTIVES, watch_collectives  # noqa: F401  (public here too)
from .models.zoo import ZOO, ZooSpec, build, step_generator

Batch = tuple[Tensor, Tensor]


@dataclass
class RunResult:
    """What a run produced: per-step loss (mean over the global batch), per-step total
    grad norm before clipping (only when clipping), and the final full parameters."""

    losses: list[float]
    grad_norms: list[float]
    params: dict[str, Tensor]


# ---- data ----------------------------------------------------------------------


def global_batch(spec: ZooSpec, step: int, global_batch_size: int, seed: int = 0) -> Batch:
    """The global batch of `step`: depends only on (seed, step), so every rank builds
    the same one and takes its slice."""
    return spec.make_batch(step_generator(seed, step), global_batch_size)


def rank_slice(batch: Batch, rank: int, world_size: int) -> Batch:
    """This rank's contiguous, equal-size slice of the global batch."""
    n = batch[0].shape[0]
    if n % world_size != 0:
        raise ValueError(
            f"global batch size {n} is not divisible by world_size {world_size}; "
            f"use a multiple of {world_size}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    size = n // world_size
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def micro_batches(batch: Batch, accum: int) -> list[Batch]:
    """`accum` equal, contiguous micro-batches of `batch`."""
    n = batch[0].shape[0]
    if accum < 1 or n % accum != 0:
        raise ValueError(f"batch size {n} is not divisible by accum {accum}; use a divisor of {n}")
    size = n // accum
    return [tuple(t[i * size : (i + 1) * size] for t in batch) for i in range(accum)]


# ---- optimizer -----------------------------------------------------------------

# Note [adam eps]: Adam's first update is lr * g / (|g| + eps). Its slope in g is
# up to lr / eps, so an element whose gradient happens to be near 0 turns fp32
# rounding noise in g (~1e-10 here; any change of summation order, e.g. micro-
# batches or ranks, makes some) into a parameter difference of up to
# lr * 1e-10 / eps: 1e-4 with eps=1e-8 and lr=1e-2, a hundred times atol. Measured
# on the zoo (seeds 0-3, accum 1 vs 2 and 4, lr 1e-2): eps=1e-8 missed the 1e-5/1e-6
# bound by up to 56x (odd_shapes) and 12x (gpt); eps=1e-3 stays within 10% of it
# (seeds 0-11, with and without clipping).
# eps=1e-3 is near the gradients' own size, which also makes the update depend on
# the gradient's scale: a bug that doubles every gradient (sum instead of mean
# over ranks), which Adam with eps=1e-8 would mostly hide, moves the parameters
# by more than 100x the bound.


def make_optimizer(
    model: nn.Module,
    lr: tuple[float, float] = (1e-2, 3e-3),
    weight_decay: tuple[float, float] = (0.1, 0.0),
    ndim_by_name: dict[str, int] | None = None,
    eps: float = 1e-3,
) -> torch.optim.AdamW:
    """AdamW with two param groups chosen by parameter name: "decay" (matrices,
    full ndim >= 2) and "no_decay" (biases, norms, scalars); frozen params left out.

    Two groups with different lr and weight decay check that per-group settings
    survive sharding. Sharded params may be 1-D shards of matrices, so a caller
    that shards passes `ndim_by_name` with the full tensors' ndim. `eps` is far
    above torch's 1e-8 on purpose: see Note [adam eps].
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = ndim_by_name[name] if ndim_by_name is not None else p.ndim
        (decay if ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "lr": lr[0], "weight_decay": weight_decay[0], "name": "decay"},
        {"params": no_decay, "lr": lr[1], "weight_decay": weight_decay[1], "name": "no_decay"},
    ]
    return torch.optim.AdamW(groups, eps=eps)


class Optimizers:
    """Several optimizers stepped and zeroed as one, each over its own parameters: Muon on the matrices and AdamW
    on the rest, as torch's Muon docs prescribe (a whole-tensor step beside an elementwise one)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


# ---- the loop ------------------------------------------------------------------


def _begin_step(model: nn.Module, step: int) -> None:
    # A wrapper (DDP's .module, torch.compile's ._orig_mod) hides the zoo model's
    # begin_step from getattr, but the zoo model is still among its modules.
    for module in model.modules():
        begin = getattr(module, "begin_step", None)
        if begin is not None:
            begin(step)
            return


def forward_passes(model: nn.Module, spec: ZooSpec, x: Tensor, y: Tensor) -> Tensor:
    """The micro-batch's loss: the mean of `spec.forward_passes` forwards, pass i on inputs
    rolled by i along their last dimension (two forwards before one backward)."""
    losses = [model(x.roll(i, dims=-1), y) for i in range(spec.forward_passes)]
    return sum(losses) / len(losses)


def _clip_grad_norm(model: nn.Module, max_norm: float) -> Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def train(
    model: nn.Module,
    spec: ZooSpec,
    steps: int = 5,
    global_batch_size: int = 8,
    *,
    rank: int = 0,
    world_size: int = 1,
    accum: int = 1,
    clip: float | None = None,
    seed: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    step_fn: Callable[[], None] | None = None,
    no_sync: Callable[[], ContextManager] | None = None,
    clip_fn: Callable[[nn.Module, float], Tensor | float] | None = None,
    all_reduce_loss: Callable[[float], float] | None = None,
    gather_params: Callable[[], dict[str, Tensor]] | None = None,
) -> RunResult:
    """Train `model` for `steps` steps on this rank's slice of each global batch.

    Per step: begin_step, zero grads, then for each of `accum` micro-batches
    backward of `loss / accum` (all but the last inside `no_sync()` if given), then
    `clip_fn(model, clip)` if `clip` is set (its returned norm is recorded), then
    `step_fn()` (default `optimizer.step()`; default optimizer `make_optimizer`).
    The recorded loss is this rank's mean, passed through `all_reduce_loss` (a
    distributed caller averages it over ranks). Final params come from
    `gather_params()` if given, else from `model.named_parameters()`.
    """
    optimizer = optimizer if optimizer is not None else make_optimizer(model)
    step_fn = step_fn if step_fn is not None else optimizer.step
    clip_fn = clip_fn if clip_fn is not None else _clip_grad_norm
    losses: list[float] = []
    grad_norms: list[float] = []
    for step in range(steps):
        _begin_step(model, step)
        # Both: the optimizer may hold shards that are not the model's parameters.
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        batch = rank_slice(global_batch(spec, step, global_batch_size, seed), rank, world_size)
        loss_sum = 0.0
        for i, (x, y) in enumerate(micro_batches(batch, accum)):
            # Only the last micro-batch may synchronize gradients across ranks.
            last = i == accum - 1
            ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
            with ctx:
                loss = forward_passes(model, spec, x, y) / accum
                loss.backward()
            loss_sum += loss.item()
        if clip is not None:
            grad_norms.append(float(clip_fn(model, clip)))
        step_fn()
        losses.append(all_reduce_loss(loss_sum) if all_reduce_loss is not None else loss_sum)
    if gather_params is not None:
        params = gather_params()
    else:
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return RunResult(losses, grad_norms, params)


def reference_run(
    name: str,
    steps: int = 5,
    global_batch_size: int = 8,
    accum: int = 1,
    clip: float | None = None,
    seed: int = 0,
) -> RunResult:
    """The single-process reference: zoo model `name` built with `seed`, trained on
    the whole global batch as rank 0 of 1."""
    model = build(name, seed)
    return train(
        model, ZOO[name], steps, global_batch_size, accum=accum, clip=clip, seed=seed
    )


# ---- comparison ----------------------------------------------------------------


def _first_mismatch(ref: list[float], got: list[float], rtol: float, atol: float) -> str | None:
    if len(ref) != len(got):
        return f"{len(ref)} steps in ref, {len(got)} in got"
    for step, (a, b) in enumerate(zip(ref, got)):
        if not abs(a - b) <= atol + rtol * abs(a):  # `not <=` also catches NaN
            return f"step {step}: ref={a!r} got={b!r} abs diff={abs(a - b):.3g}"
    return None


def _param_mismatch(name: str, a: Tensor, b: Tensor, rtol: float, atol: float) -> str | None:
    if a.shape != b.shape:
        return f"{name}: shape ref={tuple(a.shape)} got={tuple(b.shape)}"
    # float64 so the comparison itself adds no rounding, whatever the dtypes.
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    if torch.allclose(b, a, rtol=rtol, atol=atol):
        return None
    diff = (a - b).abs().nan_to_num(nan=float("inf"))
    i = int(diff.argmax())
    index = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), a.shape))
    return (
        f"{name}: max abs diff {diff.flatten()[i].item():.3g} at {index} "
        f"(ref={a.flatten()[i].item()!r} got={b.flatten()[i].item()!r})"
    )


def assert_close_runs(ref: RunResult, got: RunResult, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Assert `got` matches `ref` in losses, grad norms and every parameter, within
    |got - ref| <= atol + rtol * |ref| (DESIGN's fp32 bound). The AssertionError
    names missing/extra parameters, the first differing step of losses and grad
    norms, and the first differing parameter (in ref's order) with its worst element."""
    problems = []
    missing, extra = sorted(ref.params.keys() - got.params.keys()), sorted(got.params.keys() - ref.params.keys())
    if missing:
        problems.append(f"params missing from got: {missing}")
    if extra:
        problems.append(f"params not in ref: {extra}")
    for what, a, b in (("loss", ref.losses, got.losses), ("grad norm", ref.grad_norms, got.grad_norms)):
        msg = _first_mismatch(a, b, rtol, atol)
        if msg is not None:
            problems.append(f"{what} differs at {msg}")
    bad = [
        msg
        for name in ref.params
        if name in got.params
        and (msg := _param_mismatch(name, ref.params[name], got.params[name], rtol, atol)) is not None
    ]
    if bad:
        problems.append(f"{len(bad)} param(s) differ, first: {bad[0]}")
    if problems:
        raise AssertionError(f"runs differ (rtol={rtol}, atol={atol}):\n  " + "\n  ".join(problems))


# Bytes one rank receives in each torch.distributed collective (the ring/direct model of each: an
# all-gather brings the N-1 other chunks, a reduce-scatter the N-1 other contributions to this rank's
# chunk, an all-reduce 2(N-1)/N of the tensor, a gather its root the N-1 others, a scatter or broadcast
# each non-root its part). Counted from the arguments, so it is the same on gloo and NCCL.
def _received(name: str, args: dict, root: bool, world: int) -> int:
    tensor = args.get("tensor")
    if name in ("all_gather_single", "all_gather_into_tensor"):
        return args["output_tensor"].nbytes - args["input_tensor"].nbytes
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return args["input"].nbytes - args["output"].nbytes
    if name == "all_to_all_single":
        return args["output"].nbytes * (world - 1) // world
    if name == "all_reduce":
        return 2 * (world - 1) * tensor.nbytes // world
    if name == "broadcast":
        return 0 if root else tensor.nbytes
    if name == "gather":
        return (len(args["gather_list"]) - 1) * tensor.nbytes if args.get("gather_list") else 0
    if name == "scatter":
        return 0 if root else tensor.nbytes
    return 0


COUNTED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_to_all_single", "all_reduce", "broadcast", "gather", "scatter")


@dataclass
class Received:
    """What `count_received` counted: bytes this rank received, and the calls of each collective."""

    bytes: int = 0
    calls: dict = field(default_factory=dict)


@contextlib.contextmanager
def count_received():
    """Count, into the yielded `Received`, the bytes this rank receives in the torch.distributed
    collectives called inside (`COUNTED`, by `_received`'s model) and their calls."""
    import torch.distributed as dist

    total = Received()

    def count(name: str, found: dict) -> None:
        group = found.get("group")
        root = found.get("src") == dist.get_rank() if found.get("src") is not None \
            else found.get("group_src") == dist.get_rank(group)
        total.bytes += _received(name, found, root, dist.get_world_size(group))
        total.calls[name] = total.calls.get(name, 0) + 1

    with watch_collectives(count, COUNTED):
        yield total
