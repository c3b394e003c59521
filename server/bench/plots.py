"""The sweep's curves, continuous against static: throughput against P99 latency (where
they cross is the setting a user tunes to), and TTFT and ITL against concurrency."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt


def plot_sweep(points: list[dict], x_key: str, path: Path) -> Path:
    """points: one dict per run with 'policy', x_key and `vllm bench serve` result keys."""
    fig, (ax_tp, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(16, 4.8))
    for n, policy in enumerate(sorted({p["policy"] for p in points})):
        color = f"C{n}"
        runs = sorted((p for p in points if p["policy"] == policy), key=lambda p: p[x_key])
        xs = [p[x_key] for p in runs]
        ax_tp.plot([p["output_throughput"] for p in runs], [p["p99_e2el_ms"] for p in runs],
                   marker="o", color=color, label=policy)  # fmt: skip
        for p in runs:
            ax_tp.annotate(str(p[x_key]), (p["output_throughput"], p["p99_e2el_ms"]),
                           textcoords="offset points", xytext=(4, 4), fontsize=8)  # fmt: skip
        for ax, metric in ((ax_ttft, "ttft"), (ax_itl, "itl")):
            ax.plot(xs, [p[f"median_{metric}_ms"] for p in runs], marker="o", color=color,
                    label=f"{policy} P50")  # fmt: skip
            ax.plot(xs, [p[f"p99_{metric}_ms"] for p in runs], marker="s", linestyle="--",
                    color=color, label=f"{policy} P99")  # fmt: skip
    label = x_key.replace("_", " ")
    ax_tp.set(xlabel="output throughput (tok/s)", ylabel="P99 end-to-end latency (ms)",
              title=f"throughput vs P99 latency (points: {label})")  # fmt: skip
    ax_ttft.set(xlabel=label, ylabel="ms", title="time to first token")
    ax_itl.set(xlabel=label, ylabel="ms", title="inter-token latency")
    for ax in (ax_tp, ax_ttft, ax_itl):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in (ax_ttft, ax_itl):
        ax.set_xscale("log", base=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
