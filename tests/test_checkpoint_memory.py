"""Memory: saving and loading a zero3 model never materializes the model or its optimizer state."""

from __future__ import annotations

from helpers.ckpt_more_ranks import memory_during_checkpoint, save_one_rank_stack
from shardwise.checkpoint.format.files import CHUNK_BYTES

NUM_UNITS, WIDTH = 8, 1024  # 8 Linear units of 4 MiB: 32 MiB of parameters, 48 MiB of state per rank at 2 ranks
MIB = 2**20


def test_zero3_save_and_load_peak_rss(ranks, tmp_path):
    """Catches a save or load that gathers full parameters or reads whole files into memory
    (a full state dict, `torch.load` of everything, a memory map left open): each rank's
    peak RSS may grow by at most one unit's full size plus the I/O buffers (two checksum
    chunks) plus 4 MiB of Python objects, against 48 MiB of model state per rank. RSS is
    measured with a fixed malloc mmap threshold (Note [mmap threshold] in helpers/ckpt_more_ranks.py)."""
    unit_bytes = (WIDTH * WIDTH + WIDTH) * 4
    bound = unit_bytes + 2 * CHUNK_BYTES + 4 * MIB
    ranks.run(save_one_rank_stack, 1, str(tmp_path), NUM_UNITS, WIDTH, timeout=120)
    results = ranks.run(memory_during_checkpoint, 2, str(tmp_path), NUM_UNITS, WIDTH, timeout=120)
    for rank, result in enumerate(results):
        assert result["rank_state_bytes"] >= 3 * bound, "the model is too small to tell a bounded peak apart"
        for what in ("save", "load", "reshard_load", "export"):
            assert result[what] <= bound, (
                f"rank {rank}: {what} grew peak RSS by {result[what] / MIB:.1f} MiB; the bound is "
                f"{bound / MIB:.1f} MiB (one unit {unit_bytes / MIB:.1f} MiB + I/O buffers)"
            )
