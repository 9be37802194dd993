"""The paper's two recipes (Lin et al., 2022, Sec. 4.1) and which architecture trains with which:
each arch's row of :data:`multipath_nmt.arch_table.ARCHS`, so that an architecture without a row
is refused rather than given a recipe by its name."""
from dataclasses import dataclass

from multipath_nmt.arch_table import ARCHS, TABLE

# The paper's set-up: "on 8 GPUs", with the per-GPU batch of each recipe.
PAPER_GPUS = 8


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

# Each arch's recipe, from its row of the arch table.
ARCH_RECIPES = {arch: {"base": BASE, "deep": DEEP}[row.recipe] for arch, row in ARCHS.items()}


def recipe_for_arch(arch: str) -> Recipe:
    """The recipe of ``arch``'s row in :data:`ARCH_RECIPES`; an arch without a row is refused."""
    try:
        return ARCH_RECIPES[arch]
    except KeyError:
        raise RecipeError(f"unknown arch '{arch}': no recipe for it in {TABLE}; add a row (recipe "
                          f"base or deep) for it there") from None


def criterion_for_arch(arch: str) -> str:
    """The routed architectures add their balance loss through their own criterion; an arch
    without a row in the arch table is refused as by :func:`recipe_for_arch`."""
    recipe_for_arch(arch)
    if ARCHS[arch].routed:
        return "label_smoothed_cross_entropy_with_moe"
    return "label_smoothed_cross_entropy"
