"""Render benchmark results into the tables and plots of docs/benchmarks.md.

    python benchmarks/report.py --anchor $OUT/anchor.jsonl [...]   # gpu_session.sh / anchor.py lines: one markdown
        # table per file, docs/benchmarks_tokens.png (tokens/s relative to GPU-only)
    python benchmarks/report.py --suite benchmarks/results/suite_3.6b_*.jsonl [--docs docs] [--no-plots]
        # suite.py records: one markdown table per (workload, run), docs/benchmarks_suite_<workload>.png
        # (tokens/s and MFU per system) and docs/benchmarks_ablation_<workload>.png (per-technique ablation)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent
LABEL = {
    "gpu": "GPU-only (fp32 master, fused AdamW on GPU)",
    "ours": "hf_superoffload, default plan",
    "ours_host": "hf_superoffload, all optimizer state on host",
    "ours_host_noclip": "hf_superoffload, all on host, no clipping",
    "ours_noclip": "hf_superoffload, default plan, no clipping",
}


def load(path: str | pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    gpu = next(r for r in rows if r["mode"] == "gpu")
    out = ["| system | s/step (median) | tokens/s | x GPU-only | model TFLOP/s | MFU | peak GPU GB | peak host GB | CPU Adam s | GPU waited s |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        st = r.get("offload_stats") or []
        cpu = sorted(s["cpu_s"] for s in st)[len(st) // 2] if st else None
        wait = sorted(s["wait_s"] for s in st)[len(st) // 2] if st else None
        out.append(
            f"| {LABEL.get(r['mode'], r['mode'])} | {r['step_s_median']:.3f} | {r['tokens_per_s']:,} | "
            f"{r['tokens_per_s'] / gpu['tokens_per_s']:.2f} | {r['model_TFLOPs']:.0f} | {r['MFU_vs_989']:.1%} | "
            f"{r['peak_gpu_GB']} | {r['peak_host_rss_GB']} | {'' if cpu is None else f'{cpu:.2f}'} | "
            f"{'' if wait is None else f'{wait:.2f}'} |")
    return "\n".join(out)


def plot(runs: dict[str, list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), squeeze=False)
    for ax, (title, rows) in zip(axes[0], runs.items()):
        gpu = next(r for r in rows if r["mode"] == "gpu")["tokens_per_s"]
        names = [r["mode"] for r in rows]
        vals = [r["tokens_per_s"] / gpu for r in rows]
        ax.barh(names, vals, color=["#888" if n == "gpu" else "#2a7" for n in names])
        for y, v in enumerate(vals):
            ax.text(v + 0.01, y, f"{v:.2f}x", va="center")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlim(0, 1.25)
        ax.set_xlabel("tokens/s relative to GPU-only (same run)")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------------------------------------
# suite.py records (schema hf_superoffload.suite/1)

def _suite_definitions() -> Any:
    """benchmarks/suite.py, loaded by path (this script also runs from anywhere): one list of systems and labels."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_suite_definitions", pathlib.Path(__file__).with_name("suite.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


_SUITE = _suite_definitions()
SUITE_ORDER: tuple[str, ...] = _SUITE.ALL_SYSTEMS
SUITE_LABEL: dict[str, str] = _SUITE.LABELS
# (system, bar label) of the per-technique ablation, in the order techniques are added
ABLATION = (
    ("ours_nospec", "all state on host,\nno speculation"),
    ("ours_host", "+ speculation\n(clipping fires)"),
    ("ours_noclip", "+ speculation commits\n(no clipping)"),
    ("ours", "+ repartitioning\n(default plan: GPU tail)"),
    ("ours_castflip", "host + speculation,\ncast side flipped"),
)


def load_records(paths: Iterable[str | pathlib.Path]) -> list[dict[str, Any]]:
    """Every suite record in ``paths`` (JSON lines; other lines are ignored)."""
    out = []
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            line = line.strip()
            if line:
                rec = json.loads(line)
                if rec.get("schema", "").startswith("hf_superoffload.suite/"):
                    out.append(rec)
    return out


def group_runs(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records by (workload, run_id), systems in the suite's order. A system the run listed twice (``repeat`` 1,
    2, ...) keeps every record, in run order; the same record appended twice (a rerun of the file): the last."""
    groups: dict[tuple[str, str], dict[tuple[str, int], dict[str, Any]]] = {}
    for rec in records:
        groups.setdefault((rec["workload"], rec["run_id"]), {})[rec["system"], rec.get("repeat", 1)] = rec
    rank = {s: i for i, s in enumerate(SUITE_ORDER)}
    return {k: sorted(v.values(), key=lambda r: (rank.get(r["system"], 99), r.get("repeat", 1)))
            for k, v in sorted(groups.items())}


def _row_names(rows: list[dict[str, Any]], label: Callable[[dict[str, Any]], str]) -> list[str]:
    """``label(row)`` per row, numbered (``#1``, ``#2``) where the run listed the row's system more than once."""
    counts = Counter(r["system"] for r in rows)
    return [f"{label(r)} #{r.get('repeat', 1)}" if counts[r["system"]] > 1 else label(r) for r in rows]


def _same_model(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("model") == b.get("model") and a.get("seq_len") == b.get("seq_len")


def reference(rows: list[dict[str, Any]], everything: list[dict[str, Any]]) -> tuple[float | None, str]:
    """GPU-only tokens/s to compare a run against: its own GPU-only row when it ran, else the best GPU-only
    row of the same model and sequence length among ``everything`` (GPU-only's best where it fits)."""
    own = next((r for r in rows if r["system"] == "gpu" and r.get("status") == "ok"), None)
    if own:
        return float(own["tokens_per_s"]), "GPU-only of this run"
    if not rows:
        return None, "no GPU-only row"
    others = [r for r in everything if r["system"] == "gpu" and r.get("status") == "ok" and _same_model(r, rows[0])]
    if not others:
        return None, "no GPU-only row of this model"
    best = max(others, key=lambda r: r["tokens_per_s"])
    return float(best["tokens_per_s"]), (f"GPU-only's best of this model: batch {best['batch_size']} x "
                                         f"{best['seq_len']}, run {best['run_id']} ({best['workload']})")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _notes(rec: dict[str, Any]) -> str:
    status = rec.get("status")
    if status != "ok":
        reason = (rec.get("reason") or "").splitlines()[0] if rec.get("reason") else ""
        text = f"**{status}**: {reason[:220]}"
        if status == "oom" and rec.get("peak_gpu_gb") is not None:
            text += f" (peak {rec['peak_gpu_gb']} GB)"
        return text.replace("|", "\\|")
    parts = []
    plan = rec.get("plan") or {}
    if plan:
        host, dev = plan.get("host_numel"), plan.get("device_numel")
        if host is not None and dev is not None:
            parts.append(f"state {_count(host)} host / {_count(dev)} GPU")
        bits = [f"casts {plan['cast_side']}" if "cast_side" in plan else "",
                f"spec {'on' if plan.get('speculation') else 'off'}" if "speculation" in plan else "",
                plan.get("rollback", "")]
        parts.append(", ".join(b for b in bits if b))
    if rec.get("cast_side_planner"):
        parts.append(f"planner picked {rec['cast_side_planner']}, ran {rec.get('cast_side_used')}")
    tel = rec.get("telemetry")
    if tel:
        pass_s = f", pass {tel['pass_s']:.2f} s" if tel.get("pass_s") else ""
        parts.append(f"CPU Adam {tel['cpu_adam_s']:.2f} s{pass_s}, GPU waited {tel['gpu_wait_s']:.2f} s")
        verdicts = tel.get("verdicts") or []
        if verdicts:
            counts = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
            parts.append("verdicts " + " ".join(f"{k} x{n}" for k, n in counts.items()))
    if rec.get("hyper", {}).get("max_grad_norm") is None and rec.get("hyper"):
        parts.append("no clipping")
    return "; ".join(p for p in parts if p).replace("|", "\\|")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 or n == 0 else f"{n / 1e6:.2f}M"


def _fmt(value: Any, spec: str, default: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return format(value, spec)


def suite_table(rows: list[dict[str, Any]], everything: list[dict[str, Any]] | None = None) -> str:
    """Markdown table of one run: system, s/step, tokens/s, x GPU-only, MFU, peaks, notes."""
    ref, ref_note = reference(rows, everything or rows)
    names = _row_names(rows, lambda r: SUITE_LABEL.get(r["system"], r["system"]))
    out = ["| system | s/step (median) | tokens/s | x GPU-only | model TFLOP/s | MFU | peak GPU GB | peak host GB | notes |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r, name in zip(rows, names, strict=True):
        ok = r.get("status") == "ok"
        tok = r.get("tokens_per_s") if ok else None
        ratio = tok / ref if tok and ref else None
        out.append(
            f"| {name} | {_fmt(r.get('step_s_median') if ok else None, '.3f', '-')} | "
            f"{_fmt(tok, ',.0f', '-')} | {_fmt(ratio, '.2f', '-')} | {_fmt(r.get('model_tflops') if ok else None, '.0f', '-')} | "
            f"{_fmt(r.get('mfu') if ok else None, '.1%', '-')} | {_fmt(r.get('peak_gpu_gb'), '.1f', '-')} | "
            f"{_fmt(r.get('peak_host_rss_gb') if r.get('status') in ('ok', 'oom') else None, '.1f', '-')} | {_notes(r)} |")
    if rows:
        r0 = rows[0]
        hw = r0.get("hardware", {})
        gpu = next((r.get("gpu", {}).get("name") for r in rows if r.get("gpu")), None) or r0.get("device")
        vers = next((r.get("versions") for r in rows if r.get("versions")), {}) or {}
        out.append("")
        out.append(
            f"Workload `{r0['workload']}`: {_count(r0['params'])} params, batch {r0['batch_size']} x {r0['seq_len']}; "
            f"{r0['warmup']} warm-up + {r0['steps']} timed steps; run `{r0['run_id']}`, commit `{str(r0.get('commit'))[:12]}`; "
            f"{gpu}, {hw.get('cpu')} ({hw.get('affinity_cores')} cores), {hw.get('ram_gb')} GB RAM; "
            + ", ".join(f"{k} {v}" for k, v in vers.items() if v) + f". x GPU-only against {ref_note}. "
            f"MFU: {r0.get('mfu_convention')}, peak {r0.get('peak_tflops')} TFLOP/s.")
    return "\n".join(out)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_systems(rows: list[dict[str, Any]], path: pathlib.Path, title: str = "",
                 everything: list[dict[str, Any]] | None = None) -> pathlib.Path:
    """Two panels: tokens/s (annotated x GPU-only) and MFU per system; absent/failed rows are labelled."""
    plt = _plt()
    ref, _ = reference(rows, everything or rows)
    names = _row_names(rows, lambda r: r["system"])[::-1]
    recs = rows[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.45 * len(rows) + 1.6), sharey=True)
    color = ["#888" if n == "gpu" else "#2a7" if n.startswith("ours") else "#c55" for n in names]
    tok = [r["tokens_per_s"] if r.get("status") == "ok" else 0 for r in recs]
    mfu = [100 * r["mfu"] if r.get("status") == "ok" and r.get("mfu") is not None else 0 for r in recs]
    a1.barh(names, tok, color=color)
    a2.barh(names, mfu, color=color)
    top_t, top_m = max([*tok, 1]), max([*mfu, 1e-9])
    for y, r in enumerate(recs):
        if r.get("status") != "ok":
            a1.text(top_t * 0.01, y, r.get("status", "?"), va="center", color="#a00", fontsize=8)
            continue
        a1.text(tok[y] + top_t * 0.01, y, f"{tok[y]:,.0f}" + (f"  ({tok[y] / ref:.2f}x)" if ref else ""),
                va="center", fontsize=8)
        a2.text(mfu[y] + top_m * 0.01, y, f"{mfu[y]:.1f}%", va="center", fontsize=8)
    a1.set_xlim(0, top_t * 1.35)
    a2.set_xlim(0, top_m * 1.25)
    a1.set_xlabel("tokens/s (x GPU-only)")
    a2.set_xlabel("MFU, % of peak (model FLOPs, no recompute)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ablation(rows: list[dict[str, Any]], path: pathlib.Path, title: str = "",
                  everything: list[dict[str, Any]] | None = None) -> pathlib.Path:
    """Per-technique ablation like the paper's: tokens/s relative to GPU-only as techniques are added, with
    DeepSpeed ZeRO-2 offload and SuperOffload as reference lines."""
    plt = _plt()
    ref, _ = reference(rows, everything or rows)
    by = {r["system"]: r for r in rows}
    labels, vals, status = [], [], []
    for system, label in ABLATION:
        r = by.get(system)
        labels.append(label)
        ok = r is not None and r.get("status") == "ok" and ref
        vals.append(r["tokens_per_s"] / ref if ok else 0.0)
        status.append("ok" if ok else ("not run" if r is None else r.get("status", "?")))
    fig, ax = plt.subplots(figsize=(1.9 * len(labels) + 1.5, 4.2))
    colors = ["#2a7"] * 4 + ["#7a9"]
    ax.bar(range(len(labels)), vals, color=colors[: len(labels)])
    for x, (v, st) in enumerate(zip(vals, status)):
        ax.text(x, v + 0.02, f"{v:.2f}x" if st == "ok" else st, ha="center", fontsize=9,
                color="k" if st == "ok" else "#a00")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.text(len(labels) - 0.5, 1.01, "GPU-only", ha="right", va="bottom", fontsize=8)
    for system, style in (("ds_zero2", "--"), ("ds_superoffload", ":")):
        r = by.get(system)
        if r is not None and r.get("status") == "ok" and ref:
            v = r["tokens_per_s"] / ref
            ax.axhline(v, color="#c55", lw=1, ls=style)
            ax.text(-0.5, v + 0.01, SUITE_LABEL[system], fontsize=8, color="#c55")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("tokens/s relative to GPU-only")
    ax.set_ylim(0, max([*vals, 1.0]) * 1.15)
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_suite(paths: list[str], docs: pathlib.Path | None, plots: bool = True) -> str:
    """Markdown for every (workload, run) in ``paths``; plots under ``docs`` (the last run of each workload)."""
    records = load_records(paths)
    groups = group_runs(records)
    parts = []
    latest: dict[str, list[dict[str, Any]]] = {}
    for (workload, run_id), rows in groups.items():
        r0 = rows[0]
        parts.append(f"### {workload}: {_count(r0['params'])} params, batch {r0['batch_size']} x {r0['seq_len']} "
                     f"(run {run_id})\n")
        parts.append(suite_table(rows, records))
        parts.append("")
        latest[workload] = rows
    if plots and docs is not None:
        for workload, rows in latest.items():
            r0 = rows[0]
            title = f"{workload}: {_count(r0['params'])}, batch {r0['batch_size']} x {r0['seq_len']}"
            safe = workload.replace(".", "_")
            plot_systems(rows, docs / f"benchmarks_suite_{safe}.png", title, records)
            plot_ablation(rows, docs / f"benchmarks_ablation_{safe}.png", title, records)
            parts.append(f"![{workload} per system](benchmarks_suite_{safe}.png)\n")
            parts.append(f"![{workload} ablation](benchmarks_ablation_{safe}.png)\n")
    return "\n".join(parts)


def render_anchor(paths: list[str], docs: pathlib.Path, plots: bool = True) -> None:
    """Tables (and the tokens/s plot) of anchor.py's JSON lines, one file per workload."""
    runs = {pathlib.Path(p).stem: load(p) for p in paths}
    for name, rows in runs.items():
        print(f"### {name}\n")
        print(table(rows))
        print()
    if plots:
        plot(runs, docs / "benchmarks_tokens.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="render benchmark results")
    ap.add_argument("--suite", nargs="+", help="suite.py JSON-lines files")
    ap.add_argument("--anchor", nargs="+", help="anchor.py JSON-lines files (benchmarks/gpu_session.sh)")
    ap.add_argument("--docs", default=str(ROOT.parent / "docs"), help="where the PNGs go (default docs/)")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if args.anchor:
        render_anchor(args.anchor, pathlib.Path(args.docs), plots=not args.no_plots)
    if not args.suite:
        if not args.anchor:
            ap.error("give --suite and/or --anchor files")
        return 0
    print(render_suite(args.suite, pathlib.Path(args.docs), plots=not args.no_plots))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
