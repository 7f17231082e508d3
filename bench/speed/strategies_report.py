"""bench/speed/strategies.py's report: the markdown table (ratios paired per round, with their range; the
engine-free bound) and the PNG plot, from the rows the launcher summarized."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.speed.raw_forms import FORMS


def paired_text(row: dict, anchor: dict | None, key: str = "run_medians_s") -> str:
    """The paired ratio with its per-round range: "1.03 (0.93-1.12)"."""
    if not anchor or key not in row or key not in anchor:
        return "—"
    ratios = [a / b for a, b in zip(row[key], anchor[key])]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})"


def bound_ratio(step: float, optimizer: float, world_size: int, forms: dict, *, zero3: bool = False,
                gloo_forms: bool = False) -> float:
    """Note [engine-free bound], one round, as a ratio to DDP's `step`: DDP's step less (N-1)/N of its
    `optimizer` step; for zero3 plus one raw all-gather of the model; with `gloo_forms` plus what gloo's
    reduce-scatter and all-gather cost beyond its all-reduce (`forms`: the DDP run's raw seconds by form,
    Note [raw forms] in bench/speed/raw_forms.py)."""
    extra = (forms["gather"] if zero3 else 0.0) + \
        (forms["reduce"] + forms["gather"] - forms["all_reduce"] if gloo_forms else 0.0)
    return 1 - (world_size - 1) / world_size * optimizer / step + extra / step


def engine_free_bound(ddp: dict | None, world_size: int, *, zero3: bool = False,
                      gloo_forms: bool = False) -> str | None:
    """bound_ratio per round of the DDP row's runs: "median (min-max)"."""
    if not ddp or not ddp.get("run_optimizer_s") or None in ddp["run_optimizer_s"]:
        return None
    runs = [ddp.get(f"run_raw_{form}_s") for form in FORMS]
    if any(not values or None in values for values in runs):
        return None
    ratios = [bound_ratio(step, optimizer, world_size, dict(zip(FORMS, forms)), zero3=zero3, gloo_forms=gloo_forms)
              for step, optimizer, *forms in zip(ddp["run_medians_s"], ddp["run_optimizer_s"], *runs)]
    return f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f})"


def fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(rows: list[dict], world_sizes: list[int], args, mmap_run: bool) -> str:
    lines = [f"GPT vocab {args.vocab}, d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
             f"seq {args.seq}, batch {args.batch}/rank, fp32 AdamW, gloo, 1 thread/rank; step time is the "
             f"median over {args.repeats} interleaved runs of each run's median of {args.steps} steps after "
             f"{args.warmup} warm-up, and each ratio the median of the per-run ratios (runs of one round "
             f"share the machine's load). Peak RSS is the max over ranks; "
             f"'mmap' is a {args.mmap_steps}-step run with MALLOC_MMAP_THRESHOLD_=65536"
             + ("" if mmap_run else " (skipped)") + ". Model state counted in storages after optimizer.step() "
             "(DeepSpeed: the storages reachable from its parameters and its optimizer's attributes, "
             "after engine.step(), which has already dropped the gradients). Note [CPU-bound]: 'CPU s/step' "
             "sums each rank's process CPU time per step (all its threads, the backend's included); where it "
             "comes near (cores) × step time, the cores were saturated and step time is CPU work, so an arm "
             "is faster only by doing less of it."]
    for ws in world_sizes:
        group = [r for r in rows if r["world_size"] == ws]
        by = {r["config"]: r for r in group}
        fsdp_m = by.get("fsdp2", {}).get("model_state_mib")
        lines += ["", f"### world size {ws}", "",
                  "| config | median step s | optimizer s | × no-comm | × DDP | × FSDP2 | CPU s/step, all ranks | "
                  "CPU × DDP | model state MiB/rank | formula MiB | "
                  "state × FSDP2 | peak RSS MiB | peak RSS mmap MiB | max abs loss diff vs reference | "
                  "vs DDP |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in group:
            if "error" in r["timed"]:
                lines.append(f"| {r['label']} | failed: {r['timed']['error']} |" + " |" * 13)
                continue
            t, m = r["median_step_s"], r["model_state_mib"]
            lines.append(
                f"| {r['label']} | {t:.3f} | {fmt(r.get('optimizer_s'), '.3f')} | {paired_text(r, by.get('local'))} | "
                f"{paired_text(r, by.get('ddp'))} | {paired_text(r, by.get('fsdp2'))} | "
                f"{fmt(r.get('cpu_s_per_step'), '.3f')} | {paired_text(r, by.get('ddp'), 'run_cpu_s')} | "
                f"{m:.1f} | {r['formula_mib']:.1f} | "
                f"{fmt(m / fsdp_m if fsdp_m else None, '.2f')} | {r['peak_rss_mib']:.0f} | "
                f"{fmt(r.get('peak_rss_mmap_mib'), '.0f')} | {fmt(r.get('max_loss_diff'), '.1e')} | "
                f"{fmt(r.get('max_loss_diff_vs_ddp'), '.1e')} |")
        bounds = {(zero3, forms): engine_free_bound(by.get("ddp"), ws, zero3=zero3, gloo_forms=forms)
                  for zero3 in (False, True) for forms in (False, True)}
        if all(bounds.values()):
            lines += ["", f"Engine-free bounds at world size {ws} (Note [engine-free bound]), × DDP, median (range) "
                          f"over rounds: zero1/zero2 {bounds[False, False]} optimizer only, {bounds[False, True]} "
                          f"with gloo's forms; zero3 {bounds[True, False]} and {bounds[True, True]} (one all-gather "
                          "of the model more). 'optimizer s' is the median over runs of each run's median over "
                          "steps of the slowest rank's optimizer.step(); the forms are timed in the DDP run "
                          "(Note [raw forms], bench/speed/raw_forms.py)."]
        compiled = [r for r in group if r["config"].endswith("+compile") and "run_medians_s" in r]
        if compiled:  # Note [compiled arms]
            lines += ["", f"Compiled arms at world size {ws} (backend {args.compile_backend}; compilation in the "
                          "warm-up steps), each ratio paired per round:", "",
                      "| config | median step s | × compiled DDP | × compiled FSDP2 | × the same arm eager |",
                      "|---|---:|---:|---:|---:|"]
            for r in compiled:
                eager = by.get(r["config"].removesuffix("+compile"))
                lines.append(f"| {r['label']} | {r['median_step_s']:.3f} | {paired_text(r, by.get('ddp+compile'))} | "
                             f"{paired_text(r, by.get('fsdp2+compile'))} | {paired_text(r, eager)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], world_sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(world_sizes), 3, figsize=(16, 4.2 * len(world_sizes)), squeeze=False)
    for ax_row, ws in zip(axes, world_sizes):
        ok = [r for r in rows if r["world_size"] == ws and "error" not in r["timed"]]
        names = [r["config"] for r in ok]
        x = range(len(ok))
        ax_row[0].bar(x, [r["median_step_s"] for r in ok], color="tab:blue")
        ax_row[0].set_title(f"ws={ws}: median step time (s)")
        ax_row[1].bar(x, [r["model_state_mib"] for r in ok], color="tab:green", label="counted")
        ax_row[1].scatter(x, [r["formula_mib"] for r in ok], color="black", marker="_", s=400,
                          zorder=3, label="ZeRO formula")
        ax_row[1].set_title(f"ws={ws}: model state per rank (MiB)")
        ax_row[1].legend()
        w = 0.4
        ax_row[2].bar([i - w / 2 for i in x], [r["peak_rss_mib"] for r in ok], w, label="default malloc")
        ax_row[2].bar([i + w / 2 for i in x], [r.get("peak_rss_mmap_mib", 0) for r in ok], w,
                      label="MALLOC_MMAP_THRESHOLD_=65536")
        ax_row[2].set_title(f"ws={ws}: peak RSS per rank, max over ranks (MiB)")
        ax_row[2].legend(loc="lower right", fontsize=8)
        for ax in ax_row:
            ax.set_xticks(list(x))
            ax.set_xticklabels(names, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
