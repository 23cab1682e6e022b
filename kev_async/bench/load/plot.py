"""`kev bench load`'s plot (the README's docs/load.png): end-to-end latency (p50 solid, p99 dashed) and
goodput against the offered rate, one colour per system."""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure


def _by_system(points: list[dict]) -> dict[str, list[dict]]:
    """Per system (static batching under one name, whatever its best size), points sorted by rate."""
    systems: dict[str, list[dict]] = {}
    for p in points:
        if math.isinf(p["rate"]):
            continue  # "all at once" has no place on a rate axis
        name = "transformers static (best batch)" if p["system"].startswith("transformers static") else p["system"]
        systems.setdefault(name, []).append(p)
    return {name: sorted(ps, key=lambda p: p["rate"]) for name, ps in systems.items()}


def plot_load(points: list[dict], path: str, title: str) -> bool:
    """`points`: summaries with a "rate" key. Returns False (and draws nothing) without a finite rate."""
    systems = _by_system(points)
    if not systems:
        return False
    fig = Figure(figsize=(11, 4.5), dpi=100)  # no pyplot: no global figure, no GUI backend
    latency, goodput = fig.subplots(1, 2)
    for i, (name, ps) in enumerate(systems.items()):
        color = f"C{i}"
        rates = [p["rate"] for p in ps]
        latency.plot(rates, [p["e2e_p50_s"] for p in ps], marker="o", color=color, label=f"{name} p50")
        latency.plot(rates, [p["e2e_p99_s"] for p in ps], marker="x", color=color, linestyle="--",
                     label=f"{name} p99")
        goodput.plot(rates, [p["goodput_tps"] for p in ps], marker="o", color=color, label=name)
    latency.set_yscale("log")
    latency.set_ylabel("end-to-end latency (s)")
    goodput.set_ylabel("goodput (completed tokens / s)")
    for ax in (latency, goodput):
        ax.set_xlabel("offered rate (questions / s)")
        ax.grid(True, alpha=0.3, which="both")
    latency.legend(fontsize=7)
    goodput.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return True
