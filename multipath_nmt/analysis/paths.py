"""Learned path weights of a Multi-Path Transformer checkpoint (Lin et al., 2022, Fig. 7).

For each multi-path sublayer: the path weights alpha (raw paths first, then cheap features), the
residual weight beta and the path diversity |d| = |a1 - a2| / |a1 + a2| of the raw-path
weights. With n > 2 paths |d| is the mean over all pairs of raw paths (cheap features excluded);
with one path it is undefined (NaN).
"""
import itertools
import logging
import math
import os
import re
from typing import Dict, List

import torch

from multipath_nmt.atomic_files import write_atomically

_MIXER_KEY = re.compile(r"^(?:.*\.)?(?P<stack>encoder|decoder)\.layers\.(?P<layer>\d+)\."
                        r"(?P<sublayer>\w+)_mixer\.path_weights$")
# A parameter whose first dimension is the number of paths, per sublayer.
_PATH_SHAPED = {"self_attn": "self_attn.out_proj_weight",
                "encoder_attn": "encoder_attn.out_proj_weight",
                "ffn": "ffn.fc2_weight"}


def path_diversity(alphas: List[float]) -> float:
    """Mean over pairs i < j of |a_i - a_j| / |a_i + a_j| (Fig. 7's |d| for two paths)."""
    pairs = list(itertools.combinations(alphas, 2))
    if not pairs:
        return math.nan
    return sum(abs(a - b) / abs(a + b) for a, b in pairs) / len(pairs)


def path_weight_rows(state_dict: Dict[str, torch.Tensor]) -> List[dict]:
    """One row per multi-path sublayer, in model order: {"stack", "layer", "sublayer",
    "num_paths", "alphas", "beta", "diversity"}."""
    rows = []
    for key, alphas in state_dict.items():
        match = _MIXER_KEY.match(key)
        if not match:
            continue
        prefix = key[:-len(f"{match['sublayer']}_mixer.path_weights")]
        num_paths = state_dict[prefix + _PATH_SHAPED[match["sublayer"]]].shape[0]
        alphas = alphas.float().tolist()
        rows.append({
            "stack": match["stack"], "layer": int(match["layer"]),
            "sublayer": match["sublayer"], "num_paths": num_paths, "alphas": alphas,
            "beta": state_dict[prefix + f"{match['sublayer']}_mixer.residual_weight"].item(),
            "diversity": path_diversity(alphas[:num_paths]),
        })
    order = {"self_attn": 0, "encoder_attn": 1, "ffn": 2}
    return sorted(rows, key=lambda r: (r["stack"] != "encoder", r["layer"], order[r["sublayer"]]))


def plot_path_diversity(rows: List[dict], path) -> None:
    """|d| per layer, one line per stack and sublayer; written atomically to ``path``."""
    # fairseq's text_to_speech task sets the root logger to DEBUG on import; matplotlib would
    # then log its set-up and every font it considers.
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for stack, sublayer in sorted({(r["stack"], r["sublayer"]) for r in rows}):
        points = [(r["layer"] + 1, r["diversity"]) for r in rows
                  if (r["stack"], r["sublayer"]) == (stack, sublayer)]
        axes.plot(*zip(*points), marker="o", label=f"{stack} {sublayer}")
    axes.set_xlabel("layer")
    axes.set_ylabel("path diversity |d|")
    axes.legend()
    figure.tight_layout()
    image_format = os.path.splitext(os.fspath(path))[1][1:] or "png"  # as the name says
    try:
        write_atomically(path, lambda image: figure.savefig(image, format=image_format))
    finally:
        plt.close(figure)
