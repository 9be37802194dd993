"""Loading and translating from Python the fairseq way, for every model of the plug-in:
``TransformerModel.from_pretrained(...)`` with Moses and subword-nmt BPE, then ``.translate``,
on today's torch with weights-only loading on, gives what ``fairseq-interactive`` prints."""
import json
import sys

import pytest

from conftest import TINY_MODEL, TRAIN_FLAGS, USER_DIR, run_command, run_fairseq, run_tool
from helpers.training import MODELS, run

MOE_CRITERION = ["--criterion", "label_smoothed_cross_entropy_with_moe"]
# Flags after TRAIN_FLAGS win (argparse keeps the last value).
TRAINED = {
    "multipath": MODELS["multipath"],
    "widenet": [*MODELS["widenet"], *MOE_CRITERION],
    "ewa": [*MODELS["ewa"], *MOE_CRITERION],
    "parameternet": ["--arch", "parameternet_transformer_wmt_en_de", *TINY_MODEL, *MOE_CRITERION],
}
SENTENCES = [  # from the synthetic grammar, not in its training set
    "The report says that Laura visits the famous woman.",
    "The man recommends the new open-source project.",
    "Yesterday the developer wrote 1,250 lines of state-of-the-art software.",
]

# What a user runs: the README's snippet, in a fresh interpreter.
HUB_SCRIPT = """
import json, sys
import multipath_nmt  # registers the plug-in's models; allow-lists what fairseq checkpoints pickle
from fairseq.models.transformer import TransformerModel

jobs, data, sentences = json.loads(sys.argv[1])
translations = {}
for name, (folder, checkpoint) in jobs.items():
    model = TransformerModel.from_pretrained(
        folder, checkpoint_file=checkpoint, data_name_or_path=data,
        bpe="subword_nmt", bpe_codes=data + "/bpecodes", tokenizer="moses")
    translations[name] = [model.translate(sentence, beam=4) for sentence in sentences]

# weights-only loading is still on: any other pickled global is refused
import datetime, pickle, tempfile, torch
with tempfile.NamedTemporaryFile(suffix=".pt") as f:
    torch.save({"when": datetime.date(2020, 1, 1)}, f.name)
    try:
        torch.load(f.name)
        translations["weights_only"] = False
    except pickle.UnpicklingError:
        translations["weights_only"] = True
print("HUB " + json.dumps(translations))
"""


@pytest.fixture(scope="module")
def bpe_data(tmp_path_factory):
    """The quickstart's pipeline at a small size: synthetic corpus, Moses, joint BPE, binarize."""
    root = tmp_path_factory.mktemp("hub")
    run_tool("multipath-make-corpus", "--out", root / "raw", "--train", "400", "--valid", "40",
             "--test", "40", "--seed", "1")
    run_tool("multipath-prepare", "corpus", "--src", "en", "--tgt", "de",
             "--train", root / "raw" / "train", "--valid", root / "raw" / "valid",
             "--test", root / "raw" / "test", "--out", root / "data-bin", "--bpe-merges", "200",
             "--workers", "1")
    return root / "data-bin"


@pytest.fixture(scope="module")
def checkpoints(trains, bpe_data, tmp_path_factory):
    """{model: (folder, checkpoint file)}: each trained for 150 updates, plus the EWA model
    folded into a stock transformer by multipath-convert-ewa."""
    root = tmp_path_factory.mktemp("hub-checkpoints")
    found = {}
    for name, flags in TRAINED.items():
        run([sys.executable, "-m", "fairseq_cli.train", str(bpe_data), *TRAIN_FLAGS, *flags,
             "--lr", "0.003", "--max-tokens", "1000", "--max-update", "150",
             "--no-epoch-checkpoints", "--save-dir", str(root / name), "--user-dir", str(USER_DIR)])
        found[name] = (str(root / name), "checkpoint_last.pt")
    run_tool("multipath-convert-ewa", root / "ewa" / "checkpoint_last.pt",
             root / "ewa" / "checkpoint_folded.pt")
    found["ewa_folded"] = (str(root / "ewa"), "checkpoint_folded.pt")
    return found


@pytest.fixture(scope="module")
def hub_translations(checkpoints, bpe_data):
    proc = run_command([sys.executable, "-c", HUB_SCRIPT, json.dumps([checkpoints, str(bpe_data), SENTENCES])])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("HUB ", 1)[1])


def interactive_translations(data, checkpoint, tmp_path):
    source = tmp_path / "input.en"
    source.write_text("\n".join(SENTENCES) + "\n")
    out = run_fairseq("interactive", data, "--path", checkpoint, "--input", source,
                      "--source-lang", "en", "--target-lang", "de", "--beam", "4",
                      "--buffer-size", "1", "--batch-size", "1", "--tokenizer", "moses",
                      "--bpe", "subword_nmt", "--bpe-codes", data / "bpecodes").stdout
    return [line.split("\t")[2] for line in out.splitlines() if line.startswith("D-")]


def test_weights_only_loading_stays_on(hub_translations):
    assert hub_translations["weights_only"] is True


@pytest.mark.parametrize("name", [*TRAINED, "ewa_folded"])
def test_hub_translates_like_fairseq_interactive(name, checkpoints, hub_translations, bpe_data,
                                                 tmp_path):
    folder, checkpoint = checkpoints[name]
    expected = interactive_translations(bpe_data, f"{folder}/{checkpoint}", tmp_path)
    assert len(expected) == len(SENTENCES)
    assert hub_translations[name] == expected


def test_folded_ewa_translates_like_the_ewa_model(hub_translations):
    """EWA evaluates with the mean of its experts, which is what the folded model holds."""
    assert hub_translations["ewa_folded"] == hub_translations["ewa"]
