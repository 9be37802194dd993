"""The Multi30k study's runs (see study.py): fairseq-train and fairseq-generate as subprocesses
with the recipe of scripts/train.sh and scripts/translate.sh, what their logs say, the averaged
checkpoints, the scores, the copy of each finished run kept with the results, and the device and
machine they run on.
"""
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from study_statistics import plateau
from study_systems import (
    AVERAGE_LAST, DECODING, DEFAULT_TARGET, SHARED_RECIPE, Budget, StudyError, System,
    count_parameters, log,
)

from multipath_nmt import averaging, recipe, scoring
from multipath_nmt.atomic_files import write_atomically, write_text_atomically
from multipath_nmt.checkpoint_io.reading import read_checkpoint
from multipath_nmt.ewa.folding import convert_ewa_checkpoint

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


# the line that :func:`run` writes before each command's output in its log, and that
# :func:`logged_training_seconds` splits a resumed run's log at
COMMAND_HEADER = "$ "


def run(command: recipe.Command, log_path: Path, stdout: Optional[Path] = None) -> float:
    """Run ``command`` with its notes and its output appended to ``log_path`` (its standard
    output to ``stdout`` when given); seconds taken; StudyError on failure."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with open(log_path, "a") as out:
        out.write(f"\n{COMMAND_HEADER}{' '.join(command.argv)}\n")
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


_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) \|", re.MULTILINE)


def logged_training_seconds(log_text: str) -> Tuple[float, int]:
    """Seconds of training in the invocations that ``train.log`` already holds (:func:`run`
    starts each with a :data:`COMMAND_HEADER` line), each from its first to its last timestamped
    fairseq line (an invocation killed at a session's end included), and how many there were."""
    seconds, invocations = 0.0, 0
    for segment in re.split("^" + re.escape(COMMAND_HEADER), log_text, flags=re.MULTILINE)[1:]:
        invocations += 1
        stamps = _LOG_TIME.findall(segment)
        if stamps:
            first, last = (time.mktime(time.strptime(s, "%Y-%m-%d %H:%M:%S"))
                           for s in (stamps[0], stamps[-1]))
            seconds += last - first
    return seconds, invocations


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


def run_folder(root: Path, system: str, seed: int) -> Path:
    """The folder of one system's run with one seed under ``root`` (a runs folder of --work, or
    its copy beside the results)."""
    return root / system / f"seed{seed}"


def run_system(system: System, flags: List[str], seed: int, data_bin: Path, run_dir: Path,
               budget: Budget, dict_size: int, runs_root: Path, device: str = "cpu",
               target: str = DEFAULT_TARGET, compile_layers: Optional[str] = None) -> dict:
    """Train, average, (fold EWA), translate valid and test, score; returns the result record.
    A finished run (``result.json``) is read back instead of rerun. ``compile_layers``: train
    with ``--compile-layers BACKEND`` (the same updates; compiled kernels round differently)."""
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
        base = json.loads((run_folder(runs_root, "base", seed) / "result.json").read_text())
        extra = ["--max-update", str(base["updates"])]
    if compile_layers:
        extra += ["--compile-layers", compile_layers]
    earlier = 0.0
    if not train_done.is_file():
        log(f"{system.name} seed {seed}: training ({budget.describe()}) on {device} -> "
            f"{save_dir}")
        command = train_command(system.arch, [*flags, *SHARED_RECIPE, *budget.training_flags(),
                                              "--seed", str(seed), *extra],
                                data_bin, save_dir, device)
        # a run resumed from checkpoint_last.pt (a study stopped part-way) counts the time of
        # its earlier invocations too, read from their log lines
        earlier, resumed = (logged_training_seconds(train_log.read_text())
                            if train_log.is_file() else (0.0, 0))
        started = utc_now()
        seconds = run(command, train_log)
        write_json(train_done, {"wall_seconds": round(earlier + seconds, 1),
                                "invocations": resumed + 1, "flags": flags,
                                "compile_layers": compile_layers,
                                "environment": run_environment(device, command.argv, started)})
    done = json.loads(train_done.read_text())
    wall = done["wall_seconds"]

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
        # training, averaging, translation and scoring; for a resumed run this invocation's and
        # the training of the earlier ones
        "run_wall_seconds": round(time.monotonic() - start + earlier, 1),
        # where, with what and when it trained (None: trained before runs recorded it)
        "environment": done.get("environment"),
        "finished_utc": utc_now(),
    }
    write_json(result_path, result)
    log(f"{system.name} seed {seed}: test BLEU {result['test_bleu']:.2f} "
        f"(sacreBLEU {result['test_sacrebleu']:.2f}, chrF {result['test_chrf']:.2f}), "
        f"{result['updates']} updates")
    return result


# What the report needs of a finished run, copied beside the results (``--results``/runs/): its
# record and its fairseq-generate outputs, gzipped and without the per-token scores (P- lines,
# which no report reads, half the bytes): about 180 kB a run. A study resumed on another machine
# or from a fresh clone reads the run back instead of training it again, and anyone can recompute
# the tests against deep from the committed files. Checkpoints stay in ``--work``.
ARCHIVED_FILES = ("result.json", "train.done.json")
ARCHIVED_TRANSLATIONS = ("valid.generate", "test.generate")
POSITIONAL_SCORES = b"P-"


def archive_run(run_dir: Path, archive_dir: Path) -> bool:
    """Copy a finished run's record and translations (``run_dir/result.json`` present) to
    ``archive_dir``, the generate outputs without P- lines, gzipped with a fixed timestamp (the
    same run gives the same bytes); False, and nothing written, for an unfinished run."""
    if not (run_dir / "result.json").is_file():
        return False
    archive_dir.mkdir(parents=True, exist_ok=True)
    for name in ARCHIVED_FILES:
        write_text_atomically(archive_dir / name, (run_dir / name).read_text())
    for name in ARCHIVED_TRANSLATIONS:
        lines = (run_dir / name).read_bytes().splitlines(keepends=True)
        data = gzip.compress(b"".join(line for line in lines
                                      if not line.startswith(POSITIONAL_SCORES)), mtime=0)
        write_atomically(archive_dir / f"{name}.gz", lambda out: out.write(data))
    return True


def restore_run(archive_dir: Path, run_dir: Path) -> bool:
    """Put an archived run (:func:`archive_run`) back into ``run_dir``, which has no finished run,
    so that :func:`run_system` reads it back; False when there is nothing to restore. The record
    goes last: a restore cut short leaves no ``result.json`` and the run is redone."""
    if (run_dir / "result.json").is_file() or not (archive_dir / "result.json").is_file():
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ARCHIVED_TRANSLATIONS:
        with gzip.open(archive_dir / f"{name}.gz", "rb") as source:
            write_atomically(run_dir / name, lambda out: shutil.copyfileobj(source, out))
    for name in reversed(ARCHIVED_FILES):
        write_text_atomically(run_dir / name, (archive_dir / name).read_text())
    log(f"{run_dir}: restored from {archive_dir}")
    return True


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def training_precision(argv: Sequence[str]) -> str:
    """The precision a fairseq-train command line trains in (train.sh's flags)."""
    if "--amp" in argv:
        return "bf16 autocast (--amp --bf16)" if "--bf16" in argv else "fp16 autocast (--amp)"
    for flag in ("--memory-efficient-bf16", "--memory-efficient-fp16", "--bf16", "--fp16"):
        if flag in argv:
            return flag.lstrip("-")
    return "fp32"


def code_commit() -> Optional[str]:
    """The checkout's commit, "+dirty" when tracked files differ from it; None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_environment(device: str, argv: Sequence[str], started: str) -> dict:
    """What a run record keeps of where and how it trained: the machine (CPU, GPU), torch, the
    training precision, when training started and ended (UTC) and the code's commit."""
    machine = machine_info(device)
    return {"cpu": machine["cpu"], "gpu": machine["gpu"], "device": device,
            "torch": machine["torch"], "python": machine["python"],
            "precision": training_precision(argv), "started_utc": started,
            "ended_utc": utc_now(), "commit": code_commit()}


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
