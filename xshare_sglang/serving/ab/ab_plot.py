"""PNG plots of an A/B summary: throughput against concurrency, and throughput against accuracy."""

from __future__ import annotations

from pathlib import Path

from .ab_report import Summary


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, ax, title: str, path: Path) -> Path:
    """Title, grid and legend, then write the PNG and close the figure."""
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_throughput(summary: Summary, out_dir: Path) -> list[Path]:
    """One PNG per dataset: median output tok/s per arm against concurrency, with each arm's range."""
    plt = _pyplot()
    written = []
    for dataset in dict.fromkeys(row.dataset for row in summary.serving):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm in summary.arms:
            rows = [r for r in summary.serving if r.dataset == dataset and r.arm == arm and r.output_throughput]
            if not rows:
                continue
            xs = [r.concurrency for r in rows]
            ys = [r.output_throughput for r in rows]
            low = [r.output_throughput - r.throughput_low for r in rows]
            high = [r.throughput_high - r.output_throughput for r in rows]
            style = {"linestyle": "--", "color": "black"} if arm == summary.baseline else {}
            ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=arm, **style)
        ax.set_xscale("log", base=2)
        levels = sorted({r.concurrency for r in summary.serving if r.dataset == dataset})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("max concurrency (requests)")
        ax.set_ylabel("output tokens/s (median over repetitions)")
        written.append(_save(fig, ax, f"{summary.model_path or ''}: {dataset}", out_dir / f"throughput_{dataset}.png"))
    return written


def pareto_points(summary: Summary, dataset: str, concurrency: int) -> list[tuple[str, float, float]]:
    """(arm, output tok/s, GSM8K accuracy) of every arm with both numbers at this dataset and concurrency."""
    accuracy = {row.arm: row.accuracy for row in summary.accuracy if row.accuracy is not None}
    points = []
    for row in summary.serving:
        if row.dataset == dataset and row.concurrency == concurrency and row.output_throughput and row.arm in accuracy:
            points.append((row.arm, row.output_throughput, accuracy[row.arm]))
    return points


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Arms no other arm beats on both throughput and accuracy (ties do not dominate)."""
    front = []
    for arm, tput, acc in points:
        dominated = any((t >= tput and a >= acc) and (t > tput or a > acc) for other, t, a in points if other != arm)
        if not dominated:
            front.append(arm)
    return front


def plot_pareto(summary: Summary, out_dir: Path) -> list[Path]:
    """One PNG per dataset: each arm's throughput at the highest concurrency against its GSM8K accuracy."""
    if not summary.accuracy:
        return []
    plt = _pyplot()
    written = []
    for dataset in dict.fromkeys(row.dataset for row in summary.serving):
        levels = sorted({r.concurrency for r in summary.serving if r.dataset == dataset})
        points = []
        for concurrency in reversed(levels):
            points = pareto_points(summary, dataset, concurrency)
            if len(points) >= 2:
                break
        if not points:
            continue
        front = set(pareto_front(points))
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for arm, tput, acc in points:
            marker = "s" if arm == summary.baseline else "o"
            ax.scatter([tput], [acc], marker=marker, s=50, color="tab:red" if arm in front else "tab:gray", zorder=3)
            ax.annotate(arm, (tput, acc), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ordered = sorted((p for p in points if p[0] in front), key=lambda p: p[1])
        ax.plot([p[1] for p in ordered], [p[2] for p in ordered], color="tab:red", alpha=0.5, label="Pareto front")
        ax.set_xlabel(f"output tokens/s at concurrency {concurrency} ({dataset})")
        ax.set_ylabel("GSM8K accuracy")
        title = f"{summary.model_path or ''}: throughput vs accuracy"
        written.append(_save(fig, ax, title, out_dir / f"pareto_{dataset}.png"))
    return written
