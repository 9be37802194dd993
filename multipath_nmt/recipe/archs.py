"""The paper's two recipes (Lin et al., 2022, Sec. 4.1) and which architecture trains with which:
an explicit table, so that an architecture without a row is refused rather than given a recipe
by its name."""
from dataclasses import dataclass

# The paper's set-up: "on 8 GPUs", with the per-GPU batch of each recipe.
PAPER_GPUS = 8
MOE_ARCH_PREFIXES = ("widenet", "ewa", "parameternet", "moe")
# Where the table lives, for the refusal of an arch without a row.
TABLE = "multipath_nmt/recipe/archs.py's ARCH_RECIPES"


class RecipeError(ValueError):
    """A request that cannot be turned into a command (the message says why and what to do)."""


@dataclass(frozen=True)
class Recipe:
    name: str
    lr: str
    warmup_updates: int
    tokens_per_gpu: int  # the paper's figure

    @property
    def global_batch(self) -> int:
        """Tokens per update in the paper's set-up: per GPU x 8 GPUs."""
        return self.tokens_per_gpu * PAPER_GPUS


BASE = Recipe("base", lr="0.001", warmup_updates=8000, tokens_per_gpu=4096)
DEEP = Recipe("deep/multi-path", lr="0.002", warmup_updates=16000, tokens_per_gpu=8192)

# Every architecture the plug-in registers (tests/test_recipe.py fails for one without a row) and
# fairseq's own Transformer-base that the README and the tests name. Deep, multi-path, the wide
# baseline (Fig. 1) and the WideNet, EWA, ParameterNet and MoE models take the deep recipe: the
# paper trains models of other depths and widths with the deep models' hyperparameters (its
# Limitations section); the base recipe is Transformer-base's.
ARCH_RECIPES = {
    # fairseq's transformer model
    "transformer": BASE,
    "transformer_wmt_en_de": BASE,
    "transformer_prenorm_wmt_en_de": BASE,
    "transformer_deep12_wmt_en_de": DEEP,
    "transformer_deep24_wmt_en_de": DEEP,
    "transformer_deep36_wmt_en_de": DEEP,
    "transformer_deep48_wmt_en_de": DEEP,
    "transformer_wide_wmt_en_de": DEEP,
    # multipath_transformer
    "multipath_transformer": DEEP,
    "multipath_transformer_wmt_en_de": DEEP,
    "multipath_l6_p2_wmt_en_de": DEEP,
    "multipath_l6_p4_wmt_en_de": DEEP,
    "multipath_l6_p6_wmt_en_de": DEEP,
    "multipath_l6_p8_wmt_en_de": DEEP,
    "multipath_l12_p2_wmt_en_de": DEEP,
    "multipath_l12_p3_wmt_en_de": DEEP,
    "multipath_l12_p4_wmt_en_de": DEEP,
    "multipath_l24_p2_wmt_en_de": DEEP,
    # widenet_transformer
    "widenet_transformer": DEEP,
    "widenet_transformer_wmt_en_de": DEEP,
    # moe_transformer
    "moe_transformer": DEEP,
    "moe_transformer_wmt_en_de": DEEP,
    "ewa_transformer_wmt_en_de": DEEP,
    "ewa_early_transformer_wmt_en_de": DEEP,
    "parameternet_transformer_wmt_en_de": DEEP,
}


def recipe_for_arch(arch: str) -> Recipe:
    """The recipe of ``arch``'s row in :data:`ARCH_RECIPES`; an arch without a row is refused."""
    try:
        return ARCH_RECIPES[arch]
    except KeyError:
        raise RecipeError(f"unknown arch '{arch}': no recipe for it in {TABLE}; add a row (BASE "
                          f"or DEEP) for it there") from None


def criterion_for_arch(arch: str) -> str:
    """MoE-style architectures add their balance loss through their own criterion."""
    if arch.startswith(MOE_ARCH_PREFIXES):
        return "label_smoothed_cross_entropy_with_moe"
    return "label_smoothed_cross_entropy"
