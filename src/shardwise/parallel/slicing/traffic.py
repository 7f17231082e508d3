"""Bytes moved per training step: predicted for a GPT-shaped model on a data x tensor mesh, and
counted by wrapping torch.distributed's collectives.

Note [traffic model]: per rank and per step, in payload bytes (the size of the tensor each
collective is called on: the gathered output of an all-gather, the input of a reduce-scatter,
the buffer of an all-reduce), for B sequences of S tokens per data rank, width D, L blocks,
MLP ratio r, vocabulary V, c bytes per element:
- zero3 over N data ranks: every unit's parameters gathered once in forward, and once more in
  backward except the root and the last block (both still gathered when backward starts):
  (P_root + (2L-1)·P_block)·c gathered; every unit's gradients reduce-scattered once: P·c.
  P counts what the ranks of one data group hold whole (their slices, on a 2-D mesh), rows
  padded to a multiple of N. Which parameters any rank used is agreed apart, in one integer
  all-reduce per step (Note [unused params] in the engine), counted with the agreements.
- slicing over T tensor ranks: per block, the attention output and the MLP output are summed in
  forward (g) and the gradients at the attention and MLP inputs in backward (f): 4·B·S·D; the
  embedding's sum (g) and the head input's gradient (f): 2·B·S·D; the sliced loss: 3·B·S
  (the max, then the target's logit and the sum of exponentials); and 32 bytes per forward
  that check every rank of the group was given the same inputs (Note [same inputs] in
  api.py). All of it but those 32 bytes is activations:
  it grows with the batch and not with the width of the MLP, while zero3's grows with the
  parameters and not with the batch.
A ring moves (N-1)/N of a gather's or a reduce-scatter's payload per rank and 2(N-1)/N of an
all-reduce's: `wire_bytes`. The two small agreement collectives the engine issues per forward
(int64 signatures) are counted under `other`, not predicted.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from shardwise.collective_watch import watch_collectives
from shardwise.engine.layout.rows import padded_numel


@dataclass
class Traffic:
    """Payload bytes per rank and step by what carries them; `wire_bytes` is what a ring moves."""

    data_gather: int = 0
    data_reduce: int = 0
    tensor_reduce: int = 0
    wire_bytes: float = 0.0
    other: int = 0  # counted only: small agreement collectives
    calls: dict = field(default_factory=lambda: defaultdict(int))

    @property
    def total(self) -> int:
        return self.data_gather + self.data_reduce + self.tensor_reduce


_CHECK_BYTES = 4 * 8  # Note [same inputs]: four float64 numbers per forward


def _padded(shape: tuple[int, ...], world: int) -> int:
    return padded_numel(shape, world)


def _split(n: int, world: int, rank: int = 0) -> int:
    return n // world + (rank < n % world)


def predict_gpt(vocab: int, d_model: int, n_layers: int, mlp_ratio: int, seq: int, batch: int, *,
                data: int, tensor: int, dtype_bytes: int = 4, tensor_rank: int = 0) -> Traffic:
    """Note [traffic model] for `shardwise.models.gpt.GPT` (tied head, biased MLP and attention output,
    no qkv bias) on a `data` x `tensor` mesh, `batch` sequences per data rank, for tensor rank
    `tensor_rank` (uneven slices differ by rank). zero3 runs over the data axis whenever data > 1."""
    d, hidden = d_model, mlp_ratio * d_model
    heads_width = d // tensor  # heads divide evenly (plan.deal refuses otherwise)
    ffn = _split(hidden, tensor, tensor_rank)
    block = [(3 * heads_width, d), (d, heads_width), (d,), (d,), (d,), (d,), (d,),  # qkv, proj w/b, ln_1, ln_2
             (ffn, d), (ffn,), (d, ffn), (d,)]  # mlp up w/b, down w/b
    root = [(_split(vocab, tensor, tensor_rank), d), (seq, d), (d,), (d,)]  # tok_emb, pos_emb, ln_f
    traffic = Traffic()
    if data > 1:
        block_elems, root_elems = sum(_padded(s, data) for s in block), sum(_padded(s, data) for s in root)
        traffic.data_gather = dtype_bytes * ((2 * n_layers - 1) * block_elems + root_elems)
        traffic.data_reduce = dtype_bytes * (n_layers * block_elems + root_elems)
        traffic.wire_bytes += (traffic.data_gather + traffic.data_reduce) * (data - 1) / data
    if tensor > 1:
        tokens = batch * seq
        traffic.tensor_reduce = dtype_bytes * (tokens * d * (4 * n_layers + 2) + 3 * tokens) + _CHECK_BYTES
        traffic.wire_bytes += traffic.tensor_reduce * 2 * (tensor - 1) / tensor
    return traffic


@contextmanager
def count_collectives(tensor_group=None):
    """Count payload bytes of every collective this rank issues inside the block (Note [traffic
    model]); yields a `Traffic` filled as they run. A collective on `tensor_group` is the slices';
    a floating-point one on any other group is the engine's data-axis traffic, whatever form the
    engine gives it (an all-gather, or one broadcast per rank; a reduce-scatter, an all-to-all whose
    copies each rank sums, or an all-reduce of which each rank keeps its rows): gathers add up to
    the gathered size, reductions to the reduced buffer's. Integer collectives (the engine's
    agreements) go to `other`."""
    traffic = Traffic()
    tensor_ranks = dist.get_process_group_ranks(tensor_group) if tensor_group is not None else None

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    # each watched collective: its kind here, its payload bytes and the tensor whose dtype decides
    payload = {"all_reduce": ("all_reduce", lambda a: nbytes(a["tensor"]), "tensor"),
               "all_gather_single": ("gather", lambda a: nbytes(a["output_tensor"]), "input_tensor"),
               "reduce_scatter_single": ("reduce_scatter", lambda a: nbytes(a["input"]), "input"),
               "all_to_all_single": ("all_to_all", lambda a: nbytes(a["input"]), "input"),
               "all_gather": ("gather", lambda a: sum(nbytes(t) for t in a["tensor_list"]), "tensor"),
               "broadcast": ("broadcast", lambda a: nbytes(a["tensor"]), "tensor")}

    def record(name: str, args: dict) -> None:
        kind, size_of, typed = payload[name]
        group, size = args["group"], dist.get_world_size(args["group"])
        nbytes_, floating = size_of(args), args[typed].is_floating_point()
        on_tensor = tensor_ranks is not None and group is not None and \
            dist.get_process_group_ranks(group) == tensor_ranks
        if on_tensor:
            traffic.calls["tensor_all_reduce"] += 1
            traffic.tensor_reduce += nbytes_
            traffic.wire_bytes += nbytes_ * 2 * (size - 1) / size
        elif floating and kind in ("gather", "broadcast"):
            traffic.calls["data_" + kind] += 1
            traffic.data_gather += nbytes_
            traffic.wire_bytes += nbytes_ * (size - 1) / size
        elif floating:
            traffic.calls["data_" + kind] += 1
            traffic.data_reduce += nbytes_
            traffic.wire_bytes += nbytes_ * (2 if kind == "all_reduce" else 1) * (size - 1) / size
        else:
            traffic.other += nbytes_

    with watch_collectives(record, tuple(payload)):
        yield traffic
