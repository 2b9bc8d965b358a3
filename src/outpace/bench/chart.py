"""The speedup chart of a Spec-Bench run: one bar per category, overall last, 1x marked."""
from __future__ import annotations

from pathlib import Path

from outpace.errors import OutpaceError


def speedup_chart(summary: dict, path: str | Path, title: str = "outpace n-gram speculation") -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise OutpaceError("the speedup chart needs matplotlib: pip install matplotlib "
                           "(or pip install 'outpace[bench]'); results.json and results.md are written") from None
    rows = list(summary["categories"].items()) + [("overall", summary["overall"])]
    names = [name for name, _ in rows]
    values = [s["speedup"] or 0.0 for _, s in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(rows) + 2), 4))
    colors = ["tab:blue"] * (len(rows) - 1) + ["tab:orange"]
    bars = ax.bar(names, values, color=colors)
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in values], fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax.set_ylabel("speedup over plain decoding (tokens/s)")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=45)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
