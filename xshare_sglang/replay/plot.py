"""Pareto plots of the offline tools: modeled MoE speed-up against retained gating mass."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both),
    ordered by the first coordinate."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((ox >= x and oy >= y) and (ox > x or oy > y) for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot_pareto(
    panels: dict[str, list[dict]],
    path: str | Path,
    title: str,
    *,
    x_key: str = "retained_mass",
    x_label: str = "retained gating mass (%)",
) -> Path:
    """Write one PNG with a panel per batch shape.

    Parameters
    ----------
    panels : dict of str to list of dict
        Panel title -> points, each ``{"label": str, x_key: float in [0, 1], "speedup": float}``.
    path : str or Path
        Where the PNG goes.
    x_key, x_label : str
        The quality measure on the x axis (a fraction, drawn in percent) and its axis label.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    count = max(1, len(panels))
    fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.8), dpi=100, squeeze=False)
    # one color per policy across every panel, and each panel's legend lists its own policies
    every_policy = sorted({p["label"].split(" ")[0] for points in panels.values() for p in points})
    colors = {name: f"C{i % 10}" for i, name in enumerate(every_policy)}
    for ax, (panel, points) in zip(axes[0], panels.items(), strict=False):
        xy = [(100 * p[x_key], p["speedup"]) for p in points]
        policies = sorted({p["label"].split(" ")[0] for p in points})
        for (x, y), p in zip(xy, points, strict=True):
            ax.scatter(x, y, color=colors[p["label"].split(" ")[0]], s=18, zorder=3)
        for name in policies:
            ax.scatter([], [], color=colors[name], label=name)
        front = pareto_front(xy)
        ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], color="gray", lw=1, ls="--", zorder=2)
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(x_label)
        ax.set_ylabel("modeled MoE speed-up (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_study(families: dict[str, list[dict]], path: str | Path, title: str, *, seeds: Sequence[str] = ()) -> Path:
    """One PNG of a Pareto study: speed-up against top-1 agreement, one line per method.

    Parameters
    ----------
    families : dict of str to list of dict
        Method -> points ``{"top1_agree": float, "low": float, "high": float, "speedup": float}``
        (fractions; ``low``/``high`` the interval, drawn as horizontal bars).
    path : str or Path
    title : str
    seeds : sequence of str
        The methods that existed before (their joint Pareto frontier is drawn dashed); the first is
        drawn as grey points, the others as lines like the new methods.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    colours = iter(plt.get_cmap("tab10").colors)
    seed_points = [p for name, points in families.items() if name in seeds for p in points]
    for name, points in families.items():
        points = sorted(points, key=lambda p: p["top1_agree"])
        xs = [100 * p["top1_agree"] for p in points]
        ys = [p["speedup"] for p in points]
        errors = [
            [100 * (p["top1_agree"] - p["low"]) for p in points],
            [100 * (p["high"] - p["top1_agree"]) for p in points],
        ]
        if seeds and name == seeds[0]:
            ax.errorbar(xs, ys, xerr=errors, fmt="o", color="0.6", ms=4, elinewidth=0.8, label=name)
        else:
            ax.errorbar(xs, ys, xerr=errors, fmt="o-", color=next(colours), ms=4, lw=1.2, elinewidth=0.8, label=name)
    if seed_points:
        front = sorted(
            (seed_points[i] for i in pareto_front([(p["top1_agree"], p["speedup"]) for p in seed_points])),
            key=lambda p: p["top1_agree"],
        )
        ax.plot(
            [100 * p["top1_agree"] for p in front],
            [p["speedup"] for p in front],
            "--",
            color="0.4",
            lw=1,
            label="seed frontier",
        )
    ax.set_xlabel("top-1 agreement with the unpruned model (%), 95% interval")
    ax.set_ylabel("modeled MoE speed-up (x)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
