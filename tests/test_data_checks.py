"""Damaged and mismatched data-bins: one true line, before the first update, in fairseq-train and
fairseq-generate (multipath_nmt/data_bin_checks.py, multipath_nmt/fairseq_patches/data_bins.py).

Every damaged data-bin is a copy of the toy corpus' real one with one thing wrong. Stock fairseq
0.12 runs into each with a traceback from deep inside its data loading (often only when the bad
batch is reached) or trains on garbage; with the plug-in the command exits 1 with one line that
names the file, says what is wrong and how to rebuild the data-bin.
"""
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TOY_BASELINE, USER_DIR, run_fairseq
from helpers import in_process
from helpers.training import SMALL_BATCHES, train_command, train_to_its_end

from multipath_nmt.data_bin_checks import (DataBinError, check_dictionary, check_indexed_file,
                                     check_split, rebuild_advice)

BIN = Path(sys.executable).parent


def _truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _replace(path, other):
    shutil.copyfile(path.with_name(other), path)


def _patch_bytes(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def _drop_dictionary_tail(folder, lines):
    """Both (joined) dictionaries lose their last entries: the data has ids past their end."""
    for lang in ("en", "de"):
        path = folder / f"dict.{lang}.txt"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:-lines]))


def _second_offset(folder, split):
    """The offset of sentence 1 in the index doubled: the sizes and offsets disagree."""
    path = folder / f"{split}.en-de.en.idx"
    count = struct.unpack("<Q", path.read_bytes()[18:26])[0]
    at = 26 + 4 * count + 8
    value = struct.unpack("<q", path.read_bytes()[at:at + 8])[0]
    _patch_bytes(path, at, struct.pack("<q", 2 * value + 2))


# name -> (damage(data-bin copy, split), the file the line names, what the line says)
DAMAGE = {
    "truncated .bin": (lambda d, s: _truncate(d / f"{s}.en-de.en.bin", 0.3),
                       "{s}.en-de.en.bin", r"truncated: [\d,]+ bytes, but its index "),
    "truncated .idx": (lambda d, s: _truncate(d / f"{s}.en-de.de.idx", 0.6),
                       "{s}.en-de.de.idx", r"truncated: [\d,]+ bytes, but its header counts"),
    "empty .idx": (lambda d, s: _truncate(d / f"{s}.en-de.de.idx", 0),
                   "{s}.en-de.de.idx", r"empty \(0 bytes\)"),
    "missing .bin": (lambda d, s: (d / f"{s}.en-de.en.bin").unlink(),
                     "{s}.en-de.en.bin", r"missing \(its index {s}.en-de.en.idx is there\)"),
    "missing target side": (lambda d, s: [(d / f"{s}.en-de.de.{e}").unlink() for e in ("idx", "bin")],
                            "{s}.en-de.de.idx", r"missing: the {s} split has its en side"),
    "index of another dtype": (lambda d, s: _patch_bytes(d / f"{s}.en-de.en.idx", 17, b"\x04"),
                               "{s}.en-de.en.idx", r"damaged header: it says the tokens are int32 "
                                                   r"\(4 bytes each\), but its offsets are those of 2-byte"),
    "offsets that disagree with the sizes": (_second_offset, "{s}.en-de.en.idx",
                                             r"damaged: sentence 1 starts at byte"),
    "not an index": (lambda d, s: (d / f"{s}.en-de.en.idx").write_bytes(b"hello world, not an index"),
                     "{s}.en-de.en.idx", r"not a fairseq index"),
    "sides of different lengths": (lambda d, s: [_replace(d / f"{s}.en-de.de.{e}",
                                                          f"{'train' if s != 'train' else 'valid'}.en-de.de.{e}")
                                                 for e in ("idx", "bin")],
                                   "{s}.en-de.de.idx",
                                   r"(300|40) sentences, but its source side {s}.en-de.en.idx has (40|300): "
                                   r"the two sides are not aligned"),
    "missing dictionary": (lambda d, s: (d / "dict.de.txt").unlink(), "dict.de.txt",
                           r"no such dictionary \(the folder has dict.en.txt\)"),
    "malformed dictionary": (lambda d, s: (d / "dict.en.txt").write_text(
                                 (d / "dict.en.txt").read_text() + "w77 many\n"),
                             "dict.en.txt", r"line \d+ \('w77 many'\) has the count 'many', not a whole number"),
    "dictionary with a repeated token": (lambda d, s: (d / "dict.de.txt").write_text(
                                             (d / "dict.de.txt").read_text() + "<unk> 3\n"),
                                         "dict.de.txt", r"repeats the token '<unk>'"),
    "dictionary shorter than the data": (lambda d, s: _drop_dictionary_tail(d, 30), "{s}.en-de.",
                                         r"token id \d+ \(sentence \d+\) is not in the dictionary "
                                         r".*dict.\w\w.txt, which has 58 entries"),
    "missing split": (lambda d, s: [p.unlink() for p in d.glob(f"{s}.*")], "",
                      r"the data-bin has no {s} split"),
}
TRAIN = [*SMALL_BATCHES, "--max-update", 3, "--no-save"]


def _damaged_copy(toy_data_bin, tmp_path, name, split):
    data = tmp_path / "data-bin"
    shutil.copytree(toy_data_bin, data)
    DAMAGE[name][0](data, split)
    return data


def _assert_one_line(proc, tool, data, name, split):
    _, file, says = DAMAGE[name]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in output, output[-6000:]
    last = proc.stderr.strip().splitlines()[-1]
    prefix = f"{tool}.py: error: {data / file.format(s=split)}"
    assert last.startswith(prefix), last
    assert re.search(says.format(s=split), last), last
    assert last.endswith(f"rebuild the data-bin {data} with the multipath-prepare (corpus or wmt) "
                         "or fairseq-preprocess command that wrote it")
    return last


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_fairseq_train_says_one_line_before_the_first_update(name, toy_data_bin, tmp_path):
    data = _damaged_copy(toy_data_bin, tmp_path, name, "train")
    proc = train_to_its_end(train_command(data, tmp_path / "ckpt", "baseline", *TRAIN))
    _assert_one_line(proc, "train", data, name, "train")
    assert "num_updates=" not in proc.stdout  # stopped before the first update
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir())


@pytest.fixture(scope="module")
def checkpoint(toy_baseline_run):
    return toy_baseline_run / "checkpoint_last.pt"  # read only


# A dictionary of another size than the model's embeddings is already one line of the checkpoint
# checks (DictionaryMismatchError), before any data is read; a test split without its target side
# is translated without references, as fairseq-generate does.
GENERATE = sorted(set(DAMAGE) - {"dictionary shorter than the data", "missing target side"})


@pytest.mark.slow
@pytest.mark.parametrize("name", GENERATE)
def test_fairseq_generate_says_one_line(name, toy_data_bin, checkpoint, tmp_path):
    data = _damaged_copy(toy_data_bin, tmp_path, name, "test")
    proc = run_fairseq("generate", data, "--path", checkpoint, "--cpu", "--beam", "1",
                       "--gen-subset", "test", check=False)
    _assert_one_line(proc, "generate", data, name, "test")
    assert "\nH-" not in proc.stdout  # nothing translated


# --- the library -------------------------------------------------------------------------------

def test_a_good_data_bin_passes_and_the_counts_are_its_sentences(toy_data_bin):
    assert [check_split(toy_data_bin, s, "en", "de") for s in ("train", "valid", "test")] == [300, 40, 40]
    assert check_split(toy_data_bin, "train", "de", "en") == 300  # either language order
    assert check_dictionary(toy_data_bin / "dict.en.txt") == 4 + len(
        (toy_data_bin / "dict.en.txt").read_text().splitlines())


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_check_split_tells_each_damage_apart(name, toy_data_bin, tmp_path):
    data = _damaged_copy(toy_data_bin, tmp_path, name, "valid")
    _, file, says = DAMAGE[name]
    with pytest.raises(DataBinError) as caught:
        check_split(data, "valid", "en", "de")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{data / file.format(s='valid')}"), message
    assert re.search(says.format(s="valid"), message), message


def test_dictionary_parsing_follows_fairseq(tmp_path):
    from fairseq.data import Dictionary

    path = tmp_path / "dict.xx.txt"
    good = ["a 5", "b 3 #fairseq:overwrite", "a 2 #fairseq:overwrite", "c d 1", "e\t7 2", "f 1   "]
    path.write_text("\r\n".join(good) + "\n")
    assert check_dictionary(path) == len(Dictionary.load(str(path)))
    for bad in ("a", "a 5\n\nb 3", "a x", "a 1\na 2", "#fairseq:overwrite", "a 1 #fairseq:overwrite x"):
        path.write_text(bad + "\n")
        with pytest.raises(Exception):
            Dictionary.load(str(path))
        with pytest.raises(DataBinError, match=rf"^{re.escape(str(path))}: line \d+ "):
            check_dictionary(path)
    path.write_bytes(b"a 1\n\xff\xfe 2\n")
    with pytest.raises(DataBinError, match="line 2 is not UTF-8"):
        check_dictionary(path)


def test_the_older_index_format_is_checked_too(tmp_path):
    """fairseq-preprocess --dataset-impl lazy writes the TNTIDX index: checked the same way."""
    import torch
    from fairseq.data.indexed_dataset import IndexedDatasetBuilder, IndexedDataset

    prefix = tmp_path / "train.en-de.en"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for sentence in ([5, 6, 2], [7, 2], [8, 9, 10, 2]):
        builder.add_item(torch.tensor(sentence, dtype=torch.int32))
    builder.finalize(f"{prefix}.idx")
    assert len(IndexedDataset(str(prefix))) == check_indexed_file(prefix, 11) == 3
    with pytest.raises(DataBinError, match=r"token id 10 \(sentence 2\) is not in the dictionary"):
        check_indexed_file(prefix, 10)
    _truncate(Path(f"{prefix}.bin"), 0.5)
    with pytest.raises(DataBinError, match=r"\.bin: truncated: 18 bytes, .* 3 sentences of 9 int32"):
        check_indexed_file(prefix, 11)


def test_advice_names_the_multipath_prepare_command_that_wrote_the_data_bin(tmp_path):
    out = tmp_path / "data-bin" / "wmt14_en_de"
    out.mkdir(parents=True)
    raw = {"stage": "raw", "pair": "wmt14_en_de", "extract": {}}
    params = {"stage": "binarize", "src": "de", "tgt": "en", "raw_test": True,
              "clean": {"stage": "clean", "bpe": {"stage": "bpe", "merges": 32000,
                                                  "tok": {"stage": "tok", "raw": raw}}}}
    (out / ".done").write_text(json.dumps(params))
    assert rebuild_advice(out) == (f"rebuild it: mv {out} {out}.damaged && "
                                   f"multipath-prepare wmt wmt14_de_en --out {out}")
    (out / ".done").write_text("{")
    assert rebuild_advice(out).startswith(f"rebuild the data-bin {out} with the multipath-prepare")


@pytest.mark.slow
@pytest.mark.process  # the advised command, run by a shell as printed
def test_the_advised_command_rebuilds_a_prepared_data_bin_byte_for_byte(tmp_path):
    """A data-bin made by multipath-prepare corpus is damaged; the command of the one-line message
    is run as it is printed, and the data-bin passes again, byte-identical to the first one."""
    from multipath_nmt.pipeline.synthetic import generate

    text = tmp_path / "text"
    text.mkdir()
    for split, pairs in generate({"train": 150, "valid": 20, "test": 20}, seed=5).items():
        for column, lang in enumerate(("en", "de")):
            (text / f"{split}.{lang}").write_text("".join(p[column] + "\n" for p in pairs))
    out = tmp_path / "bin" / "syn"
    # the default --workers, as in the advised command (preprocess.log records the number)
    prepared = in_process.console_script("multipath-prepare", [
        "corpus", "--src", "en", "--tgt", "de", "--bpe-merges", "60", "--out", out,
        *[arg for s in ("train", "valid", "test") for arg in (f"--{s}", text / s)]])
    assert prepared.returncode == 0, prepared.stderr[-4000:]
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _truncate(out / "train.en-de.de.bin", 0.5)

    with pytest.raises(DataBinError) as caught:
        check_split(out, "train", "en", "de")
    advice = str(caught.value).split("; rebuild it: ", 1)[1]
    assert advice == (f"mv {out} {out}.damaged && multipath-prepare corpus --src en --tgt de "
                      f"--train {text / 'train'} --valid {text / 'valid'} --test {text / 'test'} "
                      f"--out {out} --bpe-merges 60")
    env = {"PATH": f"{BIN}:/usr/bin:/bin"}
    subprocess.run(["bash", "-c", advice], check=True, capture_output=True, timeout=300, env=env)
    check_split(out, "train", "en", "de")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- sentences longer than the model's positions (valid and test sets) ------------------------

LONG = 1596  # the long line's tokens; fairseq-preprocess adds </s>: 1,597 in the .idx
# the toy baseline's flags without "--num-workers 0" and "--disable-validation"
_WORKERS = TOY_BASELINE.index("--num-workers")
TRAIN_WITH_FAIRSEQS_DEFAULTS = [a for a in TOY_BASELINE[:_WORKERS] + TOY_BASELINE[_WORKERS + 2:]
                                if a != "--disable-validation"]


def with_a_long_sentence(toy_data_bin, folder, split, at=2):
    """A copy of the toy data-bin in ``folder`` whose ``split`` has as its sentence ``at`` (line
    ``at + 1``) a source sentence of :data:`LONG` tokens, longer than the models' 1,024."""
    import torch
    from fairseq.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder

    data = Path(folder) / "data-bin"
    shutil.copytree(toy_data_bin, data)
    source = MMapIndexedDataset(str(toy_data_bin / f"{split}.en-de.en"))  # read from the original
    words = check_dictionary(toy_data_bin / "dict.en.txt")
    long = torch.tensor([4 + i % (words - 4) for i in range(LONG)] + [2], dtype=torch.int64)
    prefix = str(data / f"{split}.en-de.en")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=source._index.dtype)
    for i in range(len(source)):
        builder.add_item(long if i == at else source[i])
    builder.finalize(prefix + ".idx")
    return data


def too_long_line(data, split):
    return (f"{data}/{split}.en-de.en.idx: sentence 2 (line 3 of the text it was binarized from) "
            f"has 1,597 tokens with its </s>, more than the model's 1,024 source positions "
            "(--max-source-positions): shorten or remove it and binarize again, or pass "
            "--skip-invalid-size-inputs-valid-test to leave such sentences out")


def test_a_valid_sentence_longer_than_the_models_positions_is_one_line(toy_data_bin, tmp_path):
    """Where fairseq's batching of a valid or test set raised ``Exception: Size of sample #2 is
    invalid`` (no file, no line): the one line; with --skip-invalid-size-inputs-valid-test
    (``ignore_invalid_inputs``) fairseq's own skipping, unchanged."""
    from fairseq import options, tasks

    data = with_a_long_sentence(toy_data_bin, tmp_path, "valid")
    args = options.parse_args_and_arch(options.get_training_parser(),
                                       [str(data), "--arch", "transformer"])
    task = tasks.setup_task(args)
    task.load_dataset("valid")
    valid = task.dataset("valid")
    with pytest.raises(DataBinError) as caught:
        task.get_batch_iterator(valid, max_tokens=4096, max_positions=task.max_positions())
    assert str(caught.value) == too_long_line(data, "valid")
    batches = task.get_batch_iterator(valid, max_tokens=4096, max_positions=task.max_positions(),
                                      ignore_invalid_inputs=True)
    assert sum(len(batch) for batch in batches.frozen_batches) == 39  # all but the long one


@pytest.mark.slow
def test_fairseq_train_with_a_valid_sentence_longer_than_the_models_positions_says_one_line(
        toy_data_bin, tmp_path):
    """fairseq's defaults: validation on, --num-workers 1. fairseq-train stopped in its start-up
    validation (its dry run over the valid set) with a 30-line traceback, on every rerun."""
    data = with_a_long_sentence(toy_data_bin, tmp_path, "valid")
    command = [sys.executable, "-m", "fairseq_cli.train", data, *TRAIN_WITH_FAIRSEQS_DEFAULTS,
               "--max-update", "3", "--save-dir", tmp_path / "ckpt", "--user-dir", USER_DIR]
    assert "--num-workers" not in command and "--disable-validation" not in command
    proc = train_to_its_end(command)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in output, output[-6000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"train.py: error: {too_long_line(data, 'valid')}"
    assert "num_updates" not in proc.stdout  # before the first update
