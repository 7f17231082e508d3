"""The zero stages as policies: when a unit's full values exist, whether its full gradients are kept,
what a step leaves behind. The step driver (zero.py), the units (flat_unit.py, unit_grads.py), the gather
schedule, the owners and the estimator ask a policy, in place of flags tested in each method.
Uses: freshness, residency, secondary, shard_storage.

Note [stages]: the three zero strategies are one mechanism (flat_unit.py) under three policies:

| stage | full params kept | full grads kept until the step | gathers in flight |
|-------|------------------|--------------------------------|-------------------|
| zero1 | yes              | yes: reduce-scattered per unit | 1 (re-gathers after a step) |
| zero2 | yes              | no: reduce-scattered per unit  | 1 |
| zero3 | no: per use      | no                             | `prefetch` (default 1: Note [prefetch depth]) |

Each stage is a class: the base answers for zero1/zero2 (full values kept), `Zero3` overrides what
zero3 does differently (when the full values exist: `needs_gather`, `free`, `storage`, `freshness`),
as zero2 vs zero3 is one branch in FSDP2's `FSDPParamGroup.reshard`; `Zero1` overrides what becomes of the
gradients (`kept_grads`, `reduces_kept_grads`). The same answers size the estimator's rows. The callers
never test which stage they run: they call the policy's action (`after_use`, `after_forward`,
`kept_grads`, ...), whose base does what zero1/zero2 do, often nothing.

When a unit's gradient is reduced is no policy's answer: at every stage the step driver issues a unit's
reduce as that unit's gradients are complete (`post_backward`, after every use, ties included), in the
reducer's fixed order, so the reduce overlaps the rest of backward; under no_sync none is issued and the
synced backward reduces what was kept the same way (tests/test_reduce_overlap.py counts the order). zero1
differs from zero2 only in keeping its full gradients: its pack lands in them and its average in its own
rows of them, where zero2 packs into a lent buffer and drops the full gradients once reduced.
"""

from __future__ import annotations

import torch

from shardwise.engine.unit.freshness import NoKeptValues, StepFreshness
from shardwise.engine.unit.residency import Residency, Residents
from shardwise.engine.unit.secondary import SecondaryShard
from shardwise.engine.unit.shard_storage import AliasedShards, HostRows, HostRowsKeptFull, OwnShards, OwnShardsKeptFull


class StagePolicy:
    """What every zero stage answers (Note [stages]); this base answers for zero1/zero2, which keep every
    unit's full values between uses. Stateless: one per engine, shared by its units."""

    name = ""
    # All-gathers the engine keeps issued ahead of use: zero3 prefetches one unit; zero1/zero2 one as
    # well, though their full buffers exist anyway (Note [eager re-gathers]).
    gathers_in_flight = 1
    # Whether backward's tail releases the comm pool (Note [lean tail], comm/buffers.py): zero1/zero2 never
    # re-gather in backward, so their pool is kept between steps; zero3 by default (keep_comm_buffers).
    trims_tail = False

    # ---- when the full values exist ----------------------------------------------------

    def storage(self, compute_dtype: torch.dtype, master_dtype: torch.dtype, host=None):
        """Where the unit's master rows live (shard_storage.py): at full precision a shard *is* its rows of
        the kept full buffer; with a lower compute dtype the fp32 master rows need storage of their own, as
        they do in host memory under offload="host" (`host`: the engine's HostCopies, Note [host offload])."""
        if host is not None:
            return HostRowsKeptFull(host)
        return AliasedShards() if compute_dtype == master_dtype else OwnShardsKeptFull()

    def freshness(self, stamp, num_params: int):
        """What tracks whether the kept full values are current (Note [stepped parameters], freshness.py)."""
        return StepFreshness(stamp, num_params)

    def needs_gather(self, unit) -> bool:
        """Whether `unit` must be gathered before its next use: the rows of a parameter changed since the
        last gather."""
        return unit.freshness.needs_gather()

    def gathers_on_use(self, unit) -> bool:
        """Whether a unit no queue holds is gathered where it is used: zero1/zero2 re-gather only from the
        forward's queue."""
        return False

    def holds_full(self, unit) -> bool:
        """Whether `unit`'s full values exist now: always."""
        return True

    def free(self, unit) -> None:
        """After a use: the full values are kept."""

    def prefetch_order(self, units: list, agreed_order: list[int]) -> list:
        """The order of this forward's gathers: re-gathers in registration order (Note [collective order],
        zero.py)."""
        return list(units)

    def secondary_shard(self, mesh) -> SecondaryShard | None:
        """hpZ's in-node copy of a unit's full values (Note [secondary shards]): only where they go after a
        use and come back for backward."""
        return None

    def counted_in(self, residents: Residents) -> Residents:
        """The count a unit's residency joins (the engine's `residents`): only units that go and come back
        are counted; a unit that stays gathered gets a count of its own."""
        return Residents()

    # ---- what the step driver does around a use ------------------------------------------

    def gather_tags(self, make_tags):
        """The gathers' tags (Note [gather tags]), made by `make_tags()` where a rank's gathers follow its own
        forward; zero1/zero2 re-gather in a fixed order, untagged."""
        return None

    def after_use(self, gathers, unit, open_units: list) -> None:
        """After `unit`'s use in a forward: the full values are kept."""

    def after_forward(self, gathers, units: list, prefetch_order: list, open_units: list) -> None:
        """At a forward's end: every unit stays gathered, and backward re-gathers nothing."""

    def frees_after_frozen_backward(self, unit, root) -> bool:
        """Whether `unit`, which nothing differentiates, is freed once its inputs' gradients are done (Note
        [frozen units]): not where full values are kept."""
        return False

    def backward_communicates(self, sync_grads: bool) -> bool:
        """Whether a backward issues collectives (a header goes first, Note [agreement rides the traffic]):
        where it reduces."""
        return sync_grads

    # ---- when the gradient is reduced --------------------------------------------------

    def reduces_kept_grads(self, unit) -> bool:
        """Whether this backward's gradients join the unit's kept full gradients before the reduce (after
        no_sync micro-batches) rather than being reduced as they come."""
        return unit.grads.holds_full()

    def kept_grads(self, full):
        """What stays of a unit's full gradients `full` (rank-major, or None) once reduced: zero2/zero3 drop
        them (they hold some only after no_sync). Every stage reduces a unit as its backward ends (the module
        docstring): this says what is kept, never when the reduce is issued."""
        return None

    # ---- what the estimator counts (estimate/core.py) ------------------------------------

    def parameter_bytes(self, full: int, shard: int, c: int, m: int) -> tuple[int, int]:
        """(kept full values, master rows held apart) of one unit of `full` padded elements, `shard` of them
        this rank's, in compute bytes `c` and master bytes `m`: the shards are views of the kept full
        buffer at c == m."""
        return c * full, 0 if c == m else m * shard

    def gradient_bytes(self, full: int, reduced: int, r: int, m: int) -> int:
        """One unit's gradient bytes after the step: `reduced`, the reduce-scatter's output."""
        return reduced

    def reduce_bytes(self, r: int, biggest: int) -> int:
        """The reduce in flight: its packed input and its receive buffer (gloo's all-to-all form, Note [gloo
        collectives])."""
        return 2 * r * biggest

    def gathered_bytes(self, c: int, root: int, biggest: int) -> int:
        """Full values a step holds besides the kept ones (Note [transient buffers], estimate/core.py): two
        re-gathers in flight."""
        return 2 * c * biggest

    def pooled_gathered_bytes(self, c: int, root: int, biggest: int) -> int:
        """The part of `gathered_bytes` the comm pool keeps between steps (Note [reused buffers]): zero1/zero2
        re-gather into their kept full buffers, none."""
        return 0

    def transient_gathered_bytes(self, c: int, root: int, biggest: int) -> int:
        """The part of `gathered_bytes` outside the pool: zero1/zero2's re-gathers in flight."""
        return self.gathered_bytes(c, root, biggest)


class Zero1(StagePolicy):
    """Full parameters and full gradients kept; each unit's gradients reduce-scattered as its backward ends,
    the average landing in this rank's rows of the kept full gradients."""

    name = "zero1"

    def reduces_kept_grads(self, unit) -> bool:
        return True

    def kept_grads(self, full):
        """The full gradients, kept across steps, rank-major: the reduce's input and the home of the shards'
        gradients (Note [kept gradients rank-major], unit_grads.py)."""
        return full

    def gradient_bytes(self, full: int, reduced: int, r: int, m: int) -> int:
        """The kept full gradients (over the whole unit); the shard grads view their rows when r == m."""
        return r * full + (0 if r == m else reduced)

    def reduce_bytes(self, r: int, biggest: int) -> int:
        """The receive buffer alone: the reduce's input is the kept gradients (counted in the state)."""
        return r * biggest


class Zero2(StagePolicy):
    """Full parameters kept; each unit's gradients reduce-scattered as its backward ends."""

    name = "zero2"


# Note [prefetch depth]: zero3 keeps up to `prefetch` gathers issued ahead of use (sw.shard(prefetch=N), default
# PREFETCH = 1): while a unit computes, the next unit's gather is in flight on the gathers' stream (Note [streams per
# collective], comm/streams.py), in forward and in backward, as FSDP2's implicit prefetch keeps one unit ahead (its
# `set_modules_to_forward_prefetch` more). A unit's gather lands when it is used, and the next is issued then: the
# unit in use and one in flight, two units' full values beside the root. Each more costs one unit's full values at
# every zero3 peak (the pool's bound and the estimator count 1 + prefetch units beside the root) and buys overlap
# only where one unit's compute is shorter than the next unit's gather (small units, a slow network). The default
# was 2 until issue 61: measured at the peak (the blocks' backward; 4 ranks, 16 blocks of bench/memory/max_model.py's
# GPT, fp32, peak RSS per rank over 3 steps) 2 held about one unit more than FSDP2 (626 MiB against 607; 1: 616),
# one block of that GPT's depth at 2 GiB, and no step time was ever measured in its favour. The order of the
# gathers is the same on every rank whatever the depth (Note [collective order]).
PREFETCH = 1


class Zero3(StagePolicy):
    """Full parameters only while used: gathered before, released after (`free`), `prefetch` gathers in flight."""

    name = "zero3"
    gathers_in_flight = PREFETCH

    def __init__(self, prefetch: int | None = None, keep_comm_buffers: bool = False) -> None:
        if prefetch is not None:
            self.gathers_in_flight = prefetch
        self.trims_tail = not keep_comm_buffers

    def storage(self, compute_dtype: torch.dtype, master_dtype: torch.dtype, host=None):
        return HostRows(host) if host is not None else OwnShards()  # the all-gather's input, rank-major

    def freshness(self, stamp, num_params: int):
        return NoKeptValues(stamp, num_params)

    def needs_gather(self, unit) -> bool:
        """The full values are gone (a gather in flight is not a missing one), or a unit still gathered holds
        values from before a write to its rows (Note [kept while gathered], freshness.py)."""
        return unit.residence.state is Residency.SHARDED or unit.written()

    def gathers_on_use(self, unit) -> bool:
        """A unit freed since its last use (A, B, A; a later forward or backward)."""
        return unit.needs_gather()

    def holds_full(self, unit) -> bool:
        return unit.resident

    def free(self, unit) -> None:
        unit.release()

    def prefetch_order(self, units: list, agreed_order: list[int]) -> list:
        """The last forward's unit order once every rank's header reported it, registration order
        otherwise: forward gathers in that order, backward gathers in its reverse."""
        order = list(units)
        if agreed_order:
            position = {key: i for i, key in enumerate(agreed_order)}
            order.sort(key=lambda u: position.get(id(u), len(position)))
        return order

    def secondary_shard(self, mesh) -> SecondaryShard | None:
        return SecondaryShard(mesh.node_group, mesh.node_rank, mesh.node_world) if mesh.node_group is not None \
            else None

    def counted_in(self, residents: Residents) -> Residents:
        return residents

    def gather_tags(self, make_tags):
        return make_tags()

    def after_use(self, gathers, unit, open_units: list) -> None:
        """Free every other idle unit (FSDP2's reshard_after_forward)."""
        gathers.free_idle({id(unit)}, open_units)

    def after_forward(self, gathers, units: list, prefetch_order: list, open_units: list) -> None:
        """Free the idle units but the root and, when backward may come, the last one: usually the first one
        backward needs (as FSDP2 keeps its root), one gather fewer per step; "last" by registration, not by
        this rank's forward, so every rank keeps the same one (Note [collective order]). Backward re-gathers
        the others in the reverse of the forward's order."""
        last = {id(units[-1])} if torch.is_grad_enabled() else set()
        gathers.free_idle({id(units[0])} | last, open_units)
        gathers.backward_queue = [u for u in reversed(prefetch_order) if not u.resident]

    def frees_after_frozen_backward(self, unit, root) -> bool:
        return not unit.trainable() and unit is not root

    def backward_communicates(self, sync_grads: bool) -> bool:
        return True  # it re-gathers

    def parameter_bytes(self, full: int, shard: int, c: int, m: int) -> tuple[int, int]:
        return 0, m * shard

    def gathered_bytes(self, c: int, root: int, biggest: int) -> int:
        """The root (gathered for the whole forward), the unit in use and `prefetch` more in flight (Note
        [prefetch depth])."""
        return c * root + (1 + self.gathers_in_flight) * c * biggest

    def pooled_gathered_bytes(self, c: int, root: int, biggest: int) -> int:
        """All of them: zero3 frees its full values into the pool."""
        return self.gathered_bytes(c, root, biggest)

    def transient_gathered_bytes(self, c: int, root: int, biggest: int) -> int:
        return 0


_POLICIES = {policy.name: policy for policy in (Zero1, Zero2, Zero3)}


def policy_of(strategy: str, prefetch: int | None = None, keep_comm_buffers: bool = False) -> StagePolicy:
    """The policy of a zero strategy ("zero1" | "zero2" | "zero3"); `prefetch`: zero3's gathers in flight
    (None: PREFETCH, Note [prefetch depth]); `keep_comm_buffers`: zero3's pool kept between steps (Note [lean
    tail], comm/buffers.py)."""
    return Zero3(prefetch, keep_comm_buffers) if strategy == "zero3" else _POLICIES[strategy]()


# Note [eager re-gathers]: zero1/zero2 could issue every re-gather at once, or from the optimizer's
# post-step hook before zero_grad and the next forward's agreement. Tried and not taken (bench GPT,
# 2 ranks, gloo, 3 interleaved rounds, step time of each form over the window of one: at once
# zero2 0.98/1.03/0.99 and zero1 1.04/0.98/0.99; post-step zero2 0.99/1.01/1.06 and zero1
# 1.07/0.97/1.03; `python bench/overhead/phases.py --configs zero1,zero2 --against OTHER/src` with the form
# patched into one tree). On two busy cores the gathers' CPU moves, it does not shrink, and the
# post-step form would need the next forward's agreement to check that every rank issued the same
# gathers. Worth measuring again on NCCL, where the gathers leave the CPU.
