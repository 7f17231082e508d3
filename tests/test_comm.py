"""The communication layer (engine/comm/, Note [comm context]): one place issues the collectives, picks
their form per backend, and reuses their buffers within a bound (Note [reused buffers])."""

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.engine.comm.collectives as coll
from shardwise.engine import engine_of
from shardwise.engine.comm.buffers import BufferPool
from shardwise.engine.comm.collectives import Pending
from shardwise.models.zoo import ZOO, build
from shardwise.testing import global_batch, make_optimizer, rank_slice

ENGINE = pathlib.Path(sw.__file__).parent / "engine"
COLLECTIVES = {"all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object", "all_reduce",
               "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "gather", "scatter",
               "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier"}


def test_no_collective_is_issued_outside_comm():
    """Catches a torch.distributed collective called from the engine beside engine/comm/ (a norm, a header, an
    owner's gather): every collective reads from one package, where its form, buffers and stream are chosen."""
    offenders = []
    for path in ENGINE.rglob("*.py"):
        if path.relative_to(ENGINE).parts[0] == "comm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"):
                offenders.append(f"{path.relative_to(ENGINE)}:{node.lineno} dist.{node.func.attr}")
    assert not offenders, offenders


class _Work:
    """A collective still in flight until `wait()`, which checks the pool before it lands."""

    def __init__(self, pool, buffers, seen):
        self.pool, self.buffers, self.seen = pool, buffers, seen

    def wait(self):
        self.seen.append([self.pool.is_lent(b) for b in self.buffers])


def test_a_lent_buffer_goes_back_only_after_its_collective_landed():
    """Catches a reused buffer given back (and so lent again, and overwritten) before its collective landed: while
    the work is in flight both buffers are still lent; after `wait()` they are kept for the next lend."""
    pool = BufferPool(bound=1 << 20, smallest=0)
    sent, received = pool.lend(1000, torch.float32, torch.device("cpu")), pool.lend(1000, torch.float32, "cpu")
    seen = []
    pending = Pending([_Work(pool, [sent, received], seen)], received, "a test reduce").lend_to(pool, sent, received)
    assert pool.lend(1000, torch.float32, "cpu").data_ptr() not in (sent.data_ptr(), received.data_ptr())
    pending.wait()
    assert seen == [[True, True]]
    assert not pool.is_lent(sent) and not pool.is_lent(received)
    again = {pool.lend(1000, torch.float32, "cpu").data_ptr() for _ in range(2)}
    assert again == {sent.data_ptr(), received.data_ptr()}


def test_the_pool_keeps_at_most_its_bound():
    """Catches a pool that grows without bound (a buffer per size ever asked for): past the bound a lend is served
    fresh and not kept, and the bytes held (lent + kept) never exceed the bound."""
    pool = BufferPool(bound=3000, smallest=0)
    a = pool.lend(250, torch.float32, "cpu")  # 1000 bytes
    b = pool.lend(500, torch.float32, "cpu")  # 2000 bytes: at the bound
    c = pool.lend(10, torch.float32, "cpu")  # past it: fresh, not kept
    assert pool.held == 3000 and not pool.is_lent(c)
    for buffer in (a, b, c):
        pool.give_back(buffer)
    assert pool.held == 3000
    big = pool.lend(700, torch.float32, "cpu")  # 2800 bytes: kept buffers released to make room
    assert pool.held <= 3000 and pool.is_lent(big)
    small = pool.lend(100, torch.float32, "cpu")  # reuses nothing lent: fresh, within what is left
    assert small.data_ptr() != big.data_ptr()


def _context_calls(strategy):
    """Two zero steps of the zoo GPT: every unit gather and reduce the engine issued, and how many of them
    came through its CommContext; the context's forms; describe's comm line."""
    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optimizer = make_optimizer(model)
    comm = engine_of(model).comm
    counts = {"coll": 0, "context": 0}
    real = coll.gather_into, coll.reduce_scatter_avg
    context_real = comm.gather_into, comm.reduce_scatter_avg

    def counted(fn, key):
        def call(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return call

    coll.gather_into, coll.reduce_scatter_avg = counted(real[0], "coll"), counted(real[1], "coll")
    comm.gather_into, comm.reduce_scatter_avg = counted(context_real[0], "context"), counted(context_real[1], "context")
    try:
        for step in range(2):
            x, y = rank_slice(global_batch(spec, step, 8), dist.get_rank(), dist.get_world_size())
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        coll.gather_into, coll.reduce_scatter_avg = real
    forms = sorted({s.name for s in comm._strategies.values()})
    return counts, forms, str(sw.describe(model)).splitlines()[-1]


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_every_unit_collective_goes_through_the_engine_context(ranks, strategy):
    """Catches a unit gather or reduce issued around the engine's CommContext (its form, buffers and stream would
    not apply): every one of a step's unit collectives came through it, in gloo's form on gloo, and sw.describe
    shows the context."""
    for counts, forms, line in ranks.run(_context_calls, 2, strategy, timeout=120):
        assert counts["coll"] > 0 and counts["coll"] == counts["context"], counts
        assert forms == ["gloo"]
        assert line.startswith("comm buffers:") and "forms: gloo" in line and "host order" in line, line


def _pool_over_steps(strategy, steps=3, keep_comm_buffers=False):
    """`steps` zero steps at this world size of a GPT whose root (its embedding) is its largest unit, as the bench
    GPT's is, and whose units' buffers are above HEAP_BYTES: per step, the pool's fresh allocations in it, bytes
    held and buffers still lent after it; its bound, its lends, and the root's and largest block's sizes."""
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    vocab = 2048
    model = GPT(GPTConfig(vocab_size=vocab, seq_len=8, d_model=128, n_layers=2, n_heads=4))
    sw.shard(model, strategy=strategy, units=Block, **({"keep_comm_buffers": True} if keep_comm_buffers else {}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = engine_of(model)
    pool, per_step = engine.comm.pool, []
    for step in range(steps):
        before = pool.fresh
        tokens = torch.randint(vocab, (2, 9), generator=torch.Generator().manual_seed(step))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append((pool.fresh - before, pool.held, len(pool.lent)))
    return per_step, pool.bound, pool.lends, engine.root.numel_full, max(u.numel_full for u in engine.units[1:])


@pytest.mark.parametrize("strategy, kept", [("zero1", False), ("zero2", False), ("zero3", True)])  # zero3's
def test_steady_steps_reuse_every_buffer_within_the_bound(ranks, strategy, kept):  # default trims: Note [lean tail]
    """Catches the page-faulting fresh buffers of issue 33's note coming back (a reduce's packed input or receive
    buffer, zero3's full values allocated anew at each gather), among them the root's when it is the largest
    unit and the bound is sized over the other units (Note [reused buffers]: zero1 3, zero2 9, zero3 3 fresh
    allocations a step on the bench GPT at 2 ranks), and a small parameters' gather buffer taking a large kept
    one another collective needed next: every step after the first allocates nothing, nothing stays lent
    between steps (a buffer never given back), and the pool never holds more than its bound. zero3 with
    keep_comm_buffers=True (the trade's speed side) too: a trim there would allocate again every step."""
    for per_step, bound, lends, root, block in ranks.run(_pool_over_steps, 2, strategy, 3, kept, timeout=120):
        fresh = [entry[0] for entry in per_step]
        assert root > block and bound > 0 and lends > sum(fresh), (root, block, bound, lends, per_step)
        assert fresh[0] > 0 and fresh[1:] == [0] * (len(fresh) - 1), per_step
        assert all(held <= bound and lent == 0 for _, held, lent in per_step), (bound, per_step)


def test_kept_buffers_are_released_only_when_that_makes_room():
    """Catches the pool releasing its kept buffers for a request past its bound even with them gone (they were
    allocated again at their next use, every step): a request that cannot be kept leaves the kept ones alone,
    and a buffer under HEAP_BYTES is served by malloc, neither lent nor counted."""
    from shardwise.engine.comm.buffers import HEAP_BYTES

    pool = BufferPool(bound=4 * HEAP_BYTES)
    pool.give_back(pool.lend(HEAP_BYTES, torch.uint8, "cpu"))  # one kept buffer
    pool.lend(5 * HEAP_BYTES, torch.uint8, "cpu")  # past the bound alone: served fresh, not kept
    assert [b.numel() for b in pool.kept] == [HEAP_BYTES] and pool.fresh == 2
    small = pool.lend(HEAP_BYTES // 8, torch.float32, "cpu")
    assert not pool.is_lent(small) and pool.lends == 2 and [b.numel() for b in pool.kept] == [HEAP_BYTES]


def _replica_reduce_order():
    """One zero2 backward of the zoo GPT on a 2 x 2 mesh: the order in which unit reduce-scatters were issued and
    replica averages issued and waited, by unit label."""
    from torch.distributed.device_mesh import init_device_mesh

    spec = ZOO["gpt"]
    model = build("gpt")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    sw.shard(model, strategy="zero2", units=spec.unit_class, mesh=mesh)
    comm = engine_of(model).comm
    events = []
    real_reduce, real_replicas = comm.reduce_scatter_avg, comm.all_reduce_avg

    def reduce(packed, world_size, group, what, out=None):
        events.append(("reduce", what.split(" (")[0].split()[-1]))
        return real_reduce(packed, world_size, group, what, out)

    def replicas(tensor, group, what):
        label = what.split(" (")[0].split()[-1]
        events.append(("replicas issued", label))
        pending = real_replicas(tensor, group, what)
        real_wait = pending.wait

        def wait():
            events.append(("replicas waited", label))
            return real_wait()
        pending.wait = wait
        return pending

    comm.reduce_scatter_avg, comm.all_reduce_avg = reduce, replicas
    x, y = rank_slice(global_batch(spec, 0, 8), dist.get_rank(), dist.get_world_size())
    model(x, y).backward()
    return events


def test_the_replica_average_is_waited_after_the_next_reduces_are_issued(ranks):
    """Catches the replica all-reduce of a hybrid mesh waited inside its unit's landing (Note [async replica
    reduce]): each unit's replica average is issued as its reduce-scatter lands and waited only after the next
    unit's reduce-scatter was issued, so it overlaps the rest of backward (the last unit's has nothing after it)."""
    for events in ranks.run(_replica_reduce_order, 4, timeout=120):
        reduces = [i for i, (kind, _) in enumerate(events) if kind == "reduce"]
        issued = {label: i for i, (kind, label) in enumerate(events) if kind == "replicas issued"}
        waited = {}
        for i, (kind, label) in enumerate(events):
            if kind == "replicas waited":
                waited.setdefault(label, i)  # the first wait: a second one (the hand-out's) finds it landed
        assert len(reduces) >= 3 and set(issued) == set(waited) and len(issued) == len(reduces), events
        last = max(issued, key=issued.get)
        assert all(any(issued[label] < i < waited[label] for i in reduces) for label in issued if label != last), events


def _collectives_on_one_rank(strategy):
    """Two steps of the zoo GPT sharded over a group of one rank: the torch.distributed collectives they issued
    (by name) and the engine's strategy names."""
    spec = ZOO["gpt"]
    model = build("gpt")
    sw.shard(model, strategy=strategy, units=spec.unit_class)
    optimizer = make_optimizer(model)
    issued, real = [], {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counted(name):
        def call(*args, **kwargs):
            issued.append(name)
            return real[name](*args, **kwargs)
        return call

    for name in real:
        setattr(dist, name, counted(name))
    try:
        for step in range(2):
            x, y = global_batch(spec, step, 4)
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return issued, sorted({s.name for s in engine_of(model).comm._strategies.values()})


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_group_of_one_rank_issues_no_collective(ranks, strategy):
    """Catches a unit's gather or reduce on a group of one rank (a pipeline stage's shard group of one, a world
    of one) issued as a collective to itself: each was a gloo call and a wait per unit per micro-batch, and a
    zero3 stage of one rank stepped 1.4x a whole-copy stage (Note [comm strategies]). Its values stay exact:
    tests/test_zero_parity.py runs every zoo model at world size 1."""
    for issued, forms in ranks.run(_collectives_on_one_rank, 1, strategy, timeout=120):
        assert issued == [], issued
        assert forms == ["one rank"], forms


def _pool_within_steps(prefetch):
    """Three zero3 steps of the test GPT (root its largest unit) with the pool's bound checked after every lend,
    fill and give-back: per step, the pool's fresh allocations, the most bytes it held, its bytes held once the
    step ended; its bound."""
    from shardwise.models.gpt import GPT, Block, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=2048, seq_len=8, d_model=128, n_layers=4, n_heads=4))
    sw.shard(model, strategy="zero3", units=Block, prefetch=prefetch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pool, per_step, most = engine_of(model).comm.pool, [], [0]

    def watched(method):
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            most[0] = max(most[0], pool.held)
            return out
        return call

    for name in ("lend", "fill", "give_back", "keep_memory"):
        setattr(pool, name, watched(getattr(pool, name)))
    for step in range(3):
        before, most[0] = pool.fresh, 0
        tokens = torch.randint(2048, (2, 9), generator=torch.Generator().manual_seed(step))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append((pool.fresh - before, most[0], pool.held))
    return per_step, pool.bound


@pytest.mark.parametrize("prefetch", [1, 2])
def test_zero3_pool_keeps_nothing_past_the_backward_that_needs_it(ranks, prefetch):
    """Catches a comm buffer outliving the step that needs it (Note [lean tail]): zero3's pool held its whole bound
    between steps, idle through the backward's tail and the optimizer step (5 of FSDP2's 133 blocks at 2 GiB,
    bench/memory/max_model.py). The pool never holds more than its bound at any lend, fill or give-back, holds
    nothing once a step's backward ended, and allocates as many buffers every step as the first did (the next
    forward's and the tail's: a count per step, not per unit)."""
    for per_step, bound in ranks.run(_pool_within_steps, 2, prefetch, timeout=120):
        assert all(most <= bound for _, most, _ in per_step), (bound, per_step)
        assert all(held == 0 for _, _, held in per_step), per_step
        fresh = [entry[0] for entry in per_step]
        assert fresh[0] == fresh[1] == fresh[2] <= 6 + 2 * prefetch, per_step  # a count per step, whatever the depth


def _kept_and_lean_side_by_side():
    """Three zero3 steps of the test GPT twice on the same ranks, the pool released at the tail (the default) and
    kept between steps (keep_comm_buffers=True): each one's losses, parameters, trims and fresh allocations."""
    from shardwise.models.gpt import GPT, Block, GPTConfig

    runs = []
    for kept in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=2048, seq_len=8, d_model=128, n_layers=3, n_heads=4))
        sw.shard(model, strategy="zero3", units=Block, keep_comm_buffers=kept)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for step in range(3):
            tokens = torch.randint(2048, (2, 9), generator=torch.Generator().manual_seed(step))
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        pool = engine_of(model).comm.pool
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters()}, pool.trims, pool.fresh))
    return runs


def test_keeping_comm_buffers_changes_memory_never_the_result(ranks):
    """Catches keep_comm_buffers=True changing what zero3 computes, or not changing what it keeps (Note [lean
    tail]): the same losses and parameters bitwise as the default, no trim where the default trims every step,
    and fewer fresh allocations over the steps."""
    for (lean_losses, lean, lean_trims, lean_fresh), (kept_losses, kept, kept_trims, kept_fresh) in \
            ranks.run(_kept_and_lean_side_by_side, 2, timeout=120):
        assert lean_losses == kept_losses, (lean_losses, kept_losses)
        assert lean.keys() == kept.keys() and all(torch.equal(lean[n], kept[n]) for n in lean)
        assert lean_trims >= 3 and kept_trims == 0, (lean_trims, kept_trims)
        assert kept_fresh < lean_fresh, (kept_fresh, lean_fresh)
