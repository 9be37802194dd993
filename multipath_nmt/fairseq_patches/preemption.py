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
* ``fairseq_cli.train.validate_and_save`` (called by every rank after every update, with or
  without a save): afterwards, the ranks agree whether any of them was signalled (one
  ``all_reduce`` of the largest signal number; a local flag with one process), so that all stop
  after the same update. Unless fairseq has just saved this update anyway, every rank calls
  ``checkpoint_utils.save_checkpoint`` (rank 0 writes ``checkpoint_last.pt`` through the atomic
  writer, with the epoch iterator's position: the resume continues mid-epoch, bit-exactly on the
  CPU; with ``--write-checkpoints-asynchronously`` ioPath's writes are awaited, as fairseq-train
  does at its end), the ranks wait for the write, one line is logged, and the process exits with
  status 128 + signal number (143 for SIGTERM, 138 for SIGUSR1, 130 for SIGINT). A signal that
  arrives with the last update (``--max-update`` reached, early stop) changes nothing: the run
  ends as it would have, status 0.
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
"""
import atexit
import functools
import logging
import os
import signal
import sys

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
    saved_at = None    # (id(trainer), update) of the last save_checkpoint call


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
    """The largest signal number any rank has received (0 for none); every rank calls this after
    the same update."""
    signum = int(_state.signum or 0)
    if trainer.data_parallel_world_size <= 1:
        return signum
    import torch
    from fairseq.distributed import utils as distributed_utils

    flag = torch.tensor([signum], dtype=torch.long, device=trainer.device)
    distributed_utils.all_reduce(flag, group=trainer.data_parallel_process_group, op="max")
    return int(flag.item())


def _all_ranks_wait(trainer):
    if trainer.data_parallel_world_size > 1:
        _agreed_signal(trainer)  # one more collective: nobody leaves before rank 0 has written


def _exit(code, trainer):
    if trainer.data_parallel_world_size <= 1:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


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
        if _state.saved_at != (id(trainer), updates):
            checkpoint_utils.save_checkpoint(cfg.checkpoint, trainer, epoch_itr, None)
        if cfg.checkpoint.write_checkpoints_asynchronously:
            PathManager.async_close()  # else the exit cuts ioPath's writer off mid-file
        _all_ranks_wait(trainer)
        last = os.path.join(cfg.checkpoint.save_dir, f"checkpoint_last{trainer.checkpoint_suffix}.pt")
        if cfg.checkpoint.no_save or cfg.checkpoint.no_last_checkpoints:
            saved = ("nothing saved (--no-save)" if cfg.checkpoint.no_save
                     else "checkpoint_last.pt not saved (--no-last-checkpoints)")
        else:
            saved = f"saved {last} for an exact resume (run the same command)"
        code = exit_code(signum)
        logger.info(f"{_name(signum)}: stopped after update {updates} (epoch {epoch_itr.epoch}, "
                    f"batch {epoch_itr.iterations_in_epoch} of {len(epoch_itr)}); {saved}; exiting "
                    f"with status {code}")
        _exit(code, trainer)

    return validate_and_save_or_stop


def _recording_saves(save_checkpoint):
    @functools.wraps(save_checkpoint)
    def save_checkpoint_recorded(cfg, trainer, epoch_itr, val_loss):
        result = save_checkpoint(cfg, trainer, epoch_itr, val_loss)
        _state.saved_at = (id(trainer), trainer.get_num_updates())
        return result

    return save_checkpoint_recorded


def _train_modules():
    """The loaded modules that are fairseq's ``fairseq_cli/train.py``."""
    found = []
    for name in ("fairseq_cli.train", "__main__", "__mp_main__"):
        module = sys.modules.get(name)
        function = getattr(module, "validate_and_save", None)
        code = getattr(function, "__code__", None)
        if code is not None and code.co_filename.endswith(TRAIN_SCRIPT) and module not in found:
            found.append(module)
    return found


def install():
    from fairseq import checkpoint_utils

    wrap(checkpoint_utils, "save_checkpoint", _recording_saves)
    for module in _train_modules():
        wrap(module, "validate_and_save", _stopping_on_signal)
        wrap(module, "train", _installing_handlers)
