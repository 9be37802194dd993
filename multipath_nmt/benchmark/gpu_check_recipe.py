"""The GPU check's recipe leg (see :mod:`multipath_nmt.benchmark.gpu_check`): the fairseq-train
command that ``scripts/train.sh --dry-run`` prints for one GPU (or for the CPU), run as it is, a
real fairseq-train process with its epoch loop, validation and checkpoint saves, then resumed.

The per-family table trains in-process through ``systems.build_trainer_from_argv`` with
``--update-freq 2``; a real run on one GPU is train.sh's own command, with ``--update-freq 8``
(base) or ``16`` (deep, multi-path), started by fairseq-train. This leg runs that command. For
each system it asks ``scripts/train.sh DATA SAVE --arch A --precision P --max-update K
--dry-run`` (a subprocess: whatever recipe.py does inside, the printed command is the one
train.sh would exec) and changes only what :data:`CHANGED_FLAGS` lists: the data-bin (synthetic
train and valid splits), the model size (the check's), ``--max-tokens`` (smaller micro-batches,
the same ``--update-freq``, so that an update stays cheap), ``--max-update``,
``--warmup-updates``, ``--save-interval-updates`` and ``--validate-interval-updates`` (a save and
a validation inside the run), ``--seed`` and the JSON log of every update. ``--update-freq``,
the precision flags, the optimizer, learning rate and criterion stay train.sh's.

Each precision (train.sh's, then fp32) is a chain of two processes in one save dir: ``K``
updates, then the same command with ``--max-update 2K``, which must load ``checkpoint_last.pt``
at update ``K`` (fairseq's "Loaded checkpoint ... (epoch E @ K updates)") and log updates K+1 to
2K. The chains are independent, so they run side by side (``jobs``): each fairseq-train process
spends its first seconds importing (about 5 s on an H200, docs/bench/gpu-check-recipe-h200.json),
which overlaps. The mixed-precision
loss passes as in the per-family table: its last loss within ``MAX_GAP_OF_FALL`` of the loss
fall that fp32 reached over the same updates (same seed, same data order).
"""
import concurrent.futures
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from multipath_nmt import recipe
from multipath_nmt.benchmark.gpu_check_ddp import (
    synthetic_pairs, write_split, write_synthetic_train_split,
)
from multipath_nmt.benchmark.gpu_check_setup import CPU_STAND_INS, STOCK, model_flags
from multipath_nmt.benchmark.gpu_check_training import compare_losses

# The systems the leg runs by default: the yardstick and the deep recipe's multi-path model
# (update-freq 8 and 16 on one GPU). Every family can run (--recipe-systems all); its time on a
# GPU is not measured.
RECIPE_SYSTEMS = (STOCK, "multi-path L x 4 (full)")
TRAIN_SH = os.path.join(os.path.dirname(recipe.USER_DIR), "scripts", "train.sh")
# What the leg changes in train.sh's command, and nothing else (the tests hold it to this): the
# data-bin (the positional argument), the model-size flags of ``gpu_check_setup.model_flags``
# (appended), a CPU stand-in precision flag where asked (``CPU_STAND_INS``, appended), and these.
CHANGED_FLAGS = ("--max-tokens", "--max-update", "--warmup-updates", "--save-interval-updates",
                 "--validate-interval-updates", "--seed", "--log-format", "--log-interval")
PRECISION_FLAGS = ("--amp", "--bf16", "--fp16", "--memory-efficient-fp16",
                   "--memory-efficient-bf16", "--cpu")
_LOADED = re.compile(r"Loaded checkpoint (?P<path>\S+) \(epoch (?P<epoch>\d+) @ "
                     r"(?P<updates>\d+) updates\)")
_JSON_LINE = re.compile(r"\| (?P<tag>train_inner|valid) \| (?P<body>\{.*\})\s*$")


class RecipeLegError(RuntimeError):
    """train.sh refused or printed no command (the message says what it printed)."""


def flag_value(argv, flag):
    """A flag's value as fairseq reads it (the last occurrence wins); None when absent."""
    values = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]
    return values[-1] if values else None


def set_flag(argv, flag, value):
    """``argv`` with every value of ``flag`` replaced by ``value``, or ``flag value`` appended
    where the command has none."""
    out = list(argv)
    found = False
    for i, word in enumerate(out[:-1]):
        if word == flag:
            out[i + 1], found = str(value), True
    return out if found else [*out, flag, str(value)]


def train_sh_dry_run(data_bin, save_dir, arch, precision, gpus, updates, bf16=None,
                     python=sys.executable):
    """The fairseq-train argv that ``scripts/train.sh ... --dry-run`` prints for ``gpus`` GPUs
    (0: the CPU) in ``precision`` (train.sh's: bf16, fp16 or fp32), ``updates`` long."""
    env = dict(os.environ, PYTHON=python, MULTIPATH_NMT_NUM_GPUS=str(gpus))
    if bf16 is not None:
        env["MULTIPATH_NMT_BF16"] = str(int(bf16))
    words = ["bash", TRAIN_SH, str(data_bin), str(save_dir), "--arch", arch, "--precision",
             precision, "--max-update", str(updates), "--dry-run"]
    proc = subprocess.run(words, capture_output=True, text=True, env=env, timeout=120)
    commands = [line[len("train.sh: "):] for line in proc.stdout.splitlines()
                if line.startswith("train.sh: ") and " -m fairseq_cli.train " in line]
    if proc.returncode != 0 or not commands:
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise RecipeLegError(f"{shlex.join(words)} exited with {proc.returncode} and printed "
                             f"no fairseq-train command: {said[-1] if said else '(nothing)'}")
    return shlex.split(commands[-1])


def leg_command(dry_run, data_bin, size, system, updates, extra=()):
    """train.sh's command (``dry_run``) with the leg's changes (:data:`CHANGED_FLAGS`, the
    data-bin, the model size, ``extra``), ``updates`` long."""
    if dry_run[1:3] != ["-m", "fairseq_cli.train"]:
        raise RecipeLegError(f"not a fairseq-train command: {shlex.join(dry_run[:4])} ...")
    argv = [*dry_run[:3], str(data_bin), *dry_run[4:]]
    interval = size["recipe_interval"]
    for flag, value in (("--max-tokens", size["recipe_max_tokens"]), ("--max-update", updates),
                        ("--warmup-updates", size["recipe_lr_warmup_updates"]),
                        ("--save-interval-updates", interval),
                        ("--validate-interval-updates", interval), ("--seed", 1),
                        ("--log-format", "json"), ("--log-interval", 1)):
        argv = set_flag(argv, flag, value)
    return [*argv, *model_flags(size, system), *extra]


def run_fairseq_train(argv, log_path, timeout):
    """Run one fairseq-train command, its output into ``log_path``; its exit status (None when
    it ran past ``timeout`` seconds and was killed). The tests replace this."""
    with open(log_path, "w") as log:
        try:
            return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def read_run_log(log_path):
    """What one fairseq-train log says: (update, loss) of every update, (update, valid loss) of
    every validation, the epochs trained in, and the checkpoint it loaded (path, epoch, update;
    None for a fresh start)."""
    losses, valid, epochs, loaded = [], [], set(), None
    with open(log_path, errors="replace") as log:
        for line in log:
            match = _LOADED.search(line)
            if match:
                loaded = dict(path=match["path"], epoch=int(match["epoch"]),
                              updates=int(match["updates"]))
                continue
            match = _JSON_LINE.search(line)
            if not match:
                continue
            try:
                stats = json.loads(match["body"])
            except ValueError:
                continue
            prefix = "" if match["tag"] == "train_inner" else "valid_"
            if prefix + "loss" not in stats or prefix + "num_updates" not in stats:
                continue
            point = (int(float(stats[prefix + "num_updates"])), float(stats[prefix + "loss"]))
            (losses if match["tag"] == "train_inner" else valid).append(point)
            if "epoch" in stats:
                epochs.add(int(stats["epoch"]))
    return dict(losses=sorted(losses), valid=sorted(valid), epochs=sorted(epochs),
                loaded=loaded)


def run_one(argv, save_dir, name, timeout):
    """One fairseq-train process and what its log says (plus its command, exit status and
    seconds; the end of its output where it failed)."""
    log_path = os.path.join(save_dir, f"{name}.log")
    start = time.perf_counter()
    status = run_fairseq_train(argv, log_path, timeout)
    result = dict(command=shlex.join(argv), exit_status=status,
                  seconds=time.perf_counter() - start)
    result.update(read_run_log(log_path))
    if status != 0:
        with open(log_path, errors="replace") as log:
            result["output_tail"] = log.read()[-3000:]
    return result


def run_chain(argv, updates, timeout):
    """``argv`` (``updates`` long) in a fresh save dir, then resumed to twice as many updates
    (the same command, ``--max-update`` doubled): both runs' results."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-recipe-") as save_dir:
        argv = set_flag(argv, "--save-dir", save_dir)
        first = run_one(argv, save_dir, "run", timeout)
        resume = (run_one(set_flag(argv, "--max-update", 2 * updates), save_dir, "resume",
                          timeout) if first["exit_status"] == 0 else None)
    return dict(run=first, resume=resume)


def _ended(run):
    """How a failed run ended, for its row."""
    if run["exit_status"] is None:
        return f"ran past its time limit and was killed after {run['seconds']:.0f} s"
    return f"exited with {run['exit_status']}"


def chain_failures(chain, updates, label):
    """What one chain fails: exit statuses, a validation in each run, the resume from
    checkpoint_last.pt at update ``updates`` and continuing to twice that."""
    first, resume = chain["run"], chain["resume"]
    if resume is None:
        return [f"{label} run {_ended(first)} (not resumed)"]
    failed = []
    for name, run in (("run", first), ("resume", resume)):
        if run["exit_status"] != 0:
            failed.append(f"{label} {name} {_ended(run)}")
        elif not run["valid"]:
            failed.append(f"{label} {name}: no validation in its log")
    if first["exit_status"] == 0 and (not first["losses"] or first["losses"][-1][0] != updates):
        failed.append(f"{label} run: its last logged update is not {updates}")
    loaded = resume["loaded"]
    if resume["exit_status"] == 0:
        if not loaded or os.path.basename(loaded["path"]) != "checkpoint_last.pt" \
                or loaded["updates"] != updates:
            failed.append(f"{label} resume did not start from checkpoint_last.pt at update "
                          f"{updates} (loaded: {loaded})")
        updates_logged = [u for u, _ in resume["losses"]]
        if updates_logged[:1] != [updates + 1] or updates_logged[-1:] != [2 * updates]:
            failed.append(f"{label} resume logged updates {updates_logged[:1]} to "
                          f"{updates_logged[-1:]}, not {updates + 1} to {2 * updates}")
    return failed


def chain_losses(chain):
    """Every update's loss over both runs, in update order."""
    resumed = chain["resume"]["losses"] if chain["resume"] else []
    return [loss for _, loss in sorted(chain["run"]["losses"] + resumed)]


def updates_per_epoch(dataset, max_tokens, update_freq):
    """How many updates one epoch of ``dataset`` makes in fairseq-train: its batches by
    ``max_tokens`` (fairseq's ``batch_by_size``, its default --required-batch-size-multiple 8)
    over ``update_freq``."""
    from fairseq.data import data_utils

    batches = data_utils.batch_by_size(dataset.ordered_indices(), dataset.num_tokens,
                                       max_tokens=max_tokens, required_batch_size_multiple=8)
    return math.ceil(len(batches) / update_freq)


def epoch_sized_pairs(folder, languages, size, update_freq, updates):
    """Synthetic sentence pairs whose epoch at ``update_freq`` ends about half-way between
    update ``updates`` and ``2 * updates`` (so that the resume starts inside an epoch and crosses
    its end), and that epoch's length in updates."""
    target = updates + max(1, updates // 2)
    sentences = math.ceil(target * update_freq * size["recipe_max_tokens"] / size["mean_length"])
    for _ in range(4):  # the batches' fill depends on the lengths drawn: scale and count again
        pairs = synthetic_pairs(folder, languages, sentences, size["mean_length"])
        epoch = updates_per_epoch(pairs, size["recipe_max_tokens"], update_freq)
        if epoch == target:
            break
        sentences = max(1, round(sentences * (target - 0.5 + (epoch < target)) / epoch))
    return pairs, epoch


@contextlib.contextmanager
def recipe_data(data, dictionaries, size, updates, languages=("src", "tgt")):
    """A function: update-freq -> (the data-bin the leg trains on, the updates of its epoch;
    None: not known). ``data`` (a user's data-bin) whatever the update-freq; else synthetic
    train and valid splits beside a copy of the ``dictionaries`` folder's dict files, the train
    split :func:`epoch_sized_pairs`, so that a chain crosses an epoch's end (fairseq's
    end-of-epoch validation and save) and resumes inside an epoch (its iterator's position)."""
    if data:
        yield lambda update_freq: (data, None)
        return
    made = {}
    with contextlib.ExitStack() as stack:
        def for_update_freq(update_freq):
            if update_freq not in made:
                folder = stack.enter_context(tempfile.TemporaryDirectory(
                    prefix="gpu-check-recipe-data-"))
                for name in os.listdir(dictionaries):
                    if name.startswith("dict."):
                        shutil.copy(os.path.join(dictionaries, name), folder)
                pairs, epoch = epoch_sized_pairs(folder, languages, size, update_freq, updates)
                write_split(folder, languages, pairs)
                write_synthetic_train_split(folder, languages, size["recipe_valid_sentences"],
                                            size["mean_length"], seed=4, split="valid")
                made[update_freq] = folder, epoch
            return made[update_freq]

        yield for_update_freq


def system_commands(system, size, precision, gpus, dictionaries, data_for, bf16=None):
    """The leg's commands of one system, train.sh's precision and fp32 (none where that is
    fp32): precision -> (train.sh's dry-run argv, the leg's argv)."""
    base, extra = CPU_STAND_INS.get(precision, (precision, []))
    updates = size["recipe_updates"]
    commands = {}
    for name, asked, more in ((precision, base, extra), ("fp32", "fp32", [])):
        if name in commands:
            continue
        with tempfile.TemporaryDirectory(prefix="gpu-check-recipe-dry-") as save_dir:
            dry_run = train_sh_dry_run(dictionaries, save_dir, system.arch, asked, gpus,
                                       updates, bf16)
        data_bin, epoch = data_for(int(flag_value(dry_run, "--update-freq") or 1))
        commands[name] = (dry_run, leg_command(dry_run, data_bin, size, system, updates, more),
                          epoch)
    return commands


def summarize(system_name, commands, chains, precision, updates):
    """One system's row: its commands, both chains, the gap to fp32 and what failed."""
    dry_run, argv, epoch = commands[precision]
    row = dict(dry_run_command=shlex.join(dry_run), command=shlex.join(argv),
               updates_per_epoch=epoch,
               update_freq=flag_value(argv, "--update-freq"),
               max_tokens=flag_value(argv, "--max-tokens"),
               precision_flags=[w for w in argv if w in PRECISION_FLAGS],
               updates=updates, chains=chains, failed_checks=[])
    for name, chain in chains.items():
        row["failed_checks"] += chain_failures(chain, updates, name)
    losses = chain_losses(chains[precision])
    row["losses"] = losses
    row["losses_finite"] = bool(losses) and all(map(math.isfinite, losses))
    row["loss_fell"] = len(losses) > 1 and losses[-1] < losses[0]
    if losses and not row["losses_finite"]:
        row["failed_checks"].append("a loss was not finite")
    elif losses and not row["loss_fell"]:
        row["failed_checks"].append("the loss did not fall")
    if precision != "fp32":
        fp32 = chain_losses(chains["fp32"])
        if losses and fp32:
            versus = row["vs_fp32"] = compare_losses(losses, fp32)
            if not versus["passed"]:
                row["failed_checks"].append(
                    "fp32's loss did not fall" if versus["gap_share_of_fp32_fall"] is None
                    else f"the last loss is {versus['gap']:+.3f} from fp32's "
                         f"({100 * versus['gap_share_of_fp32_fall']:.0f}% of its fall)")
    return row


def recipe_leg(names, systems, size, precision, device, dictionaries, data=None,
               languages=("src", "tgt"), jobs=None, bf16=None, log=print):
    """The leg for the systems ``names`` (of ``systems``): per system its row (see
    :func:`summarize`) or ``{"error": ...}``; with the seconds the leg took."""
    start = time.perf_counter()
    gpus = int(device == "cuda")
    updates = size["recipe_updates"]
    by_name = {s.name: s for s in systems}
    rows, commands = {}, {}
    with recipe_data(data, dictionaries, size, updates, languages) as data_for:
        for name in names:
            try:
                commands[name] = system_commands(by_name[name], size, precision, gpus,
                                                 dictionaries, data_for, bf16)
            except (RecipeLegError, recipe.RecipeError, OSError, ValueError) as error:
                rows[name] = {"error": f"{type(error).__name__}: {error}"}
        chains = [(name, label, argv) for name, per in commands.items()
                  for label, (_, argv, _) in per.items()]
        # side by side: the processes' start-ups (imports, mostly) overlap; on the CPU as many
        # as there are cores (the tiny size's processes are import-bound)
        jobs = jobs or min(len(chains), 64 if device == "cuda" else os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {(name, label): pool.submit(run_chain, argv, updates,
                                                   size["recipe_timeout"])
                       for name, label, argv in chains}
            done = {}
            for key, future in futures.items():
                try:
                    done[key] = future.result()
                except Exception as error:  # noqa: BLE001 a chain that broke is a finding; report the rest
                    done[key] = error
    for name, per in commands.items():
        broken = [f"{label}: {type(done[name, label]).__name__}: {done[name, label]}"
                  for label in per if isinstance(done[name, label], Exception)]
        if broken:
            rows[name] = {"error": "; ".join(broken)}
            log(f"recipe leg, {name}: {rows[name]['error']}")
            continue
        rows[name] = summarize(name, per, {label: done[name, label] for label in per},
                               precision, updates)
        rows[name]["seconds"] = max(
            c["run"]["seconds"] + (c["resume"]["seconds"] if c["resume"] else 0)
            for c in rows[name]["chains"].values())
        log(f"recipe leg, {name}: {json.dumps(rows[name]['failed_checks'])}")
    return dict(systems={name: rows[name] for name in names}, updates=updates, interval=size["recipe_interval"],
                max_tokens=size["recipe_max_tokens"],
                lr_warmup_updates=size["recipe_lr_warmup_updates"], jobs=jobs,
                gpus=gpus, seconds=time.perf_counter() - start)
