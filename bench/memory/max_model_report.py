"""bench/memory/max_model.py's report: the markdown table and the PNG of its rows (one idea per file: the
scan and probes stay in max_model.py)."""

from __future__ import annotations

from pathlib import Path

from bench.memory.max_model_options import loss_lines
from bench.memory.max_model_pipe import PIPELINES, REPORT_NOTE

MIB, GIB = 2**20, 2**30

NOT_ESTIMATED = {"ds_zero3"}  # a row of another library's engine: measured, not estimated


def markdown(rows: list[dict], args, meta: dict) -> str:
    by = {r["config"]: r for r in rows}

    def ratio(row, anchor):
        a = by.get(anchor, {}).get("max_params")
        return f"{row['max_params'] / a:.2f}" if a and row.get("max_params") else "—"

    lines = [f"Largest GPT (d_model {args.d_model}, vocab {args.vocab}, depth scanned) that trains {args.steps} "
             f"AdamW steps at world size {args.world_size} with every rank's peak RSS within "
             f"{args.budget_bytes / GIB:.2f} GiB; batch {args.batch} × seq {args.seq} per rank, gloo, 1 thread per "
             f"rank, {meta['allocator']}. shardwise zero* built under "
             f"{'sw.deferred_init()' if meta['deferred_init'] else 'eager init (no sw.deferred_init yet)'}; "
             f"FSDP2 on meta + to_empty. Max layers: the deepest probe that fit (≥: the scan stopped at the "
             f"offload cap); first depth over: the shallowest probe over budget (—: none was probed); estimated: "
             f"sw.estimate's peak at the max depth; estimator's depth: the deepest whose estimate is within the budget "
             f"(`shardwise plan --max-model`'s search, sw.max_model). "
             f"{sum(len(r.get('probes', [])) for r in rows)} probes, "
             f"{sum(p['wall_s'] for r in rows for p in r.get('probes', [])) / 60:.0f} min of probe time.",
             "", "| config | max layers | max params | × torch DDP | × shardwise ddp | × FSDP2 | peak RSS MiB "
             "| estimated MiB | estimator error | first depth over | estimator's depth | predicted − max | probes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "unavailable" in row:
            lines.append(f"| {row['label']} | {row['unavailable']} |" + " |" * 11)
            continue
        if row["max_params"] is None:
            lines.append(f"| {row['label']} | none fit | | | | | | | | {row['first_fail_layers']} | "
                         f"{row['predicted_layers']} | | {len(row['probes'])} |")
            continue
        best = next(p for p in row["probes"] if p["layers"] == row["max_layers"])
        ge = "≥ " if row["capped"] else ""
        if row["config"] in NOT_ESTIMATED:  # sw.estimate models shardwise and FSDP2, not DeepSpeed's memory
            lines.append(f"| {row['label']} | {row['max_layers']} | {row['max_params'] / 1e6:.0f}M | "
                         f"{ratio(row, 'torch_ddp')} | {ratio(row, 'ddp')} | {ratio(row, 'fsdp2')} | "
                         f"{row['peak_rss_bytes'] / MIB:.0f} | not modelled | | {row['first_fail_layers'] or '—'} | "
                         f"| | {len(row['probes'])} |")
            continue
        lines.append(
            f"| {row['label']} | {ge}{row['max_layers']} | {ge}{row['max_params'] / 1e6:.0f}M | "
            f"{ratio(row, 'torch_ddp')} | {ratio(row, 'ddp')} | {ratio(row, 'fsdp2')} | "
            f"{row['peak_rss_bytes'] / MIB:.0f} | {best['estimated_total_bytes'] / MIB:.0f} | "
            f"{(best['estimated_total_bytes'] - row['peak_rss_bytes']) / row['peak_rss_bytes']:+.1%} | "
            f"{row['first_fail_layers'] or '—'} | {row['predicted_layers']} | "
            f"{'' if row['capped'] else format(row['predicted_layers'] - row['max_layers'], '+d')} | "
            f"{len(row['probes'])} |")
    z3, off = by.get("zero3", {}), by.get("zero3_offload", {})
    if off.get("max_params") and z3.get("max_params"):
        lines += ["", f"zero3 + disk offload / zero3: {'≥ ' if off['capped'] else ''}"
                      f"{off['max_params'] / z3['max_params']:.2f}×"]
    if any(by.get(c, {}).get("max_params") for c in PIPELINES):
        lines += ["", REPORT_NOTE]
    lines += loss_lines(rows, args)
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.get("max_params")]
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.5))
    labels = [r["label"] for r in rows]
    values = [r["max_params"] / 1e6 if r.get("max_params") else 0 for r in rows]
    colors = ["tab:gray" if r["config"] in ("torch_ddp", "fsdp2") else "tab:blue" for r in rows]
    bars = ax.barh(labels, values, color=colors)
    for bar, row in zip(bars, rows):
        text = ("≥ " if row.get("capped") else "") + f"{bar.get_width():.0f}M" if row.get("max_params") else \
            row.get("unavailable", "none fit")[:40]
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("largest GPT trained (million parameters)")
    ax.set_title(f"{args.budget_bytes / GIB:.2f} GiB peak RSS per rank, world size {args.world_size} "
                 f"(gray: torch anchors)")
    if shown:
        ax.set_xlim(0, max(values) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

