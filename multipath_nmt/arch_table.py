"""The facts of every architecture, in one table (:data:`ARCHS`): the fairseq model it is an
architecture of, the paper's recipe it trains with, the shape its defaults give and, for the
routed models, the family whose measured peak the GPU memory model uses.

The rest is derived from it: ``recipe/archs.py``'s ``ARCH_RECIPES`` (train.sh's learning rate,
warm-up and batch, and its criterion), ``recipe/memory_model.py``'s micro-batch, and the
architectures ``models/`` registers from :data:`MULTIPATH_PRESETS`, :data:`DEEP_ENCODER_LAYERS`
and :data:`WIDE`. Plain Python, importing neither fairseq nor torch (``.importlinter``), so that
train.sh's dry run reads it without them. ``tests/test_recipe.py`` fails for an arch the plug-in
registers without a row, a row fairseq does not know, and a shape other than the one the
registered arch's defaults give.
"""
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Shape:
    """The dimensions the memory model reads: layers, encoder paths, width, FFN width."""
    encoder_layers: int = 6
    encoder_paths: int = 1
    decoder_layers: int = 6
    dim: int = 512
    ffn: int = 2048


@dataclass(frozen=True)
class Arch:
    """One architecture: ``model``, the fairseq model it belongs to; ``recipe``, ``"base"`` or
    ``"deep"`` (the paper's two, ``recipe/archs.py``); ``shape``, what its defaults give;
    ``routed``, the routed family (its criterion adds the balance loss, and the memory model uses
    the family's measured peak instead of the shape), or None for a dense or multi-path model."""
    model: str
    recipe: str
    shape: Shape = field(default_factory=Shape)
    routed: Optional[str] = None


# (encoder layers, paths) of the multi-path systems of Table 2 / Table 3.
MULTIPATH_PRESETS = ((6, 2), (12, 2), (6, 4), (12, 3), (6, 6), (24, 2), (12, 4), (6, 8))
# Transformer-deep's encoder layers (a 6-layer decoder).
DEEP_ENCODER_LAYERS = (12, 24, 36, 48)
# Fig. 1's wide baseline: every matrix dimension of the base model doubled.
WIDE = Shape(dim=1024, ffn=4096)

# Every architecture the plug-in registers and fairseq's own Transformer-base that the README and
# the tests name. Deep, multi-path, the wide baseline (Fig. 1) and the WideNet, EWA, ParameterNet
# and MoE models take the deep recipe: the paper trains models of other depths and widths with the
# deep models' hyperparameters (its Limitations section); the base recipe is Transformer-base's.
ARCHS = {
    # fairseq's transformer model: its own archs, then models/transformer_baselines.py
    "transformer": Arch("transformer", "base"),
    "transformer_wmt_en_de": Arch("transformer", "base"),
    "transformer_prenorm_wmt_en_de": Arch("transformer", "base"),
    **{f"transformer_deep{layers}_wmt_en_de": Arch("transformer", "deep",
                                                   Shape(encoder_layers=layers))
       for layers in DEEP_ENCODER_LAYERS},
    "transformer_wide_wmt_en_de": Arch("transformer", "deep", WIDE),
    # models/multipath_transformer.py
    "multipath_transformer": Arch("multipath_transformer", "deep", Shape(encoder_paths=2)),
    "multipath_transformer_wmt_en_de": Arch("multipath_transformer", "deep",
                                            Shape(encoder_paths=2)),
    **{f"multipath_l{layers}_p{paths}_wmt_en_de": Arch(
        "multipath_transformer", "deep", Shape(encoder_layers=layers, encoder_paths=paths))
       for layers, paths in MULTIPATH_PRESETS},
    # models/widenet_transformer.py
    "widenet_transformer": Arch("widenet_transformer", "deep", routed="widenet"),
    "widenet_transformer_wmt_en_de": Arch("widenet_transformer", "deep", routed="widenet"),
    # models/moe_transformer.py
    "moe_transformer": Arch("moe_transformer", "deep", routed="moe"),
    "moe_transformer_wmt_en_de": Arch("moe_transformer", "deep", routed="moe"),
    "ewa_transformer_wmt_en_de": Arch("moe_transformer", "deep", routed="ewa"),
    "ewa_early_transformer_wmt_en_de": Arch("moe_transformer", "deep", routed="ewa"),
    "parameternet_transformer_wmt_en_de": Arch("moe_transformer", "deep", routed="parameternet"),
}
# Where the table lives, for the refusals of an arch without a row.
TABLE = "multipath_nmt/arch_table.py's ARCHS"
