"""fairseq 0.12 reads, saves, copies and resumes checkpoints through :mod:`multipath_nmt.checkpoint_io`.

* ``checkpoint_utils.load_checkpoint_to_cpu`` (called by ``fairseq-train`` on resume,
  ``fairseq-generate``/``-interactive`` and our tools) becomes
  :func:`multipath_nmt.checkpoint_io.reading.read_checkpoint`: every way a file can fail is one
  :class:`~multipath_nmt.checkpoint_io.CheckpointError` line that starts with its path.
* ``checkpoint_utils.torch_persistent_save`` leaves its ``.tmp`` file behind when the disk is full
  (after three attempts 2.5 s apart); local saves go through
  :func:`multipath_nmt.checkpoint_io.writing.save_atomically` instead (the partial file is removed, earlier
  checkpoints are untouched, one-line :class:`~multipath_nmt.checkpoint_io.CheckpointSaveError`).
  With ``--write-checkpoints-asynchronously`` fairseq ``torch.save``-s straight into ioPath's
  asynchronous file, which cannot seek: with torch 2.13 and iopath 0.1.10 every such checkpoint
  is a zip archive without its central directory, unreadable. Here the checkpoint is serialized
  into memory first and its bytes go through ``PathManager.opena`` (one more copy of the
  checkpoint in host memory until it is written).
* ``PathManager.opena(path, "wb")`` of a local path: ioPath opens ``path`` itself (a kill leaves
  it cut short) and a write error kills its thread, logged there and never seen by training. It
  returns a file whose bytes :data:`multipath_nmt.checkpoint_io.writing.asynchronous_writer` (one
  background thread) writes through a temporary file renamed onto ``path``; an error is raised in
  the training process at the next save or when the writes are awaited.
* ``checkpoint_utils.save_checkpoint`` with ``--write-checkpoints-asynchronously`` (local save
  dir): fairseq writes only the first file of a save and copies nothing ("ioPath is not copying
  ..."), so no ``checkpoint_last.pt`` is ever written and a rerun starts at update 0. Once the
  first file's bytes are queued, fairseq is let take its synchronous course for the copies
  (``checkpoint_last.pt``, best, epoch files, as a synchronous save), and each copy is written in
  the background from the same bytes, ``checkpoint_last.pt`` first. A save waits while two
  earlier ones are still unwritten (at most two checkpoints in memory). fairseq's "Saved
  checkpoint" line, logged before anything is written, says "Queued checkpoint"; the writer logs
  "Saved checkpoint" for each file once it is written. A file that fails is logged at once and
  written again at the next save (or the end of the run), whose error stops training if it stays
  (:class:`multipath_nmt.checkpoint_io.writing.AsynchronousWriter`); stock fairseq's ioPath writer lost the
  error in its thread.
* ``PathManager.async_close`` (fairseq-train's wait at its end, and the SIGTERM stop's) also
  waits for those writes, writes failed files again and raises that error; at exit, an error
  nobody awaited is one line on stderr.
* ``PathManager.copy``: fairseq saves a checkpoint atomically but *copies* it in place to
  ``checkpoint_last.pt`` (and the best/epoch copies), so a kill during the copy leaves an
  unloadable file. Local copies go through a temporary file and ``os.replace``.
* ``checkpoint_utils.load_checkpoint`` (resume): a ``checkpoint_last.pt`` that cannot be read is
  renamed to ``checkpoint_last.pt.damaged`` (never deleted) and training resumes from the newest
  readable checkpoint of the save dir, with a warning saying how many updates are trained again.
  Whether there is a ``checkpoint_last.pt`` is asked as fairseq asks it (``PathManager.exists``),
  and only a local file proven damaged (:func:`~multipath_nmt.checkpoint_io.reading.proven_damage`) changes
  fairseq's course: a first launch, ``--finetune-from-model``, ``--continue-once``, remote storage
  (iopath handlers) and any file the check cannot judge go to fairseq's ``load_checkpoint``
  unchanged, which reads through ``Trainer.load_checkpoint`` and ``PathManager`` as it always
  does.
* ``Trainer.load_checkpoint`` and ``checkpoint_utils.load_model_ensemble_and_task``: a data-bin
  whose dictionaries do not match the checkpoint's embeddings is reported with both sizes and both
  paths (:func:`multipath_nmt.checkpoint_io.dictionaries.check_dictionaries`) before fairseq fails on a tensor
  shape; one of the same size whose symbols differ from those the checkpoint recorded, with the
  first token id that differs (a checkpoint that recorded none: by size, with a warning).
* ``Trainer.load_checkpoint`` also: a resume with another ``--arch`` (or model flags),
  ``--criterion`` or ``--optimizer`` than the checkpoint's failed with fairseq's chained
  tracebacks ("Cannot load model parameters", "Criterion does not match", "Optimizer does not
  match"); once fairseq's load has failed, the one line of
  :func:`multipath_nmt.checkpoint_io.training_setup.explain_failed_resume` says what differs and
  which flag accepts it (``--reset-optimizer``, or another ``--save-dir``), fairseq's error
  chained (``tests/test_checkpoints.py::test_a_resume_with_another_arch_criterion_or_optimizer_says_what_differs``).
* ``Trainer.state_dict`` (what every save writes): records the task's dictionaries' symbols
  (:data:`~multipath_nmt.checkpoint_io.dictionaries.DICTIONARIES`), for that check.
* ``sys.excepthook``: an uncaught ``CheckpointError`` is printed as one line without a traceback
  (the process still exits with status 1).

Reach beyond the plug-in's own models: every fairseq checkpoint read, save and local copy goes
through ``multipath_nmt.checkpoint_io`` (same files, same contents); ``PathManager.opena(path, "wb")``
of a local path returns a file written in the background through a temporary file, and
``PathManager.async_close`` also waits for it; the hook is in every process, but acts only in a
command-line tool (``fairseq_cli.*``, ``fairseq-*``, ``multipath-*``; narrowed: a user's script, a
notebook or pytest keeps the traceback).
Does nothing when: remote paths (``://``), a ``--restore-file`` other than ``checkpoint_last.pt``, a
file not proven damaged; the hook on any other error.
"""
import atexit
import functools
import inspect
import io
import logging
import os
import shutil
import sys

import torch

from multipath_nmt.checkpoint_io import CheckpointError, resume_point
from multipath_nmt.checkpoint_io.dictionaries import (DICTIONARIES, check_dictionaries,
                                                      dictionary_symbols)
from multipath_nmt.checkpoint_io.reading import (peek_checkpoint, proven_damage, read_checkpoint,
                                                 saved_at)
from multipath_nmt.checkpoint_io.resume_point import newest_readable
from multipath_nmt.checkpoint_io.training_setup import explain_failed_resume
from multipath_nmt.checkpoint_io.writing import (asynchronous_writer, save_atomically,
                                                 write_atomically)
from multipath_nmt.fairseq_patches.wrapping import one_line_excepthook, wrap

# The resume warnings are logged as the resume point's (docs/troubleshooting.md).
logger = resume_point.logger


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
    ``PathManager.opena`` (for a local file, :func:`_atomic_asynchronous_opena`'s file)."""
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
        save = _saving.current
        if save is not None and save.is_first(src_path):
            # the source is still being written in the background: the copy is written from
            # the same bytes, after it
            if not overwrite and os.path.exists(dst_path):
                return False
            save.paths.append(dst_path)
            return True
        return atomic_copy(src_path, dst_path, overwrite)

    return copy_through_a_temporary_file


# --- asynchronous saves ----------------------------------------------------------------------

class _Save:
    """One ``save_checkpoint`` call with ``--write-checkpoints-asynchronously``: the bytes of its
    first file and every path fairseq copies that file to, written as one background job."""

    def __init__(self, cfg, described):
        self.cfg, self.described, self.paths, self.chunks = cfg, described, [], None

    def is_first(self, path):
        return bool(self.paths) and os.path.abspath(path) == os.path.abspath(self.paths[0])

    def submit(self):
        # checkpoint_last*.pt first: a kill during the job then leaves the newest save the one a
        # resume reads
        last = [p for p in self.paths if os.path.basename(p).startswith("checkpoint_last")]
        asynchronous_writer.submit(last + [p for p in self.paths if p not in last], self.chunks,
                                   self.described)


class _Saving:
    current = None  # the _Save in progress (saves run on the training thread only)


_saving = _Saving()


class _QueuedNotSaved(logging.Filter):
    """fairseq's "Saved checkpoint" line of an asynchronous save, logged once the bytes are
    queued, says so: the writer logs "Saved checkpoint" for each file once it is written."""

    def filter(self, record):
        if isinstance(record.msg, str) and record.msg.startswith("Saved checkpoint "):
            record.msg = (record.msg.replace("Saved checkpoint ", "Queued checkpoint ", 1)
                          .replace("(writing took ", "(queueing took ", 1)
                          + "; written in the background")
        return True


_queued_not_saved = _QueuedNotSaved()


class _AtomicAsynchronousFile(io.RawIOBase):
    """What ``PathManager.opena(path, "wb")`` returns for a local path: the bytes written are kept
    (by reference) and, once closed, written by the background writer to a temporary file that is
    renamed onto ``path``. ioPath's own asynchronous file opens ``path`` itself (a kill leaves it
    cut short) and loses a write error in its thread."""

    def __init__(self, path):
        super().__init__()
        self.path, self._chunks = str(path), []

    def writable(self):
        return True

    def write(self, b):
        self._chunks.append(b)
        return memoryview(b).nbytes

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:  # an incomplete checkpoint is not written at all
            self._chunks = None
        return super().__exit__(exc_type, exc, tb)

    def close(self):
        chunks, self._chunks = self._chunks, None  # once: a close that raised is not retried
        try:
            if not self.closed and chunks is not None:
                _written_in_the_background(self.path, chunks)
        finally:
            super().close()


def _written_in_the_background(path, chunks):
    save = _saving.current
    if save is None or save.chunks is not None:  # not fairseq's save_checkpoint: one file
        asynchronous_writer.submit([path], chunks)
        return
    save.paths, save.chunks = [path], chunks
    # fairseq's save_checkpoint copies the first file to checkpoint_last.pt (and the best and
    # epoch files) only when writes are synchronous ("ioPath is not copying ..."); from here on
    # it takes that course, and the copies join this save's job (_atomic_local_copy)
    save.cfg.write_checkpoints_asynchronously = False


def _atomic_asynchronous_opena(opena):
    @functools.wraps(opena)
    def opena_through_a_temporary_file(path, mode="r", *args, **kwargs):
        if mode != "wb" or "://" in str(path):
            return opena(path, mode, *args, **kwargs)
        return _AtomicAsynchronousFile(path)

    return opena_through_a_temporary_file


def _copies_written_asynchronously(save_checkpoint):
    @functools.wraps(save_checkpoint)
    def save_checkpoint_in_the_background(cfg, trainer, epoch_itr, val_loss):
        from fairseq import checkpoint_utils

        # a config built by hand may lack the key (fairseq's own tests build such configs)
        if not getattr(cfg, "write_checkpoints_asynchronously", False) or "://" in str(cfg.save_dir):
            return save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        # files an earlier save failed to write are written now (a lasting error stops here)
        asynchronous_writer.write_failed_again()
        asynchronous_writer.wait(pending=1)  # at most one save queued behind the one written
        save = _saving.current = _Save(cfg, f"(epoch {epoch_itr.epoch} @ "
                                            f"{trainer.get_num_updates()} updates)")
        fairseq_logger = logging.getLogger(checkpoint_utils.__name__)
        fairseq_logger.addFilter(_queued_not_saved)
        try:
            result = save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        finally:
            fairseq_logger.removeFilter(_queued_not_saved)
            _saving.current = None
            cfg.write_checkpoints_asynchronously = True
        if save.chunks is not None:
            save.submit()
        return result

    return save_checkpoint_in_the_background


def _awaiting_the_checkpoint_writes(async_close):
    @functools.wraps(async_close)
    def async_close_after_the_checkpoint_writes():
        try:
            asynchronous_writer.wait()
        finally:
            result = async_close()
        asynchronous_writer.write_failed_again()
        return result

    return async_close_after_the_checkpoint_writes


def _report_a_lost_write_error():
    """At exit, an error of a background write that nobody awaited (the process is ending on
    another error): one line on stderr, not silence."""
    try:
        asynchronous_writer.join()
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)


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

def _recording_dictionaries(state_dict):
    @functools.wraps(state_dict)
    def state_dict_with_dictionaries(self):
        state = state_dict(self)
        state[DICTIONARIES] = dictionary_symbols(self.task)
        return state

    return state_dict_with_dictionaries


def _checking_trainer_dictionaries(load_checkpoint):
    @functools.wraps(load_checkpoint)
    def trainer_load_checkpoint(self, filename, reset_optimizer=False, *args, **kwargs):
        check_dictionaries(filename, self.task)
        try:
            return load_checkpoint(self, filename, reset_optimizer, *args, **kwargs)
        except Exception as err:
            # another --arch, --criterion or --optimizer than the checkpoint's: one line that
            # says which and what accepts it, instead of fairseq's chained tracebacks
            mismatch = explain_failed_resume(filename, self, reset_optimizer, err)
            if mismatch is None:
                raise
            raise mismatch from err

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
    wrap(PathManager, "opena", _atomic_asynchronous_opena)
    wrap(PathManager, "async_close", _awaiting_the_checkpoint_writes)
    wrap(checkpoint_utils, "save_checkpoint", _copies_written_asynchronously)
    wrap(checkpoint_utils, "load_checkpoint", _resume_from_readable)
    wrap(checkpoint_utils, "load_model_ensemble_and_task", _checking_ensemble_dictionaries)
    wrap(Trainer, "load_checkpoint", _checking_trainer_dictionaries)
    wrap(Trainer, "state_dict", _recording_dictionaries)
    # the atexit report goes in with the hook, not while install() only checks (planning)
    if wrap(sys, "excepthook", _one_line_errors) and \
            _report_a_lost_write_error not in _atexit_registered:
        atexit.register(_report_a_lost_write_error)
        _atexit_registered.append(_report_a_lost_write_error)


_atexit_registered = []
