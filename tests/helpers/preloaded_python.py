"""``python -m MODULE ARGS...`` for the tests without paying for the imports every time.

A fresh Python spends about 7 s of this project's 2 CPU cores importing torch and fairseq before
``fairseq-train`` reads its first flag; the suite starts hundreds of such processes. This module
keeps one server process that has imported them (:data:`PRELOADED`, nothing of ``multipath_nmt``,
whose import installs the patches a command's environment chooses), and runs each command in a
child forked from it: the child takes the command's environment, working directory and output
files, runs the module or script as ``__main__`` (as ``python -m`` or ``python SCRIPT`` does),
then exits the way the interpreter does: uncaught errors through ``sys.excepthook``, non-daemon
threads joined, the command's ``atexit`` functions run, the exit status of ``SystemExit``.

What the preloaded imports log or warn while they run, the server printed (to no one): a child
does not print it again. What a child does not share with a fresh process, and so is never forked
(:meth:`PreloadedPython.forkable`): anything decided when the interpreter starts. Commands
whose environment differs from the server's in those variables (:data:`STARTUP_VARIABLES`) run
as plain subprocesses. A command that a test signals or kills while it runs starts with
:meth:`PreloadedPython.popen`: its output comes through a pipe of the test's, passed to the server
over a socket, so the test reads it line by line as from ``subprocess.Popen`` and signals the
child's pid.
``MULTIPATH_NMT_TEST_FORK=0`` turns the server off: every command then runs as a subprocess.
"""
import atexit
import builtins
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types

# What the server imports once: torch and fairseq (whose ``__init__`` imports its models, tasks,
# criterions and optimizers) are 6-7 s of the 7 s a fairseq command spends before its work.
PRELOADED = ("torch", "fairseq", "numpy", "sacrebleu", "sacremoses")

# Read when the interpreter or torch starts: a child inherits the server's values.
STARTUP_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH",
                     "CUDA_VISIBLE_DEVICES")
STARTUP_PREFIXES = ("PYTHON", "TORCH_", "PYTORCH_", "KMP_", "GOMP_")


def _startup_values(env):
    return {k: v for k, v in env.items()
            if k in STARTUP_VARIABLES or k.startswith(STARTUP_PREFIXES)}


# The frames above the command's own in a traceback: this file's and runpy's.
RUNNER_FILES = (os.path.abspath(__file__), runpy.__file__, "<frozen runpy>")


def _exit_code(error: SystemExit) -> int:
    """The exit status the interpreter gives ``SystemExit(error.code)``."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _run_child(request, pipe):
    """In the forked child: become the command, run it, exit. Never returns. Its output goes
    to the files the request names, or into ``pipe`` (stdout and stderr) if there is one."""
    code = 1
    try:
        with open(os.devnull) as null:
            os.dup2(null.fileno(), 0)
        if pipe is not None:
            output = errors = pipe
        else:
            output = os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC)
            errors = os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC) \
                if request["stderr"] != request["stdout"] else output
        os.dup2(output, 1)
        os.dup2(errors, 2)
        sys.stdin = open(os.devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # The server's own signal dispositions and exit functions are not the command's.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        atexit._clear()
        sys.argv = [request["target"], *request["args"]]
        # A __main__ of the command's own that stays after it ends, as in a fresh interpreter:
        # an excepthook may ask which program runs (runpy.run_path would restore the server's).
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        try:
            if request["kind"] == "module":
                sys.path[0] = request["cwd"]
                runpy._run_module_as_main(request["target"])  # what ``python -m`` calls
            else:
                path = request["target"]
                sys.path[0] = os.path.dirname(os.path.realpath(path))
                with open(path, "rb") as script:
                    source = script.read()
                main.__file__, main.__cached__ = path, None
                exec(compile(source, path, "exec"), main.__dict__)
            code = 0
        except SystemExit as error:
            code = _exit_code(error)
        except BaseException as error:
            tb = error.__traceback__  # from the command's first frame, as the interpreter shows it
            while tb is not None and tb.tb_frame.f_code.co_filename in RUNNER_FILES:
                tb = tb.tb_next
            sys.excepthook(type(error), error.with_traceback(tb), tb)
            code = 1
        threading._shutdown()  # what the interpreter does first at exit: the threading
        atexit._run_exitfuncs()  # module's exit functions (thread pools), non-daemon threads
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(channel):
    """The server: one JSON request per line on stdin; for each, the child's pid, then its exit
    status (as ``subprocess`` reports it: -N for a signal), one JSON line each on stdout. A request
    with ``"pipe": true`` comes with the write end of a pipe on the socket ``channel``."""
    import importlib
    import logging

    root = logging.getLogger()
    unconfigured = root.level, list(root.handlers)
    for name in PRELOADED:
        importlib.import_module(name)
    # fairseq's import configures the root logger (a task module calls logging.basicConfig); a
    # command configures it before that import (fairseq-train logs to stdout), or the plug-in
    # undoes it: as in a fresh interpreter, the command finds it unconfigured.
    root.setLevel(unconfigured[0])
    root.handlers[:] = unconfigured[1]
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but replies on the reply pipe
    # the imports may set startup variables (scikit-learn, imported by fairseq, sets KMP_*)
    replies.write(json.dumps({"startup": _startup_values(os.environ)}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pipe = socket.recv_fds(channel, 1, 1)[1][0] if request.get("pipe") else None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            channel.close()
            _run_child(request, pipe)
        if pipe is not None:
            os.close(pipe)  # the child's copy is the only one: EOF when it and its children end
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


class PreloadedPython:
    """The test session's server, started on first use with ``env`` (the tests' clean
    environment)."""

    def __init__(self, env):
        self.env = dict(env)
        self.process = None
        self.channel = None  # the socket that passes pipes to the server
        self.startup = None  # the server's startup variables once it has imported PRELOADED
        self.lock = threading.Lock()  # one request at a time on the server's pipes

    @staticmethod
    def command(args):
        """``args`` as a request's ("module" or "path", target, arguments): ``python -m MODULE``,
        ``python SCRIPT.py`` or a console script of this interpreter's environment (``#!`` this
        interpreter); None for anything else (``python -c``, options to the interpreter, other
        programs)."""
        if args[0] == sys.executable and len(args) >= 3 and args[1] == "-m":
            return "module", args[2], args[3:]
        if args[0] == sys.executable and len(args) >= 2 and args[1].endswith(".py") \
                and not args[1].startswith("-"):
            return "path", args[1], args[2:]
        if os.path.dirname(args[0]) == os.path.dirname(sys.executable) \
                and os.path.isfile(args[0]):
            with open(args[0], "rb") as script:
                if script.readline().rstrip() == b"#!" + os.fsencode(sys.executable):
                    return "path", args[0], args[1:]
        return None

    def forkable(self, args, env):
        """Whether :meth:`command` knows ``args``, and ``env`` agrees with the server's on the
        variables read at startup."""
        if os.environ.get("MULTIPATH_NMT_TEST_FORK", "1") == "0" or self.command(args) is None:
            return False
        with self.lock:
            self._start()
        # what the imports set, a fresh interpreter sets too: absent from ``env`` is the same
        set_by_imports = {k: v for k, v in self.startup.items() if k not in self.env}
        return {**set_by_imports, **_startup_values(env)} == self.startup

    def _start(self):
        """Start the server unless it runs."""
        if self.process is not None and self.process.poll() is None:
            return
        if self.channel is not None:  # of a server that died
            self.channel.close()
        self.channel, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno())], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env, text=True,
                pass_fds=[theirs.fileno()])
        ready = self.process.stdout.readline()
        if not ready:
            raise RuntimeError(f"{__file__} did not start")
        self.startup = json.loads(ready)["startup"]

    def run(self, args, env, cwd=None, timeout=600, merge_stderr=False):
        """Run ``args`` (see :meth:`forkable`) in a child of the server; a
        ``subprocess.CompletedProcess`` with text output, as ``subprocess.run`` gives. A child
        still running after ``timeout`` s is killed with its descendants and
        ``subprocess.TimeoutExpired`` is raised. Commands from several threads run one after
        the other."""
        with self.lock:
            return self._run(args, env, cwd, timeout, merge_stderr)

    def popen(self, args, env, cwd=None):
        """Start ``args`` (see :meth:`forkable`) in a child of the server, its stdout and stderr
        into one pipe: a :class:`ForkedProcess`, read as ``subprocess.Popen(args, stdout=PIPE,
        stderr=STDOUT, text=True)`` is. Other commands wait until it has been waited for."""
        self.lock.acquire()
        try:
            read_end, write_end = os.pipe()
            try:
                pid = self._send(args, env, cwd, pipe=write_end)
            finally:
                os.close(write_end)
        except BaseException:
            self.lock.release()
            raise
        return ForkedProcess(self, args, pid, open(read_end))

    def _send(self, args, env, cwd, pipe=None, **output_files):
        """Ask the server to fork ``args`` with its output into ``pipe`` (passed over the socket)
        or the files ``output_files`` names (``stdout``, ``stderr``); returns the child's pid."""
        self._start()
        kind, target, arguments = self.command(args)
        request = {"kind": kind, "target": target, "args": arguments, "env": dict(env),
                   "cwd": str(cwd or os.getcwd()), "pipe": pipe is not None, **output_files}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        if pipe is not None:
            socket.send_fds(self.channel, [b"p"], [pipe])
        return json.loads(self.process.stdout.readline())["pid"]

    def _returncode(self):
        """The exit status of the child the server forked last, once it has ended."""
        return json.loads(self.process.stdout.readline())["returncode"]

    def _run(self, args, env, cwd, timeout, merge_stderr):
        with tempfile.NamedTemporaryFile("r", errors="replace") as out, \
                tempfile.NamedTemporaryFile("r", errors="replace") as err:
            pid = self._send(args, env, cwd, stdout=out.name,
                             stderr=out.name if merge_stderr else err.name)
            killed = []
            timer = threading.Timer(timeout, lambda: (killed.append(pid), kill_tree(pid)))
            timer.start()
            try:
                returncode = self._returncode()
            finally:
                timer.cancel()
            stdout, stderr = out.read(), (None if merge_stderr else err.read())
        if killed:
            raise subprocess.TimeoutExpired(args, timeout, stdout, stderr)
        return subprocess.CompletedProcess(args, returncode, stdout, stderr)

    def close(self):
        """Stop the server, and any command a test left running (started and never waited for)."""
        if self.process is not None and self.process.poll() is None:
            for child in _children(self.process.pid):
                kill_tree(child)
            self.process.stdin.close()
            self.process.wait(timeout=60)
        if self.channel is not None:
            self.channel.close()


class ForkedProcess:
    """A command started by :meth:`PreloadedPython.popen`: ``args``, ``pid``, ``stdout`` (text,
    stderr merged), ``wait()`` and ``returncode`` (-N for a signal), as ``subprocess.Popen``
    gives. The server takes the next command once :meth:`wait` has returned."""

    def __init__(self, server, args, pid, stdout):
        self.server, self.args, self.pid, self.stdout = server, args, pid, stdout
        self.returncode = None

    def wait(self):
        if self.returncode is None:
            try:
                self.returncode = self.server._returncode()
            finally:
                self.server.lock.release()
        return self.returncode


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:  # already gone
        return []


def kill_tree(pid):
    """SIGKILL a process and all its descendants at once, like a crashing machine.

    torchrun starts its workers in their own sessions, so killing the agent (or its process
    group) would leave the workers training on."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(_children(tree[-1]))
    for member in reversed(tree):  # workers before the agent, so none is restarted
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_subprocess(args, env, cwd=None, timeout=600, merge_stderr=False):
    """``subprocess.run`` with text output, except that a timeout kills the whole process tree
    (torchrun's workers too), then raises ``subprocess.TimeoutExpired`` with the output."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(args, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
