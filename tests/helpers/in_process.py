"""A command run in the test's own process, read like the finished command.

The tests call the library the way its commands do, without a process start (several seconds of
imports on 2 cores); tests where the process is the point start one (the ``process`` mark,
tests/conftest.py). Each runner gives a ``subprocess.CompletedProcess`` (``returncode``,
``stdout``, ``stderr``), and ends the way the interpreter ends a command: ``SystemExit``'s
status, with its message on stderr (``sys.exit("tool: error: ...")``); any other exception
through ``sys.excepthook`` (where the plug-in prints its one-line refusals) onto stderr, status 1.

What a fresh process decides at its start is this process's: the patches installed at the
plug-in's import (``MULTIPATH_NMT_PATCHES``), the logging that an import configures, the
interpreter's own messages. A test of those starts the command.
"""
import contextlib
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import weakref
from importlib import metadata

import pytest


def exit_status(error: SystemExit) -> int:
    """The exit status the interpreter gives ``SystemExit(error.code)``."""
    if error.code is None:
        return 0
    return error.code if isinstance(error.code, int) else 1


@contextlib.contextmanager
def _environment(env, cwd):
    """os.environ without our variables (``MULTIPATH_NMT_*``) but ``env``'s (None unsets), in
    ``cwd`` if given; both restored afterwards."""
    saved, where = dict(os.environ), os.getcwd()
    try:
        for name in [name for name in os.environ if name.startswith("MULTIPATH_NMT_")]:
            del os.environ[name]
        for name, value in (env or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        if cwd is not None:
            os.chdir(cwd)
        yield
    finally:
        os.chdir(where)
        os.environ.clear()
        os.environ.update(saved)


# The root logger of a fresh command: fairseq's format at INFO, on stdout for fairseq-train and
# fairseq-preprocess (their ``logging.basicConfig`` runs before fairseq's import), on stderr for
# the others (fairseq's text_to_speech task configures it when fairseq is imported).
FAIRSEQ_LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"
LOGS_ON_STDOUT = ("train", "preprocess")


@contextlib.contextmanager
def _root_logger_on(stream):
    """The root logger as a fresh command has it: fairseq's handler on ``stream`` at INFO, or
    (``stream`` None: our tools) none, at WARNING (logging's last resort prints on stderr)."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    root.handlers[:] = []
    root.setLevel(logging.WARNING)
    if stream is not None:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(FAIRSEQ_LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.handlers[:], root.level = saved


@contextlib.contextmanager
def _loaders_stopped_at_the_end():
    """The data-loader workers that the command forks (fairseq's default ``--num-workers 1``)
    stopped when it ends, as its process's exit stops them. Left to the garbage collector, each
    loader's end waits torch's 5 s timeout for a worker whose queue the collector has already
    closed, in whatever later test collects it."""
    from torch.utils.data import dataloader

    started = weakref.WeakSet()
    iterator = dataloader._MultiProcessingDataLoaderIter
    init = iterator.__init__

    def recording(self, *args, **kwargs):
        started.add(self)
        init(self, *args, **kwargs)

    iterator.__init__ = recording
    try:
        yield
    finally:
        iterator.__init__ = init
        for loader in list(started):
            if getattr(loader, "_workers", None) is not None:
                loader._shutdown_workers()


@contextlib.contextmanager
def _signal_handlers_restored():
    """The handlers of the signals that fairseq-train's preemption patch takes, as they were
    before the command, and the patch's record of a run cleared: they last until a fairseq-train
    process exits, and a process forked from here later (a tokenizer pool's worker) would ignore
    the SIGTERM that ends it, so the pool's end would wait for it for ever."""
    from multipath_nmt.fairseq_patches import preemption

    main_thread = threading.current_thread() is threading.main_thread()
    saved = {signum: signal.getsignal(signum) for signum in preemption.SIGNALS}
    try:
        yield
    finally:
        if main_thread:
            for signum, handler in saved.items():
                signal.signal(signum, handler)
        preemption._state = preemption._State()


def _run(program, entry, argv, env=None, cwd=None, fairseq_logging=None):
    """``entry(argv)`` with ``sys.argv`` ``[program, *argv]``; ``fairseq_logging``: the
    fairseq_cli module's name (its root logger), None for our tools."""
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv, sys.stdout, sys.stderr
    code = 0
    with _environment(env, cwd), _loaders_stopped_at_the_end(), _signal_handlers_restored(), \
            _root_logger_on(None if fairseq_logging is None
                            else out if fairseq_logging in LOGS_ON_STDOUT else err):
        sys.argv, sys.stdout, sys.stderr = [program, *argv], out, err
        try:
            entry(argv)
        except SystemExit as error:
            code = exit_status(error)
            if error.code is not None and not isinstance(error.code, int):
                err.write(f"{error.code}\n")
        except Exception:  # noqa: BLE001  (the interpreter's end of a command: hook, status 1)
            sys.excepthook(*sys.exc_info())
            code = 1
        finally:
            sys.argv, sys.stdout, sys.stderr = saved
    return subprocess.CompletedProcess([program, *argv], code, out.getvalue(), err.getvalue())


def call(main, argv, env=None, cwd=None, program="tool"):
    """``main(argv)`` (a ``cli.<tool>.main``) with ``sys.argv[0]`` ``program``: see the module
    docstring."""
    return _run(program, main, argv, env=env, cwd=cwd)


def refusal(main, argv):
    """The one line a tool's ``main(argv)`` refuses with: ``sys.exit`` of a one-line string
    (status 1)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    message = exit_info.value.code
    assert isinstance(message, str) and "\n" not in message, message
    return message


def console_script(name, argv, env=None, cwd=None):
    """The installed console script ``name`` (``multipath-score``, ``fairseq-train``) with
    ``argv``: its entry point's function, found in the package metadata and called without
    arguments (it reads ``sys.argv``), as the script calls it."""
    found = [point for point in metadata.entry_points(group="console_scripts")
             if point.name == name]
    if not found:
        raise LookupError(f"no console script {name!r} is installed")
    function = found[0].load()
    fairseq_tool = name.removeprefix("fairseq-") if name.startswith("fairseq-") else None
    return _run(os.path.join(os.path.dirname(sys.executable), name), lambda argv: function(),
                argv, env=env, cwd=cwd, fairseq_logging=fairseq_tool)


def fairseq(tool, argv, env=None, cwd=None):
    """``fairseq-TOOL ARGV...`` (train, generate, preprocess, interactive) through fairseq's own
    ``cli_main``, which reads ``sys.argv`` (``[0]``: the module's file, as ``python -m`` sets
    it), as fairseq's tests run it."""
    module = importlib.import_module(f"fairseq_cli.{tool}")
    if tool == "train":
        # a fresh fairseq-train has loaded its module when the plug-in's import wraps the main
        # and train there (fairseq_patches.preemption, save_dirs); here the plug-in may have
        # come first: install() wraps what is loaded now and leaves the rest as it is
        from multipath_nmt import fairseq_patches

        fairseq_patches.install()
    return _run(module.__file__, lambda argv: module.cli_main(), argv, env=env, cwd=cwd,
                fairseq_logging=tool)


def _write(stream, text):
    stream.write(text.encode() if "b" in getattr(stream, "mode", "") else text)
    stream.flush()


def subprocess_call(argv, stdout=None, stderr=None, **kwargs):
    """``subprocess.call`` for code that starts ``python -m fairseq_cli.TOOL ...`` (the study's
    trainings and translations): that command runs here (:func:`fairseq`), its output written
    to the files ``stdout`` and ``stderr`` (``subprocess.STDOUT``: after its stdout); any other
    command starts as a process."""
    argv = [str(a) for a in argv]
    if argv[1:2] != ["-m"] or not argv[2].startswith("fairseq_cli."):
        return _process_call(argv, stdout=stdout, stderr=stderr, **kwargs)
    finished = fairseq(argv[2].removeprefix("fairseq_cli."), argv[3:])
    if stdout is not None:
        _write(stdout, finished.stdout)
    if stderr is subprocess.STDOUT:
        stderr = stdout
    if stderr is not None:
        _write(stderr, finished.stderr)
    return finished.returncode


_process_call = subprocess.call
