"""Training and validation loss vs update from fairseq-train logs (the paper's Fig. 6), the
library of ``multipath-plot-log``.

Reads the ``train_inner`` (every --log-interval updates), ``train`` (end of epoch) and ``valid``
lines of ``--log-format simple`` or ``json`` logs. Losses are fairseq's, in base 2.
"""
import json
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from multipath_nmt.atomic_files import write_atomically

# "... | INFO | train_inner | epoch 001:  2 / 6 loss=7.6, ..." or "... | INFO | valid | {...}"
_TAGGED = re.compile(r"\| (?P<tag>train_inner|train|valid\w*) \| (?P<body>.*)$")
_SIMPLE_LOSS = re.compile(r"(?:^|[\s|,])loss[= ](?P<value>[^\s,|]+)")
_SIMPLE_UPDATES = re.compile(r"(?:^|[\s|,])num_updates[= ](?P<value>\d+)")


class PlotLogError(ValueError):
    """A log without loss lines, or an unusable output path."""


@dataclass
class LossCurves:
    """(update, loss) points of one log: train_inner, per-epoch train, and one list per valid subset."""
    train_inner: List[Tuple[int, float]] = field(default_factory=list)
    train: List[Tuple[int, float]] = field(default_factory=list)
    valid: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)


def _point(tag: str, body: str):
    if body.startswith("{"):
        stats = json.loads(body)
        prefix = "" if tag == "train_inner" else tag + "_"
        loss, updates = stats.get(prefix + "loss"), stats.get(prefix + "num_updates")
    else:
        loss, updates = _SIMPLE_LOSS.search(body), _SIMPLE_UPDATES.search(body)
        loss, updates = (loss and loss.group("value")), (updates and updates.group("value"))
    if loss is None or updates is None:
        return None
    return int(float(updates)), float(loss)


def parse_log(path) -> LossCurves:
    """The loss curves of one fairseq-train log (simple or json format, mixed is fine)."""
    if not os.path.isfile(path):
        raise PlotLogError(f"{path}: no such log file")
    curves = LossCurves()
    with open(path, encoding="utf-8", errors="replace") as log:
        for line in log:
            match = _TAGGED.search(line.rstrip("\n"))
            if not match:
                continue
            point = _point(match.group("tag"), match.group("body"))
            if point is None:
                continue
            tag = match.group("tag")
            if tag == "train_inner":
                curves.train_inner.append(point)
            elif tag == "train":
                curves.train.append(point)
            else:
                curves.valid.setdefault(tag, []).append(point)
    if not (curves.train_inner or curves.train or curves.valid):
        raise PlotLogError(f"{path}: no train_inner/train/valid loss lines; give the output of "
                           "fairseq-train run with --log-format simple or json")
    return curves


def read_logs(paths: Sequence, labels: Optional[Sequence[str]] = None) -> List[Tuple[str, LossCurves]]:
    """(label, curves) of each log; the labels default to the file names without extension."""
    labels = labels or [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(labels) != len(paths):
        raise PlotLogError(f"{len(labels)} --labels for {len(paths)} logs; give one label per log")
    return [(label, parse_log(path)) for label, path in zip(labels, paths)]


def plot_curves(logs: Sequence[Tuple[str, LossCurves]], out, title=None) -> None:
    """Two panels, training and validation loss vs update, one line per (label, curves); PNG atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise PlotLogError(f"{folder}: output folder does not exist; create it first")
    fig, (ax_train, ax_valid) = plt.subplots(1, 2, figsize=(11, 4))
    for label, curves in logs:
        train = curves.train_inner or curves.train  # per-interval points when logged
        if train:
            ax_train.plot(*zip(*train), label=label)
        for subset, points in curves.valid.items():
            name = label if subset == "valid" else f"{label} ({subset})"
            ax_valid.plot(*zip(*points), marker="o", markersize=3, label=name)
    for ax, name in ((ax_train, "training loss"), (ax_valid, "validation loss")):
        ax.set_xlabel("update")
        ax.set_ylabel(f"{name} (base 2)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        write_atomically(out, lambda png: fig.savefig(png, format="png", dpi=120))
    finally:
        plt.close(fig)

