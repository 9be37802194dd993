"""The folder lock on a file system without flock (Lustre without ``-o flock``, some NFS): flock
raises ENOLCK there, and the lock becomes its file's exclusive creation, said once on stderr."""
import errno
import fcntl
import json
import os
import socket
import threading

import pytest

from multipath_nmt import folder_locks
from multipath_nmt.folder_locks import FolderInUseError, FolderLock
from multipath_nmt.recipe import RecipeError
from multipath_nmt.recipe.save_dir import check_save_dir


@pytest.fixture
def no_flock(monkeypatch):
    def refused(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", refused)
    monkeypatch.setattr(folder_locks, "_said_fallback", False)


def test_without_flock_the_lock_keeps_out_a_second_holder_and_says_so_once(no_flock, tmp_path,
                                                                          capsys):
    path = tmp_path / "work" / "held.lock"
    lock = FolderLock(path).acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    with pytest.raises(FolderInUseError, match=f"work is in use by pid {os.getpid()} on "):
        FolderLock(path).acquire()
    lock.release()
    assert not path.exists()
    FolderLock(path).acquire().release()
    said = capsys.readouterr().err.splitlines()
    assert said == [f"multipath_nmt: locking {path.parent} by creating held.lock, flock is not "
                    "supported there (ENOLCK); a lock file left by a run killed on another host "
                    "must be removed by hand"]


def test_without_flock_a_lock_file_of_a_dead_process_here_is_taken_over(no_flock, tmp_path):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid of this host that no longer exists
    path = tmp_path / "held.lock"
    path.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "then",
                                "command": "killed"}) + "\n")
    FolderLock(path).acquire().release()


def test_without_flock_a_lock_file_of_another_host_refuses_naming_it(no_flock, tmp_path):
    path = tmp_path / "held.lock"
    path.write_text(json.dumps({"pid": 1, "host": "node-17", "started": "then",
                                "command": "fairseq-train data-bin"}) + "\n")
    with pytest.raises(FolderInUseError, match="in use by pid 1 on node-17, started then "
                                               r"\(fairseq-train data-bin\)"):
        FolderLock(path).acquire()
    assert path.exists()


def test_without_flock_a_waiting_run_takes_the_lock_once_it_is_released(no_flock, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(folder_locks, "_RETRY_SECONDS", 0.05)
    path = tmp_path / "held.lock"
    holder = FolderLock(path).acquire()
    waits = []
    timer = threading.Timer(0.3, holder.release)
    timer.start()
    waiter = FolderLock(path).acquire(wait=True, on_wait=waits.append)
    timer.join()
    assert len(waits) == 1 and "pid" in waits[0]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    waiter.release()


def test_the_creation_lock_is_chosen_by_the_switch_without_trying_flock(tmp_path, monkeypatch,
                                                                       capsys):
    def never(fd, operation):
        raise AssertionError("flock was tried")
    monkeypatch.setattr(fcntl, "flock", never)
    monkeypatch.setattr(folder_locks, "_said_fallback", False)
    monkeypatch.setenv("MULTIPATH_NMT_LOCK", "create")
    FolderLock(tmp_path / "held.lock").acquire().release()
    assert "as MULTIPATH_NMT_LOCK=create asks" in capsys.readouterr().err


def test_another_flock_error_is_raised_and_leaves_no_lock_file(tmp_path, monkeypatch):
    def failing(fd, operation):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(fcntl, "flock", failing)
    with pytest.raises(OSError, match="Input/output error"):
        FolderLock(tmp_path / "held.lock").acquire()


def test_train_sh_s_save_dir_check_passes_without_flock(no_flock, tmp_path):
    """Where flock is refused, the check before training is not "cannot write SAVE_DIR"."""
    check_save_dir(tmp_path / "checkpoints")
    assert not (tmp_path / "checkpoints" / folder_locks.SAVE_DIR_LOCK).exists()
    FolderLock(tmp_path / "checkpoints" / folder_locks.SAVE_DIR_LOCK).acquire()
    with pytest.raises(RecipeError, match="another training run writes its checkpoints there"):
        check_save_dir(tmp_path / "checkpoints")
