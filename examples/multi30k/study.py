"""The Multi30k study, En-De or En-Fr: does width beat depth at equal parameters?

Every system trains with one recipe and one batch (2,048 tokens per update) for the same budget:
the same number of updates (fairseq's ``--max-update``, the default; the validation loss is
logged along the way and checked for a plateau) or the same training time (``--stop-time-hours``).
Then the last epoch checkpoints (and the final partial epoch) are averaged, valid and test are
translated and scored with tokenized multi-bleu, sacreBLEU and chrF, and every system is compared
with the deep model, seed by seed, by sacreBLEU's paired bootstrap resampling on the test set
(BLEU and chrF), and over the seeds by a paired t-test of the seeds' scores.
Systems: a small pre-norm base model (L = 3 encoder layers), its 2L-deep version, a dense model
with a wider encoder FFN, the multi-path L x n forms of the paper's ablation (Table 4), WideNet,
EWA and ParameterNet, all but the base at about the parameters of the 2L model. Everything is
restartable: finished stages are skipped. Results: ``study.md`` (table), ``study.json``,
``study.png`` (BLEU vs parameters) and ``study-valid-loss.png`` (validation loss vs updates).

It calls the multipath_nmt library (an installed package is enough, no source checkout): the
data preparation, averaging, EWA folding, scoring and parameter counts run in this process, and
fairseq-train and fairseq-generate as subprocesses with the recipe of scripts/train.sh and
scripts/translate.sh (``multipath_nmt.recipe``). Run it as ``examples/multi30k/study.sh`` or
``python examples/multi30k/study.py``.
"""
import argparse
import gzip
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Container, Dict, List, Optional, Sequence, Tuple

from multipath_nmt import averaging, params, recipe, scoring
from multipath_nmt.atomic_files import write_atomically, write_text_atomically
from multipath_nmt.checkpoints import read_checkpoint
from multipath_nmt.ewa_folding import convert_ewa_checkpoint
from multipath_nmt.pipeline.prepare import PrepareError, prepare_corpus

SOURCE = "en"
# Multi30k's target languages with the 2016 test set; En-De is the study's default pair
TARGETS = ("de", "fr")
DEFAULT_TARGET = "de"
# Multi30k task 1 file names (github.com/multi30k/dataset, data/task1/raw)
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
BPE_MERGES = 8000

# The shared model: d 128, 4 heads, 3 decoder layers (FFN 512). d 256 trains at about a third of
# the tokens per second on 2 CPU cores, less than one Multi30k epoch in the default budget.
BASE_LAYERS = 3
BASE_FFN = 512
SHARED_MODEL = [
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--decoder-layers", "3", "--decoder-ffn-embed-dim", "512", "--dropout", "0.1",
    # train.sh's recipe adds attention and activation dropout 0.1 since the 10,000-update results
    # were trained; 0 keeps new seeds comparable with them
    "--attention-dropout", "0", "--activation-dropout", "0",
]
# One recipe for every system (train.sh's per-family recipes are overridden): a short warmup and
# a high learning rate because the budget allows thousands, not 100k, updates. These are
# train.sh's arguments (recipe.train_command): --update-freq replaces its batch arithmetic,
# 2,048 max-tokens x 1 process x 1 = 2,048 tokens per update (the study runs every training on
# one device, see DEVICE_GPUS).
SHARED_RECIPE = [
    "--max-tokens", "2048", "--update-freq", "1", "--lr", "0.002", "--warmup-updates", "100",
    "--keep-last-epochs", "5", "--num-workers", "0",
    "--no-progress-bar", "--log-format", "simple", "--log-interval", "50",
]
# Equal updates: about 41 Multi30k epochs of 242 updates. The deep model's best validation loss
# gained 1.19% over the last 20% at 8,000 updates, then none: its best (at 7,744) was still the
# best at 13,440, so the 1% bar holds from 10,000 on (README, "The budget").
DEFAULT_BUDGET_UPDATES = 10000
# Validations per run under the updates budget (plus fairseq's one at every epoch end).
VALIDATIONS = 25
# The plateau criterion: the validation loss improved by at most 1% over the last 20% of training.
PLATEAU_WINDOW = 0.2
PLATEAU_TOLERANCE = 0.01
# sacreBLEU's default number of bootstrap resamples, and the significance level of the marks.
BOOTSTRAP_SAMPLES = 1000
SIGNIFICANCE_LEVEL = 0.05
BASELINE = "deep"
# Our decoding settings (beam 4, lenpen 0.6, recipe.generate_command: the paper gives none; these are
# the authors' group's Transformer-deep script's) with a length cap, so that an undertrained model
# cannot spend minutes emitting 200-token hypotheses.
DECODING = ["--batch-size", "128", "--max-len-a", "1.2", "--max-len-b", "10"]
AVERAGE_LAST = 5


@dataclass
class System:
    name: str
    label: str
    arch: str
    flags: List[str]
    family: str
    # solve --encoder-ffn-embed-dim so that the total parameters equal the deep model's
    match_ffn: bool = False


def _encoder(layers, ffn=BASE_FFN):
    return ["--encoder-layers", str(layers), "--encoder-ffn-embed-dim", str(ffn)]


SYSTEMS = [
    System("base", "Transformer, 3 layers", "transformer_prenorm_wmt_en_de",
           _encoder(BASE_LAYERS), "base"),
    System("deep", "Transformer, 6 layers (2L)", "transformer_prenorm_wmt_en_de",
           _encoder(2 * BASE_LAYERS), "deep"),
    System("wide", "Transformer, 3 layers, wider FFN", "transformer_prenorm_wmt_en_de",
           _encoder(BASE_LAYERS), "wide", match_ffn=True),
    # The rows of the paper's ablation (Table 4), each adding one part to the row before it
    System("mp_original", "Multi-path 3x2, original (fixed 1/n, no PathNorm)",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "fixed",
                                    "--no-path-norm"], "multi-path"),
    System("mp_pathnorm", "Multi-path 3x2 + PathNorm (fixed 1/sqrt(n))",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "fixed"],
           "multi-path"),
    System("mp_learnable", "Multi-path 3x2 + PathNorm + learnable weights",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "learnable"],
           "multi-path"),
    System("mp_cheap", "Multi-path 3x3 + PathNorm + learnable + cheap features",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "3", "--path-weights", "learnable",
                                    "--cheap-features"], "multi-path", match_ffn=True),
    System("mp_no_pathnorm", "Multi-path 3x2, learnable weights without PathNorm",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "learnable",
                                    "--no-path-norm"], "multi-path"),
    System("widenet", "WideNet, 6 shared layers, 8 experts top-2",
           "widenet_transformer_wmt_en_de",
           _encoder(2 * BASE_LAYERS) + ["--moe-experts", "8", "--moe-top-k", "2"], "MoE-style"),
    System("ewa", "EWA, 5 experts in layer 2 (dense at test)", "ewa_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--ewa-layers", "every-2", "--ewa-experts", "5"], "MoE-style"),
    System("parameternet", "ParameterNet, dynamic, 4 up-projections",
           "parameternet_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--parameternet-mode", "dynamic", "--parameternet-proj",
                                    "up", "--parameternet-experts", "4"], "MoE-style"),
]
SYSTEM_NAMES = [s.name for s in SYSTEMS]
# Table 4 of the paper (Sec. 5.2) as steps: each multi-path row and the row it changes. "- PathNorm"
# takes PathNorm out of "+ Learnable Weights"; "+ More Features" is read as added to "+ Learnable
# Weights" (the method, with PathNorm; "- PathNorm" is the paper's side experiment), as
# docs/fidelity.md does; here it also goes from 2 to 3 paths, which cheap features need.
ABLATION_STEPS = {"mp_pathnorm": "mp_original", "mp_learnable": "mp_pathnorm",
                  "mp_no_pathnorm": "mp_learnable", "mp_cheap": "mp_learnable"}
# The default systems: the base model as the small reference, the deep baseline, the wide dense
# model and the multi-path rows of Table 4 in its order; the others run when named (--systems).
DEFAULT_SYSTEMS = ["base", "deep", "wide", "mp_original", "mp_pathnorm", "mp_learnable",
                   "mp_cheap"]


class StudyError(Exception):
    pass


@dataclass(frozen=True)
class Budget:
    """What every system gets: ``updates`` (fairseq --max-update, the same batch for everyone, so
    the same epochs too) or ``minutes`` of training (--stop-time-hours)."""
    updates: Optional[int] = None
    minutes: Optional[float] = None

    @property
    def runs_dirname(self) -> str:
        return f"runs-{self.updates}updates" if self.updates else f"runs-{self.minutes:g}min"

    def describe(self) -> str:
        if self.updates:
            return (f"{self.updates} updates of 2,048 tokens per system and seed (fairseq "
                    f"--max-update), validated every {validation_interval(self.updates)} updates")
        return f"{self.minutes:g} min of training per system and seed (fairseq --stop-time-hours)"

    def training_flags(self) -> List[str]:
        if self.updates:
            return ["--max-update", str(self.updates),
                    "--validate-interval-updates", str(validation_interval(self.updates))]
        # as measured in the committed equal-time study: no validation inside the time budget
        return ["--disable-validation", "--stop-time-hours", repr(self.minutes / 60)]


def validation_interval(updates: int) -> int:
    """Updates between validations: about VALIDATIONS points per curve."""
    return max(1, updates // VALIDATIONS)


def log(message):
    print(f"study: {message}", flush=True)


# ---------------------------------------------------------------------------------------- data

def find_text(prefix: Path, lang: str) -> Path:
    for path in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{prefix}.{lang}[.gz]")


def check_multi30k(data_dir: Path, target: str = DEFAULT_TARGET) -> None:
    missing = []
    for stem in SPLITS.values():
        for lang in (SOURCE, target):
            try:
                find_text(data_dir / stem, lang)
            except FileNotFoundError as err:
                missing.append(str(err))
    if missing:
        raise StudyError(
            f"Multi30k not found in {data_dir}: missing {', '.join(missing)}. Download "
            f"data/task1/raw/{{train,val,test_2016_flickr}}.{{{SOURCE},{target}}}.gz from "
            "https://github.com/multi30k/dataset and pass the folder with --data DIR")


def _read_lines(path: Path, limit: Optional[int]) -> List[str]:
    opener = gzip.open if path.suffix == ".gz" else open
    lines = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(lines) == limit:
                break
            lines.append(line)
    return lines


def subsample(data_dir: Path, out_dir: Path, max_train: Optional[int],
              max_eval: Optional[int], target: str = DEFAULT_TARGET) -> Path:
    """The first lines of each split as plain text under ``out_dir`` (for quick runs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, stem in SPLITS.items():
        limit = max_train if split == "train" else max_eval
        for lang in (SOURCE, target):
            path = out_dir / f"{stem}.{lang}"
            if not path.exists():
                write_text_atomically(
                    path, "".join(_read_lines(find_text(data_dir / stem, lang), limit)))
    return out_dir


def data_tag(max_train: Optional[int], max_eval: Optional[int],
             target: str = DEFAULT_TARGET) -> str:
    """The prepared data's folder name: ``full`` or ``trainN-evalM`` for En-De (the names of the
    committed runs), prefixed with the pair for another target (``en-fr-full``)."""
    tag = "full" if max_train is None and max_eval is None else \
        f"train{max_train or 'all'}-eval{max_eval or 'all'}"
    return tag if target == DEFAULT_TARGET else f"{SOURCE}-{target}-{tag}"


def prepare(data_dir: Path, work: Path, max_train: Optional[int], max_eval: Optional[int],
            workers: int, target: str = DEFAULT_TARGET) -> Path:
    """Multi30k En-``target`` -> ``work/<tag>/data-bin`` as multipath-prepare corpus writes it
    (restartable; its progress goes to stderr)."""
    check_multi30k(data_dir, target)
    tag = data_tag(max_train, max_eval, target)
    root = work / tag
    subsampled = max_train is not None or max_eval is not None
    text = (subsample(data_dir, root / "text", max_train, max_eval, target) if subsampled
            else data_dir)
    data_bin = root / "data-bin"
    if (data_bin / f"dict.{SOURCE}.txt").is_file():  # prepare_corpus renames it into place
        log(f"{data_bin} already prepared")
        return data_bin
    log(f"preparing Multi30k {pair_name(target)} from {data_dir} (BPE {BPE_MERGES} merges) -> "
        f"{data_bin}")
    try:
        prepare_corpus(SOURCE, target, text / SPLITS["train"], text / SPLITS["valid"],
                       text / SPLITS["test"], data_bin, bpe_merges=BPE_MERGES, workers=workers)
    except PrepareError as err:
        raise StudyError(f"preparing {data_bin}: {err}") from err
    return data_bin


def dictionary_size(data_bin: Path) -> int:
    from fairseq.data import Dictionary
    return len(Dictionary.load(str(data_bin / f"dict.{SOURCE}.txt")))


def pair_name(target: str) -> str:
    return f"{SOURCE.capitalize()}-{target.capitalize()}"


# ------------------------------------------------------------------------------ model sizes

def model_flags(system: System, ffn: Optional[int] = None) -> List[str]:
    """The shared flags, then the system's (with the encoder FFN size replaced by ``ffn``)."""
    flags = list(system.flags)
    if ffn is not None:
        flags[flags.index("--encoder-ffn-embed-dim") + 1] = str(ffn)
    return SHARED_MODEL + flags


def count_parameters(arch: str, flags: Sequence[str], dict_size: int) -> Dict[str, int]:
    """Total and active parameters as ``multipath-params`` counts them."""
    return params.parameter_counts(params.build_model(arch, dict_size, flags))


def matched_ffn(system: System, target: int, dict_size: int) -> int:
    """The encoder FFN size (a multiple of 8) giving ``system`` the ``target`` parameters; the
    count is affine in it, so two model builds determine it."""
    low, high = 64, 1024
    p_low = count_parameters(system.arch, model_flags(system, low), dict_size)["total"]
    p_high = count_parameters(system.arch, model_flags(system, high), dict_size)["total"]
    per_unit = (p_high - p_low) / (high - low)
    return max(8, int(round((low + (target - p_low) / per_unit) / 8)) * 8)


def resolve_flags(systems: Sequence[System], dict_size: int) -> Dict[str, List[str]]:
    """Final model flags per system (FFN sizes matched to the deep model where asked)."""
    deep = next(s for s in SYSTEMS if s.name == "deep")
    target = None
    resolved = {}
    for system in systems:
        if system.match_ffn:
            if target is None:
                target = count_parameters(deep.arch, model_flags(deep), dict_size)["total"]
            resolved[system.name] = model_flags(system, matched_ffn(system, target, dict_size))
        else:
            resolved[system.name] = model_flags(system)
    return resolved


# ------------------------------------------------------------------------------ running

# Each training and decoding process uses one device: the CPU, or one GPU (the first visible one;
# CUDA_VISIBLE_DEVICES selects it), so the batch is the study's 2,048 tokens per update on any
# machine. On the GPU the recipe trains every system in the same mixed precision (--amp --bf16
# where the GPU has bfloat16, else --amp) and decodes in --fp16.
DEVICE_GPUS = {"cpu": 0, "cuda": 1}


def train_command(arch: str, flags: Sequence[str], data_bin: Path, save_dir: Path,
                  device: str = "cpu") -> recipe.Command:
    """fairseq-train with train.sh's recipe, overridden by the study's (``flags`` last)."""
    try:
        return recipe.train_command(data_bin, save_dir, ["--arch", arch, *flags],
                                    gpus=DEVICE_GPUS[device])
    except recipe.RecipeError as err:
        raise StudyError(str(err)) from err


def run(command: recipe.Command, log_path: Path, stdout: Optional[Path] = None) -> float:
    """Run ``command`` with its notes and its output appended to ``log_path`` (its standard
    output to ``stdout`` when given); seconds taken; StudyError on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join(command.argv)}\n")
        out.write("".join(f"recipe: {note}\n" for note in command.notes))
        out.flush()
        if stdout is None:
            code = subprocess.call(command.argv, stdout=out, stderr=subprocess.STDOUT)
        else:
            with open(stdout, "wb") as output:
                code = subprocess.call(command.argv, stdout=output, stderr=out)
    if code != 0:
        tail = "".join(open(log_path, errors="replace").readlines()[-25:])
        raise StudyError(f"{command.argv[2]} exited with {code}; last lines of {log_path}:\n"
                         f"{tail}")
    return time.monotonic() - start


_KEY_VALUE = re.compile(r"\| (\w+) ([-+0-9.e]+)(?= \||$)")


def training_stats(log_text: str) -> Dict[str, Optional[float]]:
    """Updates, epochs and target tokens per second of training from fairseq-train's end-of-epoch
    summaries (``| train | epoch 003 | ... | wps S | wpb W | ... | num_updates U | ...``): each
    epoch trained W x (its updates) tokens at S tokens per second (fairseq's epoch meter)."""
    tokens = seconds = 0.0
    updates = 0
    epoch = None
    for line in log_text.splitlines():
        if "| train | epoch" not in line:
            continue
        values = {k: float(v) for k, v in _KEY_VALUE.findall(line.split("| train ", 1)[1])}
        new_updates = int(values["num_updates"])
        epoch_tokens = values["wpb"] * (new_updates - updates)
        tokens += epoch_tokens
        seconds += epoch_tokens / values["wps"] if values["wps"] else 0.0
        updates = new_updates
        epoch = int(values["epoch"])
    batches = re.search(r"total_num_itrs = (\d+)", log_text)
    return {
        "updates": updates,
        "last_epoch": epoch,
        "epochs": round(updates / int(batches.group(1)), 2) if batches else None,
        "train_tokens_per_second": round(tokens / seconds, 1) if seconds else None,
    }


def validation_curve(log_text: str) -> List[Tuple[int, float]]:
    """(updates, validation loss) from fairseq-train's validation summaries (``| valid | epoch
    003 | valid on 'valid' subset | loss 7.1 | nll_loss 6.3 | ... | num_updates 10 | ...``). The
    loss is ``nll_loss``: cross-entropy in bits per target token, without label smoothing and
    without the MoE balance loss, so it compares across systems. A resumed run logs some updates
    twice: the later line counts."""
    points = {}
    for line in log_text.splitlines():
        if "| valid | " not in line:
            continue
        values = dict(_KEY_VALUE.findall(line.split("| valid ", 1)[1]))
        if "nll_loss" in values and "num_updates" in values:
            points[int(float(values["num_updates"]))] = float(values["nll_loss"])
    return sorted(points.items())


def plateau(curve: Sequence[Tuple[int, float]], window: float = PLATEAU_WINDOW,
            tolerance: float = PLATEAU_TOLERANCE) -> Optional[dict]:
    """Has the validation loss stopped improving? ``improvement`` is how much the best loss of the
    whole run is below the best loss up to the last ``window`` of training, relative to the latter
    ((best before - best) / best before; 0 when the loss only rose); the run has plateaued when
    it is at most ``tolerance``. None without validations both up to and after the window start."""
    if not curve:
        return None
    start = (1 - window) * curve[-1][0]
    before = [loss for updates, loss in curve if updates <= start]
    after = [loss for updates, loss in curve if updates > start]
    if not before or not after:
        return None
    best_before = min(before)
    best = min(best_before, min(after))
    improvement = (best_before - best) / best_before
    return {"window_start_update": start, "best_loss_before": best_before, "best_loss": best,
            "improvement": improvement, "plateaued": improvement <= tolerance}


def compare_curves(curve: Sequence[Tuple[int, float]],
                   baseline_curve: Sequence[Tuple[int, float]],
                   window: float = PLATEAU_WINDOW) -> Optional[dict]:
    """The validation loss against the baseline's at the validations both runs made in the last
    ``window`` of training (where the plateau check looks): the mean relative difference
    ((loss - baseline) / baseline) and at how many of them it is lower. Averaging over the
    window steadies a comparison that one validation would make noisy (successive validations
    of one run differ by up to 1.4% on Multi30k). None when the runs share no validation there."""
    if not curve or not baseline_curve:
        return None
    baseline = dict(baseline_curve)
    start = (1 - window) * min(curve[-1][0], baseline_curve[-1][0])
    differences = [(loss - baseline[updates]) / baseline[updates]
                   for updates, loss in curve if updates > start and updates in baseline]
    if not differences:
        return None
    return {"window_start_update": start, "points": len(differences),
            "lower": sum(d < 0 for d in differences),
            "mean_difference": statistics.fmean(differences)}


def checkpoint_updates(path: Path) -> int:
    state = read_checkpoint(path)
    return state["optimizer_history"][-1]["num_updates"]


def checkpoints_to_average(save_dir: Path, count: int = AVERAGE_LAST) -> List[Path]:
    """The last ``count`` checkpoints: checkpoint_last.pt when training stopped inside an epoch
    (the time budget ran out), then the newest epoch checkpoints."""
    epochs = sorted((int(m.group(1)), save_dir / m.group(0)) for m in
                    (re.fullmatch(r"checkpoint(\d+)\.pt", p.name) for p in save_dir.iterdir()) if m)
    newest_first = [path for _, path in reversed(epochs)]
    last = save_dir / "checkpoint_last.pt"
    if not last.is_file():
        raise StudyError(f"{save_dir}: training wrote no checkpoint_last.pt")
    if not newest_first or checkpoint_updates(last) > checkpoint_updates(newest_first[0]):
        newest_first.insert(0, last)
    return newest_first[:count]


def bleu_scores(generate_output: Path, target: str = DEFAULT_TARGET) -> Dict[str, object]:
    """What ``multipath-score --generate-output FILE --lang TARGET`` prints: tokenized
    multi-bleu, and sacreBLEU and chrF on the Moses-detokenized text, each with its two printed
    decimals."""
    scores = scoring.score_generate_output(generate_output, lang=target)
    return {"bleu": round(scores.bleu, 2), "multi_bleu": str(scores.multi_bleu),
            "sacrebleu": round(scores.sacrebleu, 2), "sacrebleu_signature": scores.signature,
            "chrf": round(scores.chrf, 2), "chrf_signature": scores.chrf_signature}


def detokenized_translations(generate_output: Path,
                             target: str = DEFAULT_TARGET) -> Tuple[List[str], List[str]]:
    """Hypotheses and references of a fairseq-generate output, Moses-detokenized for the target
    language: the text the sacreBLEU and chrF columns score (``multipath-score
    --generate-output F --lang TARGET``)."""
    hyps, refs = scoring.read_generate_output(generate_output)
    return scoring.detokenize(hyps, target), scoring.detokenize(refs, target)


def paired_bootstrap(baseline: Sequence[str], system: Sequence[str], references: Sequence[str],
                     samples: int = BOOTSTRAP_SAMPLES) -> dict:
    """sacreBLEU's paired bootstrap resampling (``sacrebleu --paired-bs -m bleu chrf``, Koehn
    2004, as Moses' bootstrap-hypothesis-difference-significance.pl) of ``system`` against
    ``baseline`` on the same test sentences, for BLEU and for chrF: both scores, the difference
    and its p-value, which sacreBLEU computes from resamples whose difference exceeds the
    observed one; with its default SACREBLEU_SEED the result is reproducible. BLEU's keys are
    unprefixed, chrF's start with ``chrf_``.

    ``significant`` needs p < SIGNIFICANCE_LEVEL and a nonzero difference: when both systems
    score exactly the same, every resampled difference is 0 too and sacreBLEU's (c + 1) / (n + 1)
    gives the smallest p-value, 1 / (n + 1), for what is no difference at all."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest
    signatures, scores = PairedTest([("baseline", list(baseline)), ("system", list(system))],
                                    {"BLEU": BLEU(), "chrF": CHRF()}, [list(references)],
                                    test_type="bs", n_samples=samples)()
    result = {}
    # sacreBLEU names the results by each metric's printed name (chrF with beta 2: "chrF2")
    for metric, prefix in (("BLEU", ""), ("chrF2", "chrf_")):
        base, other = scores[metric]
        delta = other.score - base.score
        name = prefix.rstrip("_") or "bleu"
        result.update({
            f"baseline_{name}": base.score, name: other.score, f"{prefix}delta": delta,
            f"{prefix}p_value": other.p_value,
            f"{prefix}significant": other.p_value < SIGNIFICANCE_LEVEL and delta != 0,
            f"{prefix}signature": str(signatures[metric])})
    return result


def paired_t_test(deltas: Sequence[float]) -> Optional[dict]:
    """The paired t-test over seeds of a system against the baseline (``deltas``: the
    per-seed score differences, same seed, so same data order): t, degrees of freedom and the
    two-sided p-value; None with fewer than two seeds or no spread."""
    if len(deltas) < 2 or statistics.stdev(deltas) == 0:
        return None
    from scipy import stats  # scikit-learn's dependency, installed with fairseq
    test = stats.ttest_1samp(list(deltas), 0.0)
    return {"t": float(test.statistic), "df": len(deltas) - 1, "p_value": float(test.pvalue),
            "significant": float(test.pvalue) < SIGNIFICANCE_LEVEL}


def write_json(path: Path, value) -> None:
    write_text_atomically(path, json.dumps(value, indent=2) + "\n")


# Steps that run inside this process (averaging, EWA folding, scoring, model builds) take turns
# when several runs go at once (--parallel): the trainings and translations are the subprocesses
# that overlap.
IN_PROCESS = threading.Lock()


def _same_flags(path: Path, flags: List[str]) -> None:
    """A finished stage of ``path``'s run folder must come from the same model flags (a system
    whose definition changed would otherwise be read back with its old results)."""
    if path.is_file():
        recorded = json.loads(path.read_text()).get("flags")
        if recorded is not None and recorded != flags:
            raise StudyError(f"{path} was trained with other flags ({' '.join(recorded)}) than "
                             f"this study's ({' '.join(flags)}); remove {path.parent} or use "
                             "another --work")


def translate(data_bin: Path, checkpoint: Path, out_prefix: Path, subset: str,
              device: str = "cpu") -> None:
    """``subset`` as translate.sh translates it (OUT.generate, OUT.hyp and OUT.ref), with the
    study's length cap; fairseq-generate's log goes to translate.log beside them."""
    command = recipe.generate_command(data_bin, checkpoint, ["--gen-subset", subset, *DECODING],
                                      gpus=DEVICE_GPUS[device])
    run(command, out_prefix.parent / "translate.log",
        stdout=out_prefix.with_name(out_prefix.name + ".generate.tmp"))
    try:
        recipe.finish_translation(out_prefix)
    except recipe.RecipeError as err:
        raise StudyError(str(err)) from err


def run_system(system: System, flags: List[str], seed: int, data_bin: Path, run_dir: Path,
               budget: Budget, dict_size: int, runs_root: Path, device: str = "cpu",
               target: str = DEFAULT_TARGET) -> dict:
    """Train, average, (fold EWA), translate valid and test, score; returns the result record.
    A finished run (``result.json``) is read back instead of rerun."""
    result_path = run_dir / "result.json"
    train_done = run_dir / "train.done.json"
    _same_flags(result_path, flags)
    _same_flags(train_done, flags)
    if result_path.is_file():
        log(f"{system.name} seed {seed}: already done ({result_path})")
        return json.loads(result_path.read_text())
    start = time.monotonic()
    save_dir = run_dir / "checkpoints"
    train_log = run_dir / "train.log"
    extra = []
    if system.name == "ewa" and budget.minutes:
        # EWA's share rate rises linearly over --max-update, which a time budget does not know:
        # the base model's update count in the same budget (EWA does the base model's work plus
        # the averaging, so the budget binds). Under an updates budget it is that budget.
        base = json.loads((runs_root / "base" / f"seed{seed}" / "result.json").read_text())
        extra = ["--max-update", str(base["updates"])]
    if not train_done.is_file():
        log(f"{system.name} seed {seed}: training ({budget.describe()}) on {device} -> "
            f"{save_dir}")
        command = train_command(system.arch, [*flags, *SHARED_RECIPE, *budget.training_flags(),
                                              "--seed", str(seed), *extra],
                                data_bin, save_dir, device)
        seconds = run(command, train_log)
        write_json(train_done, {"wall_seconds": round(seconds, 1), "flags": flags})
    wall = json.loads(train_done.read_text())["wall_seconds"]

    averaged = run_dir / "checkpoint_avg.pt"
    with IN_PROCESS:
        inputs = checkpoints_to_average(save_dir)
        if not averaged.is_file():
            log(f"{system.name} seed {seed}: averaging {', '.join(p.name for p in inputs)}")
            averaging.save_atomically(
                averaging.average_checkpoints([str(p) for p in inputs]), averaged)
        test_checkpoint = averaged
        if system.name == "ewa":
            test_checkpoint = run_dir / "checkpoint_avg_dense.pt"
            if not test_checkpoint.is_file():
                log(f"{system.name} seed {seed}: folding the EWA experts into a dense model")
                convert_ewa_checkpoint(averaged, test_checkpoint)

    scores = {}
    for subset in ("valid", "test"):
        generated = run_dir / f"{subset}.generate"
        if not generated.is_file():
            log(f"{system.name} seed {seed}: translating {subset}")
            translate(data_bin, test_checkpoint, run_dir / subset, subset, device)
        with IN_PROCESS:
            scores[subset] = bleu_scores(generated, target)

    with IN_PROCESS:
        counts = count_parameters(system.arch, flags, dict_size)
    log_text = train_log.read_text()
    curve = validation_curve(log_text)
    result = {
        "system": system.name, "seed": seed, "arch": system.arch, "flags": flags,
        "params": counts["total"], "active_params": counts["active"],
        **training_stats(log_text),
        "train_wall_seconds": wall,
        "train_wall_minutes": round(wall / 60, 2),
        "valid_loss": curve[-1][1] if curve else None,
        "valid_curve": curve,
        "valid_plateau": plateau(curve),
        "averaged": [p.name for p in inputs],
        "test_checkpoint": str(test_checkpoint),
        "valid_bleu": scores["valid"]["bleu"], "valid_sacrebleu": scores["valid"]["sacrebleu"],
        "test_bleu": scores["test"]["bleu"], "test_sacrebleu": scores["test"]["sacrebleu"],
        "test_multi_bleu": scores["test"]["multi_bleu"],
        "sacrebleu_signature": scores["test"]["sacrebleu_signature"],
        "valid_chrf": scores["valid"]["chrf"], "test_chrf": scores["test"]["chrf"],
        "chrf_signature": scores["test"]["chrf_signature"],
        # training, averaging, translation and scoring (of the last invocation, if resumed)
        "run_wall_seconds": round(time.monotonic() - start, 1),
    }
    write_json(result_path, result)
    log(f"{system.name} seed {seed}: test BLEU {result['test_bleu']:.2f} "
        f"(sacreBLEU {result['test_sacrebleu']:.2f}, chrF {result['test_chrf']:.2f}), "
        f"{result['updates']} updates")
    return result


# ------------------------------------------------------------------------------ reporting

METRICS = ("train_tokens_per_second", "train_wall_minutes", "updates", "epochs", "valid_loss",
           "valid_bleu", "valid_sacrebleu", "test_bleu", "test_sacrebleu", "valid_chrf",
           "test_chrf")


def summarize(system: System, runs: List[dict]) -> dict:
    """Mean and (with more than one seed) sample standard deviation of each metric, and the
    largest validation-loss improvement over the last 20% of training among the seeds."""
    summary = {"system": system.name, "label": system.label, "family": system.family,
               "arch": system.arch, "flags": runs[0]["flags"], "params": runs[0]["params"],
               "active_params": runs[0]["active_params"], "seeds": [r["seed"] for r in runs],
               "mean": {}, "std": {}, "runs": runs}
    for metric in METRICS:
        values = [r[metric] for r in runs if r.get(metric) is not None]
        if values:
            summary["mean"][metric] = statistics.fmean(values)
            summary["std"][metric] = statistics.stdev(values) if len(values) > 1 else None
    checks = [r.get("valid_plateau") for r in runs]
    if checks and all(checks):
        summary["valid_plateau"] = {
            "max_improvement": max(c["improvement"] for c in checks),
            "plateaued": all(c["plateaued"] for c in checks)}
    return summary


def compare_systems(summary: dict, baseline: dict, runs_root: Path, cache: dict,
                    target: str = DEFAULT_TARGET) -> Optional[dict]:
    """``summary`` against ``baseline``: per seed that both ran, the paired bootstrap of the
    system's test translations against the baseline's (sacreBLEU and chrF on detokenized text,
    cached in ``cache``); the difference of the means over seeds; ``significant`` when every
    seed's difference is (``chrf_significant`` for chrF); over the seeds, the paired t-test of
    the per-seed differences (``across_seeds``, BLEU and chrF, from two seeds on); and the
    validation losses compared (``_compare_valid_curves``). None when they share no seed.

    Why a t-test over seeds: the bootstrap measures how much one model's score depends on which
    test sentences were drawn, not how much it depends on the seed, which is what several seeds
    measure; the seed is the unit that is replicated, and pairing by seed keeps the data order
    (fairseq's seed) common to both systems. With three seeds it has 2 degrees of freedom, so
    only a difference that is consistent across seeds can reach p < 0.05."""
    seeds = [seed for seed in summary["seeds"] if seed in baseline["seeds"]]
    per_seed = []
    for seed in seeds:
        key = (baseline["system"], summary["system"], seed)
        if key not in cache:
            base_hyps, refs = detokenized_translations(
                runs_root / baseline["system"] / f"seed{seed}" / "test.generate", target)
            hyps, _ = detokenized_translations(
                runs_root / summary["system"] / f"seed{seed}" / "test.generate", target)
            cache[key] = {"seed": seed, **paired_bootstrap(base_hyps, hyps, refs)}
        per_seed.append(cache[key])
    if not per_seed:
        return None
    deltas = [c["delta"] for c in per_seed]
    chrf_deltas = [c["chrf_delta"] for c in per_seed]
    return {
        "baseline": baseline["system"], "per_seed": per_seed,
        "delta_mean": statistics.fmean(deltas),
        "delta_std": statistics.stdev(deltas) if len(deltas) > 1 else None,
        "significant": all(c["significant"] for c in per_seed),
        "chrf_delta_mean": statistics.fmean(chrf_deltas),
        "chrf_delta_std": statistics.stdev(chrf_deltas) if len(chrf_deltas) > 1 else None,
        "chrf_significant": all(c["chrf_significant"] for c in per_seed),
        "across_seeds": {"test": "paired t-test over seeds", "bleu": paired_t_test(deltas),
                         "chrf": paired_t_test(chrf_deltas)},
        "valid_loss": _compare_valid_curves(summary, baseline, seeds)}


def ablation_step(system: str, finished: Container[str]) -> Optional[str]:
    """The finished row of Table 4 that ``system`` changes (ABLATION_STEPS), skipping back over
    rows the study did not run; None for a system outside the ablation."""
    previous = ABLATION_STEPS.get(system)
    while previous is not None and previous not in finished:
        previous = ABLATION_STEPS.get(previous)
    return previous


def _compare_valid_curves(summary: dict, baseline: dict, seeds: Sequence[int]) -> Optional[dict]:
    """compare_curves per seed, and over the seeds: the mean of the mean differences and the
    validations where the system was lower; None unless every seed has a comparison."""
    curves = {r["seed"]: r.get("valid_curve") for r in summary["runs"]}
    baseline_curves = {r["seed"]: r.get("valid_curve") for r in baseline["runs"]}
    per_seed = [compare_curves(curves.get(seed), baseline_curves.get(seed)) for seed in seeds]
    if not per_seed or None in per_seed:
        return None
    return {"per_seed": [{"seed": seed, **c} for seed, c in zip(seeds, per_seed)],
            "mean_difference": statistics.fmean(c["mean_difference"] for c in per_seed),
            "lower": sum(c["lower"] for c in per_seed),
            "points": sum(c["points"] for c in per_seed)}


def _cell(summary, metric, digits):
    mean, std = summary["mean"].get(metric), summary["std"].get(metric)
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _plateau_cell(summary):
    check = summary.get("valid_plateau")
    return "-" if check is None else f"{100 * check['max_improvement']:.2f}%"


def _valid_versus_cell(versus: Optional[dict]) -> str:
    """The validation loss's mean relative difference to the other system's over the last 20% of
    training, and at how many of those validations (all seeds) it was lower."""
    versus = (versus or {}).get("valid_loss")
    if versus is None:
        return "-"
    return f"{100 * versus['mean_difference']:+.1f}% ({versus['lower']}/{versus['points']})"


def _versus_cells(versus: Optional[dict], metric: str = "") -> Tuple[str, str]:
    """The mean sacreBLEU difference (``metric`` "chrf_": chrF's) to the other system (± its std
    over seeds; † when p >= 0.05 in some seed) and the p-value of each seed."""
    if versus is None or f"{metric}delta_mean" not in versus:
        return "-", "-"
    std = versus[f"{metric}delta_std"]
    delta = f"{versus[f'{metric}delta_mean']:+.2f}" + (f" ± {std:.2f}" if std is not None else "")
    mark = "" if versus[f"{metric}significant"] else " †"
    return delta + mark, ", ".join(f"{c[f'{metric}p_value']:.3f}" for c in versus["per_seed"])


def _t_test_cell(versus: Optional[dict], metric: str) -> str:
    """The paired t-test over seeds: p and t with its degrees of freedom, * when p < 0.05."""
    test = ((versus or {}).get("across_seeds") or {}).get(metric)
    if test is None:
        return "-"
    return (f"{test['p_value']:.3f}{' *' if test['significant'] else ''} "
            f"(t({test['df']}) = {test['t']:+.2f})")


def markdown_table(summaries: List[dict]) -> str:
    lines = ["| system | params (M) | active (M) | updates | epochs | train tok/s | "
             "train wall (min) | valid loss | loss gain, last 20% | valid loss vs deep, "
             "last 20% | valid BLEU | test BLEU | test sacreBLEU | test chrF | vs deep | "
             "p per seed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        delta, p_values = _versus_cells(s.get("vs_deep"))
        lines.append(
            f"| {s['system']}: {s['label']} | {s['params'] / 1e6:.2f} | "
            f"{s['active_params'] / 1e6:.2f} | {_cell(s, 'updates', 0)} | "
            f"{_cell(s, 'epochs', 2)} | {_cell(s, 'train_tokens_per_second', 0)} | "
            f"{_cell(s, 'train_wall_minutes', 1)} | {_cell(s, 'valid_loss', 3)} | "
            f"{_plateau_cell(s)} | {_valid_versus_cell(s.get('vs_deep'))} | "
            f"{_cell(s, 'valid_bleu', 2)} | {_cell(s, 'test_bleu', 2)} | "
            f"{_cell(s, 'test_sacrebleu', 2)} | {_cell(s, 'test_chrf', 2)} | {delta} | "
            f"{p_values} |")
    return "\n".join(lines) + "\n"


def versus_deep_table(summaries: List[dict]) -> str:
    """Each system against deep in sacreBLEU and chrF: the mean difference over seeds, each
    seed's paired bootstrap and the paired t-test over seeds; empty when no system was
    compared."""
    rows = [s for s in summaries if s.get("vs_deep")]
    if not rows:
        return ""
    lines = ["| system | sacreBLEU vs deep | p per seed | p over seeds | chrF vs deep | "
             "p per seed | p over seeds |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        versus = s["vs_deep"]
        bleu, bleu_p = _versus_cells(versus)
        chrf, chrf_p = _versus_cells(versus, "chrf_")
        lines.append(f"| {s['system']} | {bleu} | {bleu_p} | {_t_test_cell(versus, 'bleu')} | "
                     f"{chrf} | {chrf_p} | {_t_test_cell(versus, 'chrf')} |")
    return "\n".join(lines) + "\n"


def ablation_table(summaries: List[dict]) -> str:
    """Table 4's steps: each multi-path row that ran against the row it changes; empty when
    no step ran."""
    rows = [s for s in summaries if s.get("vs_ablation_step")]
    if not rows:
        return ""
    lines = ["| row | against | test sacreBLEU | difference | p per seed | "
             "valid loss difference, last 20% |",
             "|---|---|---:|---:|---:|---:|"]
    for s in rows:
        versus = s["vs_ablation_step"]
        delta, p_values = _versus_cells(versus)
        lines.append(f"| {s['system']}: {s['label']} | {versus['baseline']} | "
                     f"{_cell(s, 'test_sacrebleu', 2)} | {delta} | {p_values} | "
                     f"{_valid_versus_cell(versus)} |")
    return "\n".join(lines) + "\n"


def _budget_text(config: dict) -> str:
    if config.get("budget_updates"):
        return Budget(updates=config["budget_updates"]).describe()
    return Budget(minutes=config["budget_minutes"]).describe()


def _convergence_text(summaries: List[dict]) -> str:
    """Whether the deep baseline's validation loss stopped improving, in every seed."""
    deep = next((s for s in summaries if s["system"] == BASELINE), None)
    check = deep and deep.get("valid_plateau")
    if not check:
        return ""
    gain = f"{100 * check['max_improvement']:.2f}%"
    if check["plateaued"]:
        return (f"The deep baseline's validation loss improved by at most {gain} over the last "
                f"{PLATEAU_WINDOW:.0%} of training (every seed): it had stopped improving by "
                f"more than {PLATEAU_TOLERANCE:.0%}.")
    return (f"**The deep baseline's validation loss still improved by up to {gain} over the last "
            f"{PLATEAU_WINDOW:.0%} of training** (more than {PLATEAU_TOLERANCE:.0%}): the budget "
            "is too short for a converged comparison; raise --budget-updates.")


def markdown_report(report: dict) -> str:
    config, machine = report["config"], report["machine"]
    seeds = config["seeds"]
    seed_list = config.get("seed_list", list(range(1, seeds + 1)))
    seed_text = (f"{seeds} seed(s)" if seed_list == list(range(1, seeds + 1))
                 else f"seed(s) {', '.join(map(str, seed_list))}")
    spread = " (mean ± sample std over seeds)" if seeds > 1 else ""
    signature = next((r["sacrebleu_signature"] for s in report["systems"] for r in s["runs"]),
                     "")
    chrf_signature = next((r["chrf_signature"] for s in report["systems"] for r in s["runs"]
                           if r.get("chrf_signature")), "")
    chrf_text = f"; chrF: sacreBLEU's, `{chrf_signature}`" if chrf_signature else ""
    bootstrap = next((s["vs_deep"]["per_seed"][0]["signature"] for s in report["systems"]
                      if s.get("vs_deep")), "")
    usable = machine.get("usable_cpus", machine["cpus"])
    usable = f" ({usable} usable by the study)" if usable < machine["cpus"] else ""
    threads = machine["torch_threads"]
    threads = f"{threads} thread" + ("s" if threads != 1 else "")
    gpu = f", {machine['gpu']} (half precision)" if machine.get("gpu") else ""
    parallel = config.get("parallel", 1)
    parallel = (f", {parallel} runs at a time ({report['elapsed_seconds'] / 60:.1f} min "
                "elapsed)" if parallel > 1 else "")
    lines = [
        f"# Multi30k {pair_name(config.get('target', DEFAULT_TARGET))}: width vs depth at equal "
        "parameters", "",
        f"Budget: {_budget_text(config)}; {seed_text}{spread}; data {config['data_tag']} "
        f"(BPE {BPE_MERGES} merges, joined dictionary of {config['dict_size']} types). "
        f"Machine: {machine['cpu']}, {machine['cpus']} CPUs{usable}, torch {machine['torch']} "
        f"with {threads}{gpu}{parallel}. Wall time of all runs (training, averaging, "
        f"translation, scoring): {report['runs_wall_seconds'] / 60:.1f} min.", "",
        markdown_table(report["systems"]),
        "BLEU: tokenized multi-bleu (`multipath-score`, no compound split) of the averaged last "
        f"checkpoints (up to {AVERAGE_LAST}, the final partial epoch included); sacreBLEU on "
        f"Moses-detokenized text, `{signature}`{chrf_text}. Train tok/s: target tokens per "
        "second of training (fairseq's wps); train wall: the whole fairseq-train process. Valid loss: the "
        "last validation's cross-entropy (fairseq's nll_loss, bits per token, no label "
        "smoothing); loss gain, last 20%: how much the best validation loss improved over the "
        f"last {PLATEAU_WINDOW:.0%} of the updates (the largest over seeds); valid loss vs "
        f"deep, last {PLATEAU_WINDOW:.0%}: the mean relative difference to the deep model's "
        "validation loss at the validations both made in that window (the mean over seeds) "
        "and, in brackets, at how many of them (all seeds) it was lower.", "",
        f"vs deep: the test sacreBLEU difference to the deep model with the same seed; p per "
        f"seed: sacreBLEU's paired bootstrap resampling of the two systems' test translations"
        f"{f' (`{bootstrap}`)' if bootstrap else ''}; † marks a difference that is not significant (p >= "
        f"{SIGNIFICANCE_LEVEL}, or no difference) in at least one seed.", ""]
    versus = versus_deep_table(report["systems"])
    if versus:
        lines += ["Against deep in both metrics: the mean difference over seeds (± std), each "
                  "seed's paired bootstrap (the same for chrF) and, over the seeds, the paired "
                  "t-test of the per-seed differences (two-sided; * p < "
                  f"{SIGNIFICANCE_LEVEL}; from two seeds on). The bootstrap asks whether the "
                  "test set could have produced the difference by chance for these two models; "
                  "the t-test whether another seed would likely give it again.", "", versus]
    convergence = _convergence_text(report["systems"])
    if convergence:
        lines += [convergence, ""]
    steps = ablation_table(report["systems"])
    if steps:
        lines += ["The paper's ablation (Table 4) step by step: each multi-path row against the "
                  "row it changes, with the same paired bootstrap (difference of test sacreBLEU, "
                  "† not significant) and validation-loss comparison as against deep:", "",
                  steps]
    lines += ["Systems and flags (shared: `" + " ".join(SHARED_MODEL + SHARED_RECIPE) + "`):",
              ""]
    for s in report["systems"]:
        own = s["flags"][len(SHARED_MODEL):]
        lines.append(f"- `{s['system']}`: `--arch {s['arch']} {' '.join(own)}`")
    return "\n".join(lines) + "\n"


FAMILY_STYLE = {"base": ("black", "o"), "deep": ("tab:blue", "s"), "wide": ("tab:gray", "D"),
                "multi-path": ("tab:red", "^"), "MoE-style": ("tab:green", "v")}


PLOT_MIN_SPAN_PARAMS = 0.2  # million parameters
PLOT_MIN_SPAN_BLEU = 2.0


def plot(summaries: List[dict], path: Path, title: str) -> None:
    """BLEU vs parameters (the paper's Fig. 1): a line from the base model to each system, error
    bars of one sample std over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7.5, 5))
    base = next((s for s in summaries if s["system"] == "base"), None)
    for s in summaries:
        colour, marker = FAMILY_STYLE[s["family"]]
        x, y = s["params"] / 1e6, s["mean"]["test_bleu"]
        if base is not None and s is not base:
            axes.plot([base["params"] / 1e6, x], [base["mean"]["test_bleu"], y], color=colour,
                      alpha=0.35, linewidth=1)
        axes.errorbar(x, y, yerr=s["std"].get("test_bleu"), color=colour, marker=marker,
                      markersize=7, capsize=3, linestyle="none")
    for family, (colour, marker) in FAMILY_STYLE.items():
        if any(s["family"] == family for s in summaries):
            axes.plot([], [], color=colour, marker=marker, linestyle="none", label=family)
    # matplotlib fits the axes to the points: two systems of equal size 0.1 BLEU apart would
    # fill the whole figure, so the axes span at least PLOT_MIN_SPAN_PARAMS and _BLEU
    axes.set_xlim(_spanning(axes.get_xlim(), PLOT_MIN_SPAN_PARAMS))
    axes.set_ylim(_spanning(axes.get_ylim(), PLOT_MIN_SPAN_BLEU))
    _label_points(axes, [(s["system"], s["params"] / 1e6, s["mean"]["test_bleu"])
                         for s in summaries])
    axes.set_xlabel("parameters (M)")
    axes.set_ylabel("test BLEU, tokenized (Multi30k test 2016)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    _save_figure(figure, path)


LABEL_SIZE_POINTS = (60, 10)  # room one 8-point system name takes, in typographic points


def _label_points(axes, points: Sequence[Tuple[str, float, float]]) -> None:
    """A name beside each point (x, y in data units, the axes' limits final), from the lowest
    point up: a label that would overprint one already placed moves up until it is free, so each
    label starts level with its own point unless another is in the way."""
    to_points = 72 / axes.figure.dpi
    placed = []
    for name, x, y in sorted(points, key=lambda p: p[2]):
        px, py = (to_points * v for v in axes.transData.transform((x, y)))
        offset = 4
        while any(abs(px - qx) < LABEL_SIZE_POINTS[0]
                  and abs(py + offset - qy) < LABEL_SIZE_POINTS[1] for qx, qy in placed):
            offset += LABEL_SIZE_POINTS[1]
        placed.append((px, py + offset))
        axes.annotate(name, (x, y), textcoords="offset points", xytext=(5, offset), fontsize=8)


def _spanning(limits: Tuple[float, float], span: float) -> Tuple[float, float]:
    """``limits`` widened about their middle to at least ``span``."""
    low, high = limits
    if high - low >= span:
        return low, high
    middle = (low + high) / 2
    return middle - span / 2, middle + span / 2


def _save_figure(figure, path: Path) -> None:
    import matplotlib.pyplot as plt
    figure.tight_layout()
    write_atomically(path, lambda out: figure.savefig(out, format="png", dpi=120))
    plt.close(figure)


def mean_curve(curves: Sequence[Sequence[Tuple[int, float]]]):
    """The updates every curve was validated at, and the mean, min and max loss there."""
    common = sorted(set.intersection(*(set(u for u, _ in c) for c in curves)))
    values = [[dict(c)[u] for c in curves] for u in common]
    return (common, [statistics.fmean(v) for v in values], [min(v) for v in values],
            [max(v) for v in values])


# The validation-loss plot's right panel: the second half of training, where converged systems
# differ by 1-2% and a full-height axis from the first validation (loss 6+) flattens them
VALID_PLOT_ZOOM_FROM = 0.5
VALID_PLOT_ZOOM_MARGIN = 0.05  # of the zoomed range, above and below


def plot_validation_loss(summaries: List[dict], path: Path, title: str) -> bool:
    """Validation loss against updates per system: the mean over seeds, shaded between the
    seeds' min and max; left the whole run, right its second half with the loss axis fitted to
    it. False (nothing drawn) when no run has a validation curve."""
    curves = [(s, [r["valid_curve"] for r in s["runs"] if r.get("valid_curve")])
              for s in summaries]
    curves = [(s, c) for s, c in curves if c]
    if not curves:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, (whole, zoomed) = plt.subplots(1, 2, figsize=(13, 5))
    last = max(run[-1][0] for _, runs in curves for run in runs)
    zoom_start = VALID_PLOT_ZOOM_FROM * last
    zoomed_losses = []
    for index, (s, runs) in enumerate(curves):
        updates, mean, low, high = mean_curve(runs)
        colour = f"C{index % 10}"
        zoomed_losses += [loss for u, lowest, highest in zip(updates, low, high)
                          if u >= zoom_start for loss in (lowest, highest)]
        for axes in (whole, zoomed):
            axes.plot(updates, mean, color=colour, linewidth=1.3,
                      linestyle="-" if index < 10 else "--", label=s["system"])
            if len(runs) > 1:
                axes.fill_between(updates, low, high, color=colour, alpha=0.2, linewidth=0)
    seeds = max(len(runs) for _, runs in curves)
    whole.set_title(title + (f": mean of {seeds} seeds, shaded min-max" if seeds > 1 else ""))
    zoomed.set_title(f"from update {zoom_start:,.0f} on, zoomed")
    zoomed.set_xlim(zoom_start, last)
    if zoomed_losses:
        margin = VALID_PLOT_ZOOM_MARGIN * (max(zoomed_losses) - min(zoomed_losses) or 1.0)
        zoomed.set_ylim(min(zoomed_losses) - margin, max(zoomed_losses) + margin)
    for axes in (whole, zoomed):
        axes.set_xlabel("updates (2,048 tokens each)")
        axes.set_ylabel("validation loss (nll, bits per token)")
        axes.grid(alpha=0.3)
    zoomed.legend(fontsize=8)
    _save_figure(figure, path)
    return True


def machine_info(device: str = "cpu") -> dict:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # CPUs this process may run on (taskset/cgroups), which can be fewer than the machine has
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cpus": os.cpu_count(), "usable_cpus": usable, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "platform": platform.platform(), "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}


# ------------------------------------------------------------------------------ main

def select_systems(names: Optional[str],
                   budget: Budget = Budget(updates=DEFAULT_BUDGET_UPDATES)) -> List[System]:
    """The named systems (default: DEFAULT_SYSTEMS) in the study's order."""
    if not names:
        return [s for s in SYSTEMS if s.name in DEFAULT_SYSTEMS]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SYSTEM_NAMES]
    if unknown:
        raise StudyError(f"unknown system(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(SYSTEM_NAMES)}")
    if "ewa" in wanted and "base" not in wanted and budget.minutes:
        log("ewa takes its --max-update from the base model's run: adding base")
        wanted.append("base")
    if BASELINE not in wanted:
        log(f"no {BASELINE} model among the systems: no significance tests against it")
    return [s for s in SYSTEMS if s.name in wanted]


def resolve_device(device: str, parallel: int, budget: Budget) -> str:
    """``cpu`` or ``cuda`` (``auto``: cuda when torch sees a GPU); refuses what cannot work."""
    import torch
    available = torch.cuda.is_available()
    if device == "auto":
        device = "cuda" if available else "cpu"
    if device == "cuda" and not available:
        raise StudyError("--device cuda: torch sees no CUDA device (torch "
                         f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if parallel > 1 and device == "cpu":
        raise StudyError(f"--parallel {parallel} runs several trainings on one GPU; on the CPU "
                         "the runs go one at a time (concurrent trainings share the cores: none "
                         "finishes sooner, and each one's speed would measure the others); use "
                         "--device cuda or --parallel 1")
    if parallel > 1 and budget.minutes:
        raise StudyError(f"--parallel {parallel} needs the equal-updates budget "
                         "(--budget-updates): at equal time, runs sharing a GPU slow each other "
                         "down unevenly, and the budget would measure that")
    return device


def write_reports(report: dict, results: Path) -> None:
    pair = pair_name(report["config"].get("target", DEFAULT_TARGET))
    results.mkdir(parents=True, exist_ok=True)
    write_json(results / "study.json", report)
    write_text_atomically(results / "study.md", markdown_report(report))
    if not report["systems"]:  # no system has finished all its seeds yet
        return
    budget = ("equal updates" if report["config"].get("budget_updates")
              else "equal training time")
    plot(report["systems"], results / "study.png", f"Multi30k {pair}, {budget} per system")
    plot_validation_loss(report["systems"], results / "study-valid-loss.png",
                         f"Multi30k {pair}, {budget}")


def summaries_of(systems: Sequence[System], finished: Dict[Tuple[str, int], dict],
                 seeds: Sequence[int], runs_root: Path, cache: dict,
                 target: str = DEFAULT_TARGET) -> List[dict]:
    """The summaries of the systems whose seeds have all finished, each compared with the deep
    model and each Table 4 row with the row it changes, when those have finished."""
    summaries = [summarize(system, [finished[system.name, seed] for seed in seeds])
                 for system in systems
                 if all((system.name, seed) in finished for seed in seeds)]
    by_name = {s["system"]: s for s in summaries}
    for summary in summaries:
        comparisons = [("vs_deep", by_name.get(BASELINE)),
                       ("vs_ablation_step", by_name.get(ablation_step(summary["system"],
                                                                      by_name)))]
        for key, other in comparisons:
            versus = (compare_systems(summary, other, runs_root, cache, target)
                      if other is not None and other is not summary else None)
            if versus is not None:
                summary[key] = versus
    return summaries


def run_study(args) -> dict:
    """Prepare, run every system and seed (``--parallel`` at a time), and rewrite the reports
    after each run (so an interrupted study leaves the table of the systems that finished)."""
    budget = (Budget(minutes=args.budget_minutes) if args.budget_minutes
              else Budget(updates=args.budget_updates))
    systems = select_systems(args.systems, budget)
    device = resolve_device(args.device, args.parallel, budget)
    results = Path(args.results)
    data_bin = prepare(Path(args.data), Path(args.work), args.max_train_lines,
                       args.max_eval_lines, args.workers, args.target)
    dict_size = dictionary_size(data_bin)
    flags = resolve_flags(systems, dict_size)
    runs_root = data_bin.parent / budget.runs_dirname
    seeds = args.seeds
    report = {
        "config": {"budget_minutes": budget.minutes, "budget_updates": budget.updates,
                   "validation_interval": budget.updates and validation_interval(budget.updates),
                   "seeds": len(seeds), "seed_list": seeds, "target": args.target,
                   "systems": [s.name for s in systems],
                   "data": str(args.data), "data_tag": data_bin.parent.name,
                   "max_train_lines": args.max_train_lines,
                   "max_eval_lines": args.max_eval_lines, "dict_size": dict_size,
                   "bpe_merges": BPE_MERGES, "shared_model": SHARED_MODEL,
                   "shared_recipe": SHARED_RECIPE, "budget_flags": budget.training_flags(),
                   "decoding": DECODING, "device": device, "parallel": args.parallel,
                   "plateau": {"window": PLATEAU_WINDOW, "tolerance": PLATEAU_TOLERANCE},
                   "bootstrap": {"samples": BOOTSTRAP_SAMPLES,
                                 "significance_level": SIGNIFICANCE_LEVEL,
                                 "baseline": BASELINE}},
        "machine": machine_info(device),
        "runs_wall_seconds": 0.0,
        "systems": [],
    }
    start = time.monotonic()
    finished: Dict[Tuple[str, int], dict] = {}
    cache: dict = {}
    # jobs start seed by seed, each seed's systems in the study's order (base before EWA, which
    # reads its update count under a time budget; there --parallel is 1, so each job ends
    # before the next starts): an interrupted study has compared its systems on the first seeds
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        jobs = {pool.submit(run_system, system, flags[system.name], seed, data_bin,
                            runs_root / system.name / f"seed{seed}", budget, dict_size,
                            runs_root, device, args.target): (system.name, seed)
                for seed in seeds for system in systems}
        try:
            for job in as_completed(jobs):
                finished[jobs[job]] = job.result()
                report["systems"] = summaries_of(systems, finished, seeds, runs_root, cache,
                                                 args.target)
                report["runs_wall_seconds"] = round(sum(
                    r["run_wall_seconds"] for r in finished.values()), 1)
                report["elapsed_seconds"] = round(time.monotonic() - start, 1)
                write_reports(report, results)
        except BaseException:
            for job in jobs:  # the runs under way finish, the others do not start
                job.cancel()
            raise
    log(f"wrote {results}/study.md, study.json, study.png and study-valid-loss.png")
    return report


def _positive_int(value):
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def seed_list(value: str) -> List[int]:
    """``--seeds``: N (seeds 1 to N) or FIRST-LAST (e.g. 2-3)."""
    first, _, last = value.partition("-")
    try:
        seeds = list(range(int(first), int(last) + 1)) if last else list(range(1, int(first) + 1))
    except ValueError:
        seeds = []
    if not seeds or seeds[0] < 1:
        raise argparse.ArgumentTypeError(
            f"give N (seeds 1 to N) or FIRST-LAST with 1 <= FIRST <= LAST, got {value!r}")
    return seeds


def _positive_float(value):
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def build_parser():
    parser = argparse.ArgumentParser(prog="study.sh", description=__doc__.split("\n")[0])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-updates", type=_positive_int, default=DEFAULT_BUDGET_UPDATES,
                        help="updates of 2,048 tokens per system and seed (fairseq "
                             f"--max-update; default {DEFAULT_BUDGET_UPDATES}, about 25 epochs), "
                             "with the validation loss logged along the way")
    budget.add_argument("--budget-minutes", type=_positive_float,
                        help="instead of equal updates: the same training time per system and "
                             "seed (fairseq --stop-time-hours), without validation")
    parser.add_argument("--seeds", type=seed_list, default=[1],
                        help="N: runs per system with seeds 1..N; FIRST-LAST: those seeds only "
                             "(a study spread over machines or sessions); the table shows mean "
                             "and spread")
    parser.add_argument("--target", choices=TARGETS, default=DEFAULT_TARGET,
                        help="the language pair: English into German (default) or French, "
                             "from the same Multi30k images' captions")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cuda: train in train.sh's mixed precision (--amp --bf16 where the "
                             "GPU has bfloat16, else --amp; the same for every system) and "
                             "decode in fp16 on one GPU (the first visible one); auto "
                             "(default): cuda when torch sees a GPU, else cpu")
    parser.add_argument("--parallel", type=_positive_int, default=1,
                        help="runs (training, averaging, decoding) at a time on the GPU "
                             "(default 1; the CPU runs one at a time)")
    parser.add_argument("--data", default=os.environ.get("MULTI30K_DIR", "data/multi30k"),
                        help="folder with Multi30k's train/val/test_2016_flickr.{en,de}[.gz] "
                             "(default: $MULTI30K_DIR or data/multi30k)")
    parser.add_argument("--work", default="work/multi30k",
                        help="prepared data, checkpoints and translations (default: "
                             "work/multi30k)")
    parser.add_argument("--results", default="results/multi30k",
                        help="where study.md, study.json, study.png and study-valid-loss.png "
                             "go (default: results/multi30k)")
    parser.add_argument("--systems",
                        help=f"comma-separated subset of {', '.join(SYSTEM_NAMES)} (default: "
                             f"{','.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--max-train-lines", type=_positive_int,
                        help="only the first N training pairs (quick runs and tests)")
    parser.add_argument("--max-eval-lines", type=_positive_int,
                        help="only the first N valid and test pairs (quick runs and tests)")
    parser.add_argument("--workers", type=_positive_int, default=2,
                        help="processes for data preparation (default 2)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run_study(args)
    except StudyError as err:
        sys.exit(f"study: error: {err}")


if __name__ == "__main__":
    main()
