"""LayerNorm divergence across encoder blocks (Xue et al. 2022, "Layer Norm Analysis", Eq. 9):
how different the LayerNorm vectors (gamma, beta) of the blocks are, the paper's evidence that
WideNet's individual LayerNorms let one shared block compute different functions at different
depths. The paper compares WideNet with the plain Transformer (its Figs. 4-5), so both kinds of
checkpoint are read: WideNet's per-layer LayerNorms, and a fairseq pre-norm Transformer's
per-layer LayerNorms (post-norm ones sit after their sublayer and are refused).

Eq. 9 for the element i of a vector v (gamma or beta; N blocks, M elements, v_ij element i of
block j): y_i = 1/(M N^2) sum_j sum_m sum_n [j != n] |v_ij - v_mn|, every element of every
other block. It leaves i free while the figures plot one value per block, so we report, for each
block j, the same sum with j fixed and averaged over its M elements i:

    y_j = 1/(M^2 N) sum_i sum_m sum_n [j != n] |v_ij - v_mn|

the mean distance of block j's elements to all elements of the other blocks (with the paper's
1/N, not 1/(N-1)). The mean of y_j over the blocks equals the mean of Eq. 9's y_i over i.
The paper studies the LayerNorm before the MoE/FFN (``ffn_*`` columns); the LayerNorm before
attention is reported alongside (``attention_*``). Shared LayerNorms give 0 everywhere.
"""
import os
import re
from collections import defaultdict
from typing import Dict, List

import torch

from multipath_nmt.atomic_files import write_atomically

# WideNet: <stack>.attention_layer_norms.<j>.weight; fairseq: encoder.layers.<j>.final_layer_norm
_WIDENET_KEY = re.compile(r"^(?P<stack>.*)\.(?P<position>attention|ffn)_layer_norms\."
                          r"(?P<layer>\d+)\.(?P<vector>weight|bias)$")
_FAIRSEQ_KEY = re.compile(r"^(?P<stack>encoder\.layers)\.(?P<layer>\d+)\."
                          r"(?P<position>self_attn|final)_layer_norm\.(?P<vector>weight|bias)$")
_POSITION = {"attention": "attention", "ffn": "ffn", "self_attn": "attention", "final": "ffn"}
_VECTOR_NAME = {"weight": "gamma", "bias": "beta"}
# fairseq's encoder has this final LayerNorm only when its layers are pre-norm
_PRE_NORM_MARKER = "encoder.layer_norm.weight"


def block_divergence(vectors: torch.Tensor) -> torch.Tensor:
    """[N blocks, M elements] -> [N]: y_j of the module docstring, in float64.

    Sum over all N * M values of |v - x| for every v from one sort and prefix sums; the
    distances within v's own block are taken out again."""
    num_blocks, size = vectors.shape
    values = vectors.detach().double().cpu()
    flat = values.reshape(-1).sort().values
    prefix = torch.cat([flat.new_zeros(1), flat.cumsum(0)])
    queries = values.reshape(-1)
    below = torch.searchsorted(flat, queries, right=True)  # how many x <= v
    sum_below = prefix[below]
    to_all = (below * queries - sum_below) + (prefix[-1] - sum_below
                                             - (flat.numel() - below) * queries)
    within = (values.unsqueeze(2) - values.unsqueeze(1)).abs().sum(2)  # [N, M]
    return (to_all.view(num_blocks, size) - within).sum(1) / (size * size * num_blocks)


def _collect(state_dict: Dict[str, torch.Tensor]):
    vectors = defaultdict(dict)  # (stack, position, vector) -> {layer: tensor}
    widenet = False
    for key, value in state_dict.items():
        match = _WIDENET_KEY.match(key)
        widenet = widenet or match is not None
        match = match or _FAIRSEQ_KEY.match(key)
        if match:
            group = (match["stack"], _POSITION[match["position"]], _VECTOR_NAME[match["vector"]])
            vectors[group][int(match["layer"])] = value
    if not vectors:
        raise ValueError("no per-layer encoder LayerNorms in this state dict (WideNet's "
                         "…ffn_layer_norms.N.weight or a fairseq Transformer's "
                         "encoder.layers.N.final_layer_norm.weight)")
    if not widenet and _PRE_NORM_MARKER not in state_dict:
        raise ValueError("a post-norm encoder: its LayerNorms follow attention and the FFN, "
                         "while Eq. 9 is about the LayerNorm before the FFN; inspect a pre-norm "
                         "model (--encoder-normalize-before) or a WideNet")
    return vectors


def layernorm_divergence(state_dict: Dict[str, torch.Tensor]) -> List[dict]:
    """One row per encoder block: {"stack", "layer", "ffn_gamma", "ffn_beta",
    "attention_gamma", "attention_beta"} (y_j as floats), blocks in order."""
    rows = {}
    for (stack, position, vector), by_layer in sorted(_collect(state_dict).items()):
        layers = sorted(by_layer)
        divergence = block_divergence(torch.stack([by_layer[i].reshape(-1) for i in layers]))
        for layer, value in zip(layers, divergence.tolist()):
            rows.setdefault((stack, layer), {"stack": stack, "layer": layer})[
                f"{position}_{vector}"] = value
    return [rows[key] for key in sorted(rows)]


def plot_layernorm_divergence(rows: List[dict], path) -> None:
    """Divergence per block, gamma and beta side by side; written atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5), sharex=True)
    for axis, vector in zip(axes, ("gamma", "beta")):
        for stack in sorted({row["stack"] for row in rows}):
            stack_rows = [row for row in rows if row["stack"] == stack]
            layers = [row["layer"] for row in stack_rows]
            for position in ("ffn", "attention"):
                axis.plot(layers, [row[f"{position}_{vector}"] for row in stack_rows],
                          marker="o", label=f"{stack}: LN before {position}")
        axis.set_title(f"divergence of {vector} (Eq. 9 per block)")
        axis.set_xlabel("encoder block")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("mean |difference| to the other blocks")
    axes[1].legend(fontsize="small")
    figure.tight_layout()
    image_format = os.path.splitext(os.fspath(path))[1][1:] or "png"
    try:
        write_atomically(path, lambda image: figure.savefig(image, format=image_format))
    finally:
        plt.close(figure)
