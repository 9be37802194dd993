"""fairseq 0.12 checks a translation data-bin before it trains or translates on it (:mod:`multipath_nmt.data_bin_checks`).

* ``TranslationTask.setup_task`` (``fairseq-train``, ``-generate``, ``-interactive``): the data-bin
  directory exists, the languages can be told (given, or inferred from the file names as fairseq
  does), and both ``dict.<lang>.txt`` parse as fairseq's ``Dictionary.load`` reads them, before
  fairseq loads them (a missing one was a ``FileNotFoundError`` traceback, a malformed one a
  ``ValueError`` or ``RuntimeError`` traceback).
* ``TranslationTask.load_dataset``: before fairseq opens a split, every file of it is checked
  (:func:`multipath_nmt.data_bin_checks.check_split`): ``.idx`` against ``.bin``, every token id
  against the task's dictionaries, source against target sentence count. For the training split
  every shard of a ``DATA1:DATA2`` path is checked the first time, so a damaged later shard stops
  the run before its first update rather than epochs later. A split is checked once per process.
* ``TranslationTask.filter_indices_by_size`` where fairseq refuses sentences longer than the
  model's positions (valid sets: fairseq-train's start-up validation, with validation on as by
  default; test sets: fairseq-generate), without ``--skip-invalid-size-inputs-valid-test``:
  fairseq's ``Exception: Size of sample #N is invalid (=(1597, 12)) since max_positions=(1024,
  1024)``, a traceback on every rerun, becomes one line naming the ``.idx`` file, the sentence
  and its line, its length and the limit (:func:`multipath_nmt.data_bin_checks.sentence_too_long`),
  raised before the first update or the first translation. Training sets are not refused by
  fairseq (it skips such sentences with a warning) and so not here either.
* ``sys.excepthook``: an uncaught :class:`~multipath_nmt.data_bin_checks.DataBinError` is printed as
  one line without a traceback (the process exits with status 1), as checkpoint errors are.

Reach beyond the plug-in's own models: every ``translation`` task checks its data-bin once per split
and process (one read of each file); the hook as for ``checkpoints`` (narrowed the same way). The
length check finds the same sentences fairseq's filter finds (its own ``filter_indices_by_size``
of the dataset, once more, only where fairseq would raise) and changes nothing else.
Does nothing when: remote data, ``--dataset-impl raw``, other tasks.
Versions: fairseq 0.12 (``filter_indices_by_size`` as in ``FairseqTask`` there).
Tests: ``tests/test_data_checks.py`` (``..._longer_than_the_models_positions...``).
"""
import functools
import inspect
import os
import sys

from multipath_nmt.data_bin_checks import (DataBinError, check_dictionary, check_split,
                                           rebuild_advice, sentence_too_long)
from multipath_nmt.fairseq_patches.wrapping import one_line_excepthook, wrap


def _local_paths(data):
    if not data or "://" in data:  # remote storage (iopath): fairseq's to read
        return []
    return data.split(os.pathsep)


def _check_setup(cfg):
    paths = _local_paths(getattr(cfg, "data", None))
    if not paths:
        return
    folder = paths[0]
    if not os.path.isdir(folder):
        raise DataBinError(folder, "no such data-bin directory: check the path given to fairseq")
    if cfg.source_lang is None or cfg.target_lang is None:
        from fairseq.data import data_utils

        cfg.source_lang, cfg.target_lang = data_utils.infer_language_pair(folder)
        if cfg.source_lang is None or cfg.target_lang is None:
            raise DataBinError(folder, "cannot tell the languages: no file of the data-bin is named "
                                       "<split>.<src>-<tgt>.<lang>.idx; pass --source-lang and "
                                       "--target-lang", rebuild_advice(folder))
    for lang in (cfg.source_lang, cfg.target_lang):
        check_dictionary(os.path.join(folder, f"dict.{lang}.txt"))


def _checking_setup(setup_task):
    @functools.wraps(setup_task)
    def setup_task_after_checking_the_data_bin(cls, cfg, **kwargs):
        _check_setup(cfg)
        return setup_task(cls, cfg, **kwargs)

    return setup_task_after_checking_the_data_bin


_CHECKED = set()


def _check_split(task, split, epoch):
    cfg = task.cfg
    paths = _local_paths(cfg.data)
    if not paths or getattr(cfg, "dataset_impl", None) == "raw":
        return
    training = split == getattr(cfg, "train_subset", "train")
    if not training:
        paths = paths[:1]  # fairseq reads valid and test from the first shard only
    src, tgt = cfg.source_lang, cfg.target_lang
    sizes = {src: len(task.src_dict)}
    if tgt is not None and getattr(task, "tgt_dict", None) is not None:
        sizes[tgt] = len(task.tgt_dict)
    what = "--train-subset" if training else None
    for folder in paths:
        key = (os.path.abspath(folder), split, src, tgt)
        if key in _CHECKED:
            continue
        check_split(folder, split, src, tgt, sizes, combine=True, need_target=training, what=what)
        _CHECKED.add(key)


def _checking_splits(load_dataset):
    signature = inspect.signature(load_dataset)

    @functools.wraps(load_dataset)
    def load_dataset_after_checking_it(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        _check_split(bound.arguments["self"], bound.arguments["split"], bound.arguments["epoch"])
        return load_dataset(*args, **kwargs)

    return load_dataset_after_checking_it


def _check_lengths(task, indices, dataset, max_positions):
    """:func:`sentence_too_long` for the first sentence (by number) of ``dataset``, one of the
    task's splits, that fairseq's filter would refuse for ``max_positions``."""
    paths = _local_paths(getattr(task.cfg, "data", None))
    src_sizes = getattr(dataset, "src_sizes", None)
    if max_positions is None or not paths or src_sizes is None:
        return
    split = next((name for name, loaded in task.datasets.items() if loaded is dataset), None)
    if split is None:
        return
    _, ignored = dataset.filter_indices_by_size(indices, max_positions)
    if len(ignored) == 0:
        return
    if isinstance(max_positions, (int, float)):
        max_positions = (max_positions, max_positions)
    index = int(min(ignored))
    side, limit, length = "source", max_positions[0], int(src_sizes[index])
    if length <= limit:
        side, limit, length = "target", max_positions[1], int(dataset.tgt_sizes[index])
    raise sentence_too_long(paths[0], split, task.cfg.source_lang, task.cfg.target_lang, side,
                            index, length, int(limit), len(ignored))


def _naming_long_sentences(filter_indices_by_size):
    signature = inspect.signature(filter_indices_by_size)

    @functools.wraps(filter_indices_by_size)
    def filter_indices_by_size_naming_a_long_sentence(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if not bound.arguments["ignore_invalid_inputs"]:  # where fairseq raises
            _check_lengths(bound.arguments["self"], bound.arguments["indices"],
                           bound.arguments["dataset"], bound.arguments["max_positions"])
        return filter_indices_by_size(*args, **kwargs)

    return filter_indices_by_size_naming_a_long_sentence


def _one_line_errors(previous_hook):
    return one_line_excepthook(previous_hook, DataBinError)


def install():
    from fairseq.tasks.translation import TranslationTask

    wrap(TranslationTask, "setup_task", _checking_setup)
    wrap(TranslationTask, "load_dataset", _checking_splits)
    wrap(TranslationTask, "filter_indices_by_size", _naming_long_sentences)
    wrap(sys, "excepthook", _one_line_errors)
