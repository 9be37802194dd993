"""bfloat16 autocast (``--amp --bf16``) against fairseq's all-bf16 ``--bf16``, each against fp32,
on the CPU (docs/gpu.md, "Mixed precision"): why train.sh trains in autocast.

A multi-path model with 6 encoder layers of 4 paths (d 32, FFN 64, 2 decoder layers) trains 200
updates of the tests' toy corpus through fairseq-train with the plug-in, single-threaded, once
per precision with the same seed and batches; printed: each precision's loss gap to fp32 per
update (mean and largest, relative) and the relative distance of its final weights to fp32's.

    .venv/bin/python benchmark/bf16_modes.py [WORK_DIR]
"""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import TINY_MODEL, TRAIN_FLAGS, USER_DIR, clean_env, write_toy_parallel  # noqa: E402
from helpers.training import load_model_state  # noqa: E402

PRECISIONS = {"fp32": [], "amp-bf16": ["--amp", "--bf16"], "bf16": ["--bf16"]}
MODEL = ["--arch", "multipath_transformer_wmt_en_de", *TINY_MODEL, "--encoder-layers", "6",
         "--encoder-paths", "4", "--decoder-layers", "2"]


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
        runs[name] = losses, load_model_state(save / "checkpoint_last.pt")[0]
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
