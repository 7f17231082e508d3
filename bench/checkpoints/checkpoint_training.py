"""The training arms of bench/checkpoints/checkpoint.py: what a checkpoint every N steps costs a training loop.

Note [training arms]: the load of a shared machine swings 2x within minutes, so the arms run
inside the same ranks, interleaved period by period. A period is `--saves-per-period` times one
save (or none) then `--save-every` steps; the wait for a save to be on disk comes before the next
save (where training meets it anyway) and after the period's last steps. The saving arms are
`sw.save_async`; DCP's `async_save` on `sw.dcp_state_dict` (on a gloo group of its own, as
torch's docs advise, so its background collectives never pair with training's); and a
blocking `sw.save`. A round runs a no-save period before, between and after them (N A N B N C N,
the saving arms' order rotating from round to round), and a saving period's overhead is its
time over the mean of the two no-save periods beside it, minus one: the comparison is between
periods seconds apart. The table gives the median over `--rounds` rounds (after
`--warmup-rounds`) with the smallest and largest, as % of a plain step (overhead per step ÷
plain step time), and the same measure between no-save periods as the noise floor.

Two more rows answer issue 45's question (is sw.save_async's cost at most sw.save's?) with less
noise. Paired: in each round, the sw.save_async period's time minus the sw.save period's, per
step, as % of a plain step; its noise row is the same difference between the round's no-save
periods the same number of periods apart. Blocked + background CPU: per save, the time the call
blocked training plus the writer thread's CPU seconds (`PendingSave.cpu_s`), per step: with no
core to spare this is the most the background save can take from training (each of its CPU
seconds displacing one of training's, none hidden in training's idle moments); the blocking
save's is its call time. These come from the saves' own clocks, not from the periods' wall time,
so the other processes on the host hardly move them.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path

import torch


def at_offset_zero(state):
    """`state` with each DTensor's local tensor re-made at storage offset 0 over the same memory (no copy).

    torch 2.13's async staging (DCP's `_StateDictStager`, and `_create_cpu_state_dict` through
    FileSystemWriter) takes a DTensor for a plain tensor when its `data_ptr()` is non-zero, which it
    is when the local tensor is a view at a storage offset (a wrapper's data_ptr is its offset),
    then fails with "Attempted to call copy_() on an invalid python storage". shardwise's shards
    are views into each unit's flat buffer, so sw.dcp_state_dict meets this where FSDP2's state
    dict does not; here each local becomes an alias through DLPack: the same memory, offset 0,
    no copy (any dtype, any device)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {key: at_offset_zero(value) for key, value in state.items()}
    if not isinstance(state, DTensor) or state.to_local().storage_offset() == 0:
        return state
    local = state.to_local()
    alias = torch.from_dlpack(local)
    return DTensor.from_local(alias, state.device_mesh, state.placements, run_check=False, shape=state.shape,
                              stride=state.stride())


ARMS = ("none", "sw_async", "dcp_async", "sw_sync")
COLUMNS = ("call_s", "steps_s", "wait_s", "cpu_s")  # per period, summed over its saves
ARM_LABELS = {"none": "no saving", "sw_async": "sw.save_async", "dcp_async": "DCP async_save",
              "sw_sync": "sw.save (blocking)"}


def train_arms(args, model, optim, root: Path, tokens: torch.Tensor) -> dict | None:
    """Note [training arms]: per arm and round, (save call s, steps s, wait s) of the slowest rank and the
    no-save periods beside it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from tqdm import tqdm

    import shardwise as sw

    rank = dist.get_rank()
    dcp_group = dist.new_group(backend="gloo")  # DCP's background collectives, apart from training's

    def step():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def save(arm: str, path: Path):
        """Start one save; return (wait for it, its background CPU seconds once waited)."""
        if arm == "sw_async":
            pending = sw.save_async(path, model, optim)
            return pending.wait, lambda: pending.cpu_s
        if arm == "dcp_async":
            future = dcp.async_save(at_offset_zero(sw.dcp_state_dict(model, optim)), checkpoint_id=str(path),
                                    process_group=dcp_group)
            return future.result, lambda: 0.0
        if arm == "sw_sync":
            sw.save(path, model, optim)
        return (lambda: None), lambda: 0.0

    saving = ARMS[1:]
    total = args.warmup_rounds + args.rounds
    # Per round: no save, a saving arm, no save, the next, ..., no save (Note [training arms]).
    orders = [saving[r % len(saving):] + saving[:r % len(saving)] for r in range(total)]
    sequences = [["none"] + [x for arm in order for x in (arm, "none")] for order in orders]
    times = torch.zeros(total, len(sequences[0]), len(COLUMNS), dtype=torch.float64)
    bar = tqdm(total=times.shape[0] * times.shape[1], desc="training arms", unit="period", disable=rank != 0)
    for round_, sequence in enumerate(sequences):
        for position, arm in enumerate(sequence):
            spent = dict.fromkeys(COLUMNS, 0.0)
            wait, cpu = (lambda: None), (lambda: 0.0)
            dist.barrier()
            for number in range(args.saves_per_period):
                began = time.perf_counter()
                wait()  # the previous save on disk first: where training meets it
                spent["cpu_s"] += cpu()
                called = time.perf_counter()
                wait, cpu = save(arm, root / f"train-{round_}-{arm}-{number}")
                stepping = time.perf_counter()
                for _ in range(args.save_every):
                    step()
                spent["wait_s"] += called - began
                spent["call_s"] += stepping - called
                spent["steps_s"] += time.perf_counter() - stepping
            began = time.perf_counter()
            wait()
            spent["wait_s"] += time.perf_counter() - began
            spent["cpu_s"] += cpu()
            times[round_, position] = torch.tensor([spent[column] for column in COLUMNS])
            bar.update()
        dist.barrier()
        if rank == 0:
            for path in root.glob(f"train-{round_}-*"):
                shutil.rmtree(path, ignore_errors=True)
    bar.close()
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return summarize_arms(times[args.warmup_rounds:], sequences[args.warmup_rounds:])


def summarize_arms(times: torch.Tensor, sequences: list[list[str]]) -> dict:
    """Per arm and round: its call, steps, wait and background CPU seconds, and the no-save periods on either
    side of it (`ref_s`: their mean total, `ref_steps_s`: their mean steps). For "none", `noise_pct`: each
    inner no-save period against its two no-save neighbours, the measurement's own noise. "paired": per
    round, the sw.save_async period's seconds minus the sw.save period's (`diff_s`), and the same
    difference between no-save periods as far apart (`noise_s`)."""
    out = {arm: {key: [] for key in (*COLUMNS, "ref_s", "ref_steps_s")} for arm in ARMS}
    out["none"]["noise_pct"] = []
    out["paired"] = {"diff_s": [], "noise_s": []}
    for period, sequence in zip(times, sequences):
        totals = period[:, :3].sum(dim=1).tolist()  # call + steps + wait: the period's wall time
        for position, arm in enumerate(sequence):
            if arm == "none":
                out["none"]["steps_s"].append(period[position, 1].item())
                if 2 <= position <= len(sequence) - 3:
                    around = (totals[position - 2] + totals[position + 2]) / 2
                    out["none"]["noise_pct"].append(100 * (totals[position] / around - 1))
                continue
            entry = out[arm]
            for column, key in enumerate(COLUMNS):
                entry[key].append(period[position, column].item())
            entry["ref_s"].append((totals[position - 1] + totals[position + 1]) / 2)
            entry["ref_steps_s"].append((period[position - 1, 1].item() + period[position + 1, 1].item()) / 2)
        background, blocking = sequence.index("sw_async"), sequence.index("sw_sync")
        out["paired"]["diff_s"].append(totals[background] - totals[blocking])
        apart = abs(background - blocking)
        nones = [p for p, arm in enumerate(sequence) if arm == "none"]
        out["paired"]["noise_s"] += [totals[p + apart] - totals[p] for p in nones if p + apart in nones]
    return out


def overheads(training: dict) -> dict[str, list[float]]:
    """Per saving arm and round: % of its period's time over the mean of the no-save periods on either
    side (Note [training arms]); for "none", the no-save periods' own noise the same way."""
    over = {arm: [100 * (sum(t[key][i] for key in ("call_s", "steps_s", "wait_s")) / t["ref_s"][i] - 1)
                  for i in range(len(t["ref_s"]))] for arm, t in training.items() if arm in ARMS[1:]}
    return {"none": training["none"]["noise_pct"], **over}


def step_costs(args, training: dict) -> dict[str, list[float]]:
    """Issue 45's comparison in % of a plain step, per round (Note [training arms]): "paired" and its
    "paired_noise"; "bound_async" (blocked + background CPU) and "bound_sync" (blocked)."""
    steps = args.saves_per_period * args.save_every
    plain = statistics.median(training["none"]["steps_s"]) / steps

    def pct(seconds):
        return [100 * s / steps / plain for s in seconds]

    background, blocking = training["sw_async"], training["sw_sync"]
    return {"paired": pct(training["paired"]["diff_s"]), "paired_noise": pct(training["paired"]["noise_s"]),
            "bound_async": pct([c + u for c, u in zip(background["call_s"], background["cpu_s"])]),
            "bound_sync": pct(blocking["call_s"])}


def training_table(args, training: dict) -> list[str]:
    rounds = len(training["sw_async"]["ref_s"])
    saves = args.saves_per_period
    plain = statistics.median(training["none"]["steps_s"]) / (args.save_every * saves)
    over, costs = overheads(training), step_costs(args, training)
    lines = [f"Training with a checkpoint every {args.save_every} steps (Note [training arms] in "
             f"bench/checkpoints/checkpoint_training.py): "
             f"in the same ranks, {rounds} rounds after {args.warmup_rounds} warm-up, each round a no-save period "
             f"between every two saving periods, {saves} saves per period, the saving arms' order rotating each "
             f"round; a plain step took {plain:.3f} s (median). Overhead per step = a saving period's extra time "
             "over the mean of the no-save periods on either side, ÷ its steps, as % of a plain step: median "
             "[min, max] over rounds. The no-save row is that measurement's noise (each inner no-save period "
             "against its no-save neighbours). Target: ≤ 5%.",
             "",
             "| arm | overhead % of a step | save call s (blocks training, per save) | steps slower by % | "
             "wait for the write s (per save) |",
             "|---|---:|---:|---:|---:|"]
    lines.append(f"| {ARM_LABELS['none']} (noise) | {_spread(over['none']) if over['none'] else '—'} | — | — | — |")
    for arm in ARMS[1:]:
        t = training[arm]
        slower = [100 * (s / n - 1) for s, n in zip(t["steps_s"], t["ref_steps_s"])]
        lines.append(f"| {ARM_LABELS[arm]} | {_spread(over[arm])} | {statistics.median(t['call_s']) / saves:.3f} | "
                     f"{_spread(slower)} | {statistics.median(t['wait_s']) / saves:.3f} |")
    cpu = statistics.median(training["sw_async"]["cpu_s"]) / saves
    lines += ["", "sw.save_async against sw.save, % of a plain step per step, median [min, max] over rounds "
              "(Note [training arms]): paired = the sw.save_async period minus the sw.save period of the same "
              "round; its noise = the same difference between no-save periods as far apart; blocked + background "
              f"CPU = the save call plus the writer thread's CPU time ({cpu:.3f} s per save), the most it can take "
              "from training with no core to spare, against the blocking save's call.", "",
              "| comparison | sw.save_async | sw.save | difference |", "|---|---:|---:|---:|",
              f"| paired periods (wall time) | — | — | {_spread(costs['paired'])} |",
              f"| paired no-save periods (noise) | — | — | {_spread(costs['paired_noise'])} |",
              f"| blocked + background CPU | {_spread(costs['bound_async'])} | {_spread(costs['bound_sync'])} | "
              f"{_spread([a - b for a, b in zip(costs['bound_async'], costs['bound_sync'])])} |"]
    return lines


def _spread(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):+.1f} [{min(values):+.1f}, {max(values):+.1f}]"
