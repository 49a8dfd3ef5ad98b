"""PNG plot of serving sweeps: throughput and TTFT against concurrency, one line per engine."""
from __future__ import annotations


def plot_sweeps(results: list[dict], path: str, title: str = "") -> str:
    """``results``: serving result dicts (each with ``label`` and ``steps``). Returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in results:
        steps = sorted(res["steps"], key=lambda s: s["concurrency"])
        conc = [s["concurrency"] for s in steps]
        label = res.get("label") or res.get("model") or "engine"
        ax_tp.plot(conc, [s["output_throughput"] for s in steps], marker="o", label=label)
        ax_ttft.plot(conc, [s["ttft_ms"]["mean"] / 1000 for s in steps], marker="o", label=label)
    for ax, ylabel in ((ax_tp, "output tokens/s"), (ax_ttft, "mean TTFT (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_tp.set_title("throughput")
    ax_ttft.set_title("time to first token")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
