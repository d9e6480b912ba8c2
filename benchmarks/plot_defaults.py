"""One figure of what the defaults do, from the JSONL records of ``benchmarks/defaults.py``.

    python benchmarks/plot_defaults.py $OUT/defaults.jsonl [more.jsonl ...] --out docs/benchmarks_defaults.png

Left: tokens/s of the README snippet over the best GPU-only tokens/s of the same model (the fastest baseline at
any batch in the same files; a model no GPU-only run fits has no bar). Right: the planner's predicted seconds per
optimizer step against the measured median, every snippet and Trainer row.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

BASELINES = ("gpu_fp32", "gpu_bf16", "gpu_bf16_kept")
OURS = ("snippet", "trainer", "host0", "host0_inverse")


def _records(paths: list[Path]) -> list[dict[str, Any]]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]


def predicted_step_s(rec: dict[str, Any]) -> float | None:
    """The planner's seconds per optimizer step (its micro-batch step, plus the GPU part of each further one)."""
    p = rec.get("predicted") or {}
    if p.get("optimizer_step_s") is not None:
        return float(p["optimizer_step_s"])
    if p.get("step_s") is None or p.get("gpu_s") is None:
        return None
    return float(p["step_s"]) + (rec.get("accum", 1) - 1) * float(p["gpu_s"])


def summarize(recs: list[dict[str, Any]]) -> tuple[list[tuple[str, float]], list[tuple[str, float, float]]]:
    """(label, ratio to the best GPU-only tokens/s) per snippet row, and (label, predicted, measured) per row."""
    best: dict[str, float] = defaultdict(float)
    for r in recs:
        if r.get("status") == "ok" and r["system"] in BASELINES:
            best[r["preset"]] = max(best[r["preset"]], r["tokens_per_s"])
    ratios, points = [], []
    for r in recs:
        if r.get("status") != "ok" or r["system"] not in OURS:
            continue
        label = f"{r['preset']} bs{r['batch']}" + (f"x{r['accum']}" if r.get("accum", 1) > 1 else "")
        if r.get("clip", 1.0) >= 1e6:  # --clip 1e9: clipping that never fires, so speculation commits
            label += " no clip"
        if r.get("gpu_cap_gib"):  # a smaller GPU than any baseline ran on: no ratio
            label += f" {r['gpu_cap_gib']:g}GiB"
        elif r["system"] == "snippet" and best.get(r["preset"]):
            ratios.append((label, r["tokens_per_s"] / best[r["preset"]]))
        pred = predicted_step_s(r)
        if pred is not None:
            points.append((f"{label} {r['system']}", pred, r["step_s"]["median"]))
    return ratios, points


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios, points = summarize(_records(args.jsonl))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar([lbl for lbl, _ in ratios], [r for _, r in ratios], color="tab:blue")
    left.axhline(1.0, color="grey", lw=1, ls="--")
    left.set_ylabel("tokens/s vs best GPU-only tokens/s")
    left.set_title("README snippet, no settings")
    for k, (_, r) in enumerate(ratios):
        left.text(k, r + 0.01, f"{r:.2f}x", ha="center", va="bottom", fontsize=9)
    # log axes: the rows span 0.8 to 18 s per step, and +-10% is the same band everywhere
    values = [p for _, p, _ in points] + [m for _, _, m in points] or [1.0]
    lo, top = min(values) / 1.3, max(values) * 1.3
    right.plot([lo, top], [lo, top], color="grey", lw=1, ls="--")
    right.fill_between([lo, top], [0.9 * lo, 0.9 * top], [1.1 * lo, 1.1 * top], color="grey", alpha=0.15,
                       label="+-10%")
    for k, (lbl, pred, meas) in enumerate(points):
        right.scatter(meas, pred, s=25)
        right.annotate(lbl, (meas, pred), fontsize=7, xytext=(5, -12 if k % 2 else 4), textcoords="offset points")
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlim(lo, top)
    right.set_ylim(lo, top)
    right.set_xlabel("measured s/optimizer step (median)")
    right.set_ylabel("planner's prediction (the run's clipping)")
    right.set_title("predicted vs measured")
    right.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
