"""fairseq 0.12 reads, saves, copies and resumes checkpoints through :mod:`multipath_nmt.checkpoints`.

* ``checkpoint_utils.load_checkpoint_to_cpu`` (called by ``fairseq-train`` on resume,
  ``fairseq-generate``/``-interactive`` and our tools) becomes
  :func:`multipath_nmt.checkpoints.read_checkpoint`: every way a file can fail is one
  :class:`~multipath_nmt.checkpoints.CheckpointError` line that starts with its path.
* ``checkpoint_utils.torch_persistent_save`` leaves its ``.tmp`` file behind when the disk is full
  (after three attempts 2.5 s apart); local saves go through
  :func:`multipath_nmt.checkpoints.save_atomically` instead (the partial file is removed, earlier
  checkpoints are untouched, one-line :class:`~multipath_nmt.checkpoints.CheckpointSaveError`).
  With ``--write-checkpoints-asynchronously`` fairseq ``torch.save``-s straight into ioPath's
  asynchronous file, which cannot seek: with torch 2.13 and iopath 0.1.10 every such checkpoint
  is a zip archive without its central directory, unreadable. Here the checkpoint is serialized
  into memory first and its bytes go through the asynchronous writer (one more copy of the
  checkpoint in host memory until it is written).
* ``PathManager.copy``: fairseq saves a checkpoint atomically but *copies* it in place to
  ``checkpoint_last.pt`` (and the best/epoch copies), so a kill during the copy leaves an
  unloadable file. Local copies go through a temporary file and ``os.replace``.
* ``checkpoint_utils.load_checkpoint`` (resume): a ``checkpoint_last.pt`` that cannot be read is
  renamed to ``checkpoint_last.pt.damaged`` (never deleted) and training resumes from the newest
  readable checkpoint of the save dir, with a warning saying how many updates are trained again.
  Whether there is a ``checkpoint_last.pt`` is asked as fairseq asks it (``PathManager.exists``),
  and only a local file proven damaged (:func:`~multipath_nmt.checkpoints.proven_damage`) changes
  fairseq's course: a first launch, ``--finetune-from-model``, ``--continue-once``, remote storage
  (iopath handlers) and any file the check cannot judge go to fairseq's ``load_checkpoint``
  unchanged, which reads through ``Trainer.load_checkpoint`` and ``PathManager`` as it always
  does.
* ``Trainer.load_checkpoint`` and ``checkpoint_utils.load_model_ensemble_and_task``: a data-bin
  whose dictionaries do not match the checkpoint's embeddings is reported with both sizes and both
  paths (:func:`multipath_nmt.checkpoints.check_dictionaries`) before fairseq fails on a tensor
  shape.
* ``sys.excepthook``: an uncaught ``CheckpointError`` is printed as one line without a traceback
  (the process still exits with status 1).
"""
import functools
import inspect
import io
import os
import shutil
import sys

import torch

from multipath_nmt import checkpoints
from multipath_nmt.checkpoints import (CheckpointError, check_dictionaries, newest_readable,
                                       peek_checkpoint, proven_damage, read_checkpoint,
                                       save_atomically, saved_at, write_atomically)
from multipath_nmt.fairseq_patches.wrapping import one_line_excepthook, wrap

# The resume warnings keep the logger name users know them by (docs/troubleshooting.md).
logger = checkpoints.logger


def _reader(load):
    @functools.wraps(load)
    def load_checkpoint_to_cpu(path, arg_overrides=None, load_on_all_ranks=False):
        return read_checkpoint(path, arg_overrides, load_on_all_ranks)

    return load_checkpoint_to_cpu


def _persistent_save(original):
    @functools.wraps(original)
    def torch_persistent_save(obj, filename, async_write=False):
        if async_write:
            write_asynchronously(obj, filename)
        elif "://" in str(filename):
            original(obj, filename)
        else:
            save_atomically(obj, filename)

    return torch_persistent_save


def write_asynchronously(obj, filename):
    """fairseq's own save (``_torch_persistent_save``) into memory, then those bytes through
    ioPath's asynchronous writer."""
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    serialized = io.BytesIO()
    checkpoint_utils._torch_persistent_save(obj, serialized)
    with PathManager.opena(filename, "wb") as out:
        out.write(serialized.getbuffer())


def atomic_copy(src, dst, overwrite=False):
    """Copy through a temporary file in the destination folder, then rename over ``dst``."""
    if not overwrite and os.path.exists(dst):
        return False

    def copy_into(out):
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, length=16 << 20)

    write_atomically(dst, copy_into)
    return True


def _atomic_local_copy(copy):
    @functools.wraps(copy)
    def copy_through_a_temporary_file(src_path, dst_path, overwrite=False):
        if "://" in src_path or "://" in dst_path:  # remote storage: leave it to iopath
            return copy(src_path, dst_path, overwrite)
        return atomic_copy(src_path, dst_path, overwrite)

    return copy_through_a_temporary_file


# --- resuming ------------------------------------------------------------------------------

def _set_aside(path):
    aside, n = f"{path}.damaged", 1
    while os.path.lexists(aside):
        aside, n = f"{path}.damaged.{n}", n + 1
    os.replace(path, aside)
    return aside


def _resume_from_readable(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def load_checkpoint_or_the_newest_readable(cfg, trainer, **passthrough_args):
        from fairseq.file_io import PathManager

        suffix = trainer.checkpoint_suffix or ""
        last = os.path.join(cfg.save_dir, f"checkpoint_last{suffix}.pt")
        # fairseq's own test of a first launch (PathManager.exists, as its load_checkpoint
        # does): without a checkpoint_last.pt, --finetune-from-model, --continue-once and a
        # fresh start take fairseq's course untouched, whatever storage PathManager serves
        if cfg.restore_file != "checkpoint_last.pt" or not PathManager.exists(last):
            return load_checkpoint(cfg, trainer, **passthrough_args)
        damage = proven_damage(last)
        if damage is None:
            return load_checkpoint(cfg, trainer, **passthrough_args)
        return _resume_from_earlier(cfg, trainer, last, damage, load_checkpoint, passthrough_args)

    return load_checkpoint_or_the_newest_readable


def _all_ranks_wait(trainer):
    if trainer.data_parallel_world_size > 1:
        torch.distributed.barrier()


def _resume_from_earlier(cfg, trainer, last, damage, load_checkpoint, passthrough_args):
    try:
        _, damaged_updates = saved_at(peek_checkpoint(last) or {})
    except CheckpointError:
        damaged_updates = None
    suffix = trainer.checkpoint_suffix or ""
    found = newest_readable(cfg.save_dir, suffix, exclude={last})
    first_rank = trainer.data_parallel_rank == 0
    if found is None:
        # Every rank has seen the damaged file (and so takes this branch) before rank 0 renames
        # it, and none loads before it is gone: all start from scratch.
        _all_ranks_wait(trainer)
        aside = _set_aside(last) if first_rank else last + ".damaged"
        _all_ranks_wait(trainer)
        logger.warning(f"{damage}. Set aside as {aside}; no other checkpoint in {cfg.save_dir} "
                       f"can be read, so training starts again from update 0"
                       + (f" ({damaged_updates} updates are trained again)" if damaged_updates else ""))
        return load_checkpoint(cfg, trainer, **passthrough_args)
    path, epoch, updates = found
    if damaged_updates is not None:
        replayed = f"{max(damaged_updates - updates, 0)} updates ({updates + 1} to {damaged_updates}) are trained again"
    else:
        replayed = (f"the updates after {updates} are trained again (how many is unknown: the "
                    "damaged file does not say at which update it was saved)")
    restore_file, finetune = cfg.restore_file, cfg.finetune_from_model
    # fairseq appends the suffix to a --restore-file itself
    cfg.restore_file = path[:-len(suffix + ".pt")] + ".pt" if suffix else path
    cfg.finetune_from_model = None
    try:
        result = load_checkpoint(cfg, trainer, **passthrough_args)
    finally:
        cfg.restore_file, cfg.finetune_from_model = restore_file, finetune
    # Renamed only once every rank has read its state (the load broadcasts from rank 0).
    aside = _set_aside(last) if first_rank else last + ".damaged"
    logger.warning(f"{damage}. Set aside as {aside}; resumed from {path} (epoch {epoch} @ "
                   f"{updates} updates): {replayed}")
    return result


# --- dictionaries --------------------------------------------------------------------------

def _checking_trainer_dictionaries(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def trainer_load_checkpoint(self, filename, *args, **kwargs):
        check_dictionaries(filename, self.task)
        return load_checkpoint(self, filename, *args, **kwargs)

    return trainer_load_checkpoint


def _checking_ensemble_dictionaries(load_ensemble):
    signature = inspect.signature(load_ensemble)

    @functools.wraps(load_ensemble)
    def load_model_ensemble_and_task(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        task = bound.arguments.get("task")
        if task is not None:
            for filename in bound.arguments["filenames"]:
                check_dictionaries(filename, task)
        return load_ensemble(*args, **kwargs)

    return load_model_ensemble_and_task


def _one_line_errors(previous_hook):
    return one_line_excepthook(previous_hook, CheckpointError)


def install():
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager
    from fairseq.trainer import Trainer

    wrap(checkpoint_utils, "load_checkpoint_to_cpu", _reader)
    wrap(checkpoint_utils, "torch_persistent_save", _persistent_save)
    wrap(PathManager, "copy", _atomic_local_copy)
    wrap(checkpoint_utils, "load_checkpoint", _resume_from_readable)
    wrap(checkpoint_utils, "load_model_ensemble_and_task", _checking_ensemble_dictionaries)
    wrap(Trainer, "load_checkpoint", _checking_trainer_dictionaries)
    wrap(sys, "excepthook", _one_line_errors)
