"""The save-dir and work-dir locks with fairseq's default flags (one data-loader worker,
validation on), which the rest of the suite does not use: a forked child never holds its parent's
lock, a refused train.sh writes nothing into the save dir, and a save dir that cannot be written
is one line in fairseq-train and train.sh before any work.

The suite's other trainings run ``--num-workers 0 --disable-validation`` (conftest.TRAIN_FLAGS);
here those two are left out, so every training forks its data-loader workers as a user's does.
"""
import errno
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_MODEL, TRAIN_FLAGS, USER_DIR, run_command, run_fairseq
from helpers.processes import process_tree
from helpers.signals import alive, run_and_signal
from helpers.training import (MODELS, SMALL_BATCHES, UPDATE_LOGGED, load_model_state,
                              read_until, started)

from multipath_nmt.fairseq_patches.save_dirs import LOCK
from multipath_nmt.folder_locks import SAVE_DIR_FILES, FolderLock


def _without_loader_and_validation_flags(flags):
    """``flags`` less ``--num-workers 0`` and ``--disable-validation``: fairseq's defaults."""
    kept, words = [], list(flags)
    while words:
        word = words.pop(0)
        if word == "--num-workers":
            words.pop(0)
        elif word != "--disable-validation":
            kept.append(word)
    return kept


DEFAULT_FLAGS = _without_loader_and_validation_flags(TRAIN_FLAGS)


def default_train_command(data, save_dir, *extra):
    """fairseq-train of the tiny baseline with fairseq's default data loading and validation."""
    return [sys.executable, "-m", "fairseq_cli.train", str(data), *MODELS["baseline"],
            *DEFAULT_FLAGS, *SMALL_BATCHES, "--save-dir", str(save_dir), "--user-dir",
            str(USER_DIR), *map(str, extra)]


def _wait_until_gone(pids, timeout=120):
    """Wait (polling) until none of ``pids`` runs; SIGKILL those left after ``timeout`` s.
    Returns those that had to be killed."""
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def _open_on(pid, path):
    """Whether process ``pid`` has a file descriptor open on ``path``."""
    folder = f"/proc/{pid}/fd"
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(folder, name)) == str(path):
                return True
        except OSError:
            pass
    return False


def _lock_is_free(path):
    """Take and give back the lock file ``path`` (raises FolderInUseError, naming the holder,
    when another process holds it)."""
    lock = FolderLock(path)
    lock.acquire()
    lock.release()


# --- fault: a forked child held its parent's lock ---------------------------------------------

# Takes a work dir's lock as multipath-prepare does, forks a child as its pools do and waits to be
# killed; the child prints its pid and waits until the file argv[2] exists.
HOLDER_WITH_A_CHILD = r"""
import multiprocessing, os, sys, time
from multipath_nmt.pipeline.stages import work_dir_locked

def wait_for_the_release_file():
    print(os.getpid(), flush=True)  # running: it has been through the fork's hooks
    deadline = time.monotonic() + 300
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.01)

with work_dir_locked(sys.argv[1]):
    child = multiprocessing.get_context("fork").Process(target=wait_for_the_release_file)
    child.start()
    time.sleep(300)
"""


@pytest.mark.process
def test_the_work_dir_lock_dies_with_its_holder_though_a_forked_child_lives(tmp_path):
    """multipath-prepare's work-dir lock, its holder killed with SIGKILL while a forked child of
    it (a pool worker) still runs: the next run takes the lock at once. The child inherited the
    lock's file descriptor, and with it the lock, which it kept until it ended."""
    from multipath_nmt.pipeline.stages import LOCK as WORK_DIR_LOCK

    work, release = tmp_path / "work", tmp_path / "release"
    child = None
    with started([sys.executable, "-c", HOLDER_WITH_A_CHILD, work, release], 300) as holder:
        try:
            child = int(holder.stdout.readline())
            assert not _open_on(child, work / WORK_DIR_LOCK)
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()
            assert alive(child)
            # a lock the child kept would refuse this, naming the dead holder
            _lock_is_free(work / WORK_DIR_LOCK)
            assert alive(child)  # so the lock was free while the child lived
        finally:
            release.touch()
            if child is not None:
                assert _wait_until_gone([child]) == []


def test_a_forked_child_forgets_the_lock_and_cannot_remove_its_file(tmp_path):
    """In a forked child the lock is not held (its descriptor is closed) and release() does
    nothing: the parent's lock file stays."""
    lock = FolderLock(tmp_path / "held.lock").acquire()
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, then leave without pytest's clean-up
            try:
                held_fd = lock._fd
                lock.release()
                os.write(write_end, json.dumps({"fd": held_fd}).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as report:
            seen = json.loads(report.read())
        os.waitpid(pid, 0)
        assert seen == {"fd": None}
        assert (tmp_path / "held.lock").exists()
        with pytest.raises(Exception, match="is in use by pid"):
            FolderLock(tmp_path / "held.lock").acquire()
    finally:
        lock.release()


@pytest.mark.slow
@pytest.mark.process
def test_fairseq_train_killed_with_sigkill_frees_its_save_dir_at_once(toy_data_bin, tmp_path):
    """fairseq-train with its default data loading (one forked worker) and validation, killed
    with SIGKILL: its data-loader worker, which lives on a few seconds, holds no descriptor of
    the save dir's lock, and the same command run again at once is not refused. A worker that
    kept the lock would hold it those seconds, and the rerun would be refused, naming the dead
    process."""
    save = tmp_path / "ckpt"
    command = default_train_command(toy_data_bin, save, "--max-update", 100000)
    with started(command, timeout=300) as first:
        read_until(first, command, UPDATE_LOGGED.search, "an update")
        loaders = process_tree(first.pid)[1:]
        assert loaders, "no data-loader worker"  # fairseq's default --num-workers 1
        assert [pid for pid in loaders if _open_on(pid, save / LOCK)] == []
        assert _open_on(first.pid, save / LOCK)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        _lock_is_free(save / LOCK)
    again = run_command(default_train_command(toy_data_bin, save, "--max-update", 1),
                        merge_stderr=True, timeout=300)
    assert again.returncode == 0 and "is in use by" not in again.stdout, again.stdout[-4000:]
    _wait_until_gone(loaders)


# --- fault: a refused train.sh wrote into the save dir ----------------------------------------

TRAIN_SH = Path(__file__).resolve().parents[1] / "scripts" / "train.sh"
BASELINE = "transformer_prenorm_wmt_en_de"
# fairseq-train flags after train.sh's recipe (they override it): the tiny model, small batches
TINY_ARGS = [*TINY_MODEL, *SMALL_BATCHES, "--seed", "1", "--no-progress-bar",
             "--log-format", "simple", "--log-interval", "1"]


def _digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(folder).iterdir()}


def _train_sh_in_process(monkeypatch, *args):
    """train.sh's tool run in this process, on the CPU, up to the point where it would become
    fairseq-train (which raises here instead): its SystemExit, or None if it got there."""
    from multipath_nmt.cli import recipe_scripts

    def become_fairseq_train(*unused):
        raise _BecameFairseqTrain

    monkeypatch.setenv("MULTIPATH_NMT_NUM_GPUS", "0")
    monkeypatch.setenv(SAVE_DIR_FILES, "{}")  # what train.sh sets is undone after the test
    monkeypatch.setattr(os, "execv", become_fairseq_train)
    monkeypatch.setattr(recipe_scripts, "run_launcher", become_fairseq_train)
    try:
        recipe_scripts.main(["train.sh", *map(str, args)])
    except _BecameFairseqTrain:
        return None
    except SystemExit as stop:
        return stop
    pytest.fail("train.sh neither ran fairseq-train nor stopped")


class _BecameFairseqTrain(Exception):
    pass


def test_train_sh_on_a_save_dir_in_use_is_refused_in_one_line_and_writes_nothing(
        toy_data_bin, tmp_path, monkeypatch):
    """Another run holds the save dir (here this process, as a run's rank 0 would): train.sh
    stops in one line naming it before it starts anything, and the save dir is unchanged: were it
    to rewrite train-sh-batch.json first, with its own micro-batch, the first run's own command
    could not continue its epoch."""
    import socket

    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "train-sh-batch.json").write_text('{"max_tokens": 4096}')
    holder = FolderLock(save / LOCK).acquire()
    try:
        before = _digests(save)
        stop = _train_sh_in_process(monkeypatch, toy_data_bin, save, "--arch", BASELINE,
                                    "--max-tokens", 40)
        after = _digests(save)
    finally:
        holder.release()
    assert after == before
    assert stop is not None and isinstance(stop.code, str), stop
    assert stop.code.startswith(f"train.sh: error: SAVE_DIR {save} is in use by pid {os.getpid()} "
                                f"on {socket.gethostname()}, started "), stop.code
    assert stop.code.endswith(": another training run writes its checkpoints there; wait for it "
                              "to end, or give this run another SAVE_DIR")
    assert "\n" not in stop.code


def test_train_sh_leaves_the_batch_record_to_the_run_that_holds_the_save_dir(
        toy_data_bin, tmp_path, monkeypatch):
    """train.sh writes nothing into the save dir itself (not even its batch record): it asks
    fairseq-train's rank 0 to write the record once it holds the save dir's lock."""
    save = tmp_path / "ckpt"
    assert _train_sh_in_process(monkeypatch, toy_data_bin, save, "--arch", BASELINE,
                                "--max-tokens", 40) is None
    assert list(save.iterdir()) == []
    asked = json.loads(os.environ[SAVE_DIR_FILES])
    assert list(asked) == ["train-sh-batch.json"]
    assert 0 < json.loads(asked["train-sh-batch.json"])["max_tokens"] <= 40


def _lock_holder_pid(save):
    with open(save / LOCK) as f:
        return json.loads(f.readline())["pid"]


@pytest.mark.slow
@pytest.mark.process
def test_a_refused_train_sh_leaves_the_first_run_able_to_resume(toy_data_bin, tmp_path):
    """train.sh with fairseq's default data loading and validation, saving every 2 updates; a
    second train.sh on its save dir with another micro-batch (--max-tokens 40), while the first
    holds it, is refused in one line and changes no file; the first run, killed, resumes with
    its own command. Were the refused run to overwrite train-sh-batch.json, the resume would stop
    with "cannot continue epoch 1 where the checkpoint stopped"."""
    save = tmp_path / "ckpt"
    python = sys.executable

    def train_sh(*extra):
        return ["env", f"PYTHON={python}", "MULTIPATH_NMT_NUM_GPUS=0", "bash", str(TRAIN_SH),
                str(toy_data_bin), str(save), "--arch", BASELINE, *TINY_ARGS, *map(str, extra)]

    first_command = train_sh("--max-update", 100000, "--save-interval-updates", 2)
    with started(first_command, timeout=300) as first:
        read_until(first, first_command, lambda line: "Saved checkpoint" in line, "a save")
        read_until(first, first_command, UPDATE_LOGGED.search, "an update after its save")
        holder = _lock_holder_pid(save)
        os.kill(holder, signal.SIGSTOP)  # writes nothing while the second tries
        try:
            before = _digests(save)
            second = run_command(train_sh("--max-tokens", 40, "--max-update", 100000),
                                 merge_stderr=True, timeout=300)
            after = _digests(save)
        finally:
            os.kill(holder, signal.SIGCONT)
    assert after == before
    assert second.returncode == 1 and "Traceback" not in second.stdout, second.stdout[-4000:]
    assert second.stdout.strip().splitlines()[-1].startswith(
        f"train.sh: error: SAVE_DIR {save} is in use by pid {holder} on "), second.stdout[-4000:]
    _, at = load_model_state(save / "checkpoint_last.pt")
    code, output = run_and_signal(first_command, at + 1, signal.SIGTERM, timeout=300)
    assert code == 143 and "cannot continue" not in output, output[-4000:]
    assert f"(epoch 1 @ {at} updates)" in output



# --- fault: a save dir that cannot be written was a traceback ---------------------------------

def _dangling_symlink(tmp_path):
    link = tmp_path / "ckpt"
    link.symlink_to(tmp_path / "gone")
    return link, f"{link} is a symbolic link to {tmp_path / 'gone'}, which does not exist"


def _under_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    return (tmp_path / "file" / "ckpt", f"cannot create {tmp_path / 'file' / 'ckpt'}: "
            f"{tmp_path / 'file'} is a file, not a folder")


REAL_CASES = {"dangling-symlink": _dangling_symlink, "under-a-file": _under_a_file}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(REAL_CASES))
def test_fairseq_train_on_a_save_dir_it_cannot_write_says_one_line(case, toy_data_bin, tmp_path):
    """A dangling symbolic link, a path under a file: one line before any work (a traceback of
    the lock's makedirs before)."""
    save, problem = REAL_CASES[case](tmp_path)
    proc = run_fairseq("train", toy_data_bin, *MODELS["baseline"], *DEFAULT_FLAGS,
                       "--save-dir", save, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.strip().splitlines()[-1] == \
        f"train.py: error: {problem}; choose another --save-dir"
    assert "num_updates" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", list(REAL_CASES))
def test_train_sh_on_a_save_dir_it_cannot_write_says_one_line(case, toy_data_bin, tmp_path,
                                                               monkeypatch):
    """The same from train.sh, before it starts fairseq-train (a traceback of its makedirs
    before)."""
    save, problem = REAL_CASES[case](tmp_path)
    stop = _train_sh_in_process(monkeypatch, toy_data_bin, save, "--arch", BASELINE)
    assert stop is not None and stop.code == f"train.sh: error: {problem}; choose another SAVE_DIR"


def _failing(monkeypatch, module, name, code, under):
    """``module.<name>`` (an os function taking a path first) raising OSError ``code`` for
    paths under ``under``: a read-only file system or no permission, which root (the tests)
    cannot get from chmod."""
    original = getattr(module, name)

    def failing(path, *args, **kwargs):
        if str(path).startswith(str(under)):
            raise OSError(code, os.strerror(code), str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(module, name, failing)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES], ids=["read-only", "no-permission"])
@pytest.mark.parametrize("where", ["beside", "inside"])
def test_a_save_dir_that_cannot_be_written_is_one_line_in_both_tools(code, where, toy_data_bin,
                                                                      tmp_path, monkeypatch):
    """Simulated (the tests run as root): every folder made beside the save dir (the probe
    before any work) fails, or only the lock file inside it (the first write). fairseq-train's
    save-dir patch, called here in-process, raises the error its excepthook prints as one line
    (as for the real cases above); train.sh stops with its own line."""
    from fairseq import options

    from multipath_nmt.fairseq_patches import save_dirs

    save = tmp_path / "ckpt"
    save.mkdir()
    if where == "beside":
        _failing(monkeypatch, os, "mkdir", code, tmp_path)
    else:
        _failing(monkeypatch, os, "open", code, save)
    problem = f"cannot write {save}: {os.strerror(code)} (errno {code})"

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(toy_data_bin), *MODELS["baseline"], "--cpu",
                                                "--save-dir", str(save)])
    with pytest.raises(save_dirs.SaveDirError) as raised:
        save_dirs._holding_the_save_dir(lambda cfg: pytest.fail("fairseq-train ran"))(args)
    assert str(raised.value) == f"{problem}; choose another --save-dir"

    stop = _train_sh_in_process(monkeypatch, toy_data_bin, save, "--arch", BASELINE)
    assert stop is not None and stop.code == f"train.sh: error: {problem}; choose another SAVE_DIR"
