"""`python -m benchmarks.scaling`'s plot (the README's docs/throughput.png): tokens/s against questions answered together."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def plot_scaling(result: dict, path: str) -> None:
    fig = Figure(figsize=(8, 5), dpi=100)  # no pyplot: no global figure, no GUI backend
    ax = fig.subplots()
    for name, rates in result["rates"].items():
        ax.plot(result["counts"], rates, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(result["counts"], [str(c) for c in result["counts"]])
    ax.set_xlabel("questions answered together")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{result['model']}, fp32, CPU, greedy, <= {result['max_new_tokens']} new tokens")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
