"""``fairseq-train`` stops cleanly on SIGTERM, SIGUSR1 and SIGINT: the update in flight is finished,
``checkpoint_last.pt`` is saved with the iterator position, and the process exits with 128 + the
signal's number.

Stock fairseq 0.12 dies at once on SIGTERM or SIGUSR1 (the default action) and with a
``KeyboardInterrupt`` traceback on SIGINT, saving nothing: everything since the last save is lost,
and SLURM, Kubernetes and cloud schedulers send SIGTERM (or a chosen signal, ``sbatch
--signal``) some time before they kill a job, precisely so that it can save.

* ``fairseq_cli.train.train`` (the loop over one epoch's updates): on its first call the three
  handlers are installed. A handler only records the signal and logs one line; nothing is
  interrupted. A second signal is logged and ignored (SIGKILL still stops the process at once;
  every checkpoint write is atomic, so even that leaves the files on disk whole).
* ``Trainer._aggregate_logging_outputs`` inside ``Trainer.train_step`` (the all-reduce fairseq
  already makes of each update's statistics when there are several ranks): each rank adds one
  count per signal to the numbers summed, so the ranks learn whether any of them was signalled
  with no collective, host-to-device copy or read of their own. The summed statistics are read
  from the device in one copy and handed to fairseq as Python numbers, as with one process:
  fairseq's next line reads the sample size anyway (``sample_size or 1.0``), so the per-update
  host syncs stay what they are without this patch (tests/test_preemption.py counts them with
  ``HostSyncCounter``). With BMUF, statistics (and so the flag) are summed only on its sync
  updates: the stop waits for the next one.
* ``fairseq_cli.train.validate_and_save`` (called by every rank after every update, with or
  without a save): afterwards, if the ranks agreed on a signal at this update (one process: its
  own flag), all stop after the same update. Unless fairseq has just saved this update anyway,
  every rank calls ``checkpoint_utils.save_checkpoint`` (rank 0 writes ``checkpoint_last.pt``
  through the atomic writer, with the epoch iterator's position: the resume continues
  mid-epoch, bit-exactly on the CPU; with ``--write-checkpoints-asynchronously`` the background
  writes are awaited, as fairseq-train does at its end, and a file whose write failed is written
  again; a save the disk refuses is one error line, and the stop goes on), the ranks wait
  for the write (one collective, at the stop only), one line names the files this process wrote
  (nothing else), and the process exits with status 128 + signal number (143 for SIGTERM, 138 for
  SIGUSR1, 130 for SIGINT). A signal that arrives with the last update (``--max-update``
  reached, early stop) changes nothing: the run ends as it would have, status 0.
* How a rank of a distributed run exits: torchrun SIGTERMs the other workers as soon as one exits
  non-zero. A rank that is then still in interpreter shutdown has had its handlers reset and dies
  of that SIGTERM (status -15), or aborts in the destructor of a gloo thread whose peer has gone
  (SIGABRT): torchrun reports a crash instead of the stop. So each rank runs the ``atexit``
  functions (logging, fairseq's log writers, data-loader workers), flushes its output and leaves
  with ``os._exit``, skipping that shutdown. One process leaves with ``sys.exit``.

Both functions are attributes of the module that runs ``fairseq-train``: ``fairseq_cli.train``
for the console script, ``__main__`` for ``python -m fairseq_cli.train``. They are wrapped in
whichever of those is loaded when the plug-in is imported (fairseq imports it while parsing the
arguments, before ``main`` runs; in every process of a distributed run).

Reach beyond the plug-in's own models: every ``fairseq-train`` run, any model: a signal no longer
kills at once (a second one is ignored; SIGKILL still kills); with several ranks,
``Trainer.train_step`` sums three more numbers and gets the summed sample size, OOM count and
training time as Python numbers (as with one process), read in one copy that replaces fairseq's read
of the sample size.
Does nothing when: processes other than ``fairseq-train``; the statistics of ``valid_step``.
"""
import atexit
import functools
import inspect
import logging
import os
import signal
import sys

import torch

from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.checkpoint_io.writing import write_mark, written_since
from multipath_nmt.fairseq_patches.wrapping import wrap

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
TRAIN_SCRIPT = os.path.join("fairseq_cli", "train.py")


def exit_code(signum):
    """The status ``fairseq-train`` exits with after stopping on ``signum``: 128 + its number,
    what a shell reports for a process the signal killed."""
    return 128 + int(signum)


class _State:
    signum = None      # the first signal received by this process
    handlers_pid = None
    saved_at = None    # (id(trainer), update, write_mark() before it) of the last save_checkpoint
    agreed = 0         # the signal the ranks agreed on when they last summed their statistics
    in_train_step = False


_state = _State()


def _name(signum):
    return signal.Signals(signum).name


def _handler(signum, frame):
    if os.getpid() != _state.handlers_pid:
        return  # a forked data-loader worker: the main process stops it
    if _state.signum is None:
        _state.signum = signum
        logger.warning(f"{_name(signum)} received: training stops after the update in flight and "
                       "saves checkpoint_last.pt")
    else:
        logger.warning(f"{_name(signum)} received again: ignored, training is already stopping "
                       "(the checkpoint being saved is written atomically; SIGKILL stops at once)")


def install_handlers():
    """Record SIGTERM, SIGUSR1 and SIGINT instead of dying on them (main thread only)."""
    if _state.handlers_pid == os.getpid():
        return
    try:
        for signum in SIGNALS:
            signal.signal(signum, _handler)
    except ValueError:  # not the main thread: fairseq's own behaviour stays
        return
    _state.handlers_pid = os.getpid()


def _installing_handlers(train):
    @functools.wraps(train)
    def train_with_signal_handlers(cfg, trainer, task, epoch_itr):
        install_handlers()
        return train(cfg, trainer, task, epoch_itr)

    return train_with_signal_handlers


def _agreed_signal(trainer):
    """The largest signal number any rank had received when the ranks last summed their training
    statistics (0 for none): every rank gets the same answer after the same update. One process
    reads its own flag."""
    if trainer.data_parallel_world_size <= 1:
        return int(_state.signum or 0)
    signum, _state.agreed = _state.agreed, 0
    return signum


# --- the flag rides on fairseq's own all-reduce of the training statistics -------------------

def _in_train_step(train_step):
    @functools.wraps(train_step)
    def train_step_marked(self, *args, **kwargs):
        outer, _state.in_train_step = _state.in_train_step, True
        try:
            return train_step(self, *args, **kwargs)
        finally:
            _state.in_train_step = outer

    return train_step_marked


def _host_values(values):
    """``values`` (numbers, or one-element tensors reduced on the device) as Python floats, read
    from the device in one copy."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if tensors:
        read = iter(torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist())
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


def _carrying_the_signal(aggregate):
    @functools.wraps(aggregate)
    def aggregate_logging_outputs(self, logging_outputs, *extra_stats_to_sum, ignore=False):
        if not _state.in_train_step or self.tpu:
            return aggregate(self, logging_outputs, *extra_stats_to_sum, ignore=ignore)
        # one count per signal, summed with fairseq's own statistics (sample size, OOMs,
        # training time): the same all-reduce, a few more numbers in its host-made buffer
        flags = [float(_state.signum == signum) for signum in SIGNALS]
        logging_outputs, stats = aggregate(self, logging_outputs, *extra_stats_to_sum, *flags,
                                           ignore=ignore)
        # The summed statistics are read from the device here in one copy, and fairseq gets them
        # as Python numbers, as with one process: its next line reads the sample size anyway
        # (``sample_size or 1.0``), so the copy replaces that read rather than adding one.
        stats = _host_values(list(stats))
        counts = stats[len(extra_stats_to_sum):]
        _state.agreed = max((int(s) for s, n in zip(SIGNALS, counts) if n > 0), default=0)
        return logging_outputs, stats[:len(extra_stats_to_sum)]

    return aggregate_logging_outputs


def _all_ranks_wait(trainer):
    """Nobody leaves before rank 0 has written (one collective, at the stop only)."""
    if trainer.data_parallel_world_size > 1:
        from fairseq.distributed import utils as distributed_utils

        done = torch.zeros(1, device=trainer.device)
        distributed_utils.all_reduce(done, group=trainer.data_parallel_process_group)


def _exit(code, trainer):
    if trainer.data_parallel_world_size <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _what_was_saved(cfg, trainer, written):
    """What the log line says was saved: the files this process wrote, nothing else."""
    last = os.path.abspath(os.path.join(cfg.checkpoint.save_dir,
                                        f"checkpoint_last{trainer.checkpoint_suffix}.pt"))
    if cfg.checkpoint.no_save:
        return "nothing saved (--no-save)"
    if not written:
        if not trainer.should_save_checkpoint_on_current_rank:
            return f"rank {trainer.data_parallel_rank} saves nothing (rank 0 saves)"
        return "nothing saved"
    others = ", ".join(path for path in written if path != last)
    if last in written:
        return (f"saved {others + ' and ' if others else ''}{last} for an exact resume (run the "
                "same command)")
    return f"saved {others}; checkpoint_last.pt not saved (--no-last-checkpoints)"


def _stopping_on_signal(validate_and_save):
    @functools.wraps(validate_and_save)
    def validate_and_save_or_stop(cfg, trainer, task, epoch_itr, *args, **kwargs):
        valid_losses, should_stop = validate_and_save(cfg, trainer, task, epoch_itr, *args, **kwargs)
        signum = _agreed_signal(trainer)
        if not signum:
            return valid_losses, should_stop
        from fairseq import checkpoint_utils
        from fairseq.file_io import PathManager

        updates = trainer.get_num_updates()
        if should_stop:
            logger.info(f"{_name(signum)} received as training ends at update {updates}: the run "
                        "finishes as it would have")
            return valid_losses, should_stop
        just_saved = _state.saved_at is not None and _state.saved_at[:2] == (id(trainer), updates)
        mark = _state.saved_at[2] if just_saved else write_mark()  # fairseq has just saved it
        try:
            if not just_saved:
                checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
            if cfg.checkpoint.write_checkpoints_asynchronously:
                PathManager.async_close()  # else the exit cuts the writer off mid-file
        except CheckpointError as error:
            # the disk refused the save: the stop is still a stop by the signal (a scheduler
            # requeues on 128 + N), and the resume reads the last checkpoint that was written
            logger.error(str(error))
        _all_ranks_wait(trainer)
        saved = _what_was_saved(cfg, trainer, written_since(mark))
        code = exit_code(signum)
        logger.info(f"{_name(signum)}: stopped after update {updates} (epoch {epoch_itr.epoch}, "
                    f"batch {epoch_itr.iterations_in_epoch} of {len(epoch_itr)}); {saved}; exiting "
                    f"with status {code}")
        _exit(code, trainer)

    return validate_and_save_or_stop


def _recording_saves(save_checkpoint):
    @functools.wraps(save_checkpoint)
    def save_checkpoint_recorded(cfg, trainer, epoch_itr, val_loss):
        mark = write_mark()
        result = save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        _state.saved_at = (id(trainer), trainer.get_num_updates(), mark)
        return result

    return save_checkpoint_recorded


def _train_modules():
    """The loaded modules that are fairseq's ``fairseq_cli/train.py``."""
    found = []
    for name in ("fairseq_cli.train", "__main__", "__mp_main__"):
        module = sys.modules.get(name)
        function = getattr(module, "validate_and_save", None)
        # fairseq's own, under this patch's wrapper: save_dirs looks for the modules after it
        code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
        if code is not None and code.co_filename.endswith(TRAIN_SCRIPT) and module not in found:
            found.append(module)
    return found


def install():
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    wrap(checkpoint_utils, "save_checkpoint", _recording_saves)
    wrap(Trainer, "train_step", _in_train_step)
    wrap(Trainer, "_aggregate_logging_outputs", _carrying_the_signal)
    for module in _train_modules():
        wrap(module, "validate_and_save", _stopping_on_signal)
        wrap(module, "train", _installing_handlers)
