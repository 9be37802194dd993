"""The Multi30k study's figures (see study.py, which saves them): BLEU against parameters
(study.png) and the validation loss against updates (study-valid-loss.png).
"""
import statistics
from pathlib import Path
from typing import List, Sequence, Tuple

from multipath_nmt.atomic_files import write_atomically


FAMILY_STYLE = {"base": ("black", "o"), "deep": ("tab:blue", "s"), "wide": ("tab:gray", "D"),
                "multi-path": ("tab:red", "^"), "MoE-style": ("tab:green", "v")}
PLOT_MIN_SPAN_PARAMS = 0.2  # million parameters
PLOT_MIN_SPAN_BLEU = 2.0


def bleu_figure(summaries: List[dict], title: str):
    """BLEU vs parameters (the paper's Fig. 1): a line from the base model to each system, error
    bars of one sample std over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7.5, 5))
    base = next((s for s in summaries if s["system"] == "base"), None)
    for s in summaries:
        colour, marker = FAMILY_STYLE[s["family"]]
        x, y = s["params"] / 1e6, s["mean"]["test_bleu"]
        if base is not None and s is not base:
            axes.plot([base["params"] / 1e6, x], [base["mean"]["test_bleu"], y], color=colour,
                      alpha=0.35, linewidth=1)
        axes.errorbar(x, y, yerr=s["std"].get("test_bleu"), color=colour, marker=marker,
                      markersize=7, capsize=3, linestyle="none")
    for family, (colour, marker) in FAMILY_STYLE.items():
        if any(s["family"] == family for s in summaries):
            axes.plot([], [], color=colour, marker=marker, linestyle="none", label=family)
    # matplotlib fits the axes to the points: two systems of equal size 0.1 BLEU apart would
    # fill the whole figure, so the axes span at least PLOT_MIN_SPAN_PARAMS and _BLEU
    axes.set_xlim(_spanning(axes.get_xlim(), PLOT_MIN_SPAN_PARAMS))
    axes.set_ylim(_spanning(axes.get_ylim(), PLOT_MIN_SPAN_BLEU))
    _label_points(axes, [(s["system"], s["params"] / 1e6, s["mean"]["test_bleu"])
                         for s in summaries])
    axes.set_xlabel("parameters (M)")
    axes.set_ylabel("test BLEU, tokenized (Multi30k test 2016)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return figure


LABEL_SIZE_POINTS = (60, 10)  # room one 8-point system name takes, in typographic points


def _label_points(axes, points: Sequence[Tuple[str, float, float]]) -> None:
    """A name beside each point (x, y in data units, the axes' limits final), from the lowest
    point up: a label that would overprint one already placed moves up until it is free, so each
    label starts level with its own point unless another is in the way."""
    to_points = 72 / axes.figure.dpi
    placed = []
    for name, x, y in sorted(points, key=lambda p: p[2]):
        px, py = (to_points * v for v in axes.transData.transform((x, y)))
        offset = 4
        while any(abs(px - qx) < LABEL_SIZE_POINTS[0]
                  and abs(py + offset - qy) < LABEL_SIZE_POINTS[1] for qx, qy in placed):
            offset += LABEL_SIZE_POINTS[1]
        placed.append((px, py + offset))
        axes.annotate(name, (x, y), textcoords="offset points", xytext=(5, offset), fontsize=8)


def _spanning(limits: Tuple[float, float], span: float) -> Tuple[float, float]:
    """``limits`` widened about their middle to at least ``span``."""
    low, high = limits
    if high - low >= span:
        return low, high
    middle = (low + high) / 2
    return middle - span / 2, middle + span / 2


def save_figure(figure, path: Path) -> None:
    import matplotlib.pyplot as plt
    figure.tight_layout()
    write_atomically(path, lambda out: figure.savefig(out, format="png", dpi=120))
    plt.close(figure)


def mean_curve(curves: Sequence[Sequence[Tuple[int, float]]]):
    """The updates every curve was validated at, and the mean, min and max loss there."""
    common = sorted(set.intersection(*(set(u for u, _ in c) for c in curves)))
    values = [[dict(c)[u] for c in curves] for u in common]
    return (common, [statistics.fmean(v) for v in values], [min(v) for v in values],
            [max(v) for v in values])


# The validation-loss plot's right panel: the second half of training, where converged systems
# differ by 1-2% and a full-height axis from the first validation (loss 6+) flattens them
VALID_PLOT_ZOOM_FROM = 0.5
VALID_PLOT_ZOOM_MARGIN = 0.05  # of the zoomed range, above and below


def validation_loss_figure(summaries: List[dict], title: str):
    """Validation loss against updates per system: the mean over seeds, shaded between the
    seeds' min and max; left the whole run, right its second half with the loss axis fitted to
    it. None (nothing drawn) when no run has a validation curve."""
    curves = [(s, [r["valid_curve"] for r in s["runs"] if r.get("valid_curve")])
              for s in summaries]
    curves = [(s, c) for s, c in curves if c]
    if not curves:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (whole, zoomed) = plt.subplots(1, 2, figsize=(13, 5))
    last = max(run[-1][0] for _, runs in curves for run in runs)
    zoom_start = VALID_PLOT_ZOOM_FROM * last
    zoomed_losses = []
    for index, (s, runs) in enumerate(curves):
        updates, mean, low, high = mean_curve(runs)
        colour = f"C{index % 10}"
        zoomed_losses += [loss for u, lowest, highest in zip(updates, low, high)
                          if u >= zoom_start for loss in (lowest, highest)]
        for axes in (whole, zoomed):
            axes.plot(updates, mean, color=colour, linewidth=1.3,
                      linestyle="-" if index < 10 else "--", label=s["system"])
            if len(runs) > 1:
                axes.fill_between(updates, low, high, color=colour, alpha=0.2, linewidth=0)
    seeds = max(len(runs) for _, runs in curves)
    whole.set_title(title + (f": mean of {seeds} seeds, shaded min-max" if seeds > 1 else ""))
    zoomed.set_title(f"from update {zoom_start:,.0f} on, zoomed")
    zoomed.set_xlim(zoom_start, last)
    if zoomed_losses:
        margin = VALID_PLOT_ZOOM_MARGIN * (max(zoomed_losses) - min(zoomed_losses) or 1.0)
        zoomed.set_ylim(min(zoomed_losses) - margin, max(zoomed_losses) + margin)
    for axes in (whole, zoomed):
        axes.set_xlabel("updates (2,048 tokens each)")
        axes.set_ylabel("validation loss (nll, bits per token)")
        axes.grid(alpha=0.3)
    zoomed.legend(fontsize=8)
    return figure
