"""One process at a time in a folder: an exclusive ``fcntl.flock`` on a lock file inside it.

``multipath-prepare`` holds one on its work dir, ``fairseq-train`` (rank 0) one on its
``--save-dir``. The kernel releases a flock when its holder ends, ``kill -9`` included, so a lock
never outlives its run: a lock file left behind by a killed run is taken by the next one. While
held, the file says who holds it (pid, host, start time, command), for the message of a refused
or waiting run; a run that ends normally removes it.
"""
import fcntl
import json
import os
import socket
import sys
import time


class FolderInUseError(RuntimeError):
    """The folder is locked by another process; the message is one line naming the folder and
    the holder."""


class FolderLock:
    """The lock file ``path``: :meth:`acquire` it, :meth:`release` it (or use ``with``)."""

    def __init__(self, path):
        self.path = str(path)
        self._fd = None

    def acquire(self, wait=False, on_wait=None):
        """Take the lock. Held by another process: raise :class:`FolderInUseError` naming the
        holder, or with ``wait`` call ``on_wait(holder)`` once and block until it is free."""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        waited = False
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = describe_holder(self.path)
                if not wait:
                    os.close(fd)
                    raise FolderInUseError(f"{os.path.dirname(os.path.abspath(self.path))} is in use "
                                           f"by {holder}") from None
                if on_wait is not None and not waited:
                    on_wait(holder)
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # its holder removed the file as we waited for it: lock the one there now
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, (json.dumps(_this_process()) + "\n").encode("utf-8"))
        return self

    def release(self):
        """Remove the lock file and release the lock (nothing if not held)."""
        if self._fd is None:
            return
        # removed while still locked: a process that opened it meanwhile finds, once it holds
        # the lock, that the path no longer names its file, and starts over (acquire)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc_info):
        self.release()


def _same_file(fd, path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _this_process():
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)}


def describe_holder(path):
    """Who holds the lock file ``path``, as written by its holder, in words."""
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.loads(f.readline())
        return (f"pid {holder['pid']} on {holder['host']}, started {holder['started']} "
                f"({_shortened(holder['command'])})")
    except (OSError, ValueError, KeyError, TypeError):  # still being written, or not ours
        return f"another process (it holds {path})"


def _shortened(command, limit=160):
    return command if len(command) <= limit else command[:limit - 3] + "..."
