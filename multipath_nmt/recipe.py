"""The Multi-Path Transformer paper's training recipe (Lin et al., 2022, Sec. 4.1) for
``scripts/train.sh``: learning rate, warm-up and batch per architecture family, the batch split
over GPUs, and which embeddings are shared.

Batch: the paper trains with "4,096" (base) and "8,192" (deep and multi-path) tokens "on 8
GPUs". We read these as tokens per GPU, as in the authors' fairseq scripts, so the global batch,
max-tokens x GPUs x update-freq, is 32,768 and 65,536 tokens. Without a GPU (a smoke path, not a
reproduction) the batch is one GPU's share: 4,096 / 8,192 tokens per update.

Embeddings: Table 2's En-De sizes are one joined dictionary with every embedding shared; Table 3's
En-Fr sizes (111M / 168M) need about 130,800 embedding rows of 512, i.e. three unshared matrices
of about 43,600 types (docs/fidelity.md has the arithmetic), so En-Fr shares nothing.

This module imports neither fairseq nor the package (``train.sh`` runs it as a script with
``runpy`` to stay fast); run it with ``--help`` for its shell interface.
"""
import argparse
import filecmp
import math
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

# The paper's set-up: "on 8 GPUs", with the per-GPU batch of each recipe.
PAPER_GPUS = 8
# max-tokens when the user gives none: the authors' per-GPU micro-batch (their deep recipe
# reaches 8,192 per GPU as 4,096 x update-freq 2), which fits a 12 GB GPU.
DEFAULT_MAX_TOKENS = 4096
# Architectures trained with the deep/multi-path recipe; the others use the base recipe.
DEEP_ARCH_PATTERNS = ("deep", "multipath", "widenet", "ewa", "parameternet", "moe")
MOE_ARCH_PREFIXES = ("widenet", "ewa", "parameternet", "moe")
# Table 3's En-Fr sizes need unshared embeddings (docs/fidelity.md).
UNSHARED_LANGUAGE_PAIRS = ({"en", "fr"},)


class RecipeError(ValueError):
    """A request train.sh cannot turn into the recipe (the message says why and what to do)."""


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


def recipe_for_arch(arch: str) -> Recipe:
    """The deep/multi-path recipe for deep, multi-path and the wide (WideNet, EWA,
    ParameterNet, MoE) architectures; the base recipe for the others."""
    return DEEP if any(p in arch for p in DEEP_ARCH_PATTERNS) else BASE


def criterion_for_arch(arch: str) -> str:
    """MoE-style architectures add their balance loss through their own criterion."""
    if arch.startswith(MOE_ARCH_PREFIXES):
        return "label_smoothed_cross_entropy_with_moe"
    return "label_smoothed_cross_entropy"


def gpu_precision_for_arch(arch: str) -> str:
    """fairseq's mixed-precision flag on GPUs. Multi-path models take ``--amp`` (fp32 weights,
    fp16 arithmetic): under ``--fp16`` (fp16 weights and gradients) the gradients of their path
    and residual weights overflow at a loss scale the stock model takes (docs/fidelity.md,
    'Architecture and GPU-scale numerics'). Both are mixed-precision training with loss scaling."""
    return "--amp" if arch.startswith("multipath") else "--fp16"


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


def dictionary_files(data_bin: Path, source_lang: Optional[str] = None,
                     target_lang: Optional[str] = None) -> List[Path]:
    """The source and target dictionaries of a fairseq data-bin (languages, when not given,
    from the ``train.SRC-TGT.*`` files as fairseq infers them, else from the ``dict.*.txt``)."""
    pairs = sorted(p.name.split(".")[1] for p in data_bin.glob("train.*-*.*.idx"))
    if source_lang and target_lang:
        langs = [source_lang, target_lang]
    elif pairs:
        langs = pairs[0].split("-", 1)
    else:
        langs = sorted(p.name[len("dict."):-len(".txt")] for p in data_bin.glob("dict.*.txt"))
        if not langs:
            raise RecipeError(f"{data_bin} has no dict.*.txt: give the data-bin folder written "
                              f"by fairseq-preprocess")
        if len(langs) > 2:
            raise RecipeError(f"{data_bin} has dictionaries for {', '.join(langs)}: pass "
                              f"--source-lang and --target-lang")
    files = [data_bin / f"dict.{lang}.txt" for lang in langs]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise RecipeError(f"no dictionary {', '.join(missing)}")
    return files


def embedding_sharing(dictionaries: Sequence[Path], choice: str = "auto") -> List[str]:
    """fairseq flags for the embeddings: ``--share-all-embeddings`` (one matrix; needs a joined
    dictionary) or nothing (encoder input, decoder input and output projection unshared).

    ``auto``: nothing shared for En-Fr (Table 3's sizes), shared for a joined dictionary
    (Table 2's), nothing shared when the dictionaries differ."""
    joined = len(dictionaries) < 2 or filecmp.cmp(*dictionaries[:2], shallow=False)
    langs = {Path(d).name[len("dict."):-len(".txt")] for d in dictionaries}
    if choice == "shared":
        if not joined:
            raise RecipeError(f"--embeddings shared needs a joined dictionary, but "
                              f"{' and '.join(map(str, dictionaries))} differ (binarize with "
                              f"fairseq-preprocess --joined-dictionary, or --embeddings separate)")
        return ["--share-all-embeddings"]
    if choice == "separate":
        return []
    if choice != "auto":
        raise RecipeError(f"--embeddings must be auto, shared or separate, got {choice!r}")
    if langs in UNSHARED_LANGUAGE_PAIRS or not joined:
        return []
    return ["--share-all-embeddings"]


def gpu_count() -> int:
    """``MULTIPATH_NMT_NUM_GPUS`` if set, else the CUDA devices torch sees."""
    value = os.environ.get("MULTIPATH_NMT_NUM_GPUS")
    if value is not None:
        if not value.isdigit():
            raise RecipeError(f"MULTIPATH_NMT_NUM_GPUS must be a number, got '{value}'")
        return int(value)
    import torch
    return torch.cuda.device_count()


def _positive_int(name: str, text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RecipeError(f"{name} must be a positive integer, got '{text}'")
    return int(text)


def shell_main(argv=None):
    """For train.sh: print shell assignments (recipe, batch, flags) or one error line."""
    parser = argparse.ArgumentParser(prog="train.sh", description=shell_main.__doc__)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--data-bin", type=Path, required=True)
    parser.add_argument("--max-tokens")
    parser.add_argument("--batch-tokens")
    parser.add_argument("--update-freq")
    parser.add_argument("--embeddings", default="auto")
    parser.add_argument("--source-lang")
    parser.add_argument("--target-lang")
    args = parser.parse_args(argv)
    try:
        recipe = recipe_for_arch(args.arch)
        dictionaries = dictionary_files(args.data_bin, args.source_lang, args.target_lang)
        sharing = embedding_sharing(dictionaries, args.embeddings)
        gpus = gpu_count()
        plan = batch_plan(recipe, gpus, _positive_int("max-tokens", args.max_tokens),
                          _positive_int("--batch-tokens", args.batch_tokens),
                          _positive_int("--update-freq", args.update_freq))
    except RecipeError as error:
        sys.exit(f"train.sh: error: {error}")
    except ImportError as error:
        sys.exit(f"train.sh: error: cannot count GPUs ({error}); activate the environment or set PYTHON")
    values = {"user_dir": os.path.dirname(os.path.abspath(__file__)), "gpus": gpus,
              "recipe": recipe.name, "lr": recipe.lr, "warmup": recipe.warmup_updates,
              "criterion": criterion_for_arch(args.arch),
              "gpu_precision": gpu_precision_for_arch(args.arch), "max_tokens": plan.max_tokens,
              "update_freq": plan.update_freq, "batch_line": plan.arithmetic(),
              "sharing_line": ("embeddings: " + ("all shared (joined dictionary)" if sharing else
                               "nothing shared (encoder input, decoder input, output projection)")
                               + f" for {', '.join(d.name for d in dictionaries)}")}
    print("\n".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items()))
    print(f"sharing=({' '.join(sharing)})")


if __name__ == "__main__":
    shell_main()
