"""The fairseq-train and fairseq-generate command lines of train.sh and translate.sh: the recipe's
flags, the batch, the device and the launcher, then the user's arguments, which override them."""
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from multipath_nmt.recipe.archs import RecipeError, criterion_for_arch, recipe_for_arch
from multipath_nmt.recipe.batch import DEFAULT_MAX_TOKENS, batch_plan
from multipath_nmt.recipe.embedding_sharing import dictionary_files, embedding_sharing
from multipath_nmt.recipe.devices import (PRECISION_NOTES, PRECISIONS, bf16_assumption,
                                          choose_precision, ddp_on_cpu, gpu_count)
from multipath_nmt.recipe.launcher import LAUNCHER_NOTE, launcher_arguments
from multipath_nmt.recipe.memory_model import planned_max_tokens
from multipath_nmt.recipe.train_flags import given_flags

# The plug-in folder for fairseq's --user-dir (multipath_nmt.USER_DIR, found here without
# importing the package).
USER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _positive_int(name: str, text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise RecipeError(f"{name} must be a positive integer, got '{text}'")
    return int(text)


@dataclass(frozen=True)
class Command:
    """A fairseq command line and the lines train.sh / translate.sh print before running it."""
    argv: List[str]
    notes: List[str]


# train.sh's own flags (the batch and the embeddings): read here, not passed on to fairseq.
TRAIN_SH_FLAGS = {"--max-tokens": "max_tokens", "--batch-tokens": "batch_tokens",
                  "--embeddings": "embeddings", "--precision": "precision",
                  "--nnodes": "nnodes", "--rdzv-endpoint": "rdzv_endpoint",
                  "--rdzv-id": "rdzv_id", "--save-interval-minutes": "save_interval_minutes"}


# fairseq-train's flags that the recipe reads too: passed on unchanged.
READ_FAIRSEQ_FLAGS = {"--update-freq": "update_freq", "--source-lang": "source_lang",
                      "-s": "source_lang", "--target-lang": "target_lang", "-t": "target_lang"}


_VALUE_FLAGS = ("--arch", "-a", *TRAIN_SH_FLAGS, *READ_FAIRSEQ_FLAGS)
_LENGTH_FLAGS = ("--max-update", "--max-epoch", "--stop-time-hours")
# The training length when train.sh is given none, in epochs: every system then sees the same data
# whatever its batch (base 32,768 tokens per update, deep and multi-path 65,536), and the final
# model is an epoch checkpoint, so average.sh's mean of the last epoch checkpoints ends with it.
# 20 is what the authors' group's deep-model scripts train; the paper gives no length.
RECIPE_EPOCHS = 20
# Attention and activation (ReLU) dropout of the authors' group's pre-norm deep scripts, the same
# evidence as the per-GPU batch; fairseq's architectures default to 0 (docs/fidelity.md).
RECIPE_DROPOUT = ["--attention-dropout", "0.1", "--activation-dropout", "0.1"]


def training_length(arch: str, passed_on: Sequence[str]) -> Tuple[List[str], str]:
    """The length flags to add (the recipe's ``--max-epoch 20`` when none is given) and the line
    train.sh prints about the length."""
    given = given_flags(passed_on, (*_LENGTH_FLAGS, "--ewa-stop-at"))
    early_ewa = arch.startswith("ewa_early") or "--ewa-stop-at" in given
    if early_ewa and "--max-update" not in given:
        raise RecipeError(f"{arch}: early EWA averages the experts during the first fraction "
                          "(--ewa-stop-at, 0.5 by default) of --max-update updates, whatever "
                          "--ewa-schedule; give --max-update N")
    if "--max-epoch" in given:
        return [], f"length: {given['--max-epoch']} epochs (--max-epoch, given)"
    if "--max-update" in given:
        return [], (f"length: {given['--max-update']} updates (--max-update, given): systems with "
                    "other batches see other amounts of data, and the updates after the last "
                    "full epoch are in checkpoint_last.pt only, not in average.sh's mean of "
                    "epoch checkpoints (--max-epoch avoids both)")
    if "--stop-time-hours" in given:
        return [], f"length: {given['--stop-time-hours']} hours (--stop-time-hours, given)"
    if arch.startswith("ewa") and "constant" not in passed_on and \
            "--ewa-schedule=constant" not in passed_on:
        raise RecipeError(f"{arch}: EWA's share rate rises over --max-update updates; give "
                          f"--max-update N (or --ewa-schedule constant to train the recipe's "
                          f"{RECIPE_EPOCHS} epochs)")
    return (["--max-epoch", str(RECIPE_EPOCHS)],
            f"length: {RECIPE_EPOCHS} epochs (--max-epoch {RECIPE_EPOCHS}, the recipe's): the same "
            "data for every system, and the final model is the last epoch checkpoint, which "
            "average.sh's mean ends with")


# The periodic save: checkpoint_last.pt (and one checkpoint_E_U.pt, fairseq's way of saving
# mid-epoch; --keep-interval-updates 1 deletes the one before) every N updates, N sized for
# SAVE_INTERVAL_MINUTES on GPUs as fast as the committed H200 measurements: N = minutes x 60 /
# (tokens per update / (GPUs x one GPU's tokens per second)), rounded down to two digits. The
# speeds are the bf16 medians of docs/bench/gpu-bench-h200.json: the base recipe's Transformer
# 6+6 row, and for the deep recipe its slowest row (deep 24+6), so that no deep-recipe arch saves
# less often (tests/test_recipe.py checks them against that file). A slower GPU saves less often.
# Those rows ran 4,096-token micro-batches, 2 per update, while train.sh on one card now runs one
# micro-batch of 32k (base) or 65k (deep) tokens per update: "about 10 minutes" assumes the same
# tokens per second there, which no committed row measures yet (gpu-bench.sh's one-card rows do).
# Each save also validates (fairseq's validate_and_save), which stays: what a save and its
# validation cost, and so what a crash loses, is worked out in docs/troubleshooting.md. The epoch
# checkpoints (checkpointN.pt) that average.sh averages are saved at epoch ends as well: the
# interval files (checkpoint_E_U.pt) do not match its pattern.
SAVE_INTERVAL_MINUTES = 10.0
REFERENCE_TOKENS_PER_SECOND = {"base": 51_420, "deep/multi-path": 27_307}


def _two_digits(n: float) -> int:
    """``n`` rounded down to two significant digits (7,532 -> 7,500), at least 1."""
    n = int(n)
    if n < 100:
        return max(n, 1)
    scale = 10 ** (len(str(n)) - 2)
    return n // scale * scale


def periodic_save(recipe_name: str, tokens_per_update: int, gpus: int, passed_on: Sequence[str],
                  minutes: Optional[str]) -> Tuple[List[str], str]:
    """The flags that save checkpoint_last.pt about every ``minutes`` (default
    :data:`SAVE_INTERVAL_MINUTES`; 0: none) and train.sh's line about it."""
    if given_flags(passed_on, ("--save-interval-updates",)):
        return [], "periodic save: --save-interval-updates given"
    try:
        minutes = SAVE_INTERVAL_MINUTES if minutes is None else float(minutes)
    except ValueError:
        raise RecipeError(f"--save-interval-minutes must be a number, got '{minutes}'") from None
    if minutes < 0:
        raise RecipeError(f"--save-interval-minutes must be >= 0, got {minutes:g}")
    if not minutes:
        return [], "periodic save: none (--save-interval-minutes 0): at epoch ends only"
    if not gpus:
        return [], ("periodic save: none on the CPU (no measured speed to size it): at epoch ends; "
                    "--save-interval-updates N saves every N updates")
    update_seconds = tokens_per_update / (gpus * REFERENCE_TOKENS_PER_SECOND[recipe_name])
    every = _two_digits(minutes * 60 / update_seconds)
    return (["--save-interval-updates", str(every), "--keep-interval-updates", "1"],
            f"periodic save: checkpoint_last.pt every {every:,} updates, about {minutes:g} "
            f"minutes at an H200's speed ({update_seconds:.3g} s an update; docs/troubleshooting.md "
            f"has the arithmetic), one checkpoint_E_U.pt kept; the epoch checkpoints "
            f"that average.sh averages are unchanged")


def _train_arguments(args: Sequence[str]) -> Tuple[str, dict, List[str]]:
    """train.sh's arguments -> the arch, the recipe's options, the arguments for fairseq-train.
    A flag's value is the next word (``--flag VALUE``) or follows ``=`` (``--flag=VALUE``)."""
    arch, options, passed_on = "", {}, []
    words = [str(a) for a in args]
    while words:
        word = words.pop(0)
        name, equals, value = word.partition("=")
        if not (equals and name.startswith("--")):
            if word not in _VALUE_FLAGS:
                passed_on.append(word)
                continue
            if not words or words[0].startswith("--"):
                raise RecipeError(f"{word} needs a value")
            name, value = word, words.pop(0)
        if name in ("--arch", "-a"):
            arch = value
        elif name in TRAIN_SH_FLAGS:
            options[TRAIN_SH_FLAGS[name]] = value
        else:
            passed_on += [word] if equals else [name, value]
            if name in READ_FAIRSEQ_FLAGS:
                options[READ_FAIRSEQ_FLAGS[name]] = value
    return arch, options, passed_on


# The micro-batch a run trained with, in its save dir (written by fairseq-train's rank 0 for
# train.sh once it holds the save dir): a resume mid-epoch on another number of GPUs continues
# the epoch only with the same batches (multipath_nmt/fairseq_patches/batching.py), so it keeps
# that max-tokens rather than the one the new GPU count would be given.
BATCH_RECORD = "train-sh-batch.json"


def recorded_max_tokens(save_dir) -> Optional[int]:
    """The max-tokens recorded in ``save_dir`` by the run that saved its checkpoint_last.pt."""
    record = Path(save_dir) / BATCH_RECORD
    if not (Path(save_dir) / "checkpoint_last.pt").exists() or not record.is_file():
        return None
    try:
        return int(json.loads(record.read_text())["max_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


def batch_record(argv: Sequence[str]) -> Tuple[str, str]:
    """The name (:data:`BATCH_RECORD`) and text of the record of fairseq-train's ``argv``'s
    max-tokens, which its rank 0 writes into the save dir (:mod:`.save_dir`)."""
    max_tokens = int(argv[list(argv).index("--max-tokens") + 1])  # train.sh gives it once
    return BATCH_RECORD, json.dumps({"max_tokens": max_tokens})


def _micro_batch_cap(arch, dictionaries, shared, passed_on, options, gpus, on_cpu, save_dir):
    """The largest micro-batch (max-tokens) a worker may take, and where it comes from: the
    user's ``--max-tokens``; on GPUs, the largest that fits the card's memory
    (:mod:`.memory_model`), else :data:`DEFAULT_MAX_TOKENS`; a resume keeps the micro-batch of
    the run it resumes where that fits (:data:`BATCH_RECORD`)."""
    given = _positive_int("max-tokens", options.get("max_tokens"))
    if given is not None:
        return given, "--max-tokens given (a cap)"
    if gpus and (not on_cpu or "MULTIPATH_NMT_GPU_MEMORY_MIB" in os.environ):
        cap, source = planned_max_tokens(arch, dictionaries, shared, passed_on)
        if cap < 1:
            raise RecipeError(f"{arch} does not fit this GPU's memory ({source}); give "
                              f"--max-tokens N to try a micro-batch anyway")
    else:
        cap, source = DEFAULT_MAX_TOKENS, (f"the default for CPU processes "
                                           f"({DEFAULT_MAX_TOKENS:,}; --max-tokens N to change it)")
    recorded = recorded_max_tokens(save_dir)
    if recorded is not None and recorded <= cap:
        return recorded, (f"the micro-batch of the run that saved checkpoint_last.pt "
                          f"({Path(save_dir) / BATCH_RECORD}), so that a resume on another "
                          f"number of GPUs has its batches; --max-tokens N to change it")
    return cap, source


def train_command(data_bin, save_dir, args: Sequence[str], gpus: Optional[int] = None,
                  python: str = sys.executable, bf16: Optional[bool] = None) -> Command:
    """fairseq-train's command line with the paper's recipe, for train.sh's arguments ``args``:
    ``--arch ARCH``, train.sh's own ``--max-tokens N`` (a cap), ``--batch-tokens N``,
    ``--embeddings auto|shared|separate``, ``--precision auto|bf16|fp16|fp32`` and
    ``--save-interval-minutes M`` (:func:`periodic_save`), and
    fairseq-train arguments, which come after the recipe and so override it. ``gpus`` (default:
    :func:`gpu_count`): the command trains on that many GPUs, or on the CPU when it is 0, in the
    precision :func:`choose_precision` picks (``bf16``: whether the GPUs have bfloat16)."""
    arch, options, passed_on = _train_arguments(args)
    if not arch:
        raise RecipeError("--arch ARCH is required (e.g. transformer_prenorm_wmt_en_de, "
                          "multipath_transformer_wmt_en_de)")
    recipe = recipe_for_arch(arch)
    dictionaries = dictionary_files(Path(data_bin), options.get("source_lang"),
                                    options.get("target_lang"))
    sharing = embedding_sharing(dictionaries, options.get("embeddings", "auto"))
    gpus = gpu_count() if gpus is None else gpus
    nodes = _positive_int("--nnodes", options.get("nnodes")) or 1
    launcher = launcher_arguments(gpus, nodes, options.get("rdzv_endpoint"),
                                  options.get("rdzv_id"))
    on_cpu = gpus and ddp_on_cpu()
    workers = gpus * nodes
    cap, micro_batch = _micro_batch_cap(arch, dictionaries, bool(sharing), passed_on, options,
                                        gpus, on_cpu, save_dir)
    plan = batch_plan(recipe, workers, cap,
                      _positive_int("--batch-tokens", options.get("batch_tokens")),
                      _positive_int("--update-freq", options.get("update_freq")))
    precision = choose_precision(options.get("precision", "auto"), 0 if on_cpu else gpus, bf16)
    flags = PRECISIONS[precision]
    described = f"{PRECISION_NOTES[precision]}{': ' if flags else ''}{' '.join(flags)}"
    where = f"{nodes} nodes x {gpus} GPU(s)" if nodes > 1 else f"{gpus} GPU(s)"
    if on_cpu:
        device = [*flags, "--cpu", "--distributed-backend", "gloo",
                  "--distributed-world-size", str(workers)]
        notes = [f"{where} as CPU processes over gloo (MULTIPATH_NMT_DDP_ON_CPU=1), precision "
                 f"{precision} ({described})"]
    elif gpus:
        device = [*flags, "--distributed-world-size", str(workers)]
        notes = [f"{where}, precision {precision} ({described}), the same for every arch"]
        assumed = bf16_assumption(options.get("precision", "auto"), gpus) if bf16 is None else None
        notes += [assumed] if assumed else []
    else:
        device = [*flags, "--cpu"]
        notes = [f"no CUDA device found, training in {precision} on the CPU ({described})"]
    if launcher:
        notes.append(f"launcher: torchrun, one process per GPU; {LAUNCHER_NOTE}")
    shared = ("all shared (joined dictionary)" if sharing else
              "nothing shared (encoder input, decoder input, output projection)")
    notes += [f"{recipe.name} recipe for {arch}: lr {recipe.lr}, {recipe.warmup_updates} warmup "
              f"updates",
              f"batch: {plan.arithmetic()}",
              f"micro-batch: {plan.max_tokens:,} tokens, each worker's share cut into equal "
              f"parts of at most {cap:,}: {micro_batch}",
              f"embeddings: {shared} for {', '.join(d.name for d in dictionaries)}"]
    length, length_note = training_length(arch, passed_on)
    saving, saving_note = periodic_save(recipe.name, plan.global_batch, workers if gpus else 0,
                                        passed_on, options.get("save_interval_minutes"))
    notes += [length_note, saving_note]
    argv = [python, *launcher, "-m", "fairseq_cli.train", str(data_bin), "--user-dir", USER_DIR,
            "--arch", arch, *sharing,
            "--optimizer", "adam_fused", "--adam-betas", "(0.9, 0.997)", "--clip-norm", "0.0",
            "--lr", recipe.lr, "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", str(recipe.warmup_updates), "--warmup-init-lr", "1e-07",
            "--criterion", criterion_for_arch(arch), "--label-smoothing", "0.1",
            *RECIPE_DROPOUT,
            "--max-tokens", str(plan.max_tokens), "--update-freq", str(plan.update_freq),
            "--save-dir", str(save_dir), "--keep-last-epochs", "10", *saving, *length,
            *device, *passed_on]
    return Command(argv, notes)


# Our decoding (beam 4 and lenpen 0.6 are our choice, docs/fidelity.md), BPE removed.
DECODING = ["--gen-subset", "test", "--beam", "4", "--lenpen", "0.6", "--remove-bpe",
            "--max-tokens", "4096"]


def generate_command(data_bin, checkpoint, args: Sequence[str] = (), gpus: Optional[int] = None,
                     python: str = sys.executable) -> Command:
    """fairseq-generate's command line with our decoding defaults, for translate.sh's arguments
    ``args``: fairseq-generate arguments, which come after the defaults and so override them,
    and ``--fp32``. ``gpus`` (default: :func:`gpu_count`): 0 decodes on the CPU, more on a GPU
    in fp16 as the models are trained (``--fp32``: in fp32)."""
    passed_on = [str(a) for a in args if a != "--fp32"]
    gpus = gpu_count() if gpus is None else gpus
    if not gpus:
        notes, device = ["no CUDA device, decoding on the CPU"], ["--cpu"]
    elif "--fp32" in args:
        notes, device = ["decoding on the GPU in fp32 (--fp32)"], []
    else:
        notes, device = ["decoding on the GPU in fp16 (--fp16)"], ["--fp16"]
    argv = [python, "-m", "fairseq_cli.generate", str(data_bin), "--user-dir", USER_DIR,
            "--path", str(checkpoint), *DECODING, *device, *passed_on]
    return Command(argv, notes)
