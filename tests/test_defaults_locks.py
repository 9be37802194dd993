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

from conftest import TRAIN_FLAGS, USER_DIR, run_command, start_command
from helpers.preloaded_python import process_tree
from helpers.training import MODELS, SMALL_BATCHES, UPDATE_LOGGED, stop

from multipath_nmt.fairseq_patches.save_dirs import LOCK
from multipath_nmt.folder_locks import FolderLock


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


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _wait_until_gone(pids, timeout=120):
    """Wait (polling) until none of ``pids`` runs; SIGKILL those left after ``timeout`` s.
    Returns those that had to be killed."""
    deadline = time.monotonic() + timeout
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = [pid for pid in pids if _alive(pid)]
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

# Takes a work dir's lock as multipath-prepare does, forks a child as its pools do, prints the
# child's pid and waits to be killed; the child waits until the file argv[2] exists.
HOLDER_WITH_A_CHILD = r"""
import multiprocessing, os, sys, time
from multipath_nmt.pipeline.stages import work_dir_locked

def wait_for_the_release_file():
    deadline = time.monotonic() + 300
    while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
        time.sleep(0.01)

with work_dir_locked(sys.argv[1]):
    child = multiprocessing.get_context("fork").Process(target=wait_for_the_release_file)
    child.start()
    print(child.pid, flush=True)
    time.sleep(300)
"""


def test_the_work_dir_lock_dies_with_its_holder_though_a_forked_child_lives(tmp_path):
    """multipath-prepare's work-dir lock, its holder killed with SIGKILL while a forked child of
    it (a pool worker) still runs: the next run takes the lock at once. The child inherited the
    lock's file descriptor, and with it the lock, which it kept until it ended."""
    from multipath_nmt.pipeline.stages import LOCK as WORK_DIR_LOCK

    work, release = tmp_path / "work", tmp_path / "release"
    holder = start_command([sys.executable, "-c", HOLDER_WITH_A_CHILD, work, release])
    child = None
    try:
        child = int(holder.stdout.readline())
        assert not _open_on(child, work / WORK_DIR_LOCK)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        assert _alive(child)
        _lock_is_free(work / WORK_DIR_LOCK)  # refused, naming the dead holder, before the fix
        assert _alive(child)  # so the lock was free while the child lived
    finally:
        release.touch()
        if child is not None:
            assert _wait_until_gone([child]) == []
        stop(holder)


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
def test_fairseq_train_killed_with_sigkill_frees_its_save_dir_at_once(toy_data_bin, tmp_path):
    """fairseq-train with its default data loading (one forked worker) and validation, killed
    with SIGKILL: its data-loader worker, which lives on a few seconds, holds no descriptor of
    the save dir's lock, and the same command run again at once is not refused. Its workers
    used to keep the lock (~5 s) and the rerun was refused, naming the dead process."""
    save = tmp_path / "ckpt"
    command = default_train_command(toy_data_bin, save, "--max-update", 100000)
    first = start_command(command)
    try:
        lines = []
        for line in first.stdout:
            lines.append(line)
            if UPDATE_LOGGED.search(line):
                break
        else:
            pytest.fail("".join(lines)[-4000:])
        loaders = process_tree(first.pid)[1:]
        assert loaders, "no data-loader worker"  # fairseq's default --num-workers 1
        assert [pid for pid in loaders if _open_on(pid, save / LOCK)] == []
        assert _open_on(first.pid, save / LOCK)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        _lock_is_free(save / LOCK)
    finally:
        stop(first)
    again = run_command(default_train_command(toy_data_bin, save, "--max-update", 1),
                        merge_stderr=True, timeout=300)
    assert again.returncode == 0 and "is in use by" not in again.stdout, again.stdout[-4000:]
    _wait_until_gone(loaders)
