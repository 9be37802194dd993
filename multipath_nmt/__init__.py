"""multipath_nmt: a fairseq user-dir (``--user-dir multipath_nmt``).

Importing it fixes what fairseq 0.12 needs on today's PyTorch (:mod:`multipath_nmt.compat`) and
on CPU-only distributed runs (:mod:`multipath_nmt.distributed`), reports NaN/Inf updates with
their number (:mod:`multipath_nmt.numerics`), and registers the models, architectures and
criterions.
"""
import os

from multipath_nmt import compat, distributed, numerics

compat.install()
distributed.install()
numerics.install()

USER_DIR = os.path.dirname(os.path.abspath(__file__))

from multipath_nmt import criterions, models  # noqa: E402,F401  (registration side effects)
