"""bfloat16 autocast (``--amp --bf16``) against fairseq's all-bf16 ``--bf16``, each against fp32,
on the CPU (docs/gpu.md, "Mixed precision"): why train.sh trains in autocast.

A multi-path model with 6 encoder layers of 4 paths (d 32, FFN 64, 2 decoder layers) trains 200
updates of the tests' toy corpus through fairseq-train with the plug-in, single-threaded, once
per precision with the same seed and batches; printed: each precision's loss gap to fp32 per
update (mean and largest, relative) and the relative distance of its final weights to fp32's.

    .venv/bin/python studies/bf16_modes.py [WORK_DIR]
"""
import os
import random
import re
import subprocess
import sys
from pathlib import Path

# The study's set-up is its own, stated here rather than imported from tests/conftest.py, so
# that a change to the tests' fixtures does not change what this study measures. The values are
# those of the tests' tiny model, training flags and toy corpus when the study was written.
USER_DIR = Path(__file__).resolve().parents[1] / "multipath_nmt"
PRECISIONS = {"fp32": [], "amp-bf16": ["--amp", "--bf16"], "bf16": ["--bf16"]}
MODEL = ["--arch", "multipath_transformer_wmt_en_de",
         "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
         "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
         "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
         "--encoder-layers", "6", "--encoder-paths", "4", "--decoder-layers", "2"]
TRAIN_FLAGS = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.997)", "--lr", "0.001",
    "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "10",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "400", "--share-all-embeddings", "--seed", "1",
    "--cpu", "--no-progress-bar", "--log-interval", "1", "--log-format", "simple",
    "--num-workers", "0", "--disable-validation",
]


def clean_env():
    """The environment a user has: none of our variables, single-threaded for determinism."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MULTIPATH_NMT_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0")
    return env


def write_toy_parallel(folder, n_train=300, n_valid=40, seed=0):
    """A learnable toy pair: the target is the reversed source with a word-level mapping."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(40)]
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_valid)):
        with open(folder / f"{split}.en", "w") as src, open(folder / f"{split}.de", "w") as tgt:
            for _ in range(n):
                words = [rng.choice(vocab) for _ in range(rng.randint(3, 9))]
                src.write(" ".join(words) + "\n")
                tgt.write(" ".join("x" + w[1:] for w in reversed(words)) + "\n")
    return folder


def load_model_state(path):
    """The model state dict of a checkpoint, loaded the way fairseq-train does."""
    import multipath_nmt  # noqa: F401  (allow-lists what fairseq checkpoints pickle)
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_checkpoint_to_cpu(str(path))["model"]


def main(work):
    data = work / "data-bin"
    if not data.exists():
        text = write_toy_parallel(work / "text")
        subprocess.run([sys.executable, "-m", "fairseq_cli.preprocess", "-s", "en", "-t", "de",
                        "--trainpref", text / "train", "--validpref", text / "valid",
                        "--destdir", data, "--joined-dictionary", "--workers", "1"],
                       check=True, capture_output=True)
    runs = {}
    for name, flags in PRECISIONS.items():
        save = work / name
        proc = subprocess.run(
            [sys.executable, "-m", "fairseq_cli.train", data, "-s", "en", "-t", "de", *MODEL,
             *TRAIN_FLAGS, "--optimizer", "adam_fused", "--lr", "0.002", "--warmup-updates", "40",
             "--max-update", "200", "--no-epoch-checkpoints", "--save-dir", save,
             "--user-dir", USER_DIR, *flags], capture_output=True, text=True, env=clean_env())
        if proc.returncode:
            sys.exit(proc.stdout[-3000:] + proc.stderr[-3000:])
        losses = [float(x) for x in re.findall(r"\d+ / \d+ loss=([0-9.]+),", proc.stdout)]
        runs[name] = losses, load_model_state(save / "checkpoint_last.pt")
    reference_losses, reference = runs.pop("fp32")
    for name, (losses, state) in runs.items():
        gaps = [abs(a - b) / b for a, b in zip(losses, reference_losses)]
        distance = sum((state[k].float() - reference[k]).norm() ** 2 for k in reference) ** 0.5
        size = sum(reference[k].norm() ** 2 for k in reference) ** 0.5
        print(f"{name}: {len(losses)} updates, final loss {losses[-1]:.3f} (fp32 "
              f"{reference_losses[-1]:.3f}); loss gap to fp32 mean {100 * sum(gaps) / len(gaps):.3f}%"
              f", largest {100 * max(gaps):.3f}%; weights {100 * distance / size:.2f}% from fp32's")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "work/bf16-modes"))
