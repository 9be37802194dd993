"""Writing checkpoints: atomically (:func:`save_atomically`: a temporary file in the destination
folder, fsynced and renamed into place, through :mod:`multipath_nmt.atomic_files`; a failed write
removes the partial file and raises :class:`~multipath_nmt.checkpoint_io.CheckpointSaveError`,
earlier checkpoints untouched), in the background (:class:`AsynchronousWriter`, for fairseq's
``--write-checkpoints-asynchronously``), and which files this process wrote since a mark
(:func:`write_mark`, :func:`written_since`)."""
import concurrent.futures
import errno
import itertools
import logging
import os
import threading

import torch

from multipath_nmt import atomic_files
from multipath_nmt.checkpoint_io import CheckpointSaveError
from multipath_nmt.checkpoint_io.reading import _torch_reason

logger = logging.getLogger(__name__)


def _os_error(err):
    for candidate in (err, err.__cause__, err.__context__):
        if isinstance(candidate, OSError) and candidate.strerror:
            return candidate
    return None


def _errno(err):
    return getattr(_os_error(err), "errno", None)


def _reason(err):
    os_error = _os_error(err)
    if os_error is not None:
        return f"{os_error.strerror}, errno {os_error.errno}"
    return _torch_reason(err)


def write_atomically(path, write, ticket=None):
    """:func:`multipath_nmt.atomic_files.write_atomically` (``path`` is left as it was on any
    failure, no temporary file stays behind), its errors as one :class:`CheckpointSaveError`.
    A file written is recorded (:func:`written_since`) under ``ticket``, the number of the save
    it belongs to (a new one if None)."""
    if ticket is None:
        ticket = next(_tickets)
    try:
        atomic_files.write_atomically(path, write)
        _record_written(path, ticket)
    except CheckpointSaveError:
        raise
    except Exception as err:
        limit = " or raise the file-size limit (ulimit -f)" if _errno(err) == errno.EFBIG else ""
        raise CheckpointSaveError(
            str(path), f"could not be written ({_reason(err)}); the partial file was removed and "
                       "the checkpoints saved before are unchanged. Free disk space (or keep fewer "
                       f"checkpoints: --keep-last-epochs, --keep-interval-updates){limit} and run the "
                       "same command again") from err


def save_atomically(obj, path):
    """``torch.save(obj)`` to ``path`` through :func:`write_atomically`."""
    write_atomically(path, lambda out: torch.save(obj, out))


# --- what this process wrote ----------------------------------------------------------------

# A ticket is taken when a write is asked for (an asynchronous one completes later, after writes
# asked for since). path -> (ticket, completion number) of the write that last completed it;
# written to by the asynchronous writer's thread too, hence the lock.
_written = {}
_written_lock = threading.Lock()
_tickets = itertools.count(1)
_completions = itertools.count(1)


def _record_written(path, ticket):
    with _written_lock:
        _written[os.path.abspath(str(path))] = (ticket, next(_completions))


def write_mark():
    """A mark to pass to :func:`written_since` later."""
    return next(_tickets)


def written_since(mark):
    """The files this process completed for writes asked for after ``mark`` (:func:`write_mark`),
    in the order they completed. A write asked for before the mark is not one of them, even if
    the asynchronous writer completed it after."""
    with _written_lock:
        return [path for path, (ticket, _) in sorted(_written.items(), key=lambda item: item[1][1])
                if ticket > mark]


# --- asynchronous saves ------------------------------------------------------------------------

class AsynchronousWriter:
    """Writes checkpoints on one background thread (``--write-checkpoints-asynchronously``).

    Each job writes the same bytes to one or more paths, each through :func:`write_atomically`
    (a temporary file, fsynced, renamed over the path): a kill at any moment leaves every path
    either as it was or complete. Jobs run one after the other, in the order submitted. A path
    that cannot be written is logged at once in one line and the job goes on with its other
    paths; the failed paths are written again from the same bytes, in the training process, at
    the next submit and when the writes are awaited (:meth:`write_failed_again`): an I/O error
    that passes (a network file system's blip) costs nothing, one that stays stops training with
    its :class:`CheckpointSaveError` line. "Saved checkpoint" is logged for a path once written.
    """

    def __init__(self):
        self._executor = None
        self._jobs = []  # futures not yet checked, oldest first
        self._lock = threading.Lock()

    def submit(self, paths, chunks, described=""):
        """Write the concatenated ``chunks`` (bytes-like, kept by reference until written) to each
        of ``paths`` in turn; returns at once (after writing again what failed before).
        ``described`` follows the path in the "Saved checkpoint" line, e.g. ``(epoch 1 @ 4
        updates)``."""
        self.write_failed_again()
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="multipath_nmt-checkpoint-writer")
            self._jobs.append(self._executor.submit(
                _FailedWrites(list(paths), list(chunks), next(_tickets), described).write))

    def wait(self, pending=0):
        """Block until at most ``pending`` jobs are still to finish (0: all of them)."""
        with self._lock:
            running = [job for job in self._jobs if not job.done()]
        if len(running) > pending:
            concurrent.futures.wait(running[:len(running) - pending])

    def write_failed_again(self):
        """Write again, here and now, the paths that finished jobs failed to write; raise the
        :class:`CheckpointSaveError` of the first that fails again."""
        with self._lock:
            done = [job for job in self._jobs if job.done()]
            self._jobs = [job for job in self._jobs if not job.done()]
        for job in done:
            failed = job.result()
            if failed.paths:
                failed.write(again=True)

    def join(self):
        """Wait for every job, then write again what failed; raise the first error."""
        self.wait()
        self.write_failed_again()


class _FailedWrites:
    """One job's bytes and the paths still to write them to (all, before it runs)."""

    def __init__(self, paths, chunks, ticket, described):
        self.paths, self.chunks, self.ticket, self.described = paths, chunks, ticket, described

    def _write(self, out):
        for chunk in self.chunks:
            out.write(chunk)

    def write(self, again=False):
        """Write every path; on the background thread a failed path is logged and kept for
        later (returns ``self``), written again its error is raised."""
        failed = []
        for path in self.paths:
            try:
                write_atomically(path, self._write, self.ticket)
            except CheckpointSaveError as err:
                if again:
                    raise
                failed.append(path)
                logger.error(f"{path}: the background write failed ({_reason(err.__cause__ or err)}); "
                             "training goes on, and the next save or the end of the run writes "
                             "it again (the error stops training if it stays)")
                continue
            logger.info(f"Saved checkpoint {path} {self.described}".rstrip()
                        + (" (written again after the failed write)" if again else ""))
        self.paths = failed
        if not failed:
            self.chunks = None  # the bytes are no longer needed
        return self


asynchronous_writer = AsynchronousWriter()
