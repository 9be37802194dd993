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
* ``sys.excepthook``: an uncaught :class:`~multipath_nmt.data_bin_checks.DataBinError` is printed as
  one line without a traceback (the process exits with status 1), as checkpoint errors are.

Reach beyond the plug-in's own models: every ``translation`` task checks its data-bin once per split
and process (one read of each file); the hook as for ``checkpoints`` (narrowed the same way).
Does nothing when: remote data, ``--dataset-impl raw``, other tasks.
"""
import functools
import inspect
import os
import sys

from multipath_nmt.data_bin_checks import DataBinError, check_dictionary, check_split, rebuild_advice
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


def _one_line_errors(previous_hook):
    return one_line_excepthook(previous_hook, DataBinError)


def install():
    from fairseq.tasks.translation import TranslationTask

    wrap(TranslationTask, "setup_task", _checking_setup)
    wrap(TranslationTask, "load_dataset", _checking_splits)
    wrap(sys, "excepthook", _one_line_errors)
