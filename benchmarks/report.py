"""Render benchmarks/results/*.jsonl into the tables and plot of docs/benchmarks.md.

    python benchmarks/report.py            # prints markdown, writes docs/benchmarks_tokens.png
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent
LABEL = {
    "gpu": "GPU-only (fp32 master, fused AdamW on GPU)",
    "ours": "hf_superoffload, default plan",
    "ours_host": "hf_superoffload, all optimizer state on host",
    "ours_host_noclip": "hf_superoffload, all on host, no clipping",
    "ours_noclip": "hf_superoffload, default plan, no clipping",
}


def load(name: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / "results" / name).read_text().splitlines() if line.strip()]


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


if __name__ == "__main__":
    r36 = load("2026-11-30_h200_3.6b_run3.jsonl")
    r8 = load("2026-11-30_h200_8b_run4.jsonl")
    print("### 3.6B, batch 8 x 2048\n")
    print(table(r36))
    print("\n### 8B, batch 4 x 2048\n")
    print(table(r8))
    plot({"3.6B Llama, 8 x 2048": r36, "8B Llama, 4 x 2048": r8}, ROOT.parent / "docs" / "benchmarks_tokens.png")
