"""The Multi-Path Transformer paper's training recipe (Lin et al., 2022, Sec. 4.1) and our
decoding defaults, as the fairseq-train and fairseq-generate command lines that
``scripts/train.sh``, ``scripts/translate.sh`` and the Multi30k study run: learning rate, warm-up
and batch per architecture family, the batch split over GPUs, which embeddings are shared, and
the device flags.

Batch: the paper trains with "4,096" (base) and "8,192" (deep and multi-path) tokens "on 8
GPUs". We read these as tokens per GPU, as in the authors' fairseq scripts, so the global batch,
max-tokens x GPUs x update-freq, is 32,768 and 65,536 tokens. Without a GPU (a smoke path, not a
reproduction) the batch is one GPU's share: 4,096 / 8,192 tokens per update.

Embeddings: Table 2's En-De sizes are one joined dictionary with every embedding shared; Table 3's
En-Fr sizes (111M / 168M) need about 130,800 embedding rows of 512, i.e. three unshared matrices
of about 43,600 types (docs/fidelity.md has the arithmetic), so En-Fr shares nothing.

This module imports neither fairseq nor the package: the shell scripts run it as a script with
``runpy`` (see :func:`shell_main`), which starts in a fraction of the seconds fairseq's import
takes.
"""
import filecmp
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

# The plug-in folder for fairseq's --user-dir (multipath_nmt.USER_DIR, found here without
# importing the package).
USER_DIR = os.path.dirname(os.path.abspath(__file__))
# The paper's set-up: "on 8 GPUs", with the per-GPU batch of each recipe.
PAPER_GPUS = 8
# max-tokens when the user gives none: the authors' per-GPU micro-batch (their deep recipe
# reaches 8,192 per GPU as 4,096 x update-freq 2), which fits a 12 GB GPU.
DEFAULT_MAX_TOKENS = 4096
# Architectures trained with the deep/multi-path recipe; the others use the base recipe. "wide"
# is Fig. 1's wide baseline (and WideNet): the paper trains models of other depths and widths
# with the deep models' hyperparameters (its Limitations section).
DEEP_ARCH_PATTERNS = ("deep", "multipath", "wide", "ewa", "parameternet", "moe")
MOE_ARCH_PREFIXES = ("widenet", "ewa", "parameternet", "moe")
# Table 3's En-Fr sizes need unshared embeddings (docs/fidelity.md).
UNSHARED_LANGUAGE_PAIRS = ({"en", "fr"},)


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


def recipe_for_arch(arch: str) -> Recipe:
    """The deep/multi-path recipe for deep, multi-path, the wide baseline and the WideNet, EWA,
    ParameterNet and MoE architectures; the base recipe for the others."""
    return DEEP if any(p in arch for p in DEEP_ARCH_PATTERNS) else BASE


def criterion_for_arch(arch: str) -> str:
    """MoE-style architectures add their balance loss through their own criterion."""
    if arch.startswith(MOE_ARCH_PREFIXES):
        return "label_smoothed_cross_entropy_with_moe"
    return "label_smoothed_cross_entropy"


# train.sh's --precision: fairseq's flags for each. bf16 and fp16 are both autocast over fp32
# weights (--amp): every arch trains the same way, and multi-path's path and residual weights
# keep fp32 gradients, which overflow in fp16 at loss scales the stock model takes
# (docs/fidelity.md, 'Architecture and GPU-scale numerics'). bf16 needs no loss scaling;
# docs/gpu.md says why autocast rather than fairseq's all-bf16 --bf16.
PRECISIONS = {
    "bf16": ["--amp", "--bf16"],
    "fp16": ["--amp"],
    "fp32": [],
}
PRECISION_NOTES = {
    "bf16": "bfloat16 autocast, fp32 weights, no loss scaling",
    "fp16": "float16 autocast, fp32 weights, dynamic loss scaling",
    "fp32": "float32",
}


def gpu_supports_bf16() -> bool:
    """``MULTIPATH_NMT_BF16`` (1 or 0) if set, else whether the first CUDA GPU computes in
    bfloat16 natively (Ampere and later)."""
    value = os.environ.get("MULTIPATH_NMT_BF16")
    if value is not None:
        if value not in ("0", "1"):
            raise RecipeError(f"MULTIPATH_NMT_BF16 must be 0 or 1, got '{value}'")
        return value == "1"
    import torch
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def choose_precision(choice: str, gpus: int, bf16: Optional[bool] = None) -> str:
    """train.sh's ``--precision`` (auto, bf16, fp16, fp32) -> the precision trained in, the same
    for every arch: ``auto`` is bf16 on GPUs that have it, fp16 on older GPUs, fp32 on the CPU.
    ``bf16``: whether the GPUs have bfloat16 (default: :func:`gpu_supports_bf16`)."""
    if choice not in ("auto", *PRECISIONS):
        raise RecipeError(f"--precision must be auto, bf16, fp16 or fp32, got {choice!r}")
    if gpus and choice in ("auto", "bf16"):
        bf16 = gpu_supports_bf16() if bf16 is None else bf16
        if choice == "bf16" and not bf16:
            raise RecipeError("--precision bf16: this GPU has no native bfloat16 (it needs "
                              "compute capability 8.0 or later); use --precision fp16")
        return "bf16" if bf16 else "fp16"
    if not gpus and choice == "fp16":
        raise RecipeError("--precision fp16 needs a CUDA GPU (its loss scaler and float16 "
                          "autocast are CUDA's); on the CPU use --precision bf16 or fp32")
    return "fp32" if choice == "auto" else choice


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


def ddp_on_cpu() -> bool:
    """``MULTIPATH_NMT_DDP_ON_CPU=1``: the GPUs counted by :func:`gpu_count` are CPU processes
    that talk over gloo. The tests run the multi-GPU command this way on a machine without GPUs:
    the same launcher, batch arithmetic and flags, with ``--cpu --distributed-backend gloo`` for
    the device and the CPU's precision."""
    value = os.environ.get("MULTIPATH_NMT_DDP_ON_CPU", "0")
    if value not in ("0", "1"):
        raise RecipeError(f"MULTIPATH_NMT_DDP_ON_CPU must be 0 or 1, got '{value}'")
    return value == "1"


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


@dataclass(frozen=True)
class Command:
    """A fairseq command line and the lines train.sh / translate.sh print before running it."""
    argv: List[str]
    notes: List[str]


# train.sh's own flags (the batch and the embeddings): read here, not passed on to fairseq.
TRAIN_SH_FLAGS = {"--max-tokens": "max_tokens", "--batch-tokens": "batch_tokens",
                  "--embeddings": "embeddings", "--precision": "precision",
                  "--nnodes": "nnodes", "--rdzv-endpoint": "rdzv_endpoint",
                  "--rdzv-id": "rdzv_id"}
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


# More than one training process is started by torchrun (torch.distributed.run), as every
# distributed test runs it, not by fairseq's own torch.multiprocessing.spawn: under spawn a
# SIGTERM sent to the parent (what SLURM and Kubernetes send) never reaches the workers, and a
# worker that stops on it (exit 143) makes the parent exit 1.
LAUNCHER_MODULE = "torch.distributed.run"
# Signals that fairseq-train's workers stop on, saving checkpoint_last.pt, with status 128 + the
# signal's number (multipath_nmt/fairseq_patches/preemption.py's SIGNALS). torchrun itself would
# SIGTERM the workers, give them 30 s, and exit 1 with a traceback; train.sh passes each of these
# on to every worker instead, and leaves torchrun the others (SIGHUP, SIGQUIT).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAUNCHER_NOTE = ("SIGTERM, SIGINT and SIGUSR1 to train.sh reach every worker, which stop after the "
                 "same update and save checkpoint_last.pt; train.sh then exits 128 + the "
                 "signal's number, as one process does")


def launcher_arguments(gpus: int, nodes: int = 1, rdzv_endpoint: Optional[str] = None,
                       rdzv_id: Optional[str] = None) -> List[str]:
    """The words between ``python`` and ``-m fairseq_cli.train``: nothing for one process
    (fairseq-train as it is), else torchrun with ``gpus`` processes on each of ``nodes`` nodes
    (one node: ``--standalone``, a rendezvous on a free local port; several: a c10d rendezvous
    at ``rdzv_endpoint``, HOST:PORT of one of them, the same on every node)."""
    if nodes > 1 and not gpus:
        raise RecipeError(f"--nnodes {nodes} needs GPUs: no CUDA device found")
    if nodes > 1 and not rdzv_endpoint:
        raise RecipeError(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT (one of the nodes, "
                          f"the same on every node; docs/troubleshooting.md)")
    if nodes == 1 and (rdzv_endpoint or rdzv_id):
        raise RecipeError("--rdzv-endpoint and --rdzv-id are for several nodes: give --nnodes N")
    if gpus * nodes <= 1:
        return []
    if nodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", str(nodes), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", rdzv_endpoint, *(["--rdzv-id", rdzv_id] if rdzv_id else [])]
    return ["-m", LAUNCHER_MODULE, *rendezvous, "--nproc-per-node", str(gpus)]


def _children() -> List[int]:
    """This process's child processes (torchrun's workers when it runs in this process)."""
    children = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children += [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    return children


def _pass_on(signum, frame):
    workers = _children()
    if not workers:  # still in the rendezvous: no worker has anything to save
        print(f"train.sh: {signal.Signals(signum).name} before the workers started: exiting with "
              f"status {128 + signum}", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def run_launcher(argv: Sequence[str]) -> int:
    """Run ``argv`` (``python -m torch.distributed.run ...``, from :func:`train_command`) as
    torchrun does, in this process, with :data:`STOP_SIGNALS` passed on to every worker; the
    exit status: 0, 128 + N when every worker stopped on signal N, else torchrun's report of the
    workers' exits on stderr and 1."""
    if list(argv[1:3]) != ["-m", LAUNCHER_MODULE]:
        raise ValueError(f"not a torchrun command line: {shlex.join(argv[:3])}")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(list(argv[3:]))
    args.signals_to_handle = ",".join(sorted(
        set(args.signals_to_handle.split(",")) - {s.name for s in STOP_SIGNALS}))
    for signum in STOP_SIGNALS:
        signal.signal(signum, _pass_on)
    try:
        torchrun.run(args)
    except ChildFailedError as error:
        codes = {failure.exitcode for failure in error.failures.values()}
        stops = {128 + int(signum): signal.Signals(signum).name for signum in STOP_SIGNALS}
        if len(codes) == 1 and next(iter(codes)) in stops:
            code = codes.pop()
            print(f"train.sh: every worker stopped on {stops[code]} (status {code}); run the same "
                  f"command to resume", file=sys.stderr, flush=True)
            return code
        print(error.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0


def _given_lengths(passed_on: Sequence[str]) -> dict:
    """The length flags among fairseq-train's arguments, with their values."""
    given = {}
    for index, word in enumerate(passed_on):
        name, equals, value = word.partition("=")
        if name in _LENGTH_FLAGS:
            given[name] = value if equals else passed_on[index + 1]
    return given


def training_length(arch: str, passed_on: Sequence[str]) -> Tuple[List[str], str]:
    """The length flags to add (the recipe's ``--max-epoch 20`` when none is given) and the line
    train.sh prints about the length."""
    given = _given_lengths(passed_on)
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


def train_command(data_bin, save_dir, args: Sequence[str], gpus: Optional[int] = None,
                  python: str = sys.executable, bf16: Optional[bool] = None) -> Command:
    """fairseq-train's command line with the paper's recipe, for train.sh's arguments ``args``:
    ``--arch ARCH``, train.sh's own ``--max-tokens N`` (a cap), ``--batch-tokens N``,
    ``--embeddings auto|shared|separate`` and ``--precision auto|bf16|fp16|fp32``, and
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
    plan = batch_plan(recipe, workers, _positive_int("max-tokens", options.get("max_tokens")),
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
              f"embeddings: {shared} for {', '.join(d.name for d in dictionaries)}"]
    length, length_note = training_length(arch, passed_on)
    notes.append(length_note)
    argv = [python, *launcher, "-m", "fairseq_cli.train", str(data_bin), "--user-dir", USER_DIR,
            "--arch", arch, *sharing,
            "--optimizer", "adam_fused", "--adam-betas", "(0.9, 0.997)", "--clip-norm", "0.0",
            "--lr", recipe.lr, "--lr-scheduler", "inverse_sqrt",
            "--warmup-updates", str(recipe.warmup_updates), "--warmup-init-lr", "1e-07",
            "--criterion", criterion_for_arch(arch), "--label-smoothing", "0.1",
            *RECIPE_DROPOUT,
            "--max-tokens", str(plan.max_tokens), "--update-freq", str(plan.update_freq),
            "--save-dir", str(save_dir), "--keep-last-epochs", "10", *length,
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


def finish_translation(out_prefix) -> int:
    """``OUT.generate.tmp`` (fairseq-generate's output) -> ``OUT.generate`` when its last line
    says that fairseq-generate finished, then the hypotheses (all of them with --nbest) and the
    references sorted by sentence id, as ``OUT.hyp`` and ``OUT.ref``; the number of hypotheses.
    Works on bytes, as the text is fairseq's and not ours to decode."""
    out = str(out_prefix)
    partial = out + ".generate.tmp"
    with open(partial, "rb") as f:
        lines = f.read().split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    if not lines or not re.match(rb"Generate .* with beam=", lines[-1]):
        raise RecipeError(f"fairseq-generate did not finish; partial output left in {partial}")
    os.replace(partial, out + ".generate")

    def by_id(kind: bytes, first_field: int) -> List[bytes]:
        # "H-<id>\t<score>\t<text>", "T-<id>\t<text>" in batch order; a stable sort by id
        fields = [line[2:].split(b"\t") for line in lines if line.startswith(kind + b"-")]
        fields.sort(key=lambda f: int(f[0]))
        return [b"\t".join(f[first_field:]) + b"\n" for f in fields]

    hypotheses = by_id(b"H", 2)
    for suffix, text in ((".hyp", hypotheses), (".ref", by_id(b"T", 1))):
        with open(out + suffix, "wb") as f:
            f.writelines(text)
    return len(hypotheses)


def _train_sh(args: List[str], dry_run: bool) -> None:
    data_bin, save_dir, args = args[0], args[1], args[2:]
    if os.environ.get("MAX_TOKENS"):  # a cap that the command line's --max-tokens replaces
        args = [f"--max-tokens={os.environ['MAX_TOKENS']}", *args]
    command = train_command(data_bin, save_dir, args)
    for line in command.notes + [shlex.join(command.argv)]:
        print(f"train.sh: {line}", flush=True)
    if not dry_run:
        os.makedirs(save_dir, exist_ok=True)
        if command.argv[1:3] == ["-m", LAUNCHER_MODULE]:
            sys.exit(run_launcher(command.argv))
        os.execv(command.argv[0], command.argv)


def _translate_sh(args: List[str], dry_run: bool) -> None:
    data_bin, checkpoint, out, args = args[0], args[1], args[2], args[3:]
    command = generate_command(data_bin, checkpoint, args)
    for line in command.notes + [f"{shlex.join(command.argv)} > {out}.generate"]:
        print(f"translate.sh: {line}", flush=True)
    if dry_run:
        return
    with open(f"{out}.generate.tmp", "wb") as generated:
        code = subprocess.call(command.argv, stdout=generated)
    if code:
        sys.exit(code)
    count = finish_translation(out)
    print(f"translate.sh: wrote {out}.generate, {out}.hyp ({count} lines) and {out}.ref")


def shell_main(argv=None):
    """train.sh and translate.sh (``train.sh DATA_BIN SAVE_DIR ARGS...`` or ``translate.sh
    DATA_BIN CHECKPOINT OUT ARGS...``): print the plan and the command, then run it (train.sh
    becomes fairseq-train; translate.sh writes OUT.generate, OUT.hyp and OUT.ref) unless
    ``--dry-run`` is among the arguments; one error line and exit 1 on a bad request."""
    tool, *args = sys.argv[1:] if argv is None else argv
    run = {"train.sh": _train_sh, "translate.sh": _translate_sh}[tool]
    try:
        run([a for a in args if a != "--dry-run"], "--dry-run" in args)
    except RecipeError as error:
        sys.exit(f"{tool}: error: {error}")
    except ImportError as error:
        sys.exit(f"{tool}: error: cannot count GPUs ({error}); activate the environment or set "
                 "PYTHON")


if __name__ == "__main__":
    shell_main()
