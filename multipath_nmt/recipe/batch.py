"""The batch of train.sh: the recipe's tokens per update as max-tokens x workers x update-freq
(module docstring of :mod:`multipath_nmt.recipe` for the reading of the paper's figures)."""
import math
from dataclasses import dataclass
from typing import Optional

from multipath_nmt.recipe.archs import PAPER_GPUS, Recipe, RecipeError

# max-tokens when the user gives none and no GPU memory sizes it (CPU processes): the authors'
# per-GPU micro-batch (their deep recipe reaches 8,192 per GPU as 4,096 x update-freq 2).
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class BatchPlan:
    max_tokens: int
    update_freq: int
    workers: int  # GPUs, or 1 process on the CPU
    gpus: int
    origin: str  # where the total comes from, for the printed line

    @property
    def global_batch(self) -> int:
        return self.max_tokens * self.workers * self.update_freq

    def arithmetic(self) -> str:
        unit = f"{self.gpus} GPU(s)" if self.gpus else "1 CPU process"
        return (f"{self.max_tokens:,} max-tokens x {unit} x {self.update_freq} update-freq = "
                f"{self.global_batch:,} tokens per update ({self.origin})")


def _nearest_exact(total: int, workers: int, max_tokens: int) -> str:
    """A --batch-tokens value below ``total`` that ``workers`` can split exactly."""
    update_freq = math.ceil(total / (workers * max_tokens))
    tokens = total // (workers * update_freq)
    return (f"--batch-tokens {tokens * workers * update_freq} ({tokens} max-tokens x {workers} "
            f"workers x {update_freq} update-freq)")


def batch_plan(recipe: Recipe, gpus: int, max_tokens: Optional[int] = None,
               batch_tokens: Optional[int] = None, update_freq: Optional[int] = None) -> BatchPlan:
    """max-tokens and update-freq such that max-tokens x workers x update-freq is exactly the
    batch: ``batch_tokens`` if given, else the recipe's global batch on GPUs (32,768 / 65,536)
    and one GPU's share on the CPU (``gpus == 0``: 4,096 / 8,192).

    ``max_tokens`` (default 4,096) is a cap: it is lowered to the largest value that splits each
    worker's share into equal micro-batches, but never below half the cap (a share with no such
    divisor is refused). A batch that the workers cannot split evenly is refused with a value
    that they can. ``update_freq`` given by the user replaces the batch arithmetic: the batch is
    then max-tokens x workers x update-freq, whatever the recipe's.
    """
    cap = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    for name, value in (("max-tokens", cap), ("--batch-tokens", batch_tokens),
                        ("--update-freq", update_freq)):
        if value is not None and value < 1:
            raise RecipeError(f"{name} must be a positive integer, got {value}")
    workers = max(gpus, 1)
    if update_freq is not None:
        if batch_tokens is not None:
            raise RecipeError("give --batch-tokens or --update-freq, not both "
                              "(--update-freq is computed from --batch-tokens)")
        return BatchPlan(cap, update_freq, workers, gpus, "--update-freq given: not the recipe's batch")
    if batch_tokens is not None:
        total, origin = batch_tokens, "--batch-tokens"
    elif gpus:
        total = recipe.global_batch
        origin = f"the paper's {recipe.tokens_per_gpu:,}, read as per GPU, x {PAPER_GPUS} GPUs"
    else:
        total, origin = recipe.tokens_per_gpu, "one GPU's share of the paper's batch on the CPU"
    if total % workers:
        raise RecipeError(
            f"{total:,} tokens per update ({origin}) cannot be split evenly over {workers} GPUs; "
            f"use a GPU count that divides it (CUDA_VISIBLE_DEVICES selects them) or pass "
            f"{_nearest_exact(total, workers, cap)}")
    share = total // workers
    micro_batches = math.ceil(share / cap)
    while share % micro_batches:
        micro_batches += 1
    if share > cap and share // micro_batches < cap / 2:
        raise RecipeError(
            f"{share:,} tokens per worker ({total:,} / {workers}) cannot be cut into equal "
            f"micro-batches of {cap // 2:,} to {cap:,} tokens (max-tokens {cap:,}); pass "
            f"{_nearest_exact(total, workers, cap)} or another max-tokens")
    return BatchPlan(share // micro_batches, micro_batches, workers, gpus, origin)
