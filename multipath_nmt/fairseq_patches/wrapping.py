"""The one way a patch is put in place: :func:`wrap` replaces an attribute by a wrapper of it and
marks the wrapper, so that installing twice changes nothing."""
import inspect
import os
import sys

MARK = "__multipath_nmt_patched__"


def patch_name(make_wrapper):
    """What marks the patch ``make_wrapper`` makes: its module and qualified name."""
    return f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"


def patches_of(obj):
    """The names (:func:`patch_name`) of the patches wrapped around ``obj``, innermost first."""
    return getattr(obj, MARK, ())


def wrap(owner, name, make_wrapper):
    """Set ``owner.<name>`` to ``make_wrapper(original)``, unless this patch is already there.

    The mark is the tuple of patch names in the attribute :data:`MARK`, not a flag:
    ``functools.wraps`` copies the wrapped function's ``__dict__`` onto the wrapper, so with a
    flag the second patch of one function (``Trainer.train_step``: numerics, then EWA) would find
    the first one's mark and skip itself. A staticmethod or classmethod is unwrapped, and its
    wrapper is put back as the same kind of method. Returns whether anything was replaced.
    """
    key = patch_name(make_wrapper)
    stored = inspect.getattr_static(owner, name)
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

