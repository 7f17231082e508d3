"""Logits that stay sliced by vocabulary, and the cross-entropy computed on the slices.

Note [sliced logits]: a "vocab" head gives each rank the logits of its own vocabulary rows.
Gathering them would cost batch x sequence x vocabulary numbers per rank, the largest
activation of a language model; Megatron-LM instead computes the loss on the slices with
three small all-reduces (the max, the target's logit, the sum of exponentials), each of
batch x sequence numbers. The head returns its logits as `SlicedLogits`, a tensor subclass
that knows its slice: reshapes that keep the vocabulary as the last dimension keep it
sliced, `F.cross_entropy` on it runs `sliced_cross_entropy`, and any other operation
(softmax, argmax, a slice of the vocabulary) raises a ShardwiseError, because its result
would be this rank's part only. A model's own `F.cross_entropy(logits.reshape(-1, V), y)`
therefore works unchanged; `gather_logits` gives the full logits where they are needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils._pytree import tree_flatten

from shardwise.errors import ShardwiseError


class SlicedLogits(Tensor):
    """This rank's vocabulary slice of some logits (Note [sliced logits]); `vocab_slice` is
    (group, first vocabulary row held here, full vocabulary size)."""

    vocab_slice: tuple

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sliced = next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, SlicedLogits))
        if func is F.cross_entropy:
            return _cross_entropy_call(*args, **kwargs)
        try:
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
        except RuntimeError as error:  # e.g. a view with the full vocabulary size: say why
            raise ShardwiseError(f"{error} (on vocabulary-sliced logits: this rank holds {sliced.shape[-1]} of "
                                 f"{sliced.vocab_slice[2]} columns; use logits.shape[-1], not the vocabulary "
                                 "size, or sw.gather_logits(logits))") from None
        if not isinstance(out, Tensor) or func in _PLAIN:
            return out  # .shape, .dim(), repr, .grad: no vocabulary-sliced values
        local = sliced.shape[-1]
        if func in _KEEP and out.dim() >= 1 and out.shape[-1] == local and _keeps_vocab(func, args):
            return slice_logits(out, *sliced.vocab_slice)
        name = getattr(func, "__name__", str(func))
        raise ShardwiseError(
            f"{name} on vocabulary-sliced logits (this rank holds {local} of {sliced.vocab_slice[2]} columns) would "
            "give this rank's part only. F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets) runs on "
            "the slices; for anything else gather them first: sw.gather_logits(logits) (a collective).")


_PLAIN = {Tensor.__repr__, Tensor.__format__, Tensor.grad.__get__, Tensor.backward, Tensor.register_hook,
          Tensor.retain_grad}
_KEEP = {Tensor.reshape, Tensor.view, Tensor.flatten, Tensor.contiguous, Tensor.float, Tensor.to,
         Tensor.__getitem__, torch.flatten, torch.reshape}


def _keeps_vocab(func, args) -> bool:
    if func is Tensor.__getitem__:  # positions only: no tensor or list index (it could reorder columns)
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return all(isinstance(i, (int, slice, type(Ellipsis))) or i is None for i in index)
    return True


def slice_logits(local: Tensor, group, start: int, vocab: int) -> SlicedLogits:
    """Mark `local` as columns `start:` of logits over a vocabulary of `vocab` (Note [sliced logits])."""
    out = local.as_subclass(SlicedLogits)
    out.vocab_slice = (group, start, vocab)
    return out


def gather_logits(logits: Tensor) -> Tensor:
    """The full logits from vocabulary-sliced ones (a collective: every rank of the tensor group
    calls it); a plain tensor is returned as it is. Costs what the sliced loss avoids."""
    if not isinstance(logits, SlicedLogits):
        return logits
    group, _, vocab = logits.vocab_slice
    local = logits.as_subclass(Tensor)
    world = dist.get_world_size(group)
    sizes = [vocab // world + (r < vocab % world) for r in range(world)]  # plan.deal's split
    from shardwise.parallel.slicing.comm import gather_along
    return _GatherColumns.apply(local, sizes, group) if local.requires_grad else gather_along(local, -1, sizes, group)


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, sizes, group):
        from shardwise.parallel.slicing.comm import gather_along
        ctx.start, ctx.size = sum(sizes[: dist.get_rank(group)]), local.shape[-1]
        return gather_along(local, -1, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.start, ctx.size), None, None


def _cross_entropy_call(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    if weight is not None or size_average is not None or reduce is not None or label_smoothing != 0.0:
        raise ShardwiseError("F.cross_entropy on vocabulary-sliced logits supports ignore_index and reduction "
                             "only (no weight, label_smoothing or legacy size_average/reduce); gather the logits "
                             "with sw.gather_logits(...) for those")
    return sliced_cross_entropy(input, target, ignore_index=ignore_index, reduction=reduction)


def sliced_cross_entropy(logits: Tensor, target: Tensor, *, ignore_index: int = -100,
                         reduction: str = "mean") -> Tensor:
    """Cross-entropy of vocabulary-sliced `logits` (N, local vocab) against class indices `target`
    (N,), equal to `F.cross_entropy` on the full logits, without gathering them (Note [sliced logits])."""
    if not isinstance(logits, SlicedLogits):
        return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if logits.dim() != 2 or target.dim() != 1 or target.dtype.is_floating_point:
        raise ShardwiseError(f"cross-entropy on vocabulary-sliced logits takes (N, vocab) logits and (N,) class "
                             f"indices, got {tuple(logits.shape)} and {tuple(target.shape)} {target.dtype}; "
                             "flatten them: logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)")
    if reduction not in ("mean", "sum", "none"):
        raise ShardwiseError(f"reduction={reduction!r}: use 'mean', 'sum' or 'none'")
    group, start, _ = logits.vocab_slice
    if dist.get_world_size(group) == 1:  # one slice holds the whole vocabulary
        return F.cross_entropy(logits.as_subclass(Tensor), target, ignore_index=ignore_index, reduction=reduction)
    keep = target != ignore_index
    per_token = _SlicedCrossEntropy.apply(logits.as_subclass(Tensor), target.masked_fill(~keep, 0), keep,
                                          start, group)
    if reduction == "none":
        return per_token
    total = per_token.sum()
    return total if reduction == "sum" else total / keep.sum()


class _SlicedCrossEntropy(torch.autograd.Function):
    """Per-token loss log(sum_v exp(x_v)) - x_target over the whole vocabulary, from slices."""

    @staticmethod
    def forward(ctx, logits, target, keep, start, group):
        x = logits.float()
        biggest = x.max(dim=-1).values
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)  # for a stable exp only
        shifted = x - biggest.unsqueeze(-1)
        outside = (target < start) | (target >= start + x.shape[-1])
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        both = torch.stack([picked, exp.sum(dim=-1)])  # one all-reduce for the target's logit and the sum
        dist.all_reduce(both, group=group)
        loss = (both[1].log() - both[0]).masked_fill(~keep, 0.0)
        ctx.save_for_backward(exp.div_(both[1].unsqueeze(-1)), local, outside, keep)
        ctx.dtype = logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        saved, local, outside, keep = ctx.saved_tensors
        softmax = saved.clone()  # the saved one stays intact for a second backward (retain_graph)
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows, local] -= (~outside).to(softmax.dtype)  # minus the one-hot of the target
        softmax.mul_((grad.float() * keep).unsqueeze(-1))
        return softmax.to(ctx.dtype), None, None, None, None
