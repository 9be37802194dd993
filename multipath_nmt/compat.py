"""What fairseq 0.12 needs to run on today's PyTorch, installed once when the plug-in is imported.

* ``torch.load`` defaults to ``weights_only=True`` since PyTorch 2.6, and fairseq checkpoints
  pickle an ``argparse.Namespace``. We allow-list exactly that global instead of switching the
  protection off; a checkpoint that needs more fails with :class:`UntrustedCheckpointError`,
  which names the globals and the explicit way to trust them
  (``MULTIPATH_NMT_TRUST_GLOBALS=module.Name,...`` or :func:`trust_globals`). Reading, saving and
  resuming (and every other way a checkpoint can fail) are in :mod:`multipath_nmt.checkpoints`.
* Distributed resume broadcasts rank 0's loaded state (an OmegaConf config) to the other ranks
  through ``torch.load``; that in-memory payload comes from our own process group, and only the
  OmegaConf containers it holds (and fairseq's placeholders for the tensors sent separately) are
  allowed while it is read.
* fairseq 0.12's ``batch_by_size`` drops the last batch when its size is not a multiple of
  ``--required-batch-size-multiple`` (default 8; fairseq issue #5036): ``fairseq-generate``
  silently translated 496 of 500 test sentences, and validation and training lost up to 7
  sentences per pass. The dropped tail is given back as a final, smaller batch.
* fairseq saves checkpoints atomically but *copies* ``checkpoint_last.pt`` (and the best/epoch
  copies) in place, so a kill during the copy leaves an unloadable file. Copies go through a
  temporary file and ``os.replace`` (:func:`multipath_nmt.checkpoints.write_atomically`).
* fairseq 0.12 handles ``--help`` before it adds the flags of ``--arch`` (and the task, optimizer,
  ...), so ``fairseq-train --arch A --help`` never listed the model's flags. ``--help`` now waits
  until every flag is on the parser and shows each model flag's default for that architecture.
"""
import argparse
import collections
import functools
import importlib
import os
import shutil
import sys
import typing

import torch

from multipath_nmt import checkpoints
from multipath_nmt.checkpoints import TRUST_ENV, UntrustedCheckpointError, write_atomically  # noqa: F401

# Everything a fairseq checkpoint pickles besides tensors and builtin containers.
CHECKPOINT_GLOBALS = [argparse.Namespace]


def _broadcast_globals():
    from fairseq.distributed.utils import _TensorPlaceholder
    from omegaconf import base, dictconfig, listconfig, nodes

    return [
        typing.Any, dict, int, list, collections.defaultdict,
        dictconfig.DictConfig, listconfig.ListConfig, nodes.AnyNode,
        base.ContainerMetadata, base.Metadata,
        _TensorPlaceholder,  # fairseq's broadcast_object sends tensors separately, as placeholders
    ]


def _resolve(dotted):
    module_name, _, attr = dotted.strip().rpartition(".")
    if not module_name:
        raise ValueError(f"{TRUST_ENV}: '{dotted}' is not a dotted name like 'numpy.dtype'")
    return getattr(importlib.import_module(module_name), attr)


def trust_globals(*objects_or_names):
    """Explicitly allow more globals in checkpoints (objects or dotted names). Only for files you trust."""
    objects = [_resolve(o) if isinstance(o, str) else o for o in objects_or_names]
    torch.serialization.add_safe_globals(objects)
    return objects


def _trusting_broadcast(broadcast):
    @functools.wraps(broadcast)
    def _broadcast_object_slow(*args, **kwargs):
        with torch.serialization.safe_globals(_broadcast_globals()):
            return broadcast(*args, **kwargs)

    _broadcast_object_slow.__multipath_nmt_patched__ = True
    return _broadcast_object_slow


def atomic_copy(src, dst, overwrite=False):
    """Copy through a temporary file in the destination folder, then rename over ``dst``."""
    if not overwrite and os.path.exists(dst):
        return False

    def copy_into(out):
        with open(src, "rb") as inp:
            shutil.copyfileobj(inp, out, length=16 << 20)

    write_atomically(dst, copy_into)
    return True


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

    keep_last_batch.__multipath_nmt_patched__ = True
    return keep_last_batch


def _arch_defaults(arch):
    """The values an architecture function gives the flags a command line leaves unset."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    defaults = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](defaults)
    return vars(defaults)


def _help_after_model_flags(parse_args_and_arch):
    """``--help`` once fairseq has added the flags of the model, task, optimizer, etc.

    fairseq 0.12 parses once to learn ``--arch``/``--task``/``--optimizer``..., adds their flags,
    and parses again; ``--help`` ran in the first parse, so no model flag was ever listed. Here
    it is held back and printed from fairseq's second ``modify_parser`` call (every flag is on
    the parser then), each model flag followed by the default its ``--arch`` gives it.
    """
    @functools.wraps(parse_args_and_arch)
    def parse_args_and_arch_with_full_help(parser, input_args=None, parse_known=False,
                                           suppress_defaults=False, modify_parser=None):
        argv = sys.argv[1:] if input_args is None else list(input_args)
        rest = [a for a in argv if a not in ("-h", "--help")]
        if len(rest) == len(argv) or suppress_defaults or not parser.add_help:
            return parse_args_and_arch(parser, input_args, parse_known, suppress_defaults,
                                       modify_parser)
        first_parse = []

        def modify_then_help(p):
            if modify_parser is not None:
                modify_parser(p)
            if not first_parse:  # first call: only the generic flags are on the parser
                first_parse.append(p.parse_known_args(rest)[0])
                if getattr(first_parse[0], "arch", "") is None:  # fairseq needs an --arch to go on
                    p.print_help()
                    p.exit()
                return
            arch = getattr(first_parse[0], "arch", None)
            try:
                defaults = _arch_defaults(arch) if arch is not None else {}
            except AttributeError:  # an arch reading a flag it does not set (fairseq's lightconv_lm)
                defaults = {}
            for action in p._actions:
                if action.default is argparse.SUPPRESS and action.dest in defaults:
                    value = str(defaults[action.dest]).replace("%", "%%")
                    action.help = f"{action.help or ''} (default for {arch}: {value})"
            p.print_help()
            p.exit()

        return parse_args_and_arch(parser, rest, parse_known, suppress_defaults, modify_then_help)

    parse_args_and_arch_with_full_help.__multipath_nmt_patched__ = True
    return parse_args_and_arch_with_full_help


def install():
    """Idempotent: safe checkpoint loading on PyTorch >= 2.6, no lost batches, atomic copies, and
    the checkpoint reader, saver and resume of :func:`multipath_nmt.checkpoints.install`."""
    from fairseq import options
    from fairseq.data import data_utils
    from fairseq.distributed import utils as distributed_utils
    from fairseq.file_io import PathManager

    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS)
        trusted = os.environ.get(TRUST_ENV, "")
        if trusted.strip():
            trust_globals(*[n for n in trusted.split(",") if n.strip()])
        if not getattr(distributed_utils._broadcast_object_slow, "__multipath_nmt_patched__", False):
            distributed_utils._broadcast_object_slow = _trusting_broadcast(
                distributed_utils._broadcast_object_slow)

    if not getattr(options.parse_args_and_arch, "__multipath_nmt_patched__", False):
        options.parse_args_and_arch = _help_after_model_flags(options.parse_args_and_arch)

    if not getattr(data_utils.batch_by_size, "__multipath_nmt_patched__", False):
        data_utils.batch_by_size = _keep_last_batch(data_utils.batch_by_size)

    if not getattr(PathManager.copy, "__multipath_nmt_patched__", False):
        original_copy = PathManager.copy

        def copy(src_path, dst_path, overwrite=False):
            if "://" in src_path or "://" in dst_path:  # remote storage: leave it to iopath
                return original_copy(src_path, dst_path, overwrite)
            return atomic_copy(src_path, dst_path, overwrite)

        copy.__multipath_nmt_patched__ = True
        PathManager.copy = staticmethod(copy)

    checkpoints.install()
