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
* Left alone: ``--no-save`` (nothing is written), remote save dirs (``://``: flock is local).

Switched off with ``MULTIPATH_NMT_PATCHES=-save_dirs``. Proved by
tests/test_checkpoints.py::test_a_second_run_on_a_live_save_dir_is_refused.
"""
import argparse
import atexit
import functools
import os
import sys

from multipath_nmt.folder_locks import FolderInUseError, FolderLock
from multipath_nmt.fairseq_patches.preemption import _train_modules
from multipath_nmt.fairseq_patches.wrapping import one_line_excepthook, wrap

LOCK = "fairseq-train.lock"


class SaveDirInUseError(FolderInUseError):
    pass


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
        try:
            lock.acquire()
        except FolderInUseError as err:
            raise SaveDirInUseError(f"--save-dir {err}: another training run writes its "
                                    "checkpoints there; wait for it to end, or give this run "
                                    "another --save-dir") from None
        # a distributed rank leaves with os._exit after the atexit functions (preemption)
        atexit.register(lock.release)
        try:
            return main(cfg, *args, **kwargs)
        finally:
            atexit.unregister(lock.release)
            lock.release()

    return main_holding_the_save_dir


def _one_line_errors(previous_hook):
    return one_line_excepthook(previous_hook, SaveDirInUseError)


def install():
    for module in _train_modules():
        wrap(module, "main", _holding_the_save_dir)
    wrap(sys, "excepthook", _one_line_errors)
