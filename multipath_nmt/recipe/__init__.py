"""The Multi-Path Transformer paper's training recipe (Lin et al., 2022, Sec. 4.1) and our
decoding defaults, as the fairseq-train and fairseq-generate command lines that
``scripts/train.sh``, ``scripts/translate.sh`` and the Multi30k study run: learning rate, warm-up
and batch per architecture (:mod:`.archs`, from the arch table :mod:`multipath_nmt.arch_table`), the batch split over GPUs
(:mod:`.batch`) in micro-batches that the GPU's memory holds (:mod:`.memory_model`), which embeddings are shared (:mod:`.embedding_sharing`), the device and precision
(:mod:`.devices`), the launcher for several processes (:mod:`.launcher`), the command lines
(:mod:`.commands`) and translate.sh's output files (:mod:`.translation`).

Batch: the paper trains with "4,096" (base) and "8,192" (deep and multi-path) tokens "on 8
GPUs". We read these as tokens per GPU, as in the authors' fairseq scripts, so the global batch,
max-tokens x GPUs x update-freq, is 32,768 and 65,536 tokens. Without a GPU (a smoke path, not a
reproduction) the batch is one GPU's share: 4,096 / 8,192 tokens per update.

Embeddings: Table 2's En-De sizes are one joined dictionary with every embedding shared; Table 3's
En-Fr sizes (111M / 168M) need about 130,800 embedding rows of 512, i.e. three unshared matrices
of about 43,600 types (docs/fidelity.md has the arithmetic), so En-Fr shares nothing.

These modules import neither fairseq nor the rest of the package but the arch table (torch only to ask about CUDA
and to run torchrun): ``scripts/run-recipe.sh`` loads them and :mod:`multipath_nmt.cli.recipe_scripts`
without the package's ``__init__``, which imports fairseq, so that train.sh starts in a fraction of
the seconds fairseq's import takes.
"""
from multipath_nmt.recipe.archs import (ARCH_RECIPES, BASE, DEEP, PAPER_GPUS, Recipe, RecipeError,
                                        criterion_for_arch, recipe_for_arch)
from multipath_nmt.recipe.batch import DEFAULT_MAX_TOKENS, BatchPlan, batch_plan
from multipath_nmt.recipe.commands import (DECODING, RECIPE_DROPOUT, RECIPE_EPOCHS,
                                           READ_FAIRSEQ_FLAGS, TRAIN_SH_FLAGS, USER_DIR, Command,
                                           generate_command, train_command, training_length)
from multipath_nmt.recipe.embedding_sharing import (UNSHARED_LANGUAGE_PAIRS, dictionary_files,
                                           embedding_sharing)
from multipath_nmt.recipe.devices import (PRECISION_NOTES, PRECISIONS, choose_precision,
                                          ddp_on_cpu, gpu_count, gpu_supports_bf16,
                                          no_cuda_device)
from multipath_nmt.recipe.launcher import (LAUNCHER_MODULE, LAUNCHER_NOTE, STOP_SIGNALS,
                                           launcher_arguments, run_launcher)
from multipath_nmt.recipe.translation import finish_translation

__all__ = [
    "ARCH_RECIPES", "BASE", "DEEP", "PAPER_GPUS", "Recipe", "RecipeError",
    "criterion_for_arch", "recipe_for_arch", "DEFAULT_MAX_TOKENS", "BatchPlan", "batch_plan",
    "DECODING", "RECIPE_DROPOUT", "RECIPE_EPOCHS", "READ_FAIRSEQ_FLAGS", "TRAIN_SH_FLAGS",
    "USER_DIR", "Command", "generate_command", "train_command", "training_length",
    "UNSHARED_LANGUAGE_PAIRS", "dictionary_files", "embedding_sharing", "PRECISION_NOTES",
    "PRECISIONS", "choose_precision", "ddp_on_cpu", "gpu_count", "gpu_supports_bf16",
    "no_cuda_device",
    "LAUNCHER_MODULE", "LAUNCHER_NOTE", "STOP_SIGNALS", "launcher_arguments", "run_launcher",
    "finish_translation",
]
