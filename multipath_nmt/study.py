"""The Multi30k En-De study (examples/multi30k): does width beat depth at equal parameters?

Every system trains with one recipe for the same training-time budget (fairseq's
``--stop-time-hours``), then the last epoch checkpoints (and the final partial epoch) are
averaged, valid and test are translated and scored with tokenized multi-bleu and sacreBLEU.
Systems: a small pre-norm base model (L = 3 encoder layers), its 2L-deep version, a dense model
with a wider encoder FFN, three multi-path L x n forms, WideNet, EWA and ParameterNet, all but the
base at about the parameters of the 2L model. Everything is restartable: finished stages are
skipped. Results: ``study.md`` (table), ``study.json`` and ``study.png`` (BLEU vs parameters).
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
import time
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from multipath_nmt.cli import positive_int

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
LANGS = ("en", "de")
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
]
# One recipe for every system (train.sh's per-family recipes are overridden): a short warmup and
# a high learning rate because the budget allows hundreds, not 100k, updates.
SHARED_RECIPE = [
    "--max-tokens", "2048", "--update-freq", "1", "--lr", "0.002", "--warmup-updates", "100",
    "--keep-last-epochs", "5", "--disable-validation", "--num-workers", "0",
    "--no-progress-bar", "--log-format", "simple", "--log-interval", "50",
]
# The paper's decoding (beam 4, lenpen 0.6, in translate.sh) with a length cap, so that an
# undertrained model cannot spend minutes emitting 200-token hypotheses.
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
    System("mp_original", "Multi-path 3x2, original (fixed 1/n, no PathNorm)",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "fixed",
                                    "--no-path-norm"], "multi-path"),
    System("mp_pathnorm", "Multi-path 3x2 + PathNorm + learnable weights",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "learnable"],
           "multi-path"),
    System("mp_cheap", "Multi-path 3x3 + PathNorm + learnable + cheap features",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "3", "--path-weights", "learnable",
                                    "--cheap-features"], "multi-path", match_ffn=True),
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


class StudyError(Exception):
    pass


def log(message):
    print(f"study: {message}", flush=True)


# ---------------------------------------------------------------------------------------- data

def find_text(prefix: Path, lang: str) -> Path:
    for path in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if path.is_file():
            return path
    raise FileNotFoundError(f"{prefix}.{lang}[.gz]")


def check_multi30k(data_dir: Path) -> None:
    missing = []
    for stem in SPLITS.values():
        for lang in LANGS:
            try:
                find_text(data_dir / stem, lang)
            except FileNotFoundError as err:
                missing.append(str(err))
    if missing:
        raise StudyError(
            f"Multi30k not found in {data_dir}: missing {', '.join(missing)}. Download "
            "data/task1/raw/{train,val,test_2016_flickr}.{en,de}.gz from "
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
              max_eval: Optional[int]) -> Path:
    """The first lines of each split as plain text under ``out_dir`` (for quick runs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, stem in SPLITS.items():
        limit = max_train if split == "train" else max_eval
        for lang in LANGS:
            target = out_dir / f"{stem}.{lang}"
            if not target.exists():
                tmp = target.with_suffix(target.suffix + ".tmp")
                tmp.write_text("".join(_read_lines(find_text(data_dir / stem, lang), limit)),
                               encoding="utf-8")
                os.replace(tmp, target)
    return out_dir


def prepare(data_dir: Path, work: Path, max_train: Optional[int], max_eval: Optional[int],
            workers: int) -> Path:
    """Multi30k En-De -> ``work/<tag>/data-bin`` with scripts/prepare-corpus.sh (restartable)."""
    check_multi30k(data_dir)
    tag = "full" if max_train is None and max_eval is None else \
        f"train{max_train or 'all'}-eval{max_eval or 'all'}"
    root = work / tag
    text = subsample(data_dir, root / "text", max_train, max_eval) if tag != "full" else data_dir
    data_bin = root / "data-bin"
    if (data_bin / "dict.en.txt").is_file():  # prepare-corpus.sh renames it into place when done
        log(f"{data_bin} already prepared")
        return data_bin
    log(f"preparing Multi30k En-De from {data_dir} (BPE {BPE_MERGES} merges) -> {data_bin}")
    run([SCRIPTS / "prepare-corpus.sh", "--src", "en", "--tgt", "de",
         "--train", text / SPLITS["train"], "--valid", text / SPLITS["valid"],
         "--test", text / SPLITS["test"], "--out", data_bin, "--bpe-merges", str(BPE_MERGES),
         "--workers", str(workers)], root / "prepare.log")
    return data_bin


def dictionary_size(data_bin: Path) -> int:
    from fairseq.data import Dictionary
    return len(Dictionary.load(str(data_bin / "dict.en.txt")))


# ------------------------------------------------------------------------------ model sizes

def model_flags(system: System, ffn: Optional[int] = None) -> List[str]:
    """The shared flags, then the system's (with the encoder FFN size replaced by ``ffn``)."""
    flags = list(system.flags)
    if ffn is not None:
        flags[flags.index("--encoder-ffn-embed-dim") + 1] = str(ffn)
    return SHARED_MODEL + flags


def count_parameters(arch: str, flags: Sequence[str], dict_size: int) -> Dict[str, int]:
    """Total and active parameters as ``multipath-params`` counts them."""
    from multipath_nmt.cli import params
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

def _env():
    """The scripts run this interpreter and find its console scripts (multipath-prepare)."""
    bin_dir = os.path.dirname(sys.executable)
    return dict(os.environ, PYTHON=sys.executable,
                PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))


def run(cmd, log_path: Path) -> float:
    """Run ``cmd`` with its output appended to ``log_path``; seconds taken; StudyError on failure."""
    cmd = [str(c) for c in cmd]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        code = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env())
    if code != 0:
        tail = "".join(open(log_path, errors="replace").readlines()[-25:])
        raise StudyError(f"{Path(cmd[0]).name} exited with {code}; last lines of {log_path}:\n"
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


def checkpoint_updates(path: Path) -> int:
    from multipath_nmt.checkpoints import read_checkpoint
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


def bleu_scores(generate_output: Path) -> Dict[str, object]:
    """multipath-score --generate-output FILE --lang de: tokenized multi-bleu and sacreBLEU."""
    from multipath_nmt.cli import score
    out = StringIO()
    score.score(score.get_parser().parse_args(
        ["--generate-output", str(generate_output), "--lang", "de"]), out=out)
    multi_bleu, sacre = out.getvalue().splitlines()[:2]
    sacre_value, signature = sacre.split(" | ")[:2]
    return {"bleu": float(re.match(r"BLEU = ([0-9.]+)", multi_bleu).group(1)),
            "multi_bleu": multi_bleu,
            "sacrebleu": float(sacre_value.split("=")[1]),
            "sacrebleu_signature": signature}


def write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def run_system(system: System, flags: List[str], seed: int, data_bin: Path, run_dir: Path,
               budget_minutes: float, dict_size: int, runs_root: Path) -> dict:
    """Train, average, (fold EWA), translate valid and test, score; returns the result record.
    A finished run (``result.json``) is read back instead of rerun."""
    result_path = run_dir / "result.json"
    if result_path.is_file():
        log(f"{system.name} seed {seed}: already done ({result_path})")
        return json.loads(result_path.read_text())
    start = time.monotonic()
    save_dir = run_dir / "checkpoints"
    train_log = run_dir / "train.log"
    train_done = run_dir / "train.done.json"
    extra = []
    if system.name == "ewa":
        # EWA's share rate rises linearly over --max-update: the base model's update count in the
        # same budget (EWA does the base model's work plus the averaging, so the budget binds).
        base = json.loads((runs_root / "base" / f"seed{seed}" / "result.json").read_text())
        extra = ["--max-update", str(base["updates"])]
    if not train_done.is_file():
        log(f"{system.name} seed {seed}: training for {budget_minutes:g} min -> {save_dir}")
        seconds = run([SCRIPTS / "train.sh", data_bin, save_dir, "--arch", system.arch, *flags,
                       *SHARED_RECIPE, "--stop-time-hours", repr(budget_minutes / 60),
                       "--seed", str(seed), *extra], train_log)
        write_json(train_done, {"wall_seconds": round(seconds, 1)})
    wall = json.loads(train_done.read_text())["wall_seconds"]

    averaged = run_dir / "checkpoint_avg.pt"
    inputs = checkpoints_to_average(save_dir)
    if not averaged.is_file():
        from multipath_nmt.averaging import average_checkpoints, save_atomically
        log(f"{system.name} seed {seed}: averaging {', '.join(p.name for p in inputs)}")
        save_atomically(average_checkpoints([str(p) for p in inputs]), averaged)
    test_checkpoint = averaged
    if system.name == "ewa":
        test_checkpoint = run_dir / "checkpoint_avg_dense.pt"
        if not test_checkpoint.is_file():
            log(f"{system.name} seed {seed}: folding the EWA experts into a dense model")
            run([sys.executable, "-m", "multipath_nmt.cli.convert_ewa", averaged,
                 test_checkpoint], run_dir / "convert.log")

    scores = {}
    for subset in ("valid", "test"):
        generated = run_dir / f"{subset}.generate"
        if not generated.is_file():
            log(f"{system.name} seed {seed}: translating {subset}")
            run([SCRIPTS / "translate.sh", data_bin, test_checkpoint, run_dir / subset,
                 "--gen-subset", subset, *DECODING], run_dir / "translate.log")
        scores[subset] = bleu_scores(generated)

    counts = count_parameters(system.arch, flags, dict_size)
    result = {
        "system": system.name, "seed": seed, "arch": system.arch, "flags": flags,
        "params": counts["total"], "active_params": counts["active"],
        **training_stats(train_log.read_text()),
        "train_wall_seconds": wall,
        "train_wall_minutes": round(wall / 60, 2),
        "averaged": [p.name for p in inputs],
        "test_checkpoint": str(test_checkpoint),
        "valid_bleu": scores["valid"]["bleu"], "valid_sacrebleu": scores["valid"]["sacrebleu"],
        "test_bleu": scores["test"]["bleu"], "test_sacrebleu": scores["test"]["sacrebleu"],
        "test_multi_bleu": scores["test"]["multi_bleu"],
        "sacrebleu_signature": scores["test"]["sacrebleu_signature"],
        # training, averaging, translation and scoring (of the last invocation, if resumed)
        "run_wall_seconds": round(time.monotonic() - start, 1),
    }
    write_json(result_path, result)
    log(f"{system.name} seed {seed}: test BLEU {result['test_bleu']:.2f} "
        f"(sacreBLEU {result['test_sacrebleu']:.2f}), {result['updates']} updates")
    return result


# ------------------------------------------------------------------------------ reporting

METRICS = ("train_tokens_per_second", "train_wall_minutes", "updates", "epochs", "valid_bleu",
           "valid_sacrebleu", "test_bleu", "test_sacrebleu")


def summarize(system: System, runs: List[dict]) -> dict:
    """Mean and (with more than one seed) sample standard deviation of each metric."""
    summary = {"system": system.name, "label": system.label, "family": system.family,
               "arch": system.arch, "flags": runs[0]["flags"], "params": runs[0]["params"],
               "active_params": runs[0]["active_params"], "seeds": [r["seed"] for r in runs],
               "mean": {}, "std": {}, "runs": runs}
    for metric in METRICS:
        values = [r[metric] for r in runs if r.get(metric) is not None]
        if values:
            summary["mean"][metric] = statistics.fmean(values)
            summary["std"][metric] = statistics.stdev(values) if len(values) > 1 else None
    return summary


def _cell(summary, metric, digits):
    mean, std = summary["mean"].get(metric), summary["std"].get(metric)
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def markdown_table(summaries: List[dict]) -> str:
    lines = ["| system | params (M) | active (M) | updates | epochs | train tok/s | "
             "train wall (min) | valid BLEU | test BLEU | test sacreBLEU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        lines.append(
            f"| {s['system']}: {s['label']} | {s['params'] / 1e6:.2f} | "
            f"{s['active_params'] / 1e6:.2f} | {_cell(s, 'updates', 0)} | "
            f"{_cell(s, 'epochs', 2)} | {_cell(s, 'train_tokens_per_second', 0)} | "
            f"{_cell(s, 'train_wall_minutes', 1)} | {_cell(s, 'valid_bleu', 2)} | {_cell(s, 'test_bleu', 2)} | "
            f"{_cell(s, 'test_sacrebleu', 2)} |")
    return "\n".join(lines) + "\n"


def markdown_report(report: dict) -> str:
    config, machine = report["config"], report["machine"]
    seeds = config["seeds"]
    spread = " (mean ± sample std over seeds)" if seeds > 1 else ""
    signature = next((r["sacrebleu_signature"] for s in report["systems"] for r in s["runs"]),
                     "")
    usable = machine.get("usable_cpus", machine["cpus"])
    usable = f" ({usable} usable by the study)" if usable < machine["cpus"] else ""
    threads = machine["torch_threads"]
    threads = f"{threads} thread" + ("s" if threads != 1 else "")
    lines = [
        "# Multi30k En-De: width vs depth at equal parameters", "",
        f"Budget {config['budget_minutes']:g} min of training per system "
        f"(fairseq --stop-time-hours), {seeds} seed(s){spread}; data {config['data_tag']} "
        f"(BPE {BPE_MERGES} merges, joined dictionary of {config['dict_size']} types). "
        f"Machine: {machine['cpu']}, {machine['cpus']} CPUs{usable}, torch {machine['torch']} "
        f"with {threads}. Wall time of all runs (training, averaging, "
        f"translation, scoring): {report['runs_wall_seconds'] / 60:.1f} min.", "",
        markdown_table(report["systems"]),
        "BLEU: tokenized multi-bleu (`multipath-score`, no compound split) of the averaged last "
        f"checkpoints (up to {AVERAGE_LAST}, the final partial epoch included); sacreBLEU on "
        f"Moses-detokenized text, `{signature}`. Train tok/s: target tokens per second of "
        "training (fairseq's wps); train wall: the whole fairseq-train process.", "",
        "Systems and flags (shared: `" + " ".join(SHARED_MODEL + SHARED_RECIPE) + "`):", ""]
    for s in report["systems"]:
        own = s["flags"][len(SHARED_MODEL):]
        lines.append(f"- `{s['system']}`: `--arch {s['arch']} {' '.join(own)}`")
    return "\n".join(lines) + "\n"


FAMILY_STYLE = {"base": ("black", "o"), "deep": ("tab:blue", "s"), "wide": ("tab:gray", "D"),
                "multi-path": ("tab:red", "^"), "MoE-style": ("tab:green", "v")}


def plot(summaries: List[dict], path: Path) -> None:
    """BLEU vs parameters (the paper's Fig. 1): a line from the base model to each system."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7.5, 5))
    base = next((s for s in summaries if s["system"] == "base"), None)
    labelled = []  # points that (nearly) coincide get their labels stacked, not overprinted
    for s in summaries:
        colour, marker = FAMILY_STYLE[s["family"]]
        x, y = s["params"] / 1e6, s["mean"]["test_bleu"]
        if base is not None and s is not base:
            axes.plot([base["params"] / 1e6, x], [base["mean"]["test_bleu"], y], color=colour,
                      alpha=0.35, linewidth=1)
        axes.errorbar(x, y, yerr=s["std"].get("test_bleu"), color=colour, marker=marker,
                      markersize=7, capsize=3, linestyle="none")
        # labels of points closer than a label's size (0.05M, 0.5 BLEU) stack upwards
        stacked = sum(abs(x - lx) < 0.05 and abs(y - ly) < 0.5 for lx, ly in labelled)
        labelled.append((x, y))
        axes.annotate(s["system"], (x, y), textcoords="offset points",
                      xytext=(5, 4 + 10 * stacked), fontsize=8)
    for family, (colour, marker) in FAMILY_STYLE.items():
        if any(s["family"] == family for s in summaries):
            axes.plot([], [], color=colour, marker=marker, linestyle="none", label=family)
    axes.set_xlabel("parameters (M)")
    axes.set_ylabel("test BLEU, tokenized (Multi30k test 2016)")
    axes.set_title("Multi30k En-De, equal training time per system")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    figure.savefig(tmp, dpi=120)
    plt.close(figure)
    os.replace(tmp, path)


def machine_info() -> dict:
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
            "platform": platform.platform()}


# ------------------------------------------------------------------------------ main

def select_systems(names: Optional[str]) -> List[System]:
    if not names:
        return list(SYSTEMS)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SYSTEM_NAMES]
    if unknown:
        raise StudyError(f"unknown system(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(SYSTEM_NAMES)}")
    if "ewa" in wanted and "base" not in wanted:
        log("ewa takes its --max-update from the base model's run: adding base")
        wanted.append("base")
    return [s for s in SYSTEMS if s.name in wanted]


def write_reports(report: dict, results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    write_json(results / "study.json", report)
    tmp = results / "study.md.tmp"
    tmp.write_text(markdown_report(report))
    os.replace(tmp, results / "study.md")
    plot(report["systems"], results / "study.png")


def run_study(args) -> dict:
    """Prepare, run every system and seed, and rewrite the reports after each system (so an
    interrupted study leaves the table of the systems that finished)."""
    systems = select_systems(args.systems)
    results = Path(args.results)
    data_bin = prepare(Path(args.data), Path(args.work), args.max_train_lines,
                       args.max_eval_lines, args.workers)
    dict_size = dictionary_size(data_bin)
    flags = resolve_flags(systems, dict_size)
    runs_root = data_bin.parent / f"runs-{args.budget_minutes:g}min"
    report = {
        "config": {"budget_minutes": args.budget_minutes, "seeds": args.seeds,
                   "systems": [s.name for s in systems], "data": str(args.data),
                   "data_tag": data_bin.parent.name, "max_train_lines": args.max_train_lines,
                   "max_eval_lines": args.max_eval_lines, "dict_size": dict_size,
                   "bpe_merges": BPE_MERGES, "shared_model": SHARED_MODEL,
                   "shared_recipe": SHARED_RECIPE, "decoding": DECODING},
        "machine": machine_info(),
        "runs_wall_seconds": 0.0,
        "systems": [],
    }
    for system in systems:
        runs = [run_system(system, flags[system.name], seed, data_bin,
                           runs_root / system.name / f"seed{seed}", args.budget_minutes,
                           dict_size, runs_root)
                for seed in range(1, args.seeds + 1)]
        report["systems"].append(summarize(system, runs))
        report["runs_wall_seconds"] = round(report["runs_wall_seconds"] + sum(
            r["run_wall_seconds"] for r in runs), 1)
        write_reports(report, results)
    log(f"wrote {results}/study.md, study.json and study.png")
    return report


def _positive_float(value):
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def get_parser():
    parser = argparse.ArgumentParser(prog="study.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--budget-minutes", type=_positive_float, default=8.0,
                        help="training time per system and seed (default 8: the 9 systems, "
                             "preparation and decoding take about 90 minutes on 2 cores)")
    parser.add_argument("--seeds", type=positive_int, default=1,
                        help="runs per system with seeds 1..N; the table shows mean and spread")
    parser.add_argument("--data", default=os.environ.get("MULTI30K_DIR", "data/multi30k"),
                        help="folder with Multi30k's train/val/test_2016_flickr.{en,de}[.gz] "
                             "(default: $MULTI30K_DIR or data/multi30k)")
    parser.add_argument("--work", default="work/multi30k",
                        help="prepared data, checkpoints and translations (default: "
                             "work/multi30k)")
    parser.add_argument("--results", default="results/multi30k",
                        help="where study.md, study.json and study.png go "
                             "(default: results/multi30k)")
    parser.add_argument("--systems", help=f"comma-separated subset of {', '.join(SYSTEM_NAMES)}")
    parser.add_argument("--max-train-lines", type=positive_int,
                        help="only the first N training pairs (quick runs and tests)")
    parser.add_argument("--max-eval-lines", type=positive_int,
                        help="only the first N valid and test pairs (quick runs and tests)")
    parser.add_argument("--workers", type=positive_int, default=2,
                        help="processes for data preparation (default 2)")
    return parser


def cli_main(argv=None):
    args = get_parser().parse_args(argv)
    try:
        run_study(args)
    except StudyError as err:
        sys.exit(f"study: error: {err}")


if __name__ == "__main__":
    cli_main()
