"""WideNet LayerNorm divergence (Xue et al. 2022, Sec. 4, Eq. 9): how far apart the per-layer
LayerNorms of the shared encoder drift, the paper's evidence that individual LayerNorms let one
shared block compute different functions at different depths.

Implemented as (our reading of Eq. 9; its exact normalisation is unverified here): for each
LayerNorm position (before attention, before the MoE FFN) and each vector v in {gamma, beta},
divergence_i = sqrt(mean_d (v_i[d] - vbar[d])^2), the root-mean-square distance
of layer i's vector from the mean vbar over the L layers. Shared LayerNorms give 0 everywhere.
"""
import os
import re
from collections import defaultdict
from typing import Dict, List

import torch

_NORM_KEY = re.compile(r"^(?P<stack>.*)\.(?P<position>attention|ffn)_layer_norms\."
                       r"(?P<layer>\d+)\.(?P<vector>weight|bias)$")
_VECTOR_NAME = {"weight": "gamma", "bias": "beta"}


def layernorm_divergence(state_dict: Dict[str, torch.Tensor]) -> List[dict]:
    """One row per WideNet layer: {"stack", "layer", "attention_gamma", "attention_beta",
    "ffn_gamma", "ffn_beta"} (divergences as floats), layers in order."""
    vectors = defaultdict(dict)  # (stack, position, vector) -> {layer: tensor}
    for key, value in state_dict.items():
        match = _NORM_KEY.match(key)
        if match:
            group = (match["stack"], match["position"], _VECTOR_NAME[match["vector"]])
            vectors[group][int(match["layer"])] = value.detach().float().cpu()
    if not vectors:
        raise ValueError("no WideNet per-layer LayerNorms (…attention_layer_norms.N.weight / "
                         "…ffn_layer_norms.N.weight) in this state dict; inspect a "
                         "widenet_transformer checkpoint")
    rows = {}
    for (stack, position, vector), by_layer in sorted(vectors.items()):
        stacked = torch.stack([by_layer[i] for i in sorted(by_layer)])
        divergence = (stacked - stacked.mean(0)).pow(2).mean(1).sqrt()
        for layer, value in zip(sorted(by_layer), divergence.tolist()):
            rows.setdefault((stack, layer), {"stack": stack, "layer": layer})[
                f"{position}_{vector}"] = value
    return [rows[key] for key in sorted(rows)]


def plot_layernorm_divergence(rows: List[dict], path) -> None:
    """Divergence per layer, gamma and beta side by side; written atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharex=True)
    for axis, vector in zip(axes, ("gamma", "beta")):
        for stack in sorted({row["stack"] for row in rows}):
            stack_rows = [row for row in rows if row["stack"] == stack]
            layers = [row["layer"] for row in stack_rows]
            for position in ("attention", "ffn"):
                axis.plot(layers, [row[f"{position}_{vector}"] for row in stack_rows],
                          marker="o", label=f"{stack} {position} LN")
        axis.set_title(f"divergence of {vector}")
        axis.set_xlabel("encoder layer")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("RMS distance to the layer mean")
    axes[1].legend(fontsize="small")
    figure.tight_layout()
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.tmp")
    try:
        figure.savefig(temporary, format=os.path.splitext(path)[1][1:] or "png")
        os.replace(temporary, path)
    finally:
        plt.close(figure)
        if os.path.exists(temporary):
            os.remove(temporary)
