"""The sharing-pattern model zoo: one tiny model per way a parameter can be shared,
skipped or frozen, so every strategy can be checked against a single process on each.

Every model has `forward(x, y) -> scalar loss`, a mean over the batch (so the mean
over equal-size rank slices is the full-batch loss), and `begin_step(step)`, which
the training loop calls before each step. Models that change per step decide it in
`begin_step` only, from `(self.seed, step)` (Note [per-step choices]).

Note [per-step choices]: every rank, and every micro-batch of a step, must take the
same path through the model, or the ranks' gradients would be for different
models. So the choice is drawn once per step from a generator seeded by
`(seed, step)` and never from torch's global RNG, which ranks consume differently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from .gpt import GPT, Block, GPTConfig

WIDTH = 16  # feature width of the float-input models
GPT_CONFIG = GPTConfig(seq_len=8)  # the zoo's GPT: short sequences keep it fast on CPU


def step_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator that depends only on `(seed, step)`: same on every rank."""
    # Steps stay far below 1_000_003, so distinct (seed, step) pairs give distinct seeds.
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class ZooModel(nn.Module):
    """Base of the zoo: `seed` for per-step choices and a no-op `begin_step`."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed

    def begin_step(self, step: int) -> None:
        """Called before each optimizer step; models that vary per step override it."""

    def unused_now(self) -> set[str]:
        """Prefixes of the trainable parameters that get no gradient in the current step."""
        return set()


class ResidualMLP(nn.Module):
    """x + fc2(gelu(fc1(x))): the repeated block (and unit class) of the float models."""

    def __init__(self, width: int = WIDTH, hidden: int = 2 * WIDTH) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class TiedGPT(GPT, ZooModel):
    """Sharing case: tied weights. The output head's weight is the token embedding's,
    one Parameter used at the start and at the end of the forward."""

    def __init__(self) -> None:
        super().__init__(GPT_CONFIG)


class ReusedBlock(ZooModel):
    """Sharing case: one block applied N=3 times in one forward (ALBERT-style), so its
    gradient is the sum of three uses and must be reduced once, after the last."""

    num_repeats = 3

    def __init__(self) -> None:
        super().__init__()
        self.block = ResidualMLP()
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for _ in range(self.num_repeats):
            x = self.block(x)
        return F.mse_loss(self.head(x), y)


class Branch(nn.Module):
    """A branch with its own projection and a `shared` Linear it does not own alone."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.shared = shared

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(torch.tanh(self.proj(x)))


class SharedBranch(ZooModel):
    """Sharing case: one sub-module used by two branches. The same `shared` Linear is
    a child of both `left` and `right` (named_parameters() yields it once, as
    `left.shared.*`), so with Branch as the unit class it belongs to neither branch's
    unit but to the root's."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(WIDTH, WIDTH)
        self.left = Branch(shared)
        self.right = Branch(shared)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        # Different inputs to the two branches, so the two uses' gradients differ.
        return F.mse_loss(self.head(self.left(x) + self.right(x * x)), y)


class VaryingDepth(ZooModel):
    """Sharing case: a forward whose depth varies per step (the dynamic control-flow
    net of PyTorch's tutorial): the same block applied 1-4 times, the depth drawn in
    `begin_step`, so the number of uses of one parameter changes from step to step."""

    max_depth = 4

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.block = ResidualMLP()
        self.head = nn.Linear(WIDTH, WIDTH)
        self.depth = 1  # until begin_step draws one

    def begin_step(self, step: int) -> None:
        g = step_generator(self.seed, step)
        self.depth = int(torch.randint(1, self.max_depth + 1, (), generator=g))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        x = torch.tanh(self.stem(x))
        for _ in range(self.depth):
            x = self.block(x)
        return F.mse_loss(self.head(x), y)


class UnusedBranch(ZooModel):
    """Sharing case: a branch unused in some steps. Whether `branch` runs is drawn in
    `begin_step`; in a step where it does not, its parameters get no gradient at all
    (grad stays None, so AdamW leaves them and their state untouched)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = ResidualMLP()
        self.branch = ResidualMLP()
        self.head = nn.Linear(WIDTH, WIDTH)
        self.use_branch = True  # until begin_step draws

    def begin_step(self, step: int) -> None:
        g = step_generator(self.seed, step)
        self.use_branch = bool(torch.rand((), generator=g) < 0.5)

    def unused_now(self) -> set[str]:
        return set() if self.use_branch else {"branch."}

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        x = self.trunk(x)
        if self.use_branch:
            x = self.branch(x)
        return F.mse_loss(self.head(x), y)


class Frozen(ZooModel):
    """Sharing case: frozen layers (requires_grad=False from construction). layers[0]
    is frozen whole, layers[1] only in fc1 (a unit mixing frozen and trainable
    parameters), layers[2] and head train; gradients flow through frozen layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ResidualMLP() for _ in range(3))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.layers[0].requires_grad_(False)
        self.layers[1].fc1.requires_grad_(False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x), y)


class OddShapes(ZooModel):
    """Sharing case: none; padding edge cases for dim-0 sharding. A 0-D `scale`, a
    (3, 16) `few_rows` (fewer rows than 4 ranks), an odd-length 1-D `bias` of 3, and
    an empty (0, 16) `empty` that is concatenated onto few_rows, so it takes part in
    the forward (and gets an empty gradient) without changing the result."""

    num_classes = 3

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.few_rows = nn.Parameter(0.1 * torch.randn(self.num_classes, WIDTH))
        self.empty = nn.Parameter(torch.empty(0, WIDTH))
        self.bias = nn.Parameter(torch.zeros(self.num_classes))
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        weight = torch.cat([self.few_rows, self.empty], dim=0)  # still (3, 16)
        logits = self.scale * (torch.tanh(self.proj(x)) @ weight.T) + self.bias
        return F.cross_entropy(logits, y)


class TwoTower(ZooModel):
    """Forward pattern: two forwards before one backward (siamese and contrastive training,
    two-pass losses). The zoo loop calls it twice per micro-batch (`forward_passes=2`, the
    second time on rolled inputs) and backwards the mean, so every unit is used in two
    forward passes and both contributions must be reduced."""

    forward_passes = 2

    def __init__(self) -> None:
        super().__init__()
        self.encoder = ResidualMLP()
        self.proj = ResidualMLP()
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(self.head(self.proj(self.encoder(x))), y)


class NonConsecutive(ZooModel):
    """Forward pattern: a unit used again after another ran (A, B, A: cyclic layer sharing).
    Under zero3, A is freed when B runs and must be gathered again for its second use."""

    def __init__(self) -> None:
        super().__init__()
        self.a = ResidualMLP()
        self.b = ResidualMLP()
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(self.head(self.a(self.b(self.a(x)))), y)


class RecurrentCell(nn.Module):
    """h' = tanh(W_x x + W_h h): the unit of `Recurrent`."""

    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(WIDTH, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: Tensor, h: Tensor) -> Tensor:
        return torch.tanh(self.input(x) + self.hidden(h))


class Recurrent(ZooModel):
    """Forward pattern: a recurrent cell applied T=3 times over time steps, with a loss from
    two forward passes (`forward_passes=2`): one unit used 6 times across two forwards."""

    num_steps = 3
    forward_passes = 2

    def __init__(self) -> None:
        super().__init__()
        self.cell = RecurrentCell()
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = torch.zeros_like(x)
        for t in range(self.num_steps):
            h = self.cell(x.roll(t, dims=-1), h)
        # Summed over features (not averaged): gradients large enough for the grid's clipping to act.
        return (self.head(h) - y).pow(2).sum(-1).mean()


class EarlyExit(ZooModel):
    """Forward pattern: backward through only part of the graph. Both blocks run in every
    forward, but in some steps (drawn in `begin_step`) the loss is taken at the early exit,
    so the second block and the final head get no gradient although they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.first = ResidualMLP()
        self.second = ResidualMLP()
        self.early_head = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.exit_early = False  # until begin_step draws

    def begin_step(self, step: int) -> None:
        g = step_generator(self.seed, step)
        self.exit_early = bool(torch.rand((), generator=g) < 0.5)

    def unused_now(self) -> set[str]:
        return {"second.", "head."} if self.exit_early else {"early_head."}

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.first(x)
        late = self.head(self.second(h))
        return F.mse_loss(self.early_head(h) if self.exit_early else late, y)


class CheckpointedBlock(ResidualMLP):
    """A ResidualMLP whose own forward uses torch.utils.checkpoint (recomputed in backward)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


class InnerCheckpoint(ZooModel):
    """Forward pattern: `torch.utils.checkpoint` inside a unit, so the unit's parameters are
    used again by the recompute during backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CheckpointedBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


# ---- batches -------------------------------------------------------------------


def _float_batch(g: torch.Generator, n: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(n, WIDTH, generator=g)
    y = torch.randn(n, WIDTH, generator=g)
    return x, y


def _token_batch(g: torch.Generator, n: int) -> tuple[Tensor, Tensor]:
    # Next-token targets: y is x shifted by one position.
    seq = torch.randint(0, GPT_CONFIG.vocab_size, (n, GPT_CONFIG.seq_len + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def _class_batch(g: torch.Generator, n: int) -> tuple[Tensor, Tensor]:
    x = torch.randn(n, WIDTH, generator=g)
    y = torch.randint(0, OddShapes.num_classes, (n,), generator=g)
    return x, y


# ---- registry ------------------------------------------------------------------


@dataclass(frozen=True)
class ZooSpec:
    """How to build one zoo model and its data.

    `make_batch(generator, n)` returns n examples; `unit_class` is the repeated block
    class to cut units at (None: the root only); `skips_params` is True when some
    trainable parameter may get no gradient in a step; `forward_passes` is how many
    times the training loop calls the model per micro-batch before one backward.
    """

    name: str
    build: Callable[[], ZooModel]
    make_batch: Callable[[torch.Generator, int], tuple[Tensor, Tensor]]
    unit_class: type | None
    skips_params: bool
    forward_passes: int = 1


ZOO: dict[str, ZooSpec] = {
    spec.name: spec
    for spec in [
        ZooSpec("gpt", TiedGPT, _token_batch, Block, False),
        ZooSpec("reused_block", ReusedBlock, _float_batch, ResidualMLP, False),
        ZooSpec("shared_branch", SharedBranch, _float_batch, Branch, False),
        ZooSpec("varying_depth", VaryingDepth, _float_batch, ResidualMLP, False),
        ZooSpec("unused_branch", UnusedBranch, _float_batch, ResidualMLP, True),
        ZooSpec("frozen", Frozen, _float_batch, ResidualMLP, False),
        ZooSpec("odd_shapes", OddShapes, _class_batch, None, False),
        ZooSpec("two_tower", TwoTower, _float_batch, ResidualMLP, False, forward_passes=2),
        ZooSpec("non_consecutive", NonConsecutive, _float_batch, ResidualMLP, False),
        ZooSpec("recurrent", Recurrent, _float_batch, RecurrentCell, False, forward_passes=2),
        ZooSpec("early_exit", EarlyExit, _float_batch, ResidualMLP, True),
        ZooSpec("inner_checkpoint", InnerCheckpoint, _float_batch, CheckpointedBlock, False),
    ]
}


def build(name: str, seed: int = 0) -> ZooModel:
    """Build zoo model `name` with torch seeded by `seed`: same seed, same parameters.

    `seed` also becomes the model's `seed` for its per-step choices.
    """
    if name not in ZOO:
        raise KeyError(f"unknown zoo model {name!r}; choose one of {sorted(ZOO)}")
    torch.manual_seed(seed)
    model = ZOO[name].build()
    model.seed = seed
    return model
