"""Tables and plots shared by eval, compare, bench and the demo report."""

from __future__ import annotations

from pathlib import Path

from dflashkit.fileio import atomic_path


def fmt(v, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if isinstance(v, float) else "" if v is None else str(v)


def markdown_table(headers: list[str], rows: list[list], digits: int = 3) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(c, digits) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _figure():
    """A bare Figure, not pyplot's: no process-wide backend switch and no global figure registry to close."""
    from matplotlib.figure import Figure

    return Figure(figsize=(7, 4.2), dpi=110).add_subplot()


def _save(ax, path, legend: bool, grid: str = "both", fit_labels: bool = False) -> Path:
    """Fixed margins, or fit_labels (tight_layout: a third more time) for long labels under grouped bars."""
    ax.grid(alpha=0.3, axis=grid)
    if legend:
        ax.legend()
    fig, path = ax.figure, Path(path)
    if fit_labels:
        fig.tight_layout()
    else:
        fig.subplots_adjust(left=0.1, right=0.97, top=0.91, bottom=0.12)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def line_plot(path, series: dict[str, tuple[list, list]], title: str, xlabel: str, ylabel: str, ylim=None) -> Path:
    ax = _figure()
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o", markersize=3, label=name)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    return _save(ax, path, len(series) > 1)


def bar_plot(path, groups: dict[str, dict[str, float]], title: str, ylabel: str) -> Path:
    """Grouped bars: groups[category][series] = value."""
    ax = _figure()
    cats = list(groups)
    names = list(dict.fromkeys(n for g in groups.values() for n in g))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [c + i * width for c in range(len(cats))]
        ax.bar(xs, [groups[c].get(name, 0.0) for c in cats], width=width, label=name)
    ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(cats))], cats, rotation=20, ha="right")
    ax.set(title=title, ylabel=ylabel)
    return _save(ax, path, len(names) > 1, "y", fit_labels=True)


def hist_plot(path, series: dict[str, list[float]], title: str, xlabel: str, start: int = 0) -> Path:
    """Side-by-side histograms given as per-bin fractions or counts, bins start, start+1, ..."""
    ax = _figure()
    width = 0.8 / max(1, len(series))
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([start + j + i * width for j in range(len(vals))], vals, width=width, label=name)
    ax.set(title=title, xlabel=xlabel, ylabel="fraction")
    return _save(ax, path, len(series) > 1, "y")


def scatter_against_measured(path, points: dict[str, tuple[float, float]], title: str, unit: str, band: float) -> Path:
    """points[label] = (measured, predicted): one dot each, the diagonal and the +-band around it."""
    ax = _figure()
    top = max(max(p) for p in points.values()) * 1.1
    ax.plot([0, top], [0, top], color="grey", linewidth=1, label="predicted = measured")
    ax.fill_between([0, top], [0, top * (1 - band)], [0, top * (1 + band)], color="grey", alpha=0.15,
                    label=f"within {band:.0%}")
    ax.set(title=title, xlabel=f"measured {unit}", ylabel=f"predicted {unit}", xlim=(0, top), ylim=(0, top))
    placed, pt = [], ax.figure.dpi / 72  # labels' places in display pixels; pixels a point
    for name, (measured, predicted) in sorted(points.items(), key=lambda kv: -kv[1][1]):
        ax.scatter([measured], [predicted], s=25)
        (x, y), dy = ax.transData.transform((measured, predicted)), 4
        while any(abs(x - px) < 80 * pt and abs(y + dy * pt - py) < 9 * pt for px, py in placed):
            dy -= 9
        placed.append((x, y + dy * pt))
        ax.annotate(name, (measured, predicted), textcoords="offset points", xytext=(4, dy), fontsize=8)
    ax.legend(loc="upper left")
    return _save(ax, path, False)
