"""``python -m MODULE ARGS...`` for the tests without paying for the imports every time.

A fresh Python spends about 7 s of this project's 2 CPU cores importing torch and fairseq before
``fairseq-train`` reads its first flag; the suite starts hundreds of such processes. This module
keeps one server process that has imported them (:data:`PRELOADED`, nothing of ``multipath_nmt``,
whose import installs the patches a command's environment chooses), and runs each command in a
child forked from it: the child takes the command's environment, working directory and output
files, runs the module or script as ``__main__`` (as ``python -m`` or ``python SCRIPT`` does),
then exits the way the interpreter does: uncaught errors through
``sys.excepthook``, non-daemon threads joined, the command's ``atexit`` functions run, the exit
status of ``SystemExit``, SIGINT after an uncaught ``KeyboardInterrupt``. ``python -c CODE`` runs
as well: scripts/run-recipe.sh starts train.sh's and translate.sh's launcher that way.

The Python processes that scripts and commands start are forked too. The tests give scripts a
shim as ``PYTHON`` and as torchrun's ``PYTHON_EXEC`` (:meth:`PreloadedPython.shim`), and a forked
command's ``sys.executable`` is that shim, so torchrun's workers and a benchmark's runs go
through it. The shim's process stands in for its command (:mod:`preloaded_python_shim`): the
command gets the shim's standard streams and the signals sent to the shim, the shim exits as the
command does, and a SIGKILL to the shim kills the command and its children. It runs the
interpreter itself for anything the server does not fork.

What the preloaded imports log or warn while they run, the server printed (to no one): a child
does not print it again. What a child does not share with a fresh process, and so is never forked
(:meth:`PreloadedPython.forkable`): anything decided when the interpreter starts. Commands
whose environment differs from the server's in those variables (:data:`STARTUP_VARIABLES`) run
as plain subprocesses. A command that a test signals or kills while it runs starts with
:meth:`PreloadedPython.popen`: its output comes through a pipe of the test's, passed to the server
over a socket, so the test reads it line by line as from ``subprocess.Popen`` and signals the
child's pid.
``MULTIPATH_NMT_TEST_FORK=0`` turns the server off: every command then runs as a subprocess, as
it does on a Python other than those of :data:`IMITATED_PYTHONS`.
"""
import atexit
import builtins
import io
import json
import logging
import marshal
import os
import runpy
import shutil
import signal
import socket
import struct
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
# Not read when the interpreter or torch starts: the interpreter of the scripts (scripts/*.sh)
# and of torchrun's workers, and what torchrun sets for its workers, read when a NCCL process
# group is made.
NOT_STARTUP = ("PYTHON", "PYTHON_EXEC", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _startup_values(env):
    return {k: v for k, v in env.items() if k not in NOT_STARTUP
            and (k in STARTUP_VARIABLES or k.startswith(STARTUP_PREFIXES))}


# The frames above the command's own in a traceback: this file's and runpy's.
RUNNER_FILES = (os.path.abspath(__file__), runpy.__file__, "<frozen runpy>")

# The server's folder of links from a shim's pid (a file of that name) to the pid of the command
# forked for it, which is the server's child, not the shim's: :func:`process_tree` follows them.
_forked_links = None


def _exit_code(error: SystemExit) -> int:
    """The exit status the interpreter gives ``SystemExit(error.code)``."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _configured_at_the_first_fairseq_import(root_level, root_handlers):
    """From the command's first ``import fairseq...`` on, the root logger as that import leaves
    it in a fresh interpreter: ``root_level`` and ``root_handlers`` (the server's after its own
    imports), unless the command configured it first. The server imported fairseq before the
    command ran, so the command's import statement does nothing by itself; without this, a
    command that imports fairseq before calling ``logging.basicConfig`` (fairseq-preprocess,
    fairseq-generate) would log lines that a fresh one does not."""
    original = builtins.__import__

    def importing(name, globals=None, locals=None, fromlist=(), level=0):  # __import__'s own
        if level == 0 and (name == "fairseq" or name.startswith("fairseq.")):
            builtins.__import__ = original
            root = logging.getLogger()
            if not root.handlers:  # logging.basicConfig configures an unconfigured root only
                root.setLevel(root_level)
                root.handlers[:] = root_handlers
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = importing


def _run_child(request, pipe, client, fds, fairseq_logging):
    """In the forked child: become the command, run it, exit. Never returns. Its output goes
    to the files the request names, into ``pipe`` (stdout and stderr) if there is one, or to the
    standard streams ``fds`` of the ``client`` (:mod:`preloaded_python_shim`) that asked for it;
    ``fairseq_logging``: the root logger's level and handlers after the server's imports."""
    code, interrupted = 1, False
    try:
        if fds is not None:
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                os.close(fd)
            client.close()
        else:
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
        sys.stdin = open(0, closefd=False)
        if request["unbuffered"]:  # python -u, as torchrun starts its workers
            sys.stdout = io.TextIOWrapper(open(1, "wb", 0, closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(open(2, "wb", 0, closefd=False), write_through=True,
                                          errors="backslashreplace")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # The server's own signal dispositions and exit functions are not the command's. A fresh
        # interpreter raises KeyboardInterrupt on SIGINT unless it started with SIGINT ignored,
        # as a non-interactive shell starts its background jobs: the command's starter says which.
        signal.signal(signal.SIGINT, signal.SIG_IGN if request.get("sigint_ignored")
                      else signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        atexit._clear()
        # the Python processes the command starts (torchrun's workers, a benchmark's runs) are
        # forked as well
        sys.executable = request["executable"]
        sys.argv = ["-c" if request["kind"] == "code" else request["target"], *request["args"]]
        # A __main__ of the command's own that stays after it ends, as in a fresh interpreter:
        # an excepthook may ask which program runs (runpy.run_path would restore the server's).
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins
        sys.modules["__main__"] = main
        _configured_at_the_first_fairseq_import(*fairseq_logging)
        try:
            if request["kind"] == "module":
                sys.path[0] = request["cwd"]
                runpy._run_module_as_main(request["target"])  # what ``python -m`` calls
            elif request["kind"] == "code":
                sys.path[0] = ""  # python -c: the current folder
                exec(compile(request["target"], "<string>", "exec"), main.__dict__)
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
        except BaseException as error:  # noqa: BLE001
            interrupted = isinstance(error, KeyboardInterrupt)
            tb = _command_frames(error)
            try:
                sys.excepthook(type(error), error.with_traceback(tb), tb)
            except BaseException as hook_error:  # noqa: BLE001 reported as the interpreter reports it
                print("Error in sys.excepthook:", file=sys.stderr)
                hook_error.__context__, hook_tb = None, _command_frames(hook_error)
                sys.__excepthook__(type(hook_error), hook_error.with_traceback(hook_tb), hook_tb)
                print("\nOriginal exception was:", file=sys.stderr)
                sys.__excepthook__(type(error), error, tb)
            code = 1
        threading._shutdown()  # what the interpreter does first at exit: the threading
        atexit._run_exitfuncs()  # module's exit functions (thread pools), non-daemon threads
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            if interrupted:  # the interpreter ends on an uncaught KeyboardInterrupt by SIGINT
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


def _command_frames(error):
    """The traceback of ``error`` from the command's first frame, as the interpreter shows it."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename in RUNNER_FILES:
        tb = tb.tb_next
    return tb


def _forkable_env(startup, launched, env):
    """Whether a command with environment ``env`` may run in a child of a server launched with
    ``launched`` whose startup variables are ``startup`` (after its imports)."""
    # what the imports set, a fresh interpreter sets too: absent from ``env`` is the same
    set_by_imports = {k: v for k, v in startup.items() if k not in launched}
    return {**set_by_imports, **_startup_values(env)} == startup


def parse(args, python):
    """``args`` (a command line of the interpreter ``python``) as a request's kind ("module",
    "code" or "path"), target, arguments and whether it is unbuffered: ``python [-u] -m MODULE``,
    ``python [-u] -c CODE``, ``python [-u] SCRIPT`` (a file) or a console script of this
    interpreter's environment (``#!`` ``python``); None for anything else: other options."""
    unbuffered = args[0] == python and len(args) >= 2 and args[1] == "-u"
    if unbuffered:
        args = [args[0], *args[2:]]
    if args[0] == python and len(args) >= 3 and args[1] == "-m":
        return {"kind": "module", "target": args[2], "args": args[3:], "unbuffered": unbuffered}
    if args[0] == python and len(args) >= 3 and args[1] == "-c":
        return {"kind": "code", "target": args[2], "args": args[3:], "unbuffered": unbuffered}
    if args[0] == python and len(args) >= 2 and not args[1].startswith("-") \
            and os.path.isfile(args[1]):
        return {"kind": "path", "target": args[1], "args": args[2:], "unbuffered": unbuffered}
    if not unbuffered and os.path.dirname(args[0]) == os.path.dirname(python) \
            and os.path.isfile(args[0]):
        with open(args[0], "rb") as script:
            if script.readline().rstrip() == b"#!" + os.fsencode(python):
                return {"kind": "path", "target": args[0], "args": args[1:], "unbuffered": False}
    return None


def serve(channel, address, shim):
    """The server. The test's requests: one JSON line each on stdin; for each, the child's pid,
    then its exit status (as ``subprocess`` reports it: -N for a signal), one JSON line each on
    stdout. A request with ``"pipe": true`` comes with the write end of a pipe on the socket
    ``channel``. The shim's requests (:mod:`preloaded_python_shim`, for the Python processes that
    commands and scripts start): a connection each on the socket at ``address``, with the
    client's standard streams; the server forks them at once, however many run, and answers the
    same two messages (``marshal``) on the connection, or that the shim should run the
    interpreter itself. A client that goes (killed with SIGKILL by a test's kill -9
    or a timeout) takes its command and everything that started along, as if they were one
    process: the server watches the connection, not the command, which may have ``exec``ed
    another program (train.sh's launcher becomes fairseq-train)."""
    import importlib
    import select

    global _forked_links
    _forked_links = os.path.join(os.path.dirname(address), "forked")
    links = {}  # a shim's command's pid -> the link to it (every pid of ``clients``)
    launched = dict(os.environ)
    root = logging.getLogger()
    unconfigured = root.level, list(root.handlers)
    for name in PRELOADED:
        importlib.import_module(name)
    # fairseq's import configures the root logger (a task module calls logging.basicConfig); a
    # command configures it before that import (fairseq-train logs to stdout) or after it
    # (fairseq-preprocess, whose configuration then does nothing), or the plug-in undoes it: as
    # in a fresh interpreter, the command finds it unconfigured, and its first import of fairseq
    # configures it (_configured_at_the_first_fairseq_import).
    fairseq_logging = root.level, list(root.handlers)
    root.setLevel(unconfigured[0])
    root.handlers[:] = unconfigured[1]
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing but replies on the reply pipe
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address)
    listener.listen(64)
    # the imports may set startup variables (scikit-learn, imported by fairseq, sets KMP_*)
    startup = _startup_values(os.environ)
    replies.write(json.dumps({"startup": startup}) + "\n")
    replies.flush()

    requests = os.fdopen(os.dup(0), "rb", 0)
    test_child = None
    clients = {}  # pid -> the connection of the client that asked for it
    # A child's end wakes the loop below at once (a byte on ``ended``), which then answers its
    # exit status: every command waits on that answer.
    ended, ended_writer = os.pipe()
    os.set_blocking(ended, False)
    os.set_blocking(ended_writer, False)
    signal.set_wakeup_fd(ended_writer)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def fork(request, pipe=None, client=None, fds=None):
        request["executable"] = shim
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for other in (replies, channel, listener, requests, *clients.values()):
                other.close()
            os.close(ended)
            os.close(ended_writer)
            _run_child(request, pipe, client, fds, fairseq_logging)
        return pid

    def forget(pid):
        """The connection of the shim whose command ``pid`` has ended or was killed; the link
        from the shim to the command removed."""
        os.unlink(links.pop(pid))
        return clients.pop(pid)

    def reply(client, message):
        try:
            client.send(marshal.dumps(message))
        except OSError:  # the client is gone; its command was killed with it
            pass

    pending = b""
    while True:
        readable, _, _ = select.select([requests, listener, ended, *clients.values()], [], [])
        if ended in readable:
            os.read(ended, 4096)
        for pid, client in list(clients.items()):
            if client in readable:  # a client sends nothing after its request: it has gone
                kill_tree(pid)  # its descendants first, the command last
                forget(pid).close()
        if requests in readable:
            chunk = requests.read(65536)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pipe = socket.recv_fds(channel, 1, 1)[1][0] if request.get("pipe") else None
                test_child = fork(request, pipe)
                if pipe is not None:
                    os.close(pipe)  # the child holds the only copy: EOF once it and its children end
                replies.write(json.dumps({"pid": test_child}) + "\n")
                replies.flush()
        if listener in readable:
            client, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(client, 1 << 20, 3)
                request = marshal.loads(message)
            except (OSError, EOFError, ValueError, TypeError):  # a client that died first
                client.close()
                continue
            command = parse([request["python"], *request["argv"]], request["python"])
            if command is None or len(fds) != 3 or \
                    not _forkable_env(startup, launched, request["env"]):
                reply(client, {"exec": True})
                client.close()
            else:
                pid = fork({**request, **command}, client=client, fds=fds)
                clients[pid] = client
                client_pid, _, _ = struct.unpack("3i", client.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
                links[pid] = os.path.join(_forked_links, str(client_pid))
                with open(links[pid], "w") as link:
                    link.write(str(pid))
                reply(client, {"pid": pid})
            for fd in fds:
                os.close(fd)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            returncode = os.waitstatus_to_exitcode(status)
            if pid == test_child:
                replies.write(json.dumps({"returncode": returncode}) + "\n")
                replies.flush()
            elif pid in clients:
                client = forget(pid)
                reply(client, {"returncode": returncode})
                client.close()


class PreloadedPython:
    """The test session's server, started on first use with ``env`` (the tests' clean
    environment)."""

    def __init__(self, env):
        self.env = dict(env)
        self.process = None
        self.channel = None  # the socket that passes pipes to the server
        self.startup = None  # the server's startup variables once it has imported PRELOADED
        # the server's socket, the shim (:meth:`shim`) and its console scripts
        self.folder = self.shim_path = self.bin = None
        self.lock = threading.Lock()  # one request at a time on the server's pipes

    def forkable(self, args, env):
        """Whether :func:`parse` knows ``args``, and ``env`` agrees with the server's on the
        variables read at startup."""
        if not _forking() or parse(args, sys.executable) is None:
            return False
        with self.lock:
            self._start()
        return _forkable_env(self.startup, self.env, env)

    def shim(self):
        """The path of an executable that stands for this interpreter and forks the commands it
        is given from the server (:mod:`preloaded_python_shim`): what the tests give scripts as
        ``PYTHON``. This interpreter itself when forking is off."""
        if not _forking():
            return sys.executable
        with self.lock:
            self._start()
        return self.shim_path

    def console_scripts(self):
        """A folder of the environment's console scripts that fork from the server (through the
        shim), for the front of a script's ``PATH``; None when forking is off."""
        if not _forking():
            return None
        with self.lock:
            self._start()
        return self.bin

    def _start(self):
        """Start the server unless it runs."""
        if self.process is not None and self.process.poll() is None:
            return
        if self.channel is not None:  # of a server that died
            self.channel.close()
        global _forked_links
        self.folder = tempfile.mkdtemp(prefix="preloaded-python-")
        _forked_links = os.path.join(self.folder, "forked")
        os.mkdir(_forked_links)
        address = os.path.join(self.folder, "socket")
        self.shim_path = os.path.join(self.folder, "python")
        with open(self.shim_path, "w") as shim:
            shim.write(f"#!{sys.executable} -IS\n"
                       f"import sys\n"
                       f"sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"
                       f"from preloaded_python_shim import client_main\n"
                       f"client_main({sys.executable!r}, {address!r})\n")
        os.chmod(self.shim_path, 0o755)
        # The environment's console scripts (multipath-*, fairseq-*) with the shim as their
        # interpreter: on a script's PATH, the commands it runs by name fork too.
        self.bin = os.path.join(self.folder, "bin")
        os.mkdir(self.bin)
        for name in os.listdir(os.path.dirname(sys.executable)):
            script = os.path.join(os.path.dirname(sys.executable), name)
            if parse([script], sys.executable) is not None:
                with open(script) as original, open(os.path.join(self.bin, name), "w") as copy:
                    copy.write(f"#!{self.shim_path}\n" + original.read().split("\n", 1)[1])
                os.chmod(os.path.join(self.bin, name), 0o755)
        self.channel, theirs = socket.socketpair()
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(theirs.fileno()), address, self.shim_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=self.env, text=True, pass_fds=[theirs.fileno()])
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
        request = {**parse(args, sys.executable), "env": dict(env),
                   "cwd": str(cwd or os.getcwd()), "pipe": pipe is not None, **output_files,
                   "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN}
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
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


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
    """``pid``'s children, and the command the server forked for it if it is a shim."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(child) for child in f.read().split()]
    except OSError:  # already gone
        return []
    if _forked_links is not None:
        try:
            with open(os.path.join(_forked_links, str(pid))) as link:
                children.append(int(link.read()))
        except (OSError, ValueError):
            pass
    return children


def process_tree(pid):
    """``pid`` and its descendants, each after its parent (from /proc, at this moment); a
    shim's command counts as its child."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(_children(tree[-1]))
    return tree


def kill_tree(pid):
    """SIGKILL a process and all its descendants at once, like a crashing machine.

    torchrun starts its workers in their own sessions, so killing the agent (or its process
    group) would leave the workers training on."""
    for member in reversed(process_tree(pid)):  # workers before the agent, so none is restarted
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


# The CPython versions whose startup, exits and tracebacks the server reproduces, as
# tests/test_preloaded_python.py checks against fresh interpreters; on another Python every
# command starts a fresh interpreter (3.13 prints a traceback's source lines for ``-c`` code, for
# one, which a forked command does not).
IMITATED_PYTHONS = ((3, 11), (3, 12))


def _forking():
    return (os.environ.get("MULTIPATH_NMT_TEST_FORK", "1") != "0"
            and sys.version_info[:2] in IMITATED_PYTHONS)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), *sys.argv[2:])
