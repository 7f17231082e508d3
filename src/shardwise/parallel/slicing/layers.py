"""Slicing one module in place: its parameters keep their objects and names, their data becomes
this rank's slice, and its forward is replaced by the sliced one (Note [f and g] in comm.py).

Note [sliced parameters]: a sliced parameter stays the same `nn.Parameter` object (so a tied
embedding and head, which are one object, stay one object and their gradient is the sum of
both uses), holds this rank's slice as its data, and records where that slice sits in the
full tensor as a `SlicedParam`, kept beside the parameter (`record_slice`, engine/protocol.py),
which full-tensor exports and the checkpoint path read. A parameter no plan entry slices (a norm,
a row-sliced layer's bias) is whole on every rank of the tensor group and gets the same gradient on each.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise.engine.protocol import record_slice, slice_record
from shardwise.errors import ShardwiseError
from shardwise.parallel.slicing.comm import copy_to_slices, reduce_from_slices
from shardwise.parallel.slicing.loss import slice_logits
from shardwise.parallel.slicing.plan import Slice, deal


@dataclass(frozen=True, eq=False)
class SlicedParam:
    """Where this rank's slice of a parameter sits in the full tensor (Note [sliced parameters]).

    `segments[r]` are rank r's `(start, size)` runs of dimension `dim`, concatenated in order."""

    dim: int
    segments: tuple[tuple[tuple[int, int], ...], ...]
    full_shape: torch.Size
    rank: int
    group: object

    @property
    def sizes(self) -> list[int]:
        return [sum(size for _, size in segs) for segs in self.segments]

    def take(self, full: Tensor) -> Tensor:
        """This rank's slice of a full tensor (a copy)."""
        return torch.cat([full.narrow(self.dim, s, n) for s, n in self.segments[self.rank]], dim=self.dim)

    def place(self, parts: list[Tensor]) -> Tensor:
        """The full tensor from every rank's slice, `parts[r]` being rank r's."""
        full = parts[0].new_empty(self.full_shape)
        for segs, part in zip(self.segments, parts):
            at = 0
            for start, size in segs:
                full.narrow(self.dim, start, size).copy_(part.narrow(self.dim, at, size))
                at += size
        return full


def _is_conv1d(module: nn.Module) -> bool:
    # Hugging Face's GPT-2 Conv1D: a Linear whose weight is stored transposed, [in, out].
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(module.weight, Tensor)


def _slice_param(param: nn.Parameter, dim: int, per_rank, rank: int, group, what: str) -> None:
    segments = tuple(tuple(segs) for segs in per_rank)
    done = slice_record(param)
    if done is not None:  # a tied parameter reached from its second module
        if done.dim != dim or done.segments != segments:
            raise ShardwiseError(f"{what} is tied to a parameter already sliced another way (dim {done.dim}); "
                                 "slice both modules that share it the same way (e.g. both 'vocab')")
        return
    record = SlicedParam(dim, segments, param.shape, rank, group)
    with torch.no_grad():
        param.data = record.take(param.detach()).contiguous()
    param.grad = None
    record_slice(param, record)


def slice_module(name: str, module: nn.Module, spec: Slice, rank: int, world: int, group) -> None:
    """Slice `module` (named `name`) in place as `spec` says, for rank `rank` of `world` in `group`."""
    what = f"module {name!r} ({type(module).__name__})"
    if spec.kind == "divide":
        _divide(module, spec.attrs, world, what)
        return
    if isinstance(module, nn.Embedding):
        if spec.kind != "vocab":
            raise ShardwiseError(f"{what} is an Embedding: slice it as 'vocab', not {spec.kind!r}")
        if module.max_norm is not None or module.sparse:
            raise ShardwiseError(f"{what}: an Embedding with max_norm or sparse=True cannot be sliced; "
                                 "build it without them")
        per_rank = deal(_full_shape(module.weight)[0], world, what=what)
        _slice_param(module.weight, 0, per_rank, rank, group, what)
        module.forward = types.MethodType(_vocab_embedding_forward(per_rank[rank][0], group), module)
        return
    conv = _is_conv1d(module)
    if not (isinstance(module, nn.Linear) or conv):
        raise ShardwiseError(f"{what}: only nn.Linear, Hugging Face's Conv1D and nn.Embedding can be sliced "
                             f"(as {spec.kind!r}); name their Linear children in the plan instead")
    out_dim, in_dim = (1, 0) if conv else (0, 1)
    shape = _full_shape(module.weight)
    out_features, in_features = shape[out_dim], shape[in_dim]
    if spec.kind in ("colwise", "vocab"):
        per_rank = deal(out_features, world, spec.parts, spec.heads, what=what)
        _slice_param(module.weight, out_dim, per_rank, rank, group, what)
        if module.bias is not None:
            _slice_param(module.bias, 0, per_rank, rank, group, what)
        vocab = (per_rank[rank][0][0], out_features) if spec.kind == "vocab" else None
        if vocab is not None and spec.parts != 1:
            raise ShardwiseError(f"{what}: a 'vocab' head has no fused parts; drop parts=")
        module.forward = types.MethodType(_column_forward(conv, group, vocab), module)
    else:  # rowwise
        per_rank = deal(in_features, world, spec.parts, spec.heads, what=what)
        _slice_param(module.weight, in_dim, per_rank, rank, group, what)
        module.forward = types.MethodType(_row_forward(conv, group), module)


def _full_shape(param: Tensor) -> torch.Size:
    """The unsliced shape (a tied parameter may already be sliced through its other module)."""
    done = slice_record(param)
    return done.full_shape if done is not None else param.shape


def _divide(module: nn.Module, attrs: tuple[str, ...], world: int, what: str) -> None:
    for attr in attrs:
        value = getattr(module, attr, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ShardwiseError(f"{what} has no integer attribute {attr!r} to divide; fix divide(...) in the plan")
        if value % world:
            raise ShardwiseError(f"{what}.{attr}={value} cannot be divided by {world} tensor ranks; use a tensor "
                                 f"group size that divides {value}")
    for attr in attrs:
        setattr(module, attr, getattr(module, attr) // world)


def _matmul(conv: bool, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if not conv:
        return F.linear(x, weight, bias)
    shape = (*x.shape[:-1], weight.shape[1])
    flat = x.reshape(-1, x.shape[-1])
    out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return out.view(shape)


def _column_forward(conv: bool, group, vocab: tuple[int, int] | None):
    def forward(self, x: Tensor) -> Tensor:
        out = _matmul(conv, copy_to_slices(x, group), self.weight, self.bias)
        return out if vocab is None else slice_logits(out, group, *vocab)
    return forward


def _row_forward(conv: bool, group):
    def forward(self, x: Tensor) -> Tensor:
        # The bias is added once, after the partial outputs are summed (it is whole on every rank).
        out = reduce_from_slices(_matmul(conv, x, self.weight, None), group)
        return out if self.bias is None else out + self.bias
    return forward


def _vocab_embedding_forward(segment: tuple[int, int], group):
    start, size = segment

    def forward(self, ids: Tensor) -> Tensor:
        # Rows outside this rank's vocabulary read row 0 and are zeroed; the sum over ranks
        # then holds exactly one nonzero term per token: the owner's row.
        outside = (ids < start) | (ids >= start + size)
        local = (ids - start).masked_fill(outside, 0)
        padding = self.padding_idx - start if self.padding_idx is not None and 0 <= self.padding_idx - start < size \
            else None
        rows = F.embedding(local, self.weight, padding)
        return reduce_from_slices(rows.masked_fill(outside.unsqueeze(-1), 0.0), group)
    return forward
