"""How train.sh starts more than one training process: torchrun, run in train.sh's own process so
that the signals a scheduler sends reach every worker and the exit status says how they stopped,
and so that the workers die with it: torchrun starts each worker in a session of its own, so a
``kill -9`` of train.sh (or of its process group) would leave them training with no parent,
rank 0 holding the save dir. Each worker asks the kernel, before it ``exec``s, for SIGKILL
when its parent ends (``prctl(PR_SET_PDEATHSIG)``, kept across ``exec``), as multipath-prepare's
children die with it (:mod:`multipath_nmt.pipeline.tethered`)."""
import contextlib
import ctypes
import functools
import os
import shlex
import signal
import sys
from typing import List, Optional, Sequence

from multipath_nmt.recipe.archs import RecipeError

# More than one training process is started by torchrun (torch.distributed.run), as every
# distributed test runs it, not by fairseq's own torch.multiprocessing.spawn: under spawn a
# SIGTERM sent to the parent (what SLURM and Kubernetes send) never reaches the workers, and a
# worker that stops on it (exit 143) makes the parent exit 1.
LAUNCHER_MODULE = "torch.distributed.run"
# Signals that fairseq-train's workers stop on, saving checkpoint_last.pt, with status 128 + the
# signal's number (multipath_nmt/fairseq_patches/preemption.py's SIGNALS). torchrun itself would
# SIGTERM the workers, give them 30 s, and exit 1 with a traceback; train.sh passes each of these
# on to every worker instead, and leaves torchrun the others (SIGHUP, SIGQUIT).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAUNCHER_NOTE = ("SIGTERM, SIGINT and SIGUSR1 to train.sh reach every worker, which stop after the "
                 "same update and save checkpoint_last.pt; train.sh then exits 128 + the "
                 "signal's number, as one process does")


def launcher_arguments(gpus: int, nodes: int = 1, rdzv_endpoint: Optional[str] = None,
                       rdzv_id: Optional[str] = None) -> List[str]:
    """The words between ``python`` and ``-m fairseq_cli.train``: nothing for one process
    (fairseq-train as it is), else torchrun with ``gpus`` processes on each of ``nodes`` nodes
    (one node: ``--standalone``, a rendezvous on a free local port; several: a c10d rendezvous
    at ``rdzv_endpoint``, HOST:PORT of one of them, the same on every node)."""
    if nodes > 1 and not gpus:
        raise RecipeError(f"--nnodes {nodes} needs GPUs: no CUDA device found")
    if nodes > 1 and not rdzv_endpoint:
        raise RecipeError(f"--nnodes {nodes} needs --rdzv-endpoint HOST:PORT (one of the nodes, "
                          f"the same on every node; docs/troubleshooting.md)")
    if nodes == 1 and (rdzv_endpoint or rdzv_id):
        raise RecipeError("--rdzv-endpoint and --rdzv-id are for several nodes: give --nnodes N")
    if gpus * nodes <= 1:
        return []
    if nodes == 1:
        rendezvous = ["--standalone"]
    else:
        rendezvous = ["--nnodes", str(nodes), "--rdzv-backend", "c10d",
                      "--rdzv-endpoint", rdzv_endpoint, *(["--rdzv-id", rdzv_id] if rdzv_id else [])]
    return ["-m", LAUNCHER_MODULE, *rendezvous, "--nproc-per-node", str(gpus)]


def nodes_of(argv: Sequence[str]) -> int:
    """The number of nodes of a command line from :func:`launcher_arguments` (1 without
    torchrun or without ``--nnodes``)."""
    words = list(argv)
    if words[1:3] != ["-m", LAUNCHER_MODULE] or "--nnodes" not in words:
        return 1
    return int(words[words.index("--nnodes") + 1])


def _children() -> List[int]:
    """This process's child processes (torchrun's workers when it runs in this process)."""
    children = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children += [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    return children


_passed_on = []  # the stop signals passed on to the workers, in order

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls it


def _die_with_parent(parent: int) -> None:
    """In a worker between fork and exec (``preexec_fn``): SIGKILL when ``parent`` ends; if it
    ended already (killed as the worker was forked), end now."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)


@contextlib.contextmanager
def workers_die_with_this_process():
    """While in the block, every worker torchrun starts in this process dies when this process
    does, however it dies. Its ``SubprocessHandler`` ``Popen``s them from this thread (the
    kernel's "parent" is the thread that forked, and torchrun runs in the main thread); the
    ``Popen`` it calls is wrapped, not copied: its other arguments stay torch's."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    original = subprocess_handler.Popen

    def popen(*args, **kwargs):
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = functools.partial(_die_with_parent, os.getpid())
        return original(*args, **kwargs)

    subprocess_handler.Popen = popen
    try:
        yield
    finally:
        subprocess_handler.Popen = original


def _pass_on(signum, frame):
    workers = _children()
    if not workers:  # still in the rendezvous: no worker has anything to save
        print(f"train.sh: {signal.Signals(signum).name} before the workers started: exiting with "
              f"status {128 + signum}", file=sys.stderr, flush=True)
        os._exit(128 + signum)
    _passed_on.append(signum)
    for pid in workers:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def run_launcher(argv: Sequence[str]) -> int:
    """Run ``argv`` (``python -m torch.distributed.run ...``, from :func:`train_command`) as
    torchrun does, in this process, with :data:`STOP_SIGNALS` passed on to every worker; the
    exit status: 0, 128 + N when every worker stopped on signal N or, not yet training, was
    killed by it, else torchrun's report of the workers' exits on stderr and 1."""
    if list(argv[1:3]) != ["-m", LAUNCHER_MODULE]:
        raise ValueError(f"not a torchrun command line: {shlex.join(argv[:3])}")
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(list(argv[3:]))
    args.signals_to_handle = ",".join(sorted(
        set(args.signals_to_handle.split(",")) - {s.name for s in STOP_SIGNALS}))
    for signum in STOP_SIGNALS:
        signal.signal(signum, _pass_on)
    try:
        with workers_die_with_this_process():
            torchrun.run(args)
    except ChildFailedError as error:
        codes = {failure.exitcode for failure in error.failures.values()}
        stops = {128 + int(signum): signal.Signals(signum).name for signum in STOP_SIGNALS}
        if len(codes) == 1 and next(iter(codes)) in stops:
            code = codes.pop()
            print(f"train.sh: every worker stopped on {stops[code]} (status {code}); run the same "
                  f"command to resume", file=sys.stderr, flush=True)
            return code
        if _passed_on and codes <= {-_passed_on[0], 128 + _passed_on[0]}:
            # a worker that had not yet installed fairseq-train's handlers (it was importing,
            # building the model, joining the rendezvous) dies of the signal: still a stop by
            # the signal, which a scheduler's requeue script must see as one
            code = 128 + _passed_on[0]
            print(f"train.sh: {signal.Signals(_passed_on[0]).name} while the workers were "
                  f"starting: they stopped before training, nothing to save; exiting with status "
                  f"{code}", file=sys.stderr, flush=True)
            return code
        print(error.format_msg(), file=sys.stderr, flush=True)
        return 1
    return 0
