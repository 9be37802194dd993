"""Every change the plug-in makes to fairseq 0.12, PyTorch and Python at import time, in one place.

docs/patches.md is the one list of the patches: for every attribute wrapped, what, why, on which
versions it is needed and which test proves it; the fairseq builds they are tested on; the order of
the patches that wrap one function; why each is a wrap; what ``MULTIPATH_NMT_PATCHES=off`` breaks
again. ``tests/test_fairseq_patches.py`` ties that list to the code. Each module's docstring has
the details of its own patches.

:func:`install` (called by ``multipath_nmt/__init__.py``, so by every ``--user-dir multipath_nmt``
run) puts them all in place; calling it again changes nothing. Each patch is a
``make_wrapper(original)`` put in place by :func:`multipath_nmt.fairseq_patches.wrapping.wrap`,
which marks the wrapper with the patch's name and skips a patch already there. Before any of them,
:func:`install` refuses in one line a fairseq the patches are not tested on
(:data:`~multipath_nmt.fairseq_patches.wrapping.KNOWN_FAIRSEQ`) and an attribute a patch would
wrap that is missing or not callable (:mod:`multipath_nmt.fairseq_patches.wrapping` says how). The
code a patch calls, when it is more than the wiring, is library code outside this package
(:mod:`multipath_nmt.checkpoint_io`, :mod:`multipath_nmt.ewa.training`,
:mod:`multipath_nmt.atomic_files`).

``MULTIPATH_NMT_PATCHES=off`` in the environment installs none of them (:data:`SWITCH`) and checks
nothing: fairseq as it ships, for debugging and for measuring stock fairseq; the models still
register. ``MULTIPATH_NMT_PATCHES=-attention,-preemption`` leaves out just those modules (names:
:data:`NAMES`), to debug one patch with the others in place.
"""
import logging
import os
import sys

from multipath_nmt.fairseq_patches import (attention, batching, checkpoints, compile_layers,
                                           data_bins, distributed, ewa_trainer, grad_norm,
                                           help_flags, mixed_precision, numerics, out_of_memory,
                                           preemption, save_dirs, torch_compat)
from multipath_nmt.fairseq_patches.wrapping import (SWITCH, PatchRefusedError, one_line_refusals,
                                                    planning, refuse_untested_fairseq, wrap)

MODULES = (torch_compat, help_flags, batching, checkpoints, data_bins, distributed, numerics,
           out_of_memory, mixed_precision, grad_norm, attention, ewa_trainer, preemption,
           compile_layers, save_dirs)


NAMES = tuple(module.__name__.rsplit(".", 1)[1] for module in MODULES)

# SWITCH, ``MULTIPATH_NMT_PATCHES`` (defined in wrapping, whose refusals name it): ``off``
# installs none of the patches: fairseq runs as it ships, for debugging and for measuring stock
# fairseq. The models still register; what the patches fix is broken again (on torch >= 2.6 no
# checkpoint loads, --amp unscales twice, ...).
# ``-NAME,-NAME`` leaves out only those modules: someone chasing one patch keeps the others (a
# checkpoint still loads while the attention patch is off). Only exclusions are offered: every
# patch is on unless named, so a new patch module is never silently left out.


def left_out():
    """The names (:data:`NAMES`) of the modules ``MULTIPATH_NMT_PATCHES`` turns off: all for
    ``off``, none for ``on`` (the default); a malformed value or unknown name raises one line."""
    value = os.environ.get(SWITCH, "on").strip()
    if value == "on":
        return ()
    if value == "off":
        return NAMES
    entries = [entry.strip() for entry in value.split(",")]
    if not all(entry.startswith("-") for entry in entries):
        raise ValueError(f"{SWITCH} must be 'on' or 'off', got {value!r}; or -NAME,-NAME to leave "
                         f"out some patches, NAME one of {', '.join(NAMES)}")
    names = [entry[1:].strip() for entry in entries]
    unknown = [name for name in names if name not in NAMES]
    if unknown:
        raise ValueError(f"{SWITCH}={value}: unknown patch {', '.join(map(repr, unknown))}; "
                         f"known patches: {', '.join(NAMES)}")
    return tuple(name for name in NAMES if name in names)


def enabled():
    """Whether any patch is to be installed (``MULTIPATH_NMT_PATCHES`` is not ``off``)."""
    return len(left_out()) < len(NAMES)


def running_a_fairseq_command():
    """Whether this process is one of fairseq's commands: ``fairseq-train`` and the other console
    scripts, or ``python -m fairseq_cli.train`` (torchrun's workers, train.sh)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    program = spec.name if spec is not None else os.path.basename(sys.argv[0] if sys.argv else "")
    return program.startswith(("fairseq_cli.", "fairseq-"))


def install():
    """Put every patch in place (idempotent), but those ``MULTIPATH_NMT_PATCHES`` turns off.

    Before the first wrap: the fairseq of this process must be one the patches are tested on, and
    every attribute they wrap must be there and callable; else :class:`PatchRefusedError`, one
    line in a command-line tool (the hook that prints it goes in just before it is raised)."""
    skipped = left_out()
    logger = logging.getLogger(__name__)
    in_force = [name for name in NAMES if name not in skipped]
    modules = [module for name, module in zip(NAMES, MODULES) if name in in_force]
    if modules:
        try:
            refuse_untested_fairseq(in_force, len(NAMES))
            with planning():  # every wrap checks its target; nothing is replaced yet
                for module in modules:
                    module.install()
        except PatchRefusedError:
            wrap(sys, "excepthook", one_line_refusals)
            raise
    if len(skipped) == len(NAMES):
        logger.warning("%s=off: fairseq runs without the plug-in's patches", SWITCH)
    elif skipped:
        logger.warning("%s=%s: fairseq runs without the plug-in's patches %s", SWITCH,
                       os.environ[SWITCH].strip(), ", ".join(skipped))
    # at the start of a fairseq-train log, which the run's numbers depend on (docs/patches.md);
    # our own tools print nothing of it (fairseq's speech modules turn INFO on at import)
    logger.log(logging.INFO if running_a_fairseq_command() else logging.DEBUG,
               "patches in force: %s (%s switches them)", ", ".join(in_force) or "none", SWITCH)
    for module in modules:
        module.install()
