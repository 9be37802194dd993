"""One process at a time in a folder: an exclusive ``fcntl.flock`` on a lock file inside it.

``multipath-prepare`` holds one on its work dir, ``fairseq-train`` (rank 0) one on its
``--save-dir``. The kernel releases a flock when its holder ends, ``kill -9`` included, so a lock
never outlives its run: a lock file left behind by a killed run is taken by the next one. While
held, the file says who holds it (pid, host, start time, command), for the message of a refused
or waiting run; a run that ends normally removes it.

Only the process that took a lock holds it, never a child forked from it. A flock belongs to
the open file description, which ``fork`` shares: a data-loader worker of fairseq-train or a pool
worker of multipath-prepare forked while the lock is held would otherwise keep it after its
parent is killed (a data-loader worker lives ~5 s more), and the next run is refused in the name
of a dead process. So every child forked with ``os.fork`` (multiprocessing's fork start method,
the one Linux uses) closes the descriptors of its parent's locks first (``os.register_at_fork``),
and forgets them: ``release`` in a child neither unlinks the parent's file nor unlocks it. A
program started with ``exec`` never has them: the descriptor is close-on-exec (``os.open``'s
default), and ``subprocess`` forks without the hook only to ``exec`` at once.

Why flock with that hook, rather than a lock that ``fork`` does not pass on: a POSIX record lock
(``fcntl.lockf``) is held by the process, not inherited by its children, but it does not exclude
a second holder in the same process, and it is dropped as soon as the holder closes any
descriptor of the file (reading the holder line would release it); an open-file-description lock
(``F_OFD_SETLK``) is shared through ``fork`` exactly as a flock is.

Where the file system refuses flock (Lustre mounted without ``-o flock``, some NFS: ENOLCK,
ENOSYS, EOPNOTSUPP, EINVAL), or with ``MULTIPATH_NMT_LOCK=create``, the lock is the lock file's
exclusive creation (``O_CREAT | O_EXCL``) instead, said once on stderr. No kernel releases that
one: a file left by a killed run is taken over when its holder line names a process of this host
that no longer exists; one naming another host refuses the next run until it is removed by hand.
"""
import errno
import fcntl
import json
import os
import socket
import sys
import time

# The lock file of a fairseq-train --save-dir, held by the run's rank 0
# (multipath_nmt/fairseq_patches/save_dirs.py) and checked by train.sh before it starts one.
SAVE_DIR_LOCK = "fairseq-train.lock"
# The files that train.sh asks fairseq-train's rank 0 to write into the save dir once it holds
# its lock, a JSON object {file name: text} in this environment variable: nothing is written
# into a save dir by a run that does not hold it.
SAVE_DIR_FILES = "MULTIPATH_NMT_SAVE_DIR_FILES"

# flock's errors on a file system that does not support it
_FLOCK_UNSUPPORTED = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}
LOCK_MODE = "MULTIPATH_NMT_LOCK"  # "create": take the exclusive-creation lock without trying flock
_RETRY_SECONDS = 5  # how often a waiting exclusive-creation lock looks again
_STALE_EMPTY_SECONDS = 60  # an exclusive-creation lock file still empty after this is left over
_said_fallback = False

_held = set()  # the locks this process holds
_descriptors = set()  # their descriptors, and that of a lock being waited for


def _forget_held_locks_in_child():
    """In a child just forked: close the parent's lock descriptors, forget its locks."""
    for fd in _descriptors:
        try:
            os.close(fd)
        except OSError:
            pass
    _descriptors.clear()
    for lock in _held:
        lock._fd = None
    _held.clear()


os.register_at_fork(after_in_child=_forget_held_locks_in_child)


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
        if os.environ.get(LOCK_MODE) == "create":
            return self._acquire_by_creation(wait, on_wait, "as MULTIPATH_NMT_LOCK=create asks")
        waited = False
        while self._fd is None:
            try:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                fd, created = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), False
            _descriptors.add(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = describe_holder(self.path)
                if not wait:
                    _descriptors.discard(fd)
                    os.close(fd)
                    raise self._in_use(holder) from None
                if on_wait is not None and not waited:
                    on_wait(holder)
                waited = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as error:  # flock refused by the file system, or another failure
                _descriptors.discard(fd)
                os.close(fd)
                if error.errno not in _FLOCK_UNSUPPORTED:
                    raise
                if created:  # the empty file this attempt made, not another run's lock
                    os.unlink(self.path)
                return self._acquire_by_creation(
                    wait, on_wait, f"flock is not supported there ({errno.errorcode[error.errno]})")
            if _same_file(fd, self.path):
                self._fd = fd
                _held.add(self)
            else:  # its holder removed the file as we waited for it: lock the one there now
                _descriptors.discard(fd)
                os.close(fd)
        os.ftruncate(self._fd, 0)
        _write_holder(self._fd)
        return self

    def _in_use(self, holder):
        return FolderInUseError(f"{os.path.dirname(os.path.abspath(self.path))} is in use by "
                                f"{holder}")

    def _acquire_by_creation(self, wait, on_wait, reason):
        """The lock as the exclusive creation of its file, for a file system without flock."""
        global _said_fallback
        if not _said_fallback:
            _said_fallback = True
            print(f"multipath_nmt: locking {os.path.dirname(os.path.abspath(self.path))} by creating "
                  f"{os.path.basename(self.path)}, {reason}; a lock file left by a run killed on "
                  f"another host must be removed by hand", file=sys.stderr)
        waited = False
        while True:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if _left_over(self.path):
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                holder = describe_holder(self.path)
                if not wait:
                    raise self._in_use(holder) from None
                if on_wait is not None and not waited:
                    on_wait(holder)
                waited = True
                time.sleep(_RETRY_SECONDS)
                continue
            _descriptors.add(fd)
            _write_holder(fd)
            os.fsync(fd)
            self._fd = fd
            _held.add(self)
            return self

    def release(self):
        """Remove the lock file and release the lock (nothing if not held)."""
        if self._fd is None:
            return
        # removed while still locked: a process that opened it meanwhile finds, once it holds
        # the lock, that the path no longer names its file, and starts over (acquire)
        if _same_file(self._fd, self.path):
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        _held.discard(self)
        _descriptors.discard(self._fd)
        os.close(self._fd)
        self._fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc_info):
        self.release()


def _left_over(path):
    """Whether the exclusive-creation lock file ``path`` is left by a run that no longer exists:
    its holder line names a dead process of this host, or it has stayed empty a minute."""
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline()
        if not line:
            return time.time() - os.stat(path).st_mtime > _STALE_EMPTY_SECONDS
        holder = json.loads(line)
        if holder["host"] != socket.gethostname():
            return False
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return True
    except (OSError, ValueError, KeyError, TypeError):  # gone meanwhile, alive elsewhere, not ours
        return False
    return False


def _same_file(fd, path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _write_holder(fd):
    os.write(fd, (json.dumps(_this_process()) + "\n").encode("utf-8"))


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
