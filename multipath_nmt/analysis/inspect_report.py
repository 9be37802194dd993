"""The report of ``multipath-inspect``: the path weights and path diversity of a trained
checkpoint (:mod:`multipath_nmt.analysis.paths`) and, for WideNet and pre-norm Transformer
checkpoints, the divergence of the encoder blocks' LayerNorms
(:mod:`multipath_nmt.analysis.layernorm_divergence`), as Markdown tables."""
import math
import os
from typing import List, Optional

from multipath_nmt.analysis import layernorm_divergence
from multipath_nmt.analysis.paths import path_weight_rows, plot_path_diversity
from multipath_nmt.checkpoint_io.reading import read_checkpoint


def _widenet_rows(state_dict) -> List[dict]:
    try:
        return layernorm_divergence.layernorm_divergence(state_dict)
    except ValueError:  # no per-layer encoder LayerNorms, or post-norm ones
        return []


def _number(value) -> str:
    return "n/a" if isinstance(value, float) and math.isnan(value) else f"{value:.4f}"


def format_path_rows(rows: List[dict]) -> str:
    lines = ["| stack | layer | sublayer | paths | alpha | beta | abs(d) |",
             "|---|---:|---|---:|---|---:|---:|"]
    for r in rows:
        alphas = ", ".join(f"{a:.4f}" for a in r["alphas"])
        lines.append(f"| {r['stack']} | {r['layer'] + 1} | {r['sublayer']} | {r['num_paths']} "
                     f"| {alphas} | {r['beta']:.4f} | {_number(r['diversity'])} |")
    return "\n".join(lines) + "\n"


def format_generic_rows(rows: List[dict]) -> str:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(
            _number(row[c]) if isinstance(row.get(c), float) else str(row.get(c, ""))
            for c in columns) + " |")
    return "\n".join(lines) + "\n"


def inspect_checkpoint(path, plot: Optional[str] = None) -> str:
    """The report for the checkpoint at ``path``; draws |d| per layer to ``plot`` if given.
    Raises ValueError (a :class:`~multipath_nmt.checkpoint_io.CheckpointError` for an unreadable
    file) saying what is wrong."""
    if not os.path.isfile(path):
        raise ValueError(f"no checkpoint file {path}")
    state_dict = read_checkpoint(path)["model"]
    rows = path_weight_rows(state_dict)
    divergence = _widenet_rows(state_dict)
    if not rows and not divergence:
        raise ValueError(f"{path} has no multi-path sublayers (…_mixer.path_weights) or pre-norm "
                         "encoder LayerNorms; inspect a multipath_transformer, widenet or "
                         "pre-norm transformer checkpoint")
    if plot and not rows:
        raise ValueError("--plot draws path diversity, which this checkpoint does not have")
    report = []
    if rows:
        report.append("Path weights and diversity |d| = |a1 - a2| / |a1 + a2| (mean over pairs "
                      "of raw paths for n > 2)\n\n" + format_path_rows(rows))
        if plot:
            plot_path_diversity(rows, plot)
    if divergence:
        report.append("LayerNorm divergence per encoder block (WideNet Eq. 9 for each block: "
                      "mean |difference| of its elements to all elements of the other blocks; "
                      "ffn = the LayerNorm before the FFN/MoE)\n\n"
                      + format_generic_rows(divergence))
    return "\n".join(report)
