"""The one way a patch is put in place, and the checks before it: :func:`wrap` replaces an
attribute by a wrapper of it and marks the wrapper, so that installing twice changes nothing.

Two checks keep a patch off a fairseq it does not fit, each refusing in one line
(:class:`PatchRefusedError`) before anything is wrapped:

* the version: :data:`KNOWN_FAIRSEQ` is the one table of the fairseq builds the patches are tested
  on, by distribution and version. :func:`refuse_untested_fairseq` compares it with
  :func:`installed_fairseq` once, in ``fairseq_patches.install()``, before any module installs:
  a fairseq whose code we never ran can wrap the same names and still call them in another order,
  which no shape check sees. ``MULTIPATH_NMT_UNTESTED_FAIRSEQ=1`` (:data:`UNTESTED_SWITCH`) tries
  the patches anyway, with a warning; ``MULTIPATH_NMT_PATCHES=off`` runs fairseq without them.
* the shape: :func:`wrap` refuses a target that is missing or not callable, naming the patch
  and the attribute. ``fairseq_patches.install()`` first runs every module's ``install()`` under
  :func:`planning` (each ``wrap`` only checks and records), so that a missing attribute is found
  before the first wrap, not after half of them. An ``install()`` therefore does its other work
  (an allow-list, a flag, an atexit function) only where a ``wrap`` returned True.

A refusal is an exception (a notebook or a user's script can catch it and sees a traceback, as
for the other errors of the plug-in); in a command-line tool its one line is all that is printed
(:func:`one_line_excepthook`, put in place just before the refusal is raised), with status 1.
Not ``sys.exit``: an import that exits would end a notebook's kernel or a test run's collection.
A build is told by its distribution's name and by ``fairseq.__version__`` (what the imported
code says of itself: 0.12.3.1, 0.12.3): both known builds are of fairseq's unreleased main
branch, which no fairseq release number names, and a version alone could be anyone's fork.
"""
import contextlib
import importlib.metadata
import inspect
import logging
import os
import sys
import types

MARK = "__multipath_nmt_patched__"

# The environment variable that switches the patches off or leaves some out (fairseq_patches).
SWITCH = "MULTIPATH_NMT_PATCHES"

# The fairseq builds every patch is tested on: (distribution, version), the version being also
# what the imported ``fairseq.__version__`` says (README, "Which fairseq"). fairseq-fixed is what
# a fresh venv installs; ve-fairseq is what venvs made before it still have.
KNOWN_FAIRSEQ = (("fairseq-fixed", "0.12.3.1"), ("ve-fairseq", "0.12.3"))

# Set to 1 to install the patches on a fairseq not in KNOWN_FAIRSEQ (the shape checks still run).
UNTESTED_SWITCH = "MULTIPATH_NMT_UNTESTED_FAIRSEQ"


class PatchRefusedError(RuntimeError):
    """A patch refused the fairseq of this process; the message is one line saying what to do."""


def installed_fairseq():
    """``(distribution, version)`` of the fairseq this process imports.

    The distribution is the one of :data:`KNOWN_FAIRSEQ` whose files are the imported
    ``fairseq`` package (each asked by name: cheap), else whichever installed distribution
    provides ``fairseq`` (a scan of all of them, only for a fairseq we do not know), else
    ``"fairseq"`` (a source tree on ``sys.path``). The version is ``fairseq.__version__``, the
    imported code's own, which tells the builds apart when one was installed over the other.
    """
    import fairseq

    version = str(getattr(fairseq, "__version__", "unknown"))
    package = os.path.realpath(fairseq.__file__)
    providers = []
    for name, _ in KNOWN_FAIRSEQ:
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if os.path.realpath(distribution.locate_file("fairseq/__init__.py")) == package:
            providers.append(name)
    for name in providers:
        if (name, version) in KNOWN_FAIRSEQ:
            return name, version
    if not providers:
        providers = importlib.metadata.packages_distributions().get("fairseq") or ["fairseq"]
    return providers[0], version


def _known_builds():
    return " and ".join(f"{name} {version}" for name, version in KNOWN_FAIRSEQ)


def refuse_untested_fairseq(names, of_all):
    """Raise :class:`PatchRefusedError` unless this process's fairseq is in :data:`KNOWN_FAIRSEQ`
    (or ``MULTIPATH_NMT_UNTESTED_FAIRSEQ=1`` asks to try it: then one warning). ``names``: the
    patch modules about to be installed; ``of_all``: how many there are in all."""
    found = installed_fairseq()
    if found in KNOWN_FAIRSEQ:
        return
    found = " ".join(found)
    if os.environ.get(UNTESTED_SWITCH, "").strip() == "1":
        logging.getLogger("multipath_nmt.fairseq_patches").warning(
            "%s=1: trying the patches on %s, not tested (tested: %s)", UNTESTED_SWITCH, found,
            _known_builds())
        return
    which = f"patches (all {of_all})" if len(names) == of_all else \
        f"patch{'es' if len(names) > 1 else ''} {', '.join(names)}"
    raise PatchRefusedError(
        f"multipath_nmt's {which} {'are' if len(names) > 1 else 'is'} tested with "
        f"{_known_builds()}, not with {found}: {UNTESTED_SWITCH}=1 installs anyway, "
        f"{SWITCH}=off runs fairseq unpatched")


def patch_name(make_wrapper):
    """What marks the patch ``make_wrapper`` makes: its module and qualified name."""
    return f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"


def patches_of(obj):
    """The names (:func:`patch_name`) of the patches wrapped around ``obj``, innermost first."""
    return getattr(obj, MARK, ())


def target_name(owner, name):
    """``owner.name`` as the docs write it: ``Trainer.train_step``, ``checkpoint_utils.save_checkpoint``
    (a module of fairseq without its ``fairseq.``), ``fairseq_cli.train.main``, ``sys.excepthook``."""
    if isinstance(owner, types.ModuleType):
        spec = getattr(owner, "__spec__", None)  # fairseq_cli.train run as __main__ keeps its name
        module = spec.name if spec is not None else owner.__name__
        return f"{module.removeprefix('fairseq.')}.{name}"
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"


# While not None: the wraps install() would make, as (module, target, patch); wrap only checks.
_plan = None


@contextlib.contextmanager
def planning():
    """Within: :func:`wrap` checks its target and records it, and replaces nothing (returns
    False). Yields the list of ``(patch module, target, patch)`` recorded."""
    global _plan
    outer, _plan = _plan, []
    try:
        yield _plan
    finally:
        _plan = outer


def _refuse_target(owner, name, make_wrapper, what):
    module = make_wrapper.__module__.rsplit(".", 1)[1]
    raise PatchRefusedError(
        f"multipath_nmt's patch {module} cannot wrap {target_name(owner, name)}: {what} in "
        f"{' '.join(installed_fairseq())} (tested: {_known_builds()}); {SWITCH}=-{module} leaves "
        f"that patch out, {SWITCH}=off all of them")


def wrap(owner, name, make_wrapper):
    """Set ``owner.<name>`` to ``make_wrapper(original)``, unless this patch is already there.

    A target that is missing or not callable raises :class:`PatchRefusedError` naming the patch
    and ``owner.name``. The mark is the tuple of patch names in the attribute :data:`MARK`, not a
    flag: ``functools.wraps`` copies the wrapped function's ``__dict__`` onto the wrapper, so with
    a flag the second patch of one function (``Trainer.train_step``: numerics, then EWA) would
    find the first one's mark and skip itself. A staticmethod or classmethod is unwrapped, and its
    wrapper is put back as the same kind of method. Returns whether anything was replaced (never,
    under :func:`planning`).
    """
    key = patch_name(make_wrapper)
    try:
        stored = inspect.getattr_static(owner, name)
    except AttributeError:
        _refuse_target(owner, name, make_wrapper, "no such attribute")
    if not callable(getattr(owner, name)):
        _refuse_target(owner, name, make_wrapper, f"a {type(stored).__name__}, not callable")
    if _plan is not None:
        _plan.append((make_wrapper.__module__.rsplit(".", 1)[1], target_name(owner, name), key))
        return False
    method_kind = type(stored) if isinstance(stored, (staticmethod, classmethod)) else None
    original = stored.__func__ if method_kind else getattr(owner, name)
    if key in patches_of(original):
        return False
    wrapper = make_wrapper(original)
    setattr(wrapper, MARK, (*patches_of(original), key))
    setattr(owner, name, method_kind(wrapper) if method_kind else wrapper)
    return True


# The command-line tools whose uncaught errors of the plug-in are one line: fairseq's (run as
# ``python -m fairseq_cli.train``, as the recipe does, or as the ``fairseq-train`` console script)
# and the plug-in's own (``multipath-*``, ``python -m multipath_nmt.cli.*``).
CLI_MODULES = ("fairseq_cli.", "multipath_nmt.cli.")
CLI_PROGRAMS = ("fairseq-", "multipath-")


def cli_process():
    """Whether this process runs one of those tools (its ``__main__`` module, or its program's
    name). Anything else that imports the plug-in (a user's script, a notebook, pytest) is not."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if name.startswith(CLI_MODULES):
        return True
    program = sys.argv[0] if sys.argv and sys.argv[0] else ""
    folder, base = os.path.split(os.path.abspath(program)) if program else ("", "")
    return base.startswith(CLI_PROGRAMS) or os.path.basename(folder) == "fairseq_cli" \
        or folder.endswith(os.path.join("multipath_nmt", "cli"))


def one_line_excepthook(previous_hook, error_type):
    """A ``sys.excepthook`` that prints an uncaught ``error_type`` as ``PROGRAM: error: MESSAGE``
    (no traceback: the message says what is wrong and what to do) and hands anything else to
    ``previous_hook``. Only in a command-line tool (:func:`cli_process`, asked when the error
    arrives): in any other process every error goes to ``previous_hook``, traceback and all."""
    def excepthook(kind, value, traceback):
        if isinstance(value, error_type) and cli_process():
            program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            sys.stderr.write(f"{program}: error: {value}\n")
        else:
            previous_hook(kind, value, traceback)

    return excepthook


def one_line_refusals(previous_hook):
    """The hook that prints an uncaught :class:`PatchRefusedError` on one line."""
    return one_line_excepthook(previous_hook, PatchRefusedError)
