"""Damaged, foreign and mismatched checkpoints: one true line each, and training always resumes.

Every damaged file is made here from a real checkpoint of a short run: truncations at several
points, zero bytes, random bytes, a zip archive without its data.pkl record, plain pickles, a bare
state dict, a global outside the allow-list, an architecture nobody registered.
"""
import hashlib
import io
import os
import pickle
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import TINY_MODEL, TRAIN_FLAGS, clean_env, copy_run, run_fairseq
from helpers import in_process
from helpers.training import (SMALL_BATCHES, UPDATE_LOGGED, assert_same_tensors, load_model_state,
                              read_until, run, started, train_command, train_to_its_end)

from multipath_nmt import checkpoint_io
from multipath_nmt.checkpoint_io import dictionaries, reading, writing
from multipath_nmt.checkpoint_io import (DamagedCheckpointError, MissingCheckpointError,
                                         NotAFairseqCheckpointError, NotAPytorchFileError,
                                         UnregisteredArchitectureError, UntrustedCheckpointError)
from multipath_nmt.checkpoint_io.reading import read_checkpoint

BIN = Path(sys.executable).parent
SAVE_EVERY = 4
RUN_UPDATES = 12


class Foreign:
    """A class a checkpoint has no business pickling."""


@pytest.fixture(scope="module")
def run_dir(trains, toy_data_bin, tmp_path_factory):
    """A finished baseline run: checkpoint_1_4/8/12.pt and checkpoint_last.pt (= update 12)."""
    save = tmp_path_factory.mktemp("run") / "ckpt"
    run(train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", RUN_UPDATES,
                      "--save-interval-updates", SAVE_EVERY, "--no-epoch-checkpoints"))
    return save


@pytest.fixture(scope="module")
def good(run_dir):
    return (run_dir / "checkpoint_last.pt").read_bytes()


def _data_pkl_end(raw):
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        first = archive.infolist()[0]
        assert first.filename.endswith("data.pkl")
        return archive.infolist()[1].header_offset


def _without_data_record(raw):
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as archive, zipfile.ZipFile(out, "w") as stripped:
        for info in archive.infolist():
            if not info.filename.endswith("data.pkl"):
                stripped.writestr(info, archive.read(info))
    return out.getvalue()


def _tensor_header_zeroed(raw):
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        record = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    start = record.header_offset
    return raw[:start] + bytes(30) + raw[start + 30:]


def _saved(obj, **kwargs):
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)
    return buffer.getvalue()


def _edited(raw, edit):
    state = torch.load(io.BytesIO(raw), weights_only=False)
    edit(state)
    return _saved(state)


def _unregistered_arch(state):
    state["cfg"]["model"]._name = state["cfg"]["model"].arch = "someone_elses_transformer"
    state["cfg"]["common"]["user_dir"] = "/opt/their_plugin"


# name -> (how the file is made from a good checkpoint's bytes, error class, what the line says)
DAMAGE = {
    "zero bytes": (lambda raw: b"", DamagedCheckpointError,
                   r"empty file \(0 bytes\), not a checkpoint: its write was interrupted"),
    "cut after 20 bytes": (lambda raw: raw[:20], DamagedCheckpointError,
                           r"truncated checkpoint \(20 bytes, the end of its zip archive is missing\)"),
    "cut inside data.pkl": (lambda raw: raw[:_data_pkl_end(raw) // 2], DamagedCheckpointError,
                            r"truncated checkpoint \(\d+ bytes"),
    "cut after data.pkl": (lambda raw: raw[:_data_pkl_end(raw) + 100], DamagedCheckpointError,
                           r"truncated checkpoint"),
    "cut in the middle": (lambda raw: raw[:len(raw) // 2], DamagedCheckpointError,
                          r"truncated checkpoint"),
    "last byte missing": (lambda raw: raw[:-1], DamagedCheckpointError, r"truncated checkpoint"),
    "first record's header zeroed": (lambda raw: bytes(30) + raw[30:], DamagedCheckpointError,
                                     r"damaged or truncated checkpoint \(its pickled data cannot be read: "
                                     r"Unsupported operand 0\): an interrupted write or copy, or a failing disk"),
    "a tensor record's header zeroed": (_tensor_header_zeroed, DamagedCheckpointError,
                                        r"damaged or truncated checkpoint \(PytorchStreamReader failed "
                                        r"reading file data/0: invalid header or archive is corrupted\)"),
    "random bytes": (lambda raw: random.Random(0).randbytes(4096),
                     NotAPytorchFileError, r"not a PyTorch checkpoint \(it starts with bytes [0-9a-f ]+: "
                                           r"neither a zip archive nor a pickle\)"),
    "zip without its data record": (_without_data_record, NotAPytorchFileError,
                                    r"a zip archive without the data.pkl record that torch.save writes"),
    "a plain pickle": (lambda raw: pickle.dumps({"model": {}, "cfg": {}}), NotAPytorchFileError,
                       r"a plain Python pickle, not a PyTorch checkpoint"),
    "a pickle of a foreign object": (lambda raw: pickle.dumps(Foreign()), NotAPytorchFileError,
                                r"a plain Python pickle, not a PyTorch checkpoint"),
    "legacy format, truncated": (lambda raw: _saved({"model": {}}, _use_new_zipfile_serialization=False)[:40],
                                 DamagedCheckpointError, r"damaged or truncated checkpoint \(the file ends too early\)"),
    "a bare state dict": (lambda raw: _saved({"encoder.embed_tokens.weight": torch.zeros(2, 2)}),
                          NotAFairseqCheckpointError,
                          r"a PyTorch file but not a fairseq checkpoint: no 'model' and 'cfg' entries "
                          r"\(it holds only tensors, a bare state dict: 1 of them, e.g. encoder.embed_tokens.weight\)"),
    "a list": (lambda raw: _saved([1, 2]), NotAFairseqCheckpointError,
               r"a PyTorch file but not a fairseq checkpoint: it holds a list"),
    "unregistered architecture": (lambda raw: _edited(raw, _unregistered_arch), UnregisteredArchitectureError,
                                  r"architecture 'someone_elses_transformer' is not registered: "
                                  r"pass --user-dir /opt/their_plugin \(the plug-in it was trained with\)"),
    "untrusted global": (lambda raw: _edited(raw, lambda s: s["extra_state"].update(evil=Foreign())),
                         UntrustedCheckpointError,
                         r"pickles test_checkpoints.Foreign, which safe loading .* does not allow .* "
                         r"allow it explicitly with MULTIPATH_NMT_TRUST_GLOBALS=test_checkpoints.Foreign"),
}


def _write(folder, name, raw):
    path = Path(folder) / (name.replace(" ", "_").replace(",", "") + ".pt")
    path.write_bytes(raw)
    return path


def _without_import_noise(stderr):
    """stderr's lines but fairseq's own note, printed when it is imported, that tensorboardX is missing."""
    return [line for line in stderr.strip().splitlines() if "pip install tensorboardX" not in line]


def _assert_one_line(message, path):
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    assert "see the torch error" not in message


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_reader_tells_each_failure_apart(name, good, tmp_path):
    make, kind, says = DAMAGE[name]
    path = _write(tmp_path, name, make(good))
    with pytest.raises(kind, match=says) as err:
        read_checkpoint(path)
    _assert_one_line(str(err.value), path)
    # the opt-in is offered only for a complete file that really pickles a foreign global
    assert (reading.TRUST_ENV in str(err.value)) == (kind is UntrustedCheckpointError)


def test_missing_file_and_directory(run_dir, tmp_path):
    with pytest.raises(MissingCheckpointError, match=r"checkpoint_9.pt: no such checkpoint file \(.*ckpt "
                                                     r"has checkpoint_1_12.pt, checkpoint_1_4.pt"):
        read_checkpoint(run_dir / "checkpoint_9.pt")
    with pytest.raises(MissingCheckpointError, match="is a directory, not a checkpoint file"):
        read_checkpoint(run_dir)


def test_the_good_checkpoint_reads(run_dir):
    state = read_checkpoint(run_dir / "checkpoint_last.pt")
    assert reading.saved_at(state) == (1, RUN_UPDATES)
    peeked = reading.peek_checkpoint(run_dir / "checkpoint_last.pt")
    assert reading.saved_at(peeked) == (1, RUN_UPDATES)
    assert {k: v.shape for k, v in peeked["model"].items()} == {k: v.shape for k, v in state["model"].items()}


TOOLS = {  # console script -> arguments after the checkpoint, the output it must not leave
    "multipath-inspect": lambda out: [],
    "multipath-convert-ewa": lambda out: [out],
    "multipath-average": lambda out: ["--output", out],
}


@pytest.mark.slow
@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("name", ["zero bytes", "cut in the middle", "random bytes", "untrusted global"])
def test_console_scripts_say_one_line(tool, name, good, tmp_path):
    make, _, says = DAMAGE[name]
    path = _write(tmp_path, name, make(good))
    out = tmp_path / "out.pt"
    args = ["--inputs", path] if tool == "multipath-average" else [path]
    proc = in_process.console_script(tool, [*args, *TOOLS[tool](out)])
    assert proc.returncode == 1
    lines = _without_import_noise(proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{path}: " in lines[0] and re.search(says, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no output, no temp file


@pytest.mark.slow
@pytest.mark.parametrize("tool,name", [("generate", "cut after data.pkl"),
                                       ("generate", "zip without its data record"),
                                       ("generate", "untrusted global"),
                                       ("generate", "unregistered architecture"),
                                       ("interactive", "zero bytes")])
def test_fairseq_generate_says_one_line(tool, name, good, toy_data_bin, tmp_path):
    make, _, says = DAMAGE[name]
    path = _write(tmp_path, name, make(good))
    proc = run_fairseq(tool, toy_data_bin, "--path", path, "--cpu", "--beam", "1", check=False)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    prefix = f"{tool}.py: error: "
    assert last.startswith(prefix)
    _assert_one_line(last[len(prefix):], path)
    assert re.search(says, last)


@pytest.fixture(scope="module")
def small_vocabulary_bin(toy_data_bin, tmp_path_factory):
    """The same text with a 30-word joined dictionary instead of the toy corpus' full one."""
    from conftest import write_toy_parallel

    root = tmp_path_factory.mktemp("small_vocab")
    text = write_toy_parallel(root / "text")
    out = root / "data-bin"
    run_fairseq("preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", text / "train",
                "--validpref", text / "valid", "--testpref", text / "test", "--destdir", out,
                "--joined-dictionary", "--nwordssrc", "30", "--workers", "1", user_dir=False)
    return out


def _dictionary_sizes(data_bin):
    with open(Path(data_bin) / "dict.en.txt") as f:
        return 4 + sum(1 for _ in f)  # fairseq adds <s>, <pad>, </s>, <unk>


@pytest.mark.slow
def test_mismatched_dictionary_generate_and_resume(run_dir, toy_data_bin, small_vocabulary_bin, tmp_path):
    rows, entries = _dictionary_sizes(toy_data_bin), _dictionary_sizes(small_vocabulary_bin)
    assert rows != entries
    checkpoint = run_dir / "checkpoint_last.pt"
    says = (f"{checkpoint}: its source embedding has {rows} rows but the source dictionary "
            f"{small_vocabulary_bin / 'dict.en.txt'} has {entries} entries: use the data-bin")
    generate = run_fairseq("generate", small_vocabulary_bin, "--path", checkpoint, "--cpu", check=False)
    assert generate.returncode == 1 and "Traceback" not in generate.stderr
    assert generate.stderr.strip().splitlines()[-1] == f"generate.py: error: {says} (and dictionaries) " \
                                                       "the model was trained on"

    save = tmp_path / "ckpt"
    shutil.copytree(run_dir, save)
    command = train_command(small_vocabulary_bin, save, "baseline", *SMALL_BATCHES, "--max-update", 20)
    proc = train_to_its_end(command)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(says.replace(str(checkpoint), str(save / "checkpoint_last.pt"))
                                                         + " (and dictionaries) the model was trained on")


def _with_two_symbols_swapped(data_bin, folder):
    """A copy of ``data_bin`` whose dictionaries have the words of their first two entries swapped
    (counts kept, so still sorted): as many entries as the original, other symbols."""
    shutil.copytree(data_bin, folder)
    for lang in ("en", "de"):
        path = folder / f"dict.{lang}.txt"
        first, second, *rest = path.read_text(encoding="utf-8").splitlines(True)
        (word_a, count_a), (word_b, count_b) = first.split(" ", 1), second.split(" ", 1)
        path.write_text("".join([f"{word_b} {count_a}", f"{word_a} {count_b}", *rest]), encoding="utf-8")
    return word_a, word_b


@pytest.mark.slow
def test_same_size_dictionary_with_other_symbols_generate_and_resume(run_dir, toy_data_bin, tmp_path):
    """The checkpoint records its dictionaries' symbols: a data-bin whose dictionaries have as
    many entries but other symbols is refused in one line naming the first token id that differs;
    a checkpoint without them (stock fairseq's) is checked by size, with one warning."""
    other = tmp_path / "other-bin"
    word_a, word_b = _with_two_symbols_swapped(toy_data_bin, other)
    rows = _dictionary_sizes(toy_data_bin)
    checkpoint = run_dir / "checkpoint_last.pt"
    says = (f"its source dictionary is not {other / 'dict.en.txt'}, although both have {rows} entries: "
            f"token id 4 is {word_a!r} in the checkpoint but {word_b!r} in the data-bin's; use the "
            "data-bin (and dictionaries) the model was trained on")
    generate = run_fairseq("generate", other, "--path", checkpoint, "--cpu", check=False)
    assert generate.returncode == 1 and "Traceback" not in generate.stderr
    assert generate.stderr.strip().splitlines()[-1] == f"generate.py: error: {checkpoint}: {says}"

    save = tmp_path / "ckpt"
    shutil.copytree(run_dir, save)
    before = {p.name: _digest(p) for p in save.iterdir()}
    proc = train_to_its_end(train_command(other, save, "baseline", *SMALL_BATCHES, "--max-update",
                                          RUN_UPDATES + 1))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(f"error: {save / 'checkpoint_last.pt'}: {says}")
    assert {p.name: _digest(p) for p in save.iterdir()} == before

    state = torch.load(checkpoint, weights_only=False)
    del state[dictionaries.DICTIONARIES]
    stock = tmp_path / "stock.pt"
    torch.save(state, stock)
    generate = run_fairseq("generate", other, "--path", stock, "--cpu", "--quiet")
    warning = (f"{stock} does not record its dictionaries' symbols (saved by stock fairseq or an older "
               "multipath_nmt): the data-bin's dictionaries are checked by their size only")
    assert (generate.stdout + generate.stderr).count(warning) == 1


@pytest.mark.slow
@pytest.mark.process
def test_a_second_run_on_a_live_save_dir_is_refused(run_dir, toy_data_bin, tmp_path):
    """A second fairseq-train on the save dir of a live run is refused before it reads or writes
    anything, in one line naming the save dir and the holder; after the first is killed with
    SIGKILL, the next run takes the save dir and resumes."""
    import socket

    from multipath_nmt.fairseq_patches.save_dirs import LOCK

    save = tmp_path / "ckpt"
    shutil.copytree(run_dir, save)
    command = train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", 1000)
    with started(command, 300) as first:
        read_until(first, command, UPDATE_LOGGED.search, "an update")  # it holds the save dir
        os.kill(first.pid, signal.SIGSTOP)  # writes nothing while the second tries
        before = {p.name: _digest(p) for p in save.iterdir()}
        second = subprocess.run([*train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES,
                                                      "--max-update", RUN_UPDATES + 1)],
                                capture_output=True, text=True, env=clean_env(), timeout=300)
        assert {p.name: _digest(p) for p in save.iterdir()} == before
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr[-3000:]
    assert re.fullmatch(rf"train\.py: error: --save-dir {re.escape(str(save))} is in use by pid {first.pid} on "
                        rf"{re.escape(socket.gethostname())}, started [-\d: A-Z]+ \(.*fairseq_cli/train\.py .*\): "
                        "another training run writes its checkpoints there; wait for it to end, or give this run "
                        "another --save-dir", second.stderr.strip().splitlines()[-1])
    assert "num_updates=" not in second.stdout + second.stderr

    run(train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", RUN_UPDATES + 1))
    assert load_model_state(save / "checkpoint_last.pt")[1] == RUN_UPDATES + 1
    assert not (save / LOCK).exists()
    # the resumed run's save records the dictionaries' symbols as the first run's did
    from fairseq.data import Dictionary

    symbols = Dictionary.load(str(toy_data_bin / "dict.en.txt")).symbols
    resumed = torch.load(save / "checkpoint_last.pt", weights_only=False)[dictionaries.DICTIONARIES]
    assert resumed == {"source": symbols, "target": symbols}


def _digest(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.slow
def test_resume_sets_a_damaged_checkpoint_last_aside(run_dir, good, toy_data_bin, tmp_path):
    """checkpoint_last.pt (update 12) cut after its data.pkl, checkpoint_1_12.pt zero bytes: the
    run resumes from checkpoint_1_8.pt, says that updates 9 to 12 are trained again, keeps both
    damaged files, and ends exactly where an uninterrupted run ends."""
    save = tmp_path / "killed"
    shutil.copytree(run_dir, save)
    damaged = good[:_data_pkl_end(good) + 100]
    (save / "checkpoint_last.pt").write_bytes(damaged)
    (save / "checkpoint_1_12.pt").write_bytes(b"")
    flags = [*SMALL_BATCHES, "--max-update", 16, "--save-interval-updates", SAVE_EVERY, "--no-epoch-checkpoints"]
    output = run(train_command(toy_data_bin, save, "baseline", *flags))
    assert (f"{save / 'checkpoint_last.pt'}: truncated checkpoint ({len(damaged)} bytes, the end of its zip "
            f"archive is missing): its write was interrupted (killed, or the disk was full); use an "
            f"earlier checkpoint. Set aside as {save / 'checkpoint_last.pt.damaged'}; resumed from "
            f"{save / 'checkpoint_1_8.pt'} (epoch 1 @ 8 updates): 4 updates (9 to 12) are trained again") in output
    assert f"skipping {save / 'checkpoint_1_12.pt'}: empty file (0 bytes)" in output
    assert (save / "checkpoint_last.pt.damaged").read_bytes() == damaged  # set aside, not deleted

    reference = tmp_path / "uninterrupted"
    run(train_command(toy_data_bin, reference, "baseline", *flags))
    expected, expected_updates = load_model_state(reference / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(save / "checkpoint_last.pt")
    assert actual_updates == expected_updates == 16
    assert_same_tensors(actual, expected)


@pytest.mark.slow
def test_resume_when_the_damaged_file_does_not_say_its_update(run_dir, good, toy_data_bin, tmp_path):
    save = tmp_path / "ckpt"
    shutil.copytree(run_dir, save)
    (save / "checkpoint_last.pt").write_bytes(good[:_data_pkl_end(good) // 2])
    output = run(train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", RUN_UPDATES + 1))
    assert (f"resumed from {save / 'checkpoint_1_12.pt'} (epoch 1 @ 12 updates): the updates after 12 are "
            "trained again (how many is unknown: the damaged file does not say at which update it was "
            "saved)") in output
    assert load_model_state(save / "checkpoint_last.pt")[1] == RUN_UPDATES + 1


@pytest.mark.slow
def test_a_damaged_restore_file_the_user_named_stops_with_one_line(run_dir, toy_data_bin, tmp_path):
    """Only checkpoint_last.pt is replaced by an earlier checkpoint; a file named with
    --restore-file is what the user asked for."""
    damaged = tmp_path / "chosen.pt"
    damaged.write_bytes((run_dir / "checkpoint_1_8.pt").read_bytes()[:1000])
    command = train_command(toy_data_bin, tmp_path / "ckpt", "baseline", *SMALL_BATCHES, "--max-update", 2,
                            "--restore-file", damaged)
    proc = train_to_its_end(command)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {damaged}: truncated checkpoint (1000 bytes, the end of its zip archive is "
        "missing): its write was interrupted (killed, or the disk was full); use an earlier checkpoint")
    assert damaged.stat().st_size == 1000 and not (tmp_path / "ckpt" / "checkpoint_last.pt").exists()


@pytest.mark.slow
def test_resume_with_nothing_readable_starts_over(run_dir, toy_data_bin, tmp_path):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "checkpoint_last.pt").write_bytes(b"\x00" * 100)
    output = run(train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", 2))
    assert (f"{save / 'checkpoint_last.pt'}: not a PyTorch checkpoint (it starts with bytes 00 00 00 00 "
            f"00 00 00 00: neither a zip archive nor a pickle). Set aside as "
            f"{save / 'checkpoint_last.pt.damaged'}; no other checkpoint in {save} can be read, so training "
            "starts again from update 0") in output
    assert load_model_state(save / "checkpoint_last.pt")[1] == 2


def _file_size_limit(limit):
    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit raises EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limit_file_size


@pytest.mark.slow
@pytest.mark.process  # the file-size limit of a process of its own
def test_full_disk_during_a_save(run_dir, toy_data_bin, tmp_path):
    """The resumed run's first save hits a file-size limit below a checkpoint's size (what a full
    disk does to the write): the partial file is gone, every earlier checkpoint is unchanged and
    loads, and the run stops with one line."""
    save = tmp_path / "ckpt"
    shutil.copytree(run_dir, save)
    before = {p.name: _digest(p) for p in save.iterdir()}
    limit = os.path.getsize(save / "checkpoint_last.pt") // 2
    command = train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", 20,
                            "--save-interval-updates", SAVE_EVERY, "--no-epoch-checkpoints")
    proc = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300,
                          preexec_fn=_file_size_limit(limit))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {save / 'checkpoint_1_16.pt'}: could not be written (File too large, errno 27); "
        "the partial file was removed and the checkpoints saved before are unchanged. Free disk space (or "
        "keep fewer checkpoints: --keep-last-epochs, --keep-interval-updates) or raise the file-size limit "
        "(ulimit -f) and run the same command again")
    assert {p.name: _digest(p) for p in save.iterdir()} == before
    for name in before:
        read_checkpoint(save / name)


@pytest.mark.slow
def test_asynchronous_writes_save_the_synchronous_checkpoints(run_dir, toy_data_bin, tmp_path):
    """--write-checkpoints-asynchronously: the same files as a synchronous run, checkpoint_last.pt
    included, each readable and holding the parameters the synchronous run saved. fairseq 0.12
    torch.save-s into ioPath's unseekable file, which with torch 2.13 left no checkpoint readable,
    and writes only the first file of each save: no checkpoint_last.pt, so a rerun started at
    update 0."""
    save = tmp_path / "ckpt"
    output = run(train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update",
                               RUN_UPDATES, "--save-interval-updates", SAVE_EVERY,
                               "--no-epoch-checkpoints", "--write-checkpoints-asynchronously"))
    assert "ioPath PathManager finished waiting." in output
    assert "ioPath is not copying" not in output
    names = sorted(p.name for p in run_dir.iterdir())
    assert "checkpoint_last.pt" in names
    assert sorted(p.name for p in save.iterdir()) == names  # no temporary file left either
    for name in names:
        actual, updates = load_model_state(save / name)
        expected, expected_updates = load_model_state(run_dir / name)
        assert updates == expected_updates
        assert_same_tensors(actual, expected)


def test_asynchronous_write_goes_through_a_temporary_file(tmp_path, monkeypatch):
    """The background write is a temporary file renamed onto the checkpoint's name once complete:
    while it is being written the name does not exist (ioPath's own writer opened the final name,
    so a kill left it cut short), and the training thread does not wait for it."""
    import threading

    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    from multipath_nmt import atomic_files

    path = tmp_path / "checkpoint_1_4.pt"
    state = {"model": {"w": torch.arange(1000.0)}}
    started, release = threading.Event(), threading.Event()
    fsync = os.fsync

    def slow_fsync(fd):  # the writer thread, after the bytes, before the rename
        if threading.current_thread() is not threading.main_thread():
            started.set()
            assert release.wait(30)
        fsync(fd)

    monkeypatch.setattr(atomic_files.os, "fsync", slow_fsync)
    checkpoint_utils.torch_persistent_save(state, str(path), async_write=True)  # returns at once
    assert started.wait(30)
    try:
        assert not path.exists()
        [tmp] = tmp_path.glob("checkpoint_1_4.pt.*.tmp")
        assert tmp.stat().st_size > 0
    finally:
        release.set()
    PathManager.async_close()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_1_4.pt"]
    assert torch.equal(torch.load(path)["model"]["w"], state["model"]["w"])


def test_asynchronous_write_error_is_raised_in_the_training_process(tmp_path, monkeypatch):
    """A write that fails in the background thread is raised, as one CheckpointSaveError line, by
    the next save and by the wait at the end (fairseq-train's PathManager.async_close); with
    ioPath it killed the writer thread and training never heard of it."""
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    from multipath_nmt import atomic_files

    def full_disk(path, write):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic_files, "write_atomically", full_disk)
    first = tmp_path / "checkpoint_1_4.pt"
    checkpoint_utils.torch_persistent_save({"x": 1}, str(first), async_write=True)
    message = (rf"{re.escape(str(first))}: could not be written \(No space left on device, errno 28\); "
               r"the partial file was removed and the checkpoints saved before are unchanged")
    writing.asynchronous_writer.wait()
    with pytest.raises(checkpoint_io.CheckpointSaveError, match=message):  # the next save
        checkpoint_utils.torch_persistent_save({"x": 2}, str(tmp_path / "checkpoint_1_8.pt"),
                                               async_write=True)
    checkpoint_utils.torch_persistent_save({"x": 3}, str(tmp_path / "checkpoint_1_12.pt"),
                                           async_write=True)
    with pytest.raises(checkpoint_io.CheckpointSaveError, match="checkpoint_1_12.pt: could not be written"):
        PathManager.async_close()  # the end of training
    assert list(tmp_path.iterdir()) == []


def test_a_background_write_that_fails_once_is_written_again_by_the_next_submit(
        tmp_path, monkeypatch, caplog):
    """One path of a job fails once (EIO): the job still writes its other paths, the failure is
    one error line at once, and the next submit writes the failed path again from the same bytes
    before queueing its own: no save lost, no error raised. A failed path must neither stop the
    job's other paths nor raise at the next save, which would end the run."""
    import errno

    from multipath_nmt import atomic_files

    last, epoch = str(tmp_path / "checkpoint_last.pt"), str(tmp_path / "checkpoint_1_4.pt")
    write_atomically, failed = atomic_files.write_atomically, []

    def failing_once(path, write):
        if str(path) == last and not failed:
            failed.append(path)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        write_atomically(path, write)

    monkeypatch.setattr(atomic_files, "write_atomically", failing_once)
    caplog.set_level("INFO", logger=writing.logger.name)
    writing.asynchronous_writer.submit([last, epoch], [b"4"], "(epoch 1 @ 4 updates)")
    writing.asynchronous_writer.wait()
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_1_4.pt"]
    assert [r.getMessage() for r in caplog.records] == [
        f"{last}: the background write failed (Input/output error, errno 5); training goes on, and "
        "the next save or the end of the run writes it again (the error stops training if it stays)",
        f"Saved checkpoint {epoch} (epoch 1 @ 4 updates)"]
    caplog.clear()
    writing.asynchronous_writer.submit([str(tmp_path / "checkpoint_1_8.pt")], [b"8"])
    writing.asynchronous_writer.join()
    assert caplog.records[0].getMessage() == (f"Saved checkpoint {last} (epoch 1 @ 4 updates) "
                                              "(written again after the failed write)")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == {
        "checkpoint_last.pt": b"4", "checkpoint_1_4.pt": b"4", "checkpoint_1_8.pt": b"8"}


def test_written_since_a_mark_leaves_out_earlier_asynchronous_writes_completed_after_it(
        tmp_path, monkeypatch):
    """A stop's line names the files of its own save: a write asked for before the mark that the
    writer thread completes after it is not one of them. (A loaded CI machine caught the stop
    naming the previous update's checkpoint_1_3.pt as saved by the stop after update 4.)"""
    import threading

    from multipath_nmt import atomic_files

    earlier, own, last = (str(tmp_path / name) for name in
                          ("checkpoint_1_3.pt", "checkpoint_1_4.pt", "checkpoint_last.pt"))
    release = threading.Event()
    write_atomically = atomic_files.write_atomically

    def slow_for_the_earlier_save(path, write):
        if str(path) == earlier:
            assert release.wait(30)
        write_atomically(path, write)

    monkeypatch.setattr(atomic_files, "write_atomically", slow_for_the_earlier_save)
    writing.asynchronous_writer.submit([earlier], [b"3"])
    mark = writing.write_mark()
    writing.asynchronous_writer.submit([own, last], [b"4"])
    release.set()
    writing.asynchronous_writer.join()
    assert writing.written_since(mark) == [own, last]
    writing.save_atomically({"x": 5}, tmp_path / "checkpoint_1_5.pt")  # a synchronous write
    assert writing.written_since(mark) == [own, last, str(tmp_path / "checkpoint_1_5.pt")]


@pytest.mark.slow
@pytest.mark.process  # the file-size limit of a process of its own
def test_full_disk_during_an_asynchronous_save(run_dir, toy_data_bin, tmp_path):
    """As test_full_disk_during_a_save, with --write-checkpoints-asynchronously: the error of the
    background write stops the run with one line (with ioPath it was a traceback in its thread
    and the run went on, exit 0), the partial file is removed, earlier checkpoints unchanged."""
    save = tmp_path / "ckpt"
    shutil.copytree(run_dir, save)
    before = {p.name: _digest(p) for p in save.iterdir()}
    limit = os.path.getsize(save / "checkpoint_last.pt") // 2
    command = train_command(toy_data_bin, save, "baseline", *SMALL_BATCHES, "--max-update", 20,
                            "--save-interval-updates", SAVE_EVERY, "--no-epoch-checkpoints",
                            "--write-checkpoints-asynchronously")
    proc = subprocess.run(command, capture_output=True, text=True, env=clean_env(), timeout=300,
                          preexec_fn=_file_size_limit(limit))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    # checkpoint_last.pt is the first file of each background save
    assert proc.stderr.strip().splitlines()[-1] == (
        f"train.py: error: {save / 'checkpoint_last.pt'}: could not be written (File too large, errno 27); "
        "the partial file was removed and the checkpoints saved before are unchanged. Free disk space (or "
        "keep fewer checkpoints: --keep-last-epochs, --keep-interval-updates) or raise the file-size limit "
        "(ulimit -f) and run the same command again")
    assert {p.name: _digest(p) for p in save.iterdir()} == before
    for name in before:
        read_checkpoint(save / name)


def test_save_atomically_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint_last.pt"
    torch.save({"old": 1}, path)
    old = path.read_bytes()

    def full_disk(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writing.torch, "save", full_disk)
    with pytest.raises(checkpoint_io.CheckpointSaveError,
                       match=r"checkpoint_last.pt: could not be written \(No space left on device, errno 28\); "
                             r"the partial file was removed .* Free disk space \(or keep fewer checkpoints: "
                             r"--keep-last-epochs, --keep-interval-updates\) and run the same command again"):
        writing.save_atomically({"new": 1}, path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint_last.pt"]


def test_save_atomically_keeps_the_usual_permissions(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"")
    writing.save_atomically({"x": 1}, tmp_path / "saved.pt")
    assert os.stat(tmp_path / "saved.pt").st_mode == os.stat(plain).st_mode


def test_batches_of_a_later_epoch_are_those_of_epoch_1(toy_data_bin):
    """fairseq builds a reusable iterator's batches once, with --seed + the epoch it is created
    in; an uninterrupted run creates it in epoch 1. A resumed run creating it in epoch 3 now gets
    the same batches (and stock fairseq's differ, so the check has teeth)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.tasks.fairseq_task import FairseqTask

    args = options.parse_args_and_arch(options.get_training_parser(), [str(toy_data_bin), "--arch", "transformer"])
    task_cfg = convert_namespace_to_omegaconf(args).task

    def batches(epoch, get_batch_iterator):
        task = tasks.setup_task(task_cfg)
        task.load_dataset("train")
        iterator = get_batch_iterator(task, task.dataset("train"), max_sentences=8, seed=1, epoch=epoch)
        assert iterator.epoch == epoch
        return [list(b) for b in iterator.frozen_batches]

    patched = FairseqTask.get_batch_iterator
    stock = patched.__wrapped__
    assert batches(3, patched) == batches(1, patched) == batches(1, stock)
    assert batches(3, stock) != batches(1, stock)


# --- a resume with another --arch, --criterion or --optimizer ---------------------------------

# TRAIN_FLAGS without the suite's --num-workers 0 and --disable-validation: fairseq's defaults (a
# loader worker process, validation at every save), as a user runs it.
_DEFAULT_FLAGS = [word for i, word in enumerate(TRAIN_FLAGS)
                  if word not in ("--num-workers", "--disable-validation")
                  and TRAIN_FLAGS[i - 1] != "--num-workers"]
_BASELINE = ["--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL]


def _with(flags, old, new):
    """``flags`` with the words ``old`` (a flag and its value, or more) replaced by ``new``."""
    i = next(i for i in range(len(flags)) if flags[i:i + len(old)] == old)
    return [*flags[:i], *new, *flags[i + len(old):]]


@pytest.fixture(scope="module")
def default_flags_run(trains, toy_data_bin, tmp_path_factory):
    """The save dir of 2 updates of the baseline (adam, label_smoothed_cross_entropy) trained
    with fairseq's defaults for the loader and validation."""
    save = tmp_path_factory.mktemp("defaults") / "ckpt"
    run_fairseq("train", toy_data_bin, *_BASELINE, *_DEFAULT_FLAGS, "--max-update", "2",
                "--save-dir", save)
    return save


_OTHER_TRAINING = {
    "arch": (
        ["--arch", "multipath_transformer_wmt_en_de", *TINY_MODEL, "--encoder-paths", "2",
         *_DEFAULT_FLAGS],
        "its model (--arch transformer_prenorm_wmt_en_de) has other parameters than this "
        "command's (--arch multipath_transformer_wmt_en_de): "
        "'encoder.layers.0.self_attn.k_proj.weight' is in the checkpoint only (and 55 more "
        "tensors differ); "
        "resume with the checkpoint's --arch and model flags, or give another --save-dir to "
        "train this model from the start"),
    "criterion": (
        [*_BASELINE, *_with(_DEFAULT_FLAGS, ["--criterion", "label_smoothed_cross_entropy",
                                             "--label-smoothing", "0.1"],
                            ["--criterion", "cross_entropy"])],
        "its optimizer state was saved with --criterion label_smoothed_cross_entropy, not this "
        "command's --criterion cross_entropy: pass --reset-optimizer to go on from its weights "
        "with a new optimizer state, learning-rate schedule and update count, or give another "
        "--save-dir to train from the start"),
    "optimizer": (
        [*_BASELINE, *_with(_DEFAULT_FLAGS, ["--optimizer", "adam"], ["--optimizer", "adam_fused"])],
        "its optimizer state was saved with --optimizer adam, not this command's --optimizer "
        "adam_fused: pass --reset-optimizer to go on from its weights with a new optimizer "
        "state, learning-rate schedule and update count, or give another --save-dir to train "
        "from the start"),
}


@pytest.mark.parametrize("changed", sorted(_OTHER_TRAINING))
def test_a_resume_with_another_arch_criterion_or_optimizer_says_what_differs(
        changed, default_flags_run, toy_data_bin, tmp_path):
    """Resuming 2 updates of adam and label_smoothed_cross_entropy with another --arch,
    --criterion or --optimizer (fairseq's defaults for the loader and validation) stops in one
    line that says what differs and which flag, if any, accepts it; no chained tracebacks
    ("Cannot load model parameters", "Criterion does not match", "Optimizer does not match").
    Nothing in the save dir changes."""
    save = copy_run(default_flags_run, tmp_path)
    before = {p.name: _digest(p) for p in save.iterdir()}
    flags, says = _OTHER_TRAINING[changed]
    proc = run_fairseq("train", toy_data_bin, *flags, "--max-update", "4", "--save-dir", save,
                       check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"train.py: error: {save / 'checkpoint_last.pt'}: {says}"
    assert {p.name: _digest(p) for p in save.iterdir()} == before


@pytest.mark.slow
def test_a_resume_with_another_criterion_and_reset_optimizer_goes_on(default_flags_run,
                                                                    toy_data_bin, tmp_path):
    """The flag the line names does what it says: the model's weights, a new optimizer."""
    save = copy_run(default_flags_run, tmp_path)
    flags, _ = _OTHER_TRAINING["criterion"]
    proc = run_fairseq("train", toy_data_bin, *flags, "--max-update", "1", "--save-dir", save,
                       "--reset-optimizer")
    assert "Loaded checkpoint" in proc.stdout + proc.stderr


def test_a_resume_that_changes_several_things_says_them_all_in_one_line(default_flags_run):
    """explain_failed_resume, given fairseq's failed load: another --arch and another
    --criterion are one line (one rerun fixes both); the same --optimizer wrapped in another
    class (--amp's AMPOptimizer around adam) names the classes; a failure it cannot explain
    (the shapes agree, nothing else differs) is left to fairseq's error."""
    import types

    from multipath_nmt.checkpoint_io.training_setup import explain_failed_resume

    path = default_flags_run / "checkpoint_last.pt"
    saved, _ = load_model_state(path)

    class AMPOptimizer:
        pass

    class CrossEntropyCriterion:
        pass

    def trainer(model_state, criterion, optimizer_class, arch="transformer_prenorm_wmt_en_de",
                criterion_name="cross_entropy"):
        model = torch.nn.Module()
        model.state_dict = lambda: model_state
        cfg = types.SimpleNamespace(model=types.SimpleNamespace(arch=arch),
                                    criterion={"_name": criterion_name},
                                    optimizer={"_name": "adam"})
        return types.SimpleNamespace(cfg=cfg, get_model=lambda: model,
                                     get_criterion=lambda: criterion, optimizer=optimizer_class())

    failed = Exception(f"Cannot load model parameters from checkpoint {path}; please ensure that "
                       "the architectures match.")
    smaller = {name: tensor[:1] for name, tensor in saved.items()}
    found = explain_failed_resume(path, trainer(smaller, CrossEntropyCriterion(), AMPOptimizer,
                                                arch="transformer_wmt_en_de"), False, failed)
    assert str(found) == (
        f"{path}: its model (--arch transformer_prenorm_wmt_en_de) has other parameters than "
        "this command's (--arch transformer_wmt_en_de): 'encoder.embed_tokens.weight' is "
        f"{list(saved['encoder.embed_tokens.weight'].shape)} in the checkpoint but "
        f"[1, {saved['encoder.embed_tokens.weight'].shape[1]}] here (and "
        f"{sum(t.shape[0] > 1 for t in saved.values()) - 1} more tensors differ); and its "
        "optimizer state was saved with --criterion label_smoothed_cross_entropy and --optimizer "
        "adam (FairseqAdam), not this command's --criterion cross_entropy and --optimizer adam "
        "(AMPOptimizer); resume with the checkpoint's flags for these, or give another "
        "--save-dir to train this model from the start")

    criterion = type("LabelSmoothedCrossEntropyCriterion", (), {})()
    amp = trainer(saved, criterion, AMPOptimizer, criterion_name="label_smoothed_cross_entropy")
    assert str(explain_failed_resume(path, amp, False, AssertionError("Optimizer does not match"))) \
        == (f"{path}: its optimizer state was saved with --optimizer adam (FairseqAdam), not this "
            "command's --optimizer adam (AMPOptimizer): pass --reset-optimizer to go on from its "
            "weights with a new optimizer state, learning-rate schedule and update count, or give "
            "another --save-dir to train from the start")
    assert explain_failed_resume(path, amp, True, AssertionError("Optimizer does not match")) is None
    same = trainer(saved, criterion, type("FairseqAdam", (), {}),
                   criterion_name="label_smoothed_cross_entropy")
    assert explain_failed_resume(path, same, False, failed) is None
