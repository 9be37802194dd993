"""A micro-batch that does not fit the GPU stops training in one line, instead of dropping its update.

fairseq 0.12's ``Trainer.train_step`` catches an out-of-memory error (a ``RuntimeError`` whose
message has "out of memory", what CUDA's allocator raises) in a micro-batch's forward or backward,
logs a warning and drops the whole update: on one process it returns as if nothing had happened
(exit status 0 at the end), and as the batches are the same in every epoch, the same update is
dropped in every epoch; on several processes the rank that dropped its part skips DDP's all-reduce
that the others wait in (a hang, or a garbled reduction). An error after the micro-batches (the
gradients' reduction, clipping, the optimizer step) was re-raised with a traceback.

``Trainer.train_step`` is wrapped: it passes fairseq's own ``raise_oom=True`` (re-raise instead of
dropping) and turns the error into :class:`OutOfMemoryInUpdateError`, whose one line
(``train.py: error: ...``, status 1, through ``sys.excepthook``) names the update, the micro-batch
(K of M, its sentences, its tokens with padding), the rank on several processes, ``--max-tokens``,
CUDA's own words and what to do: a lower ``--max-tokens`` (``scripts/train.sh`` keeps the tokens
per update with a higher ``--update-freq``) or ``--checkpoint-activations``. On several processes
the rank that ran out stops at once; the others, waiting for it in a collective, fail with their
own error when its connection closes (gloo: "Connection closed by peer", a traceback), or are
stopped by torchrun once it sees the failed worker (SIGTERM, then SIGKILL 30 s later; the NCCL
case is not tested here: the suite has no GPUs). Splitting the micro-batch
and retrying was not chosen: its halves are other batches than every other run's, so results
would depend on the memory left.

``Trainer._prepare_sample`` (called once per micro-batch, before its forward) counts the
micro-batches of the update, and ``Trainer._sync_stats`` (called once they are all done) marks the
end of them, for the line.

Reach beyond the plug-in's own models: every ``Trainer``, any task and model: an out-of-memory
error in training stops the run. Validation keeps fairseq's one retry after freeing the gradients
(then its error, with a traceback).
Does nothing when: an update that raises nothing; any other error.
Proved by ``tests/test_out_of_memory.py``. Off: ``MULTIPATH_NMT_PATCHES=-out_of_memory``.
"""
import functools
import re
import sys

from multipath_nmt.fairseq_patches.wrapping import one_line_excepthook, wrap


class OutOfMemoryInUpdateError(Exception):
    """A micro-batch (or the step after them) did not fit the device's memory. Not a
    ``RuntimeError``: fairseq's handlers of out-of-memory ``RuntimeError`` s (an update retried
    under ``--amp`` runs inside one) let it pass."""


class _Update:
    """What the line says about the update in progress: its number, its micro-batches, how many
    have started, whether they are all done."""

    def __init__(self, number, samples):
        self.number, self.samples, self.started, self.reduced = number, samples, 0, False


_CONTEXT = "_multipath_nmt_update_in_progress"


def _is_out_of_memory(err):
    """fairseq's own test (trainer.py): a ``RuntimeError`` whose message says "out of memory"."""
    return isinstance(err, RuntimeError) and "out of memory" in str(err)


def _device_words(err):
    """The allocator's words without its numbers of the moment: "CUDA out of memory. Tried to
    allocate 2.00 GiB"."""
    text = " ".join(str(err).split())
    head = re.match(r"(.*?out of memory)\.?", text)
    if head is None:
        return text
    tried = re.search(r"Tried to allocate [\d.]+ ?[KMGT]?i?B", text)
    return head.group(1) + (f". {tried.group(0)}" if tried else "")


def _micro_batch_size(sample):
    """(sentences, tokens with padding as --max-tokens counts them: sentences x the longer of
    the padded source and target), or None when the sample does not say."""
    try:
        source = sample["net_input"]["src_tokens"]
        sentences, length = source.size(0), source.size(1)
        target = sample.get("target")
        if target is not None:
            length = max(length, target.size(1))
        return sentences, sentences * length
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _message(trainer, update, err):
    cfg = trainer.cfg.dataset
    max_tokens, batch_size = cfg.max_tokens, cfg.batch_size
    limit = f"--max-tokens {max_tokens}" if max_tokens else f"--batch-size {batch_size}"
    rank = (f" on rank {trainer.data_parallel_rank}" if trainer.data_parallel_world_size > 1
            else "")
    micro_batches = len(update.samples)
    if update.reduced or not update.started:
        where = (f"update {update.number} after its {micro_batches} micro-batches (the "
                 f"gradients' reduction, clipping or the optimizer step)")
    else:
        k = min(update.started, micro_batches)
        size = _micro_batch_size(update.samples[k - 1])
        sized = (f"{size[0]} sentences, {size[1]:,} tokens with padding, " if size else "")
        where = f"update {update.number}'s micro-batch {k} of {micro_batches} ({sized}{limit})"
    if max_tokens:
        remedy = (f"Lower --max-tokens (scripts/train.sh: --max-tokens {max(max_tokens // 2, 1)}; "
                  "it keeps the tokens per update with a higher --update-freq)")
    else:
        remedy = f"Lower --batch-size (now {batch_size}) and raise --update-freq as much"
    return (f"out of memory{rank} in {where}: {_device_words(err)}. {remedy} or add "
            "--checkpoint-activations")


def _stopping_on_out_of_memory(train_step):
    @functools.wraps(train_step)
    def train_step_stopping_on_out_of_memory(self, samples, raise_oom=False):
        outer = getattr(self, _CONTEXT, None)
        update = _Update(self.get_num_updates() + 1, samples)
        setattr(self, _CONTEXT, update)
        try:
            # fairseq's own switch: re-raise the error instead of dropping the update
            return train_step(self, samples, True)
        except RuntimeError as err:
            if not _is_out_of_memory(err):
                raise
            raise OutOfMemoryInUpdateError(_message(self, update, err)) from err
        finally:
            setattr(self, _CONTEXT, outer)

    return train_step_stopping_on_out_of_memory


def _counting_micro_batches(prepare_sample):
    @functools.wraps(prepare_sample)
    def prepare_sample_counted(self, sample, is_dummy=False):
        update = getattr(self, _CONTEXT, None)
        if update is not None and not update.reduced and not is_dummy:
            update.started += 1
        return prepare_sample(self, sample, is_dummy)

    return prepare_sample_counted


def _marking_the_micro_batches_done(sync_stats):
    @functools.wraps(sync_stats)
    def sync_stats_after_the_micro_batches(self):
        update = getattr(self, _CONTEXT, None)
        if update is not None:
            update.reduced = True
        return sync_stats(self)

    return sync_stats_after_the_micro_batches


def _one_line_errors(previous_hook):
    return one_line_excepthook(previous_hook, OutOfMemoryInUpdateError)


def install():
    from fairseq.trainer import Trainer

    wrap(Trainer, "train_step", _stopping_on_out_of_memory)
    wrap(Trainer, "_prepare_sample", _counting_micro_batches)
    wrap(Trainer, "_sync_stats", _marking_the_micro_batches_done)
    wrap(sys, "excepthook", _one_line_errors)
