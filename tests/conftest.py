"""Shared fixtures: a tiny binarized corpus, fairseq CLI runners, the optional Multi30k data."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    """The environment a user has: none of our variables, single-threaded for determinism."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIPATH_NMT_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    env.update(extra)
    return env


def run_cli(args, check=True, env=None, cwd=None, timeout=600):
    """Run a command; on an unexpected exit code fail with its output."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          env=env or clean_env(), cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {proc.returncode}\n"
                    f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def run_fairseq(tool, *args, check=True, env=None, user_dir=True):
    """``fairseq-<tool>`` as a user runs it, with ``--user-dir multipath_nmt``."""
    cmd = [sys.executable, "-m", f"fairseq_cli.{tool}", *args]
    if user_dir:
        cmd += ["--user-dir", USER_DIR]
    return run_cli(cmd, check=check, env=env)


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


@pytest.fixture(scope="session")
def toy_data_bin(tmp_path_factory):
    """A binarized joined-dictionary en-de toy corpus (train/valid/test)."""
    root = tmp_path_factory.mktemp("toy")
    text = write_toy_parallel(root / "text")
    out = root / "data-bin"
    run_fairseq("preprocess", "--source-lang", "en", "--target-lang", "de",
                "--trainpref", text / "train", "--validpref", text / "valid",
                "--testpref", text / "test", "--destdir", out, "--joined-dictionary",
                "--workers", "1", user_dir=False)
    return out


@pytest.fixture
def multi30k():
    if not (MULTI30K / "train.en.gz").exists():
        pytest.skip(f"Multi30k corpus not found at {MULTI30K}")
    return MULTI30K


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


# The fixtures that run fairseq-train, as (test module, fixture): a test that uses one, directly
# or through another fixture, trains, and is marked slow (`make test-fast` leaves it out).
TRAINING_FIXTURES = {
    ("test_average", "run_dir"), ("test_checkpoints", "run_dir"), ("test_compat", "trained"),
    ("test_convert_ewa", "ewa_checkpoint"), ("test_data_checks", "checkpoint"),
    ("test_hub", "checkpoints"), ("test_numerics", "runs"), ("test_serving", "dense_checkpoints"),
}


def _uses_a_training_fixture(item):
    definitions = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for fixture in (definitions.name2fixturedefs.get(name, ()) if definitions else ()):
            if (fixture.func.__module__.rsplit(".", 1)[-1], fixture.func.__name__) in \
                    TRAINING_FIXTURES:
                return True
    return False


def pytest_collection_modifyitems(items):
    for item in items:
        if _uses_a_training_fixture(item):
            item.add_marker(pytest.mark.slow)
