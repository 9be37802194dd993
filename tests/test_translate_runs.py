"""scripts/translate.sh decoding for real with a trained toy model: a SIGTERM to translate.sh
stops its fairseq-generate too (nothing decodes on after it exited 143)."""
import os
import shutil
import signal
import threading
import time

import pytest

from conftest import ROOT, run_command, script_env, start_command
from helpers.processes import kill_tree, process_tree

TRANSLATE_SH = ROOT / "scripts" / "translate.sh"
WAIT = 180  # s: the longest any condition below is waited for, on a busy machine


def _wait_for(condition, what, proc):
    """Poll ``condition`` until it holds; fail after :data:`WAIT` s or when ``proc`` ended."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if proc.returncode is not None or time.monotonic() > deadline:
            pytest.fail(f"translate.sh {'exited' if proc.returncode is not None else 'ran'} "
                        f"before {what}")
        time.sleep(0.05)


def _repeated_test_set(data_bin, folder, times):
    """A copy of ``data_bin``'s dictionaries with its test split ``times`` over, so that the
    decoder runs long enough to be caught running (its output is block-buffered: nothing shows
    in the file before the first 8 KiB)."""
    from fairseq.data import indexed_dataset

    folder.mkdir()
    for name in ("dict.en.txt", "dict.de.txt"):
        shutil.copy(data_bin / name, folder / name)
    for lang in ("en", "de"):
        source = indexed_dataset.MMapIndexedDataset(str(data_bin / f"test.en-de.{lang}"))
        prefix = str(folder / f"test.en-de.{lang}")
        builder = indexed_dataset.MMapIndexedDatasetBuilder(prefix + ".bin",
                                                            dtype=source._index.dtype)
        for _ in range(times):
            for i in range(len(source)):
                builder.add_item(source[i])
        builder.finalize(prefix + ".idx")
    return folder


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _decoder(pid):
    """The fairseq-generate process below translate.sh's ``pid`` and its descendants."""
    for member in process_tree(pid)[1:]:
        try:
            with open(f"/proc/{member}/cmdline", "rb") as f:
                if b"fairseq_cli.generate" in f.read().split(b"\0"):
                    return process_tree(member)
        except OSError:
            continue
    return []


@pytest.mark.slow
@pytest.mark.process
def test_sigterm_to_translate_sh_stops_its_decoder_and_exits_143(toy_baseline_run, toy_data_bin,
                                                                 tmp_path):
    """SIGTERM to translate.sh's pid alone (as a scheduler sends it): fairseq-generate is
    stopped, waited for, and translate.sh exits 143 once it is gone. The decoder is held
    (SIGSTOP) while translate.sh is signalled, so that it cannot finish on its own first on a
    fast machine, and let go at once: then translate.sh must not have exited before it ended."""
    data_bin = _repeated_test_set(toy_data_bin, tmp_path / "data-bin", 100)
    out = tmp_path / "mp"
    partial = tmp_path / "mp.generate.tmp"
    proc = start_command(["bash", TRANSLATE_SH, data_bin, toy_baseline_run / "checkpoint_last.pt",
                          out, "--batch-size", "1"], env=script_env(MULTIPATH_NMT_NUM_GPUS="0"))
    lines, decoder = [], []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    watchdog = threading.Timer(WAIT, kill_tree, (proc.pid,))
    watchdog.start()
    try:
        _wait_for(lambda: partial.exists() and b"H-" in partial.read_bytes(),
                  "fairseq-generate wrote a hypothesis", proc)
        decoder = _decoder(proc.pid)
        assert decoder, process_tree(proc.pid)
        for pid in decoder:
            os.kill(pid, signal.SIGSTOP)
        os.kill(proc.pid, signal.SIGTERM)
        for pid in decoder:
            os.kill(pid, signal.SIGCONT)
        proc.wait()
        still_decoding = [pid for pid in decoder if _alive(pid)]
    finally:
        timed_out = watchdog.finished.is_set()
        watchdog.cancel()
        for pid in decoder:  # before the test ends, whatever it found
            kill_tree(pid)
        if proc.returncode is None:
            kill_tree(proc.pid)
            proc.wait()
        reader.join(WAIT)  # the decoder's stderr is translate.sh's: at its end, the pipe's
        proc.stdout.close()
    output = "".join(lines)
    assert not timed_out, output
    assert not still_decoding, f"fairseq-generate decodes on after translate.sh exited\n{output}"
    assert proc.returncode == 143, output  # an exit status, not death by the signal (-15)
    assert (f"translate.sh: SIGTERM: fairseq-generate was stopped (its output so far is in "
            f"{partial}); exiting with status 143") in output
    assert not (tmp_path / "mp.hyp").exists() and not (tmp_path / "mp.generate").exists()


@pytest.mark.slow
@pytest.mark.process
def test_a_test_sentence_longer_than_the_models_positions_is_one_line(toy_baseline_run,
                                                                      toy_data_bin, tmp_path):
    """translate.sh refuses a test set with a sentence longer than the model's positions, in
    one line from fairseq-generate before it translates anything (it was a traceback and no
    .hyp); it does not skip the sentence, which would score a subset of the test set."""
    from test_data_checks import too_long_line, with_a_long_sentence

    data = with_a_long_sentence(toy_data_bin, tmp_path, "test")
    proc = run_command(["bash", TRANSLATE_SH, data, toy_baseline_run / "checkpoint_last.pt",
                        tmp_path / "mp"], env=script_env(MULTIPATH_NMT_NUM_GPUS="0"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-6000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == f"generate.py: error: {too_long_line(data, 'test')}"
    assert not (tmp_path / "mp.hyp").exists()
    assert b"\nH-" not in (tmp_path / "mp.generate.tmp").read_bytes()  # nothing translated
