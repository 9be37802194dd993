"""Which checkpoint a resume starts from when ``checkpoint_last.pt`` is damaged:
:func:`newest_readable`, the one with the most updates whose structure reads."""
import logging
import os
import re

from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.checkpoint_io.reading import (check_file, peek_checkpoint, read_checkpoint,
                                                 saved_at)

logger = logging.getLogger(__name__)


_CHECKPOINT_NAMES = (r"checkpoint_\d+_\d+{}\.pt", r"checkpoint\d+{}\.pt", r"checkpoint_best{}\.pt",
                     r"checkpoint\.best_.+{}\.pt")


def newest_readable(folder, suffix="", exclude=()):
    """(path, epoch, updates) of the checkpoint of ``folder`` with the most updates whose
    structure reads, or None; unreadable ones are logged and skipped."""
    patterns = [re.compile(p.format(re.escape(suffix))) for p in _CHECKPOINT_NAMES]
    best = None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if path in exclude or not any(p.fullmatch(name) for p in patterns):
            continue
        try:
            check_file(path)
            state = peek_checkpoint(path) or read_checkpoint(path)
            epoch, updates = saved_at(state)
        except CheckpointError as err:
            logger.warning(f"skipping {err}")
            continue
        if updates is None:
            continue
        key = (updates, os.path.getmtime(path))
        if best is None or key > best[0]:
            best = (key, path, epoch, updates)
    return best and best[1:]
