"""Plot a ``bench_triton.py --out`` record: each op's graph-timed share of the copy ceiling per bucket size and
layout, with issue #4's 85% line and the size-matched ``copy_`` of the same bytes.

    python benchmarks/plot_triton.py $OUT/bench_triton.json docs/<name>.png [--ops OP ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_OPS = ("flatten_stats_bf16_spread", "flatten_stats_bf16", "flatten_stats_f32_bf16_spread", "scatter_f32_bf16")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("record", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--ops", nargs="+", default=list(DEFAULT_OPS))
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(a.record.read_text())
    ceiling = data["copy_ceiling_gbps"]
    rows = [r for r in data["rows"] if r["op"] in a.ops and r.get("graph_gbps")]
    if not rows:
        raise SystemExit(f"no rows of {a.ops} with a graph time in {a.record}")
    sizes = sorted({r["bucket_mb"] for r in rows})
    layouts = sorted({r["layout"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.2 * len(sizes), 4.2), sharey=True)
    axes = axes if len(sizes) > 1 else [axes]
    width = 0.8 / len(layouts)
    for ax, mb in zip(axes, sizes, strict=True):
        for j, lay in enumerate(layouts):
            vals = []
            for op in a.ops:
                r = next((r for r in rows if r["op"] == op and r["bucket_mb"] == mb and r["layout"] == lay), None)
                vals.append(100 * r["graph_gbps"] / ceiling if r else 0.0)
            xs = [i + (j - (len(layouts) - 1) / 2) * width for i in range(len(a.ops))]
            ax.bar(xs, vals, width, label=lay, hatch="" if j == 0 else "//")
        szc = data.get("size_matched_copy_gbps", {}).get(str(mb))
        if szc:
            ax.axhline(100 * szc / ceiling, color="gray", ls=":", label="torch copy_ (same bytes)")
        ax.axhline(85, color="red", ls="--", label="issue #4: 85%")
        ax.set_title(f"{mb} MB bucket")
        ax.set_xticks(range(len(a.ops)))
        ax.set_xticklabels([op.replace("flatten_stats_", "stats ").replace("_", " ") for op in a.ops],
                           rotation=30, ha="right", fontsize=8)  # fmt: skip
        ax.set_ylim(0, 110)
    axes[0].set_ylabel("% of the device copy ceiling (graph time)")
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"{data['device']}: Triton bucket kernels (ceiling {ceiling:.0f} GB/s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
