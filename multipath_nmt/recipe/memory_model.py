"""How many tokens one training micro-batch may hold on a GPU: the memory of an arch as a linear
model of its parameters and its padded tokens, fitted to peaks measured on a GPU, with a margin.

peak = STATIC_BYTES_PER_PARAM x parameters + activation bytes per token x max-tokens

* Static: fp32 weights, gradients and Adam's two moments (16 bytes), and the bf16 copies that
  autocast keeps for the update (2 bytes).
* Activations per padded token (fairseq's max-tokens counts padding): the encoder's layers (per
  layer and path, scaled by width), the decoder's layers, and the output layer's logits, whose
  log-probabilities and their gradients are fp32 rows of the target vocabulary (12 bytes per
  entry: bf16 logits, fp32 log-probabilities, fp32 and bf16 gradients). Attention runs in SDPA's
  fused kernels, whose memory grows with tokens, not with the square of the length, so the
  longest sentences cost what any padded tokens cost.
* The per-layer constants are solved from two peaks measured on an H200 with fairseq's reset of
  the peak counter switched off (``docs/bench/gpu-check-h200.json``, which records its commit:
  the pre-norm base model and multi-path 6 x 4 at 4,096 max-tokens, d 512, 32,000 types, bf16
  autocast). The routed families (WideNet, MoE, EWA, ParameterNet) use their own measured peaks
  from the same file, their logits moved to the data's vocabulary.

The planner uses half of what the card leaves after the static memory and a reserve for CUDA's
context and workspaces: the peaks were measured on batches of 28-token sentences, and real data
adds longer sentences, other batch shapes (the caching allocator holds more than it hands out
when shapes vary) and kernels' workspaces. ``scripts/gpu-bench.sh`` prints each row's planned
and measured peak, so the margin is checked on every GPU it runs on (docs/gpu.md).
"""
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Tuple

from multipath_nmt.arch_table import ARCHS, TABLE, Shape
from multipath_nmt.recipe.archs import RecipeError
from multipath_nmt.recipe.devices import unseen_gpus
from multipath_nmt.recipe.train_flags import given_flags

MIB = 2 ** 20
STATIC_BYTES_PER_PARAM = 18
RESERVE_MIB = 1024
MARGIN = 0.5
MEASURED_VOCAB = 32000
LOGIT_BYTES_PER_TYPE = 12
# Solved from the two measured peaks (module docstring): the peak MiB and parameters of the base
# model's and multi-path 6 x 4's rows of docs/bench/gpu-check-h200.json (tests/test_recipe.py
# checks that they are that file's).
_BASE_ACTIVATIONS = 3931.21142578125 * MIB - STATIC_BYTES_PER_PARAM * 60524544
_MULTIPATH_ACTIVATIONS = 5962.7158203125 * MIB - STATIC_BYTES_PER_PARAM * 117279804
MEASURED_MAX_TOKENS = 4096
# bytes per padded token of one encoder layer-path at d 512 (6 x 4 has 18 more than 6 x 1)
ENCODER_LAYER_BYTES = (_MULTIPATH_ACTIVATIONS - _BASE_ACTIVATIONS) / 18 / MEASURED_MAX_TOKENS
# bytes per padded token of one decoder layer at d 512: the base model's rest
DECODER_LAYER_BYTES = (_BASE_ACTIVATIONS / MEASURED_MAX_TOKENS - 6 * ENCODER_LAYER_BYTES
                       - LOGIT_BYTES_PER_TYPE * MEASURED_VOCAB) / 6


# The routed families (the arch table's ``routed``) at d 512 with their defaults, measured whole
# (module docstring):
# (peak MiB at 4,096 max-tokens, parameters at 32,000 shared types).
_ROUTED_PEAKS = {
    "widenet": (4204.28271484375, 51074048),
    "moe": (4475.28369140625, 79428096),
    "ewa": (4268.81884765625, 79421952),
    "parameternet": (5058.37451171875, 125134896),  # dynamic, the larger of its two modes
}
# Flags of fairseq-train that change a dense or multi-path shape, when given to train.sh.
SHAPE_FLAGS = {"--encoder-layers": "encoder_layers", "--encoder-paths": "encoder_paths",
               "--decoder-layers": "decoder_layers", "--encoder-embed-dim": "dim",
               "--encoder-ffn-embed-dim": "ffn"}


@dataclass(frozen=True)
class MemoryEstimate:
    static_bytes: float
    bytes_per_token: float

    def peak_mib(self, max_tokens: int) -> float:
        return (self.static_bytes + self.bytes_per_token * max_tokens) / MIB

    def max_tokens(self, card_mib: int) -> int:
        """The largest micro-batch whose activations fit in :data:`MARGIN` of what the card
        leaves after the static memory and :data:`RESERVE_MIB`."""
        free = (card_mib - RESERVE_MIB) * MIB - self.static_bytes
        return max(0, int(MARGIN * free / self.bytes_per_token))


def _given_shape(arch: str, passed_on: Sequence[str]) -> Shape:
    values = dict(ARCHS[arch].shape.__dict__)
    for flag, text in given_flags(passed_on, SHAPE_FLAGS).items():
        if text.isdigit():
            values[SHAPE_FLAGS[flag]] = int(text)
    return Shape(**values)


def _dictionary_size(path: Path) -> int:
    """Types of a fairseq dictionary: its lines and the four symbols fairseq adds."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f) + 4


def estimate(arch: str, dictionaries: Sequence[Path], shared_embeddings: bool,
             passed_on: Sequence[str] = ()) -> MemoryEstimate:
    """The memory model of ``arch`` trained on the data-bin whose dictionaries are given
    (source, target), with the shape flags among fairseq-train's arguments ``passed_on``."""
    source_types, target_types = (_dictionary_size(d) for d in (*dictionaries, dictionaries[-1])[:2])
    logits = LOGIT_BYTES_PER_TYPE * target_types
    if arch not in ARCHS:
        raise RecipeError(f"no memory model for arch '{arch}': it has no row in {TABLE}; give "
                          f"--max-tokens N")
    family = ARCHS[arch].routed
    if family:
        peak_mib, params = _ROUTED_PEAKS[family]
        activations = (peak_mib * MIB - STATIC_BYTES_PER_PARAM * params) / MEASURED_MAX_TOKENS
        embedding_change = 512 * ((source_types if shared_embeddings else
                                   source_types + 2 * target_types) - MEASURED_VOCAB)
        return MemoryEstimate(STATIC_BYTES_PER_PARAM * (params + embedding_change),
                              activations + logits - LOGIT_BYTES_PER_TYPE * MEASURED_VOCAB)
    shape = _given_shape(arch, passed_on)
    d, f = shape.dim, shape.ffn
    encoder_layer = 4 * d * d + 2 * d * f
    decoder_layer = 8 * d * d + 2 * d * f
    embeddings = d * (source_types if shared_embeddings else source_types + 2 * target_types)
    params = (shape.encoder_layers * shape.encoder_paths * encoder_layer
              + shape.decoder_layers * decoder_layer + embeddings)
    width = d / 512
    per_token = (shape.encoder_layers * shape.encoder_paths * ENCODER_LAYER_BYTES * width
                 + shape.decoder_layers * DECODER_LAYER_BYTES * width + logits)
    return MemoryEstimate(STATIC_BYTES_PER_PARAM * params, per_token)


def gpu_memory_mib() -> Tuple[int, str]:
    """(MiB, where from): ``MULTIPATH_NMT_GPU_MEMORY_MIB`` if set, else the first CUDA GPU's total
    memory; with no GPU visible (a plan made on a login node) one line that names the variable."""
    value = os.environ.get("MULTIPATH_NMT_GPU_MEMORY_MIB")
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise RecipeError(f"MULTIPATH_NMT_GPU_MEMORY_MIB must be a positive number of MiB, "
                              f"got '{value}'")
        return int(value), "MULTIPATH_NMT_GPU_MEMORY_MIB"
    unseen = unseen_gpus()
    if unseen is not None:
        raise RecipeError(
            f"MULTIPATH_NMT_NUM_GPUS={os.environ.get('MULTIPATH_NMT_NUM_GPUS', '')} counts GPUs that "
            f"{unseen}, so no GPU's memory can size the micro-batch: set "
            "MULTIPATH_NMT_GPU_MEMORY_MIB to one GPU's memory in MiB (nvidia-smi's memory.total on "
            "the GPU machine, e.g. 143771 for an H200) or give --max-tokens N")
    import torch
    return torch.cuda.get_device_properties(0).total_memory // MIB, "the GPU's memory"


def planned_max_tokens(arch: str, dictionaries: Sequence[Path], shared_embeddings: bool,
                       passed_on: Sequence[str], card_mib: Optional[int] = None):
    """(the largest micro-batch the GPU holds for ``arch``, the words saying where it comes
    from); ``card_mib``: that card's memory instead of :func:`gpu_memory_mib`'s."""
    card_mib, source = gpu_memory_mib() if card_mib is None else (card_mib, "a card of that size")
    model = estimate(arch, dictionaries, shared_embeddings, passed_on)
    tokens = model.max_tokens(card_mib)
    return tokens, (f"the micro-batch that fits {card_mib:,} MiB ({source}) with a "
                    f"{1 / MARGIN:.0f}x margin: {model.static_bytes / MIB:,.0f} MiB of weights "
                    f"and optimizer state + {model.bytes_per_token / 1024:,.0f} KiB per token "
                    f"(multipath_nmt/recipe/memory_model.py)")
