"""How fairseq 0.12 cuts the data into batches: every sentence, and the same batches after a resume.

* ``data_utils.batch_by_size`` drops the last batch when its size is not a multiple of
  ``--required-batch-size-multiple`` (default 8; fairseq issue #5036): ``fairseq-generate``
  silently translated 496 of 500 test sentences, and validation and training lost up to 7
  sentences per pass. The dropped tail is given back as a final, smaller batch.
* ``FairseqTask.get_batch_iterator`` builds a reusable iterator's batches once, when it is
  created, breaking ties between equally long sentences with ``--seed`` + *that* epoch, and reuses
  them for every later epoch. An uninterrupted run therefore trains all epochs on the batches of
  epoch 1, but a run resumed in epoch e >= 2 rebuilt them with seed + e. The batches of a
  reusable iterator are now always built as in epoch 1, whatever the epoch it starts in, so a
  resume is exact across epochs.
* ``EpochBatchIterator.state_dict`` / ``load_state_dict`` / ``ordered_batches``: the saved position
  in an epoch is ``iterations_in_epoch``, the batches *one* process has taken. The epoch's
  batches (shuffled with the seed, the same for any number of processes) are dealt out in turn:
  process r of W takes batches r, r + W, ..., so after k each, W x k batches are done, the first
  W x k of the list. A resume on another number of processes read k as its own: on fewer
  processes part of the epoch was trained twice (2 -> 1 after 3 updates: 387 sentences of 300),
  on more part was skipped (1 -> 4: 248 of 300) or fairseq stopped with "dataloader mismatch".
  The state now also holds the batches done in the whole job (``batches_done``), the number of
  processes and a digest of the epoch's batches; a resume on another number of processes deals
  out the batches left after the done ones, so the epoch trains each sentence once. Batches that
  differ (another ``--max-tokens``, other data) or ``--grouped-shuffling`` (its order depends
  on the number of processes) are refused in one line before the first update. The same number
  of processes, and checkpoints saved without these entries, take fairseq's own course.

Reach beyond the plug-in's own models: every task: ``fairseq-generate`` translates every sentence,
validation and training see up to 7 more sentences per pass, a resumed run trains on the batches of
an uninterrupted one; stock fairseq's batches differ only there (not narrowed: it is the fix, and a
fair comparison needs it for fairseq's models too).
Does nothing when: the batches already cover every sentence; epoch 1, and iterators that are not
reused; a resume on the same number of processes, or from a checkpoint without the position's
new entries.
"""
import functools
import hashlib
import inspect
import logging

from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.fairseq_patches.wrapping import wrap

logger = logging.getLogger(__name__)


def _keep_last_batch(batch_by_size):
    @functools.wraps(batch_by_size)
    def keep_last_batch(indices, *args, **kwargs):
        import numpy as np

        batches = batch_by_size(indices, *args, **kwargs)
        # Batches are consecutive runs of ``indices``; whatever is missing is the dropped tail.
        covered = sum(len(batch) for batch in batches)
        indices = np.asarray(indices, dtype=np.int64)
        if covered < len(indices):
            batches = list(batches) + [indices[covered:]]
        return batches

    return keep_last_batch


def _batches_as_in_epoch_1(get_batch_iterator):
    signature = inspect.signature(get_batch_iterator)

    @functools.wraps(get_batch_iterator)
    def get_batch_iterator_with_epoch_1_batches(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        task, dataset, epoch = bound.arguments["self"], bound.arguments["dataset"], bound.arguments["epoch"]
        reusable = (not bound.arguments["disable_iterator_cache"]
                    and not bound.arguments["update_epoch_batch_itr"]
                    and task.can_reuse_epoch_itr(dataset)
                    and dataset not in task.dataset_to_epoch_iter)
        if not reusable or epoch <= 1:
            return get_batch_iterator(*bound.args, **bound.kwargs)
        # A run that never stopped created this iterator in epoch 1 and kept its batches.
        bound.arguments["epoch"] = 1
        iterator = get_batch_iterator(*bound.args, **bound.kwargs)
        iterator.epoch = epoch
        dataset.set_epoch(epoch)
        return iterator

    return get_batch_iterator_with_epoch_1_batches


class ResumePositionError(CheckpointError):
    """A checkpoint's position in its epoch that this run cannot continue from (one line)."""

    def __init__(self, message):
        ValueError.__init__(self, message)
        self.path = None


def _digest(iterator):
    """A digest of the epoch's batches (before any shuffling), cached with them."""
    import numpy as np

    batches = iterator.frozen_batches
    cached = getattr(iterator, "_multipath_digest", None)
    if cached is None or cached[0] is not batches:
        digest = hashlib.sha1(np.asarray([len(b) for b in batches], dtype=np.int64).tobytes())
        for batch in batches:
            digest.update(np.asarray(batch, dtype=np.int64).tobytes())
        cached = iterator._multipath_digest = (batches, digest.hexdigest()[:16])
    return cached[1]


def _batches_done(iterator, iterations):
    """The batches the whole job has taken from the current epoch when each process has taken
    ``iterations``: ``num_shards`` per round, after those done before a resume on another
    number of processes."""
    resumed = getattr(iterator, "_multipath_resumed", None)  # (epoch, batches done then)
    before = resumed[1] if resumed is not None and resumed[0] == iterator.epoch else 0
    return before + iterator.num_shards * iterations


def _with_batches_done(state_dict):
    @functools.wraps(state_dict)
    def state_dict_with_batches_done(self):
        state = state_dict(self)
        if state.get("iterations_in_epoch", 0) > 0:
            done = _batches_done(self, state["iterations_in_epoch"])
            # what stock fairseq reads on as many processes: this process's share of the done
            state.update(iterations_in_epoch=done // self.num_shards, batches_done=done,
                         processes=self.num_shards, batches_digest=_digest(self))
        return state

    return state_dict_with_batches_done


def _continuing_with_other_processes(load_state_dict):
    @functools.wraps(load_state_dict)
    def load_state_dict_on_any_number_of_processes(self, state):
        done, processes = state.get("batches_done"), state.get("processes")
        if done is None or not state.get("iterations_in_epoch"):
            return load_state_dict(self, state)  # an epoch's start, or a checkpoint without them
        epoch, total = state["epoch"], len(self.frozen_batches)
        if state.get("batches_digest") != _digest(self):
            raise ResumePositionError(
                f"cannot continue epoch {epoch} where the checkpoint stopped (after {done} of its "
                f"batches): this run cuts the data into other batches ({total}; another "
                "--max-tokens, --batch-size or other data). Resume with the batch flags and data "
                "of the run that saved it, or pass --reset-dataloader to start the epoch over")
        if processes == self.num_shards and done == processes * state["iterations_in_epoch"]:
            return load_state_dict(self, state)  # as many processes: fairseq's own course
        from fairseq.data.iterators import EpochBatchIterator

        # only fairseq's plain iterator deals out its batches through ordered_batches (not the
        # multi-corpus GroupedEpochBatchIterator); --grouped-shuffling's order depends on W
        dealt_here = (type(self)._get_iterator_for_epoch
                      is EpochBatchIterator._get_iterator_for_epoch)
        if self.grouped_shuffling or not dealt_here:
            why = ("--grouped-shuffling orders the batches by the number of processes"
                   if dealt_here else f"{type(self).__name__} cannot deal out the batches left")
            raise ResumePositionError(
                f"cannot continue epoch {epoch} on {self.num_shards} processes: it was saved on "
                f"{processes}, and {why}. Resume on as many processes, or pass --reset-dataloader "
                "to start the epoch over")
        self.epoch = epoch
        self._multipath_skip = (epoch, done)
        try:
            self._next_epoch_itr = self._get_iterator_for_epoch(
                epoch, shuffle=state.get("shuffle", True))
        finally:
            self._multipath_skip = None
        self._multipath_resumed = (epoch, done)
        if self.shard_id == 0:
            logger.info(f"epoch {epoch} was saved on {processes} process(es) after {done} of its "
                        f"{total} batches: the {total - done} left are dealt out to "
                        f"{self.num_shards} process(es)")

    return load_state_dict_on_any_number_of_processes


def _dealing_out_what_is_left(ordered_batches):
    @functools.wraps(ordered_batches)
    def ordered_batches_after_the_done(self, epoch, fix_batches_to_gpus, shuffle):
        skip = getattr(self, "_multipath_skip", None)
        if skip is None or skip[0] != epoch:
            return ordered_batches(self, epoch, fix_batches_to_gpus, shuffle)
        from fairseq.data.iterators import ShardedIterator

        shards = self.num_shards, self.shard_id
        self.num_shards, self.shard_id = 1, 0  # the epoch's whole list, in its order
        try:
            every = ordered_batches(self, epoch, fix_batches_to_gpus, shuffle)
        finally:
            self.num_shards, self.shard_id = shards
        return list(ShardedIterator(every[skip[1]:], self.num_shards, self.shard_id,
                                    fill_value=[]))

    return ordered_batches_after_the_done


def install():
    from fairseq.data import data_utils
    from fairseq.data.iterators import EpochBatchIterator
    from fairseq.tasks.fairseq_task import FairseqTask

    wrap(data_utils, "batch_by_size", _keep_last_batch)
    wrap(FairseqTask, "get_batch_iterator", _batches_as_in_epoch_1)
    wrap(EpochBatchIterator, "state_dict", _with_batches_done)
    wrap(EpochBatchIterator, "load_state_dict", _continuing_with_other_processes)
    wrap(EpochBatchIterator, "ordered_batches", _dealing_out_what_is_left)
