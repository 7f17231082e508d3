"""What a slicing plan says: which module is cut how, and how a dimension is dealt to ranks.

A plan maps module-name patterns (`*` stands for one name component: `blocks.*.mlp.0`) to a `Slice`, or to its string
form: "colwise", "rowwise", "vocab", "colwise(parts=3, heads=4)", "rowwise(heads=4)",
"divide(n_heads)". Strings are parsed here, once, into the typed `Slice`.

Note [dealing a dimension]: a sliced dimension of length n is `parts` equal blocks (a fused
q/k/v projection has 3) of `heads` heads each (or of single features when `heads` is None).
Each rank takes the same share of every block, so its local tensor is the concatenation of
`parts` segments of the full one. Features are dealt as evenly as possible (sizes differ by
at most one: exact, since each feature is computed independently); heads must divide evenly
(a rank's head count is one number the attention module reads), else slicing is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shardwise.errors import ShardwiseError

KINDS = ("colwise", "rowwise", "vocab", "divide")


@dataclass(frozen=True)
class Slice:
    """How one module is sliced across the tensor group.

    `kind`: "colwise" (a Linear's output features: its input arrives whole, its output is this
    rank's features), "rowwise" (its input features: the partial outputs are summed across
    ranks), "vocab" (an Embedding's rows, or an output head's vocabulary: logits stay sliced
    and `F.cross_entropy` on them runs on the slices, Note [sliced logits]), or "divide" (no
    weight: divide the module's integer attributes `attrs`, e.g. its head count, by the group size).
    `parts`: equal fused blocks in the sliced dimension (3 for a fused q/k/v projection).
    `heads`: heads per block; a rank then takes whole heads and the count must divide evenly.
    """

    kind: str
    parts: int = 1
    heads: int | None = None
    attrs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ShardwiseError(f"Slice(kind={self.kind!r}) is not one of {KINDS}")
        if not isinstance(self.parts, int) or self.parts < 1:
            raise ShardwiseError(f"Slice.parts must be a positive int, got {self.parts!r}")
        if self.heads is not None and (not isinstance(self.heads, int) or self.heads < 1):
            raise ShardwiseError(f"Slice.heads must be a positive int or None, got {self.heads!r}")
        if (self.kind == "divide") != bool(self.attrs):
            raise ShardwiseError("Slice(kind='divide') needs attrs=('n_heads', ...), and only 'divide' takes attrs")


_FORM = re.compile(r"^\s*(\w+)\s*(?:\((.*)\))?\s*$")


def parse(value: str | Slice, pattern: str) -> Slice:
    """The `Slice` a plan entry means; a ShardwiseError naming the entry if it means nothing."""
    if isinstance(value, Slice):
        return value
    match = _FORM.match(value) if isinstance(value, str) else None
    if match is None or match.group(1) not in KINDS:
        raise ShardwiseError(f"plan entry {pattern!r}: {value!r} is not a slice; use one of {KINDS}, e.g. "
                             "'colwise', 'rowwise(heads=4)', 'colwise(parts=3, heads=4)', 'divide(n_heads)', "
                             "or sw.Slice(...)")
    kind, args = match.group(1), [a.strip() for a in (match.group(2) or "").split(",") if a.strip()]
    if kind == "divide":
        return Slice("divide", attrs=tuple(args))
    options = {}
    for arg in args:
        key, _, number = arg.partition("=")
        if key.strip() not in ("parts", "heads") or not number.strip().isdigit():
            raise ShardwiseError(f"plan entry {pattern!r}: cannot read {arg!r} in {value!r}; options are "
                                 "parts=N and heads=N")
        options[key.strip()] = int(number)
    return Slice(kind, **options)


def resolve(model: torch.nn.Module, plan: dict) -> list[tuple[str, torch.nn.Module, Slice]]:
    """(name, module, slice) for every module a plan entry names, in module order. A pattern that
    names no module, or a module two patterns name, is refused (a typo must not slice nothing)."""
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, Slice]] = {}
    for pattern, value in plan.items():
        spec = parse(value, pattern)
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))  # one `*`: one name component
        names = [n for n in modules if n and regex.fullmatch(n)]
        if not names:
            sample = ", ".join(list(n for n in modules if n)[:8])
            raise ShardwiseError(f"plan entry {pattern!r} names no module of {type(model).__name__} (its modules "
                                 f"include: {sample}, ...); fix the pattern ('*' is one name component, "
                                 "e.g. 'blocks.*.mlp.0')")
        for name in names:
            if name in chosen:
                raise ShardwiseError(f"module {name!r} is named by two plan entries ({chosen[name][0]!r} and "
                                     f"{pattern!r}); give each module one slice")
            chosen[name] = (pattern, spec)
    return [(name, modules[name], chosen[name][1]) for name in modules if name in chosen]


def deal(length: int, world: int, parts: int = 1, heads: int | None = None, *,
         what: str) -> list[list[tuple[int, int]]]:
    """Per rank, its `(start, size)` segments of a dimension of `length` (Note [dealing a dimension])."""
    if length % parts:
        raise ShardwiseError(f"{what}: size {length} is not {parts} equal fused parts; fix parts= in the plan")
    block = length // parts
    if heads is not None:
        if block % heads:
            raise ShardwiseError(f"{what}: {block} features are not {heads} equal heads; fix heads= in the plan")
        if heads % world:
            raise ShardwiseError(
                f"{what}: {heads} heads cannot be sliced {world} ways (each rank must hold whole heads and the "
                f"same number of them). Use a tensor group size that divides {heads}, or a model whose head "
                "count is a multiple of it.")
        unit, count = block // heads, heads
    else:
        unit, count = 1, block
    if count < world:
        raise ShardwiseError(f"{what}: {count} {'heads' if heads else 'features'} cannot be sliced {world} ways "
                             "(some rank would hold none); use a smaller tensor group")
    sizes = [count // world + (r < count % world) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return [[(p * block + starts[r] * unit, sizes[r] * unit) for p in range(parts)] for r in range(world)]
