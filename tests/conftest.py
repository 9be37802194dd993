"""Shared fixtures: a tiny binarized corpus, fairseq CLI runners, models trained once per session
for every module that only reads them, the optional Multi30k data.

Slow tests: trainings, end-to-end runs of fairseq or the scripts, full-size models. A test is slow
when it carries the ``slow`` mark (``@pytest.mark.slow`` or its module's ``pytestmark``);
``make test-fast`` leaves those out. A fixture that trains says so by requesting the fixture
:func:`trains`; every test that uses it, directly or through other fixtures, then gets the mark
at collection (from pytest's public ``item.fixturenames``: no list of names to keep up to date, a
renamed fixture keeps its mark). It cannot fail open silently: a test without the mark that
trains through the suite's runners (``run_fairseq("train", ...)``, ``helpers.training.run``)
fails with a line that says to mark it or its fixture (:func:`fail_unless_marked_slow`); in
``make test-fast`` that catches any training fixture that forgot ``trains``.
"""
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from helpers import in_process
from helpers.processes import run_subprocess

ROOT = Path(__file__).resolve().parents[1]
USER_DIR = ROOT / "multipath_nmt"
MULTI30K = Path(os.environ.get("MULTI30K_DIR", ROOT.parent / "shared" / "data" / "multi30k"))

# Model dimensions small enough for a few CPU updates in about a second.
TINY_MODEL = [
    "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
    "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
    "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
    "--encoder-layers", "2", "--decoder-layers", "1",
]
TRAIN_FLAGS = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.997)", "--lr", "0.001",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "400", "--share-all-embeddings", "--seed", "1",
    "--cpu", "--no-progress-bar", "--log-interval", "1", "--log-format", "simple",
    "--num-workers", "0", "--disable-validation",
]


def clean_env(**extra):
    """The environment a user has: none of our variables, the venv's console scripts on the
    ``PATH`` (as an activated venv has them), single-threaded for determinism."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIPATH_NMT_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update(extra)
    return env


def script_env(**extra):
    """:func:`clean_env` for a script (``scripts/*.sh``): this interpreter as its ``PYTHON`` and
    as the interpreter of torchrun's workers (torchrun's ``PYTHON_EXEC``)."""
    return clean_env(PYTHON=sys.executable, PYTHON_EXEC=sys.executable, **extra)


def _resolved(args, env):
    """``args`` with a command given by name (``multipath-score``) as the path ``PATH`` finds."""
    if os.sep not in args[0]:
        args = [shutil.which(args[0], path=env.get("PATH")) or args[0], *args[1:]]
    return args


def run_command(args, env=None, cwd=None, timeout=600, merge_stderr=False):
    """``subprocess.run(args)`` with text output (stderr in stdout with ``merge_stderr``), for a
    test marked ``process``. A timeout kills the command and everything it started, then raises
    ``subprocess.TimeoutExpired``."""
    fail_unless_marked_process(args)
    args, env = [str(a) for a in args], env or clean_env()
    return run_subprocess(_resolved(args, env), env, cwd=cwd, timeout=timeout,
                          merge_stderr=merge_stderr)


def start_command(args, env=None):
    """``subprocess.Popen(args, stdout=PIPE, stderr=STDOUT, text=True)`` for a command that the
    test reads while it runs, signals or kills (``pid``, ``stdout``, ``wait()``,
    ``returncode``), for a test marked ``process``."""
    fail_unless_marked_process(args)
    args, env = [str(a) for a in args], env or clean_env()
    return subprocess.Popen(_resolved(args, env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def _checked(proc, command, check):
    """``proc``; with ``check``, fail the test with its output unless it exited 0."""
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, command))} exited {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def run_cli(args, check=True, env=None, cwd=None, timeout=600):
    """Run a command; on an unexpected exit code fail with its output."""
    return _checked(run_command(args, env=env, cwd=cwd, timeout=timeout), args, check)


def run_tool(name, *args, check=True, env=None):
    """The console script ``name`` (``multipath-score``) with ``args``, in this process
    (:func:`helpers.in_process.console_script`; ``env``: variables set for the run); on an
    unexpected exit code fail with its output."""
    return _checked(in_process.console_script(name, args, env=env), [name, *args], check)


def run_fairseq(tool, *args, check=True, env=None, user_dir=True):
    """``fairseq-<tool> ARGS... --user-dir multipath_nmt`` (without the flag for
    ``user_dir=False``) through fairseq's ``cli_main`` in this process
    (:func:`helpers.in_process.fairseq`; ``env``: variables set for the run); on an unexpected
    exit code fail with its output."""
    args = [*args, "--user-dir", USER_DIR] if user_dir else list(args)
    proc = _checked(in_process.fairseq(tool, args, env=env), [f"fairseq-{tool}", *args], check)
    if tool == "train":
        fail_unless_marked_slow(proc.stdout + proc.stderr, "fairseq-train")
    return proc


def generate_hypotheses(data_bin, checkpoint, beam, *args):
    """fairseq-generate's best hypothesis (tokens) of each test sentence of ``data_bin``, in the
    order of the test set; ``args``: more fairseq-generate options."""
    output = run_fairseq("generate", data_bin, "--path", checkpoint, "--gen-subset", "test",
                         "--beam", str(beam), "--batch-size", "16", "--cpu",
                         "--no-progress-bar", *args).stdout
    found = {}
    for line in output.splitlines():
        if line.startswith("H-"):
            number, _, text = line.split("\t")
            found[int(number[2:])] = text.split()
    return [found[i] for i in range(len(found))]


# --- slow tests (see the module docstring) --------------------------------------------------

# A fairseq log line after an update: ``num_updates=3`` (train_inner) or ``| num_updates 3``.
UPDATES_LOGGED = re.compile(r"\bnum_updates[= ]([1-9]\d*)\b")
_running = []  # the test being set up, run or torn down


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def fail_unless_marked_slow(output, what):
    """Fail the running test if it is not marked slow and ``output`` (of ``what``) shows updates:
    a training that would otherwise slip into ``make test-fast`` unnoticed."""
    item = _running[-1] if _running else None
    if item is None or item.get_closest_marker("slow") or not UPDATES_LOGGED.search(output):
        return
    pytest.fail(f"{item.nodeid} trains ({what}) but is not marked slow: add @pytest.mark.slow, "
                "or have the fixture that trains request the `trains` fixture", pytrace=False)


def fail_unless_marked_process(args):
    """Fail the running test if it starts ``args`` in its own body without the ``process`` mark:
    library behaviour is tested in-process (:mod:`helpers.in_process`); a process is started
    where it is the point (signals, kill -9, torchrun, the patches off, a fresh interpreter, a
    script's own logic). Fixtures may start processes for the tests that use them."""
    item = _running[-1] if _running else None
    if item is None or _phase.get(item.nodeid) != "call" or item.get_closest_marker("process"):
        return
    pytest.fail(f"{item.nodeid} starts {' '.join(map(str, args))[:120]} but is not marked "
                "process: call the library in-process (tests/helpers/in_process.py), or add "
                "@pytest.mark.process where the process is the point", pytrace=False)


_phase = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _phase[item.nodeid] = "call"
    try:
        yield
    finally:
        _phase.pop(item.nodeid, None)


@pytest.fixture(scope="session")
def trains():
    """Requested by every fixture that trains: the tests using that fixture are marked slow."""


@pytest.hookimpl(tryfirst=True)  # before ``-m "not slow"`` deselects
def pytest_collection_modifyitems(items):
    for item in items:
        if "trains" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def write_toy_parallel(folder, n_train=300, n_valid=40, seed=0):
    """A learnable toy pair: the target is the reversed source with a word-level mapping."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(40)]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        with open(folder / f"{split}.en", "w") as src, open(folder / f"{split}.de", "w") as tgt:
            for _ in range(n):
                words = [rng.choice(vocab) for _ in range(rng.randint(3, 9))]
                src.write(" ".join(words) + "\n")
                tgt.write(" ".join("x" + w[1:] for w in reversed(words)) + "\n")
    return folder


def dictionaries_only_data_bin(folder, src, tgt, joined):
    """A data-bin with just its dictionaries (one joined, or two different) and a train index:
    what the recipe reads to choose the embedding sharing."""
    folder.mkdir()
    (folder / f"dict.{src}.txt").write_text("a 3\nb 2\n")
    (folder / f"dict.{tgt}.txt").write_text("a 3\nb 2\n" if joined else "c 3\n")
    (folder / f"train.{src}-{tgt}.{src}.idx").write_bytes(b"")
    return folder


def built_once(tmp_path_factory, name, build):
    """The folder ``name`` after ``build(folder)`` filled it, once for the whole run: under
    pytest-xdist (``make test``) the first worker to ask builds it and the others wait for it and
    read it, instead of each training the same model. A build that failed is started afresh."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' base folders are siblings in the run's folder
    folder, done = root / name, root / f"{name}.built"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def toy_data_bin(tmp_path_factory):
    """A binarized joined-dictionary en-de toy corpus (train/valid/test)."""
    def build(root):
        text = write_toy_parallel(root / "text")
        run_fairseq("preprocess", "--source-lang", "en", "--target-lang", "de",
                    "--trainpref", text / "train", "--validpref", text / "valid",
                    "--testpref", text / "test", "--destdir", root / "data-bin",
                    "--joined-dictionary", "--workers", "1", user_dir=False)
    return built_once(tmp_path_factory, "toy", build) / "data-bin"


@pytest.fixture
def multi30k():
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip(f"Multi30k corpus not found at {MULTI30K}")
    return MULTI30K


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


# --- models trained once per session ---------------------------------------------------------
# Modules that only read a trained model share these instead of each training its own on the
# toy corpus. A test that writes into the run's folder (a resume, a converted file) works on a
# copy (copy_run) or writes elsewhere: the fixtures are read-only for everyone.

TOY_BASELINE = ["--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL, *TRAIN_FLAGS]
TOY_EWA = ["--arch", "ewa_transformer_wmt_en_de", *TINY_MODEL, "--ewa-layers", "last-4",
           "--ewa-share-rate", "0.3"]
# Learnable in a few hundred updates: a higher rate than TRAIN_FLAGS' (flags after them win).
FAST_LEARNING = ["--lr", "0.003", "--warmup-updates", "50", "--no-epoch-checkpoints"]


@pytest.fixture(scope="session")
def toy_baseline_run(trains, toy_data_bin, tmp_path_factory):
    """The save dir of the pre-norm baseline (TOY_BASELINE) after 3 updates (checkpoint_last.pt
    and the like). ``run_fairseq("train", toy_data_bin, *TOY_BASELINE, "--save-dir", copy)``
    resumes a copy of it."""
    def build(root):
        run_fairseq("train", toy_data_bin, *TOY_BASELINE, "--max-update", "3",
                    "--save-dir", root / "ckpt")
    return built_once(tmp_path_factory, "toy-baseline", build) / "ckpt"


@pytest.fixture(scope="session")
def toy_ewa_run(trains, toy_data_bin, tmp_path_factory):
    """The save dir of an EWA model (TOY_EWA: both encoder layers, share rate 0.3) after 100
    updates that learn the toy task (FAST_LEARNING): checkpoint_last.pt."""
    def build(root):
        run_fairseq("train", toy_data_bin, *TRAIN_FLAGS, *TOY_EWA, "--max-update", "100",
                    *FAST_LEARNING, "--save-dir", root / "ckpt")
    return built_once(tmp_path_factory, "toy-ewa", build) / "ckpt"


@pytest.fixture(scope="session")
def toy_learned_baseline_run(trains, toy_data_bin, tmp_path_factory):
    """The save dir of the pre-norm baseline (TOY_BASELINE) after 300 updates that learn the toy
    task (FAST_LEARNING): checkpoint_last.pt, for the tests that compare translations."""
    def build(root):
        run_fairseq("train", toy_data_bin, *TOY_BASELINE, "--max-update", "300", *FAST_LEARNING,
                    "--save-dir", root / "ckpt")
    return built_once(tmp_path_factory, "toy-learned-baseline", build) / "ckpt"


def copy_run(run_dir, folder):
    """A copy of the save dir ``run_dir`` in ``folder``, for a test that writes into it."""
    return Path(shutil.copytree(run_dir, Path(folder) / run_dir.name))

