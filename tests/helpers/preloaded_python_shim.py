"""The shim's program: the Python that the tests give scripts (``PYTHON``) and forked commands
(``sys.executable``), which asks the server of :mod:`preloaded_python` to fork its command line.

A process of its own for every Python process a script starts (train.sh's launcher, each of
torchrun's workers, each run of a benchmark), so it imports as little as it can: ``_socket``
and ``marshal`` rather than ``socket`` (enum, selectors) and ``json`` (re), about 55 ms less
a start on this project's CPUs.
"""
import _socket
import array
import marshal
import os
import signal
import sys

# The signals a client passes on to its command: those a scheduler, torchrun or a test sends.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP,
             signal.SIGQUIT)


def client_main(python, address):
    """Run this process's command line in a child of the server at ``address``, as if this
    process were that command. Its standard streams go to the command; the signals of
    :data:`FORWARDED` are passed on to it; this process ends as it does (the same exit status,
    or killed by the same signal); killed with SIGKILL, it takes the command along
    (``preloaded_python.serve``). Anything the server does not fork (other options, a different
    startup environment, no server) ``exec``s ``python`` itself."""
    args = sys.argv[1:]
    sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as this process started
    # Held from before the request until the command's pid is known: the command may run, and
    # be signalled by someone who saw it run, before this process has read its pid.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        client = _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        client.connect(address)
        request = {"python": python, "argv": args, "env": dict(os.environ), "cwd": os.getcwd(),
                   "sigint_ignored": sigint_ignored}
        client.sendmsg([marshal.dumps(request)],  # with this process's standard streams
                       [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        answered = client.recv(1 << 16)
        answer = marshal.loads(answered) if answered else {}  # nothing: the server has gone
    except OSError:
        answer = {}
    if "pid" in answer:
        pid = answer["pid"]

        def forward(signum, frame):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

        for signum in FORWARDED:
            signal.signal(signum, forward)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # those held are passed on now
        ended = client.recv(1 << 16)
        returncode = marshal.loads(ended)["returncode"] if ended else -signal.SIGKILL
        if returncode < 0:
            signal.signal(-returncode, signal.SIG_DFL)
            os.kill(os.getpid(), -returncode)
        os._exit(returncode)
    # the interpreter itself: a signal held meanwhile ends this process as it would end an
    # interpreter that has not started yet
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.execv(python, [python, *args])
