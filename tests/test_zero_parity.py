"""zero1/zero2/zero3 against the single-process reference, for every sharing pattern."""

import pytest

from helpers.forms import coll_threshold
from helpers.parity import check_parity, run_on_rank
from shardwise.models.zoo import ZOO

# (accum, clip): plain steps, then 2 micro-batches under no_sync with clipping (the
# clipped norm is compared with the reference's, step by step).
CONFIGS = [(1, None), (2, 0.5)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_parity_with_single_process(ranks, strategy, name, world_size):
    """Catches any wrong gradient, shard, gather, padding, tie or unused-parameter handling:
    5 AdamW steps with two param groups must equal the single-process run (fp32 1e-5/1e-6)."""
    check_parity(ranks, strategy, name, world_size, CONFIGS)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
@pytest.mark.parametrize("name", ["gpt", "reused_block", "varying_depth"])
def test_activation_checkpointing_leaves_results_unchanged(ranks, strategy, name):
    """Catches a recompute that runs on freed (zero3) or stale parameters, or whose gradient
    misses the unit's reduce: checkpointed units must give the reference's numbers."""
    check_parity(ranks, strategy, name, 2, CONFIGS, shard_kwargs={"checkpoint_activations": True})


def _run_with_torchs_reduce_and_gathers_in_place(*args):
    # every reduce through torch's reduce-scatter (NCCL's form), every gather in place (Note [gloo collectives])
    with coll_threshold(2**62, in_place_from=0):
        return run_on_rank(*args)


def _run_with_matrices_gathered_in_place(*args):
    # The zoo GPT's matrices hold 1.5-6 KiB per rank at 2 and 4 ranks, its vectors under 100 bytes.
    with coll_threshold(0, in_place_from=1024):
        return run_on_rank(*args)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", ["gpt", "unused_branch", "odd_shapes", "frozen"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_parity_with_torchs_reduce_scatter_and_gathers_in_place(ranks, strategy, name, world_size):
    """The grid above reduces the zoo's units on gloo by an all-to-all each rank sums (zero1's into its
    kept gradients) and gathers their small parameters packed; this runs the other forms: torch's
    reduce-scatter (the one NCCL takes) and every parameter gathered in place. Catches wrong rows
    kept, a missing average, rows landed in another parameter's place, or the unused-parameter
    flags lost in those forms."""
    check_parity(ranks, strategy, name, world_size, CONFIGS, rank_fn=_run_with_torchs_reduce_and_gathers_in_place)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_parity_with_some_parameters_gathered_in_place(ranks, strategy, world_size):
    """Real models' gathers on gloo: large parameters broadcast straight into their full region,
    small ones packed and copied out (Note [gathered in place]). Catches a parameter gathered
    into another's place, a packed segment offset wrong, or this rank's own rows left stale."""
    check_parity(ranks, strategy, "gpt", world_size, CONFIGS, rank_fn=_run_with_matrices_gathered_in_place)
