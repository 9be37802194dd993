"""One ``fairseq-train`` run at a time per ``--save-dir``.

Stock fairseq 0.12 lets a second run start on the save dir of a live one (a requeued job whose
first instance still runs, a typo): it resumes from the first run's ``checkpoint_last.pt``, then
both overwrite the same files and both exit 0.

* ``fairseq_cli.train.main`` (each process of a run; ``--user-dir`` has installed the patch
  before ``cli_main`` calls it): the rank that writes ``checkpoint_last.pt`` (rank 0) holds an
  exclusive lock on ``SAVE_DIR/fairseq-train.lock``
  (:class:`multipath_nmt.folder_locks.FolderLock`) from before the save dir is read to the end of
  the run; the kernel frees it whatever the end (``kill -9`` included). A second run's rank 0 is
  refused before it reads anything, in one line that names the save dir and the holder
  (:class:`SaveDirInUseError`, printed by ``sys.excepthook`` without a traceback; status 1; its
  other ranks are stopped by their launcher). Only rank 0: the other ranks of one run must not
  shut each other out, and rank 0 is the one that writes.
* A save dir that cannot be written (a symbolic link to nothing, a path under a file, a
  read-only file system, no permission) is refused in one line before the lock, or when the
  lock file cannot be written (:class:`SaveDirError`); stock fairseq, and the lock alone, ended
  in a traceback.
* Once rank 0 holds the lock, it writes the files that train.sh asks for
  (:data:`multipath_nmt.folder_locks.SAVE_DIR_FILES`: its batch record): train.sh itself writes
  nothing into a save dir, which another run may hold.
* Left alone: ``--no-save`` (nothing is written), remote save dirs (``://``: flock is local).

Switched off with ``MULTIPATH_NMT_PATCHES=-save_dirs`` (and with it train.sh's batch record).
Tested with fairseq 0.12.3. Proved by
tests/test_checkpoints.py::test_a_second_run_on_a_live_save_dir_is_refused,
tests/test_defaults_locks.py::test_fairseq_train_on_a_save_dir_it_cannot_write_says_one_line,
tests/test_defaults_locks.py::test_a_save_dir_that_cannot_be_written_is_one_line_in_both_tools,
tests/test_defaults_locks.py::test_a_refused_train_sh_leaves_the_first_run_able_to_resume.
"""
import argparse
import atexit
import functools
import json
import os
import sys

from multipath_nmt.atomic_files import os_error_reason, unwritable_folder, write_text_atomically
from multipath_nmt.folder_locks import SAVE_DIR_FILES, SAVE_DIR_LOCK, FolderInUseError, FolderLock
from multipath_nmt.fairseq_patches.preemption import _train_modules
from multipath_nmt.fairseq_patches.wrapping import one_line_excepthook, wrap

LOCK = SAVE_DIR_LOCK


class SaveDirInUseError(FolderInUseError):
    pass


class SaveDirError(RuntimeError):
    """The save dir cannot be written; the message is one line naming it and the reason."""


def _cannot_write(save_dir, error):
    return SaveDirError(f"cannot write {save_dir}: {os_error_reason(error)}; choose another "
                        "--save-dir")


def _write_asked_files(save_dir):
    """The files of :data:`SAVE_DIR_FILES` (``{name: text}``), written into ``save_dir``."""
    asked = json.loads(os.environ.get(SAVE_DIR_FILES) or "{}")
    for name, text in asked.items():
        if os.path.basename(name) != name:
            raise ValueError(f"{SAVE_DIR_FILES}: {name!r} is not a file name")
        write_text_atomically(os.path.join(save_dir, name), text)


def _lock_of(cfg):
    """The lock this process of the run must hold, or None."""
    from fairseq.distributed import utils as distributed_utils

    save_dir = cfg.checkpoint.save_dir
    if cfg.checkpoint.no_save or "://" in save_dir:
        return None
    if not distributed_utils.is_master(cfg.distributed_training):
        return None
    return FolderLock(os.path.join(save_dir, LOCK))


def _holding_the_save_dir(main):
    @functools.wraps(main)
    def main_holding_the_save_dir(cfg, *args, **kwargs):
        from fairseq.dataclass.utils import convert_namespace_to_omegaconf

        config = convert_namespace_to_omegaconf(cfg) if isinstance(cfg, argparse.Namespace) else cfg
        lock = _lock_of(config)
        if lock is None:
            return main(cfg, *args, **kwargs)
        save_dir = config.checkpoint.save_dir
        problem = unwritable_folder(save_dir)
        if problem:
            raise SaveDirError(f"{problem}; choose another --save-dir")
        try:
            lock.acquire()
        except FolderInUseError as err:
            raise SaveDirInUseError(f"--save-dir {err}: another training run writes its "
                                    "checkpoints there; wait for it to end, or give this run "
                                    "another --save-dir") from None
        except OSError as error:  # the folder's own permissions, a race with the check above
            raise _cannot_write(save_dir, error) from None
        try:
            _write_asked_files(save_dir)
        except OSError as error:
            lock.release()
            raise _cannot_write(save_dir, error) from None
        # a distributed rank leaves with os._exit after the atexit functions (preemption)
        atexit.register(lock.release)
        try:
            return main(cfg, *args, **kwargs)
        finally:
            atexit.unregister(lock.release)
            lock.release()

    return main_holding_the_save_dir


def _one_line_errors(previous_hook):
    return one_line_excepthook(previous_hook, (SaveDirInUseError, SaveDirError))


def install():
    for module in _train_modules():
        wrap(module, "main", _holding_the_save_dir)
    wrap(sys, "excepthook", _one_line_errors)
