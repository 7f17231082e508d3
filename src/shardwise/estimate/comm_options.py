"""The communication layer's share of a rank's memory, for `sw.estimate`: hpZ's secondary chunks, the
compressed forms' wire buffers (engine/comm/), and the note saying what the gather/reduce buffers row holds.
The rest of the engine's memory is core.py's.

Note [comm option bytes]:
- hpZ (`reshard_after_forward=N`, Note [secondary shards], engine/unit/secondary.py): each zero3 unit freed
  in its forward keeps, from then to the end of backward, its 1/N chunk of its full values in the compute
  dtype: c * ceil(F / N), with F its padded full size. Every unit but the root (gathered for the whole
  forward) and the last one to run (kept gathered for backward to start with): of the units in
  registration order, every non-root one but the last. All of them at once at the end of forward, beside
  the activations, so the peak counts their sum (`secondary`; tests/test_hpz.py measures it).
- Compression (`sw.Compression`, Note [quantized collectives], engine/comm/quantize.py): one quantized
  gather and one quantized reduce in flight hold uint8 wire buffers (int8: one byte per element, int4:
  half, plus one fp32 scale per block), over the largest unit, the root included. They are lent by the
  engine's comm pool and counted in its bound (`wire_buffer_bytes`, Note [reused buffers]), so they join the
  gather/reduce buffers row.
"""

from __future__ import annotations


def secondary_bytes(full_sizes: list[int], compute_bytes: int, reshard_after_forward: bool | int) -> int:
    """hpZ's chunks held at the end of forward: `full_sizes` are the non-root units' padded full sizes, in
    registration order (the last is still gathered when forward ends: no chunk)."""
    if reshard_after_forward is True or reshard_after_forward is False:
        return 0
    per_node = int(reshard_after_forward)
    return sum(compute_bytes * -(-full // per_node) for full in full_sizes[:-1])


def gather_note(strategy: str, probed: bool, no_batch: bool, kept_input: bool = False, prefetch: int = 1,
                *, kept_pool: bool) -> str:
    """What the gather/reduce buffers row holds, in a line (Note [transient buffers]); `prefetch`: zero3's gathers in
    flight beside the unit in use (Note [prefetch depth], stage.py); `kept_pool`: the comm pool kept between steps
    (zero1/zero2; zero3 with keep_comm_buffers, Note [lean tail])."""
    held = {"ddp": "autograd's copy of the largest gradient before it lands in its bucket",
            "zero3": f"the root unit and up to {1 + prefetch} others gathered at once"}.get(
                strategy, "two units re-gathered after the step")
    if strategy == "ddp":
        return f"gather/reduce buffers: held only while a step runs: {held}"
    kept = ("lent by the engine's comm pool in backward, none kept between steps (Note [lean tail])"
            if not kept_pool
            else "kept between steps by the engine's comm pool (Note [reused buffers])")
    if probed:
        return f"gather/reduce buffers: {kept}: {held}, and one reduce in flight"
    probe = (" (with batch= the probe counts those gradients among the activations: this row is then smaller)"
             if no_batch else "")
    reduce = ("its receive buffer: the kept gradients are its input" if kept_input
              else "its input and its receive buffer")
    return (f"gather/reduce buffers: {kept}: {held} and one reduce in flight ({reduce}), plus in backward one "
            f"unit's and the root's full gradients{probe}")
