"""Plots of benchmark results (matplotlib, imported only when drawing)."""

from __future__ import annotations


def plot_scaling(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
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
    fig.savefig(path)
    plt.close(fig)
