"""fairseq 0.12 checkpoints on PyTorch >= 2.6, whose ``torch.load`` defaults to ``weights_only=True``.

fairseq checkpoints pickle an ``argparse.Namespace``: that one global is allow-listed instead of
switching the protection off. A checkpoint that needs more fails with
:class:`multipath_nmt.checkpoint_io.UntrustedCheckpointError`, which names the globals and the
explicit ways to trust them (``MULTIPATH_NMT_TRUST_GLOBALS=module.Name,...``, read here, or
:func:`multipath_nmt.checkpoint_io.reading.trust_globals`).

A distributed resume broadcasts rank 0's loaded state (an OmegaConf config) to the other ranks
through ``torch.load``. That in-memory payload comes from our own process group; only the
OmegaConf containers it holds (and fairseq's placeholders for the tensors sent separately) are
allowed, and only while it is read.

Reach beyond the plug-in's own models: every ``torch.load`` of the process may unpickle
``argparse.Namespace`` (and the globals named in ``MULTIPATH_NMT_TRUST_GLOBALS``).
Does nothing when: torch < 2.4 (no allow-list).
"""
import argparse
import collections
import functools
import os
import typing

import torch

from multipath_nmt.checkpoint_io.reading import TRUST_ENV, trust_globals
from multipath_nmt.fairseq_patches.wrapping import wrap

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


def _trusting_broadcast(broadcast):
    @functools.wraps(broadcast)
    def _broadcast_object_slow(*args, **kwargs):
        with torch.serialization.safe_globals(_broadcast_globals()):
            return broadcast(*args, **kwargs)

    return _broadcast_object_slow


def install():
    from fairseq.distributed import utils as distributed_utils

    # torch < 2.4 (pyproject.toml allows >= 2.1) has no allow-list and loads everything by default.
    if not hasattr(torch.serialization, "add_safe_globals"):
        return
    # the allow-list goes in with the wrap: once, and not while install() only checks (planning)
    if wrap(distributed_utils, "_broadcast_object_slow", _trusting_broadcast):
        torch.serialization.add_safe_globals(CHECKPOINT_GLOBALS)
        trusted = os.environ.get(TRUST_ENV, "")
        if trusted.strip():
            trust_globals(*[n for n in trusted.split(",") if n.strip()])
