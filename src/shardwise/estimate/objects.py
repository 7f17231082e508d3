"""What each parameter tensor costs a rank besides its elements (Note [per-tensor objects]): a term of `sw.estimate`'s
total (`tensor_objects`), counted per parameter tensor. Uses: nothing.

Note [per-tensor objects]: the table of estimate/core.py counts elements; every parameter tensor a rank holds also
costs objects that no element count sees, once the steps run: the parameter's Python objects and its module's
bookkeeping, the C++ tensors of its gradient and optimizer state (TensorImpls, storages, autograd's accumulator, the
0-d `step` counter), the engine's record of it, and the rounding of each of its storages to whole pages (with
MALLOC_MMAP_THRESHOLD_=65536 every storage of 64 KiB or more is its own mapping, Note [allocator] in core.py).
Measured on bench/memory/max_model.py's GPT (11 tensors a block), 4 ranks, zero3, fp32 AdamW, 3 steps, each
rank's peak RSS against sw.estimate (bench/memory/estimate_gap.py, results/estimate_gap.md): the difference grows by
0.28 MiB a block from 20 to 135 blocks at d_model 512, 0.27 at d_model 768 (2.25x the elements a block), FSDP2 and
zero3 + bf16 + optimizer in backward + 8-bit AdamW + checkpointing alike (0.30): a cost per tensor, not per
element. glibc's mallinfo2 on each rank at 20 and 60 blocks (d_model 512, at the step) splits the 0.29 MiB a
block: 0.10 Python objects (pymalloc's own arenas: RSS outside malloc), 0.08 small allocations in malloc's heap,
0.08 free heap between them, 0.03 page rounding of the mapped storages. So 26 KiB per tensor (0.28 MiB / 11) are
counted for every parameter tensor of the model (frozen ones too: an upper bound; a bare parameter count is one
tensor a unit). Below d_model 512 at this sequence length an activation of T·D floats is under the mmap threshold,
so it lands in malloc's heap among those small objects, and the heap keeps growing from step to step (d_model 256,
20 to 60 blocks: 0.12, 0.34, 0.52 MiB a block free in the heap after steps 1, 2, 3, against 0.03-0.08 at d_model
512): not modelled; such a narrow model ran 0.54 MiB a block over the estimate after 3 steps
(results/estimate_gap.md's d_model 256 rows).
"""

from __future__ import annotations

TENSOR_OBJECT_BYTES = 26 * 1024  # per parameter tensor: Note [per-tensor objects]


def tensor_object_bytes(num_tensors: int) -> int:
    """Bytes a rank holds for `num_tensors` parameter tensors beyond their elements (Note [per-tensor objects])."""
    return TENSOR_OBJECT_BYTES * num_tensors
