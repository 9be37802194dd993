"""multipath_nmt: a fairseq user-dir (``--user-dir multipath_nmt``).

Importing it installs every patch of fairseq 0.12 and PyTorch (:mod:`multipath_nmt.fairseq_patches`:
today's PyTorch, safe and atomic checkpoints, exact resume, CPU-only distributed runs, NaN/Inf
updates reported with their number, fused attention, the EWA after-step hook), and registers the
models, architectures, criterions and the ``adam_fused`` optimizer.
"""
import logging
import os

# fairseq's text_to_speech task calls logging.basicConfig(level=INFO) when fairseq is imported;
# when we are imported first (our own tools), undo that so they do not print INFO chatter.
_root_logging = (logging.getLogger().level, list(logging.getLogger().handlers))
# The same module logs "Please install tensorboardX" at INFO on import, before our tools' own
# one-line messages; nothing here uses that task.
logging.getLogger("fairseq.tasks.text_to_speech").setLevel(logging.WARNING)

from multipath_nmt import fairseq_patches  # noqa: E402

fairseq_patches.install()

if not _root_logging[1]:
    logging.getLogger().handlers[:] = []
    logging.getLogger().setLevel(_root_logging[0])

USER_DIR = os.path.dirname(os.path.abspath(__file__))

from multipath_nmt import criterions, models, optim  # noqa: E402,F401  (registration side effects)
