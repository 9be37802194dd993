"""Processes of ``multipath-prepare`` that die with it.

After a kill -9 of multipath-prepare, none of its children may go on writing into a stage's
``.partial`` folder while the next run removes and rebuilds it. Each child watches a lifeline, the
read end of a pipe whose write end only its parent holds: when the parent dies, however it dies,
the kernel closes that end, the read returns end-of-file, and the child kills itself.

* the workers of our own pools (tokenize, BPE): the lifeline is multiprocessing's
  ``parent_process().sentinel``. A worker also holds the write ends of the sentinels of the workers
  forked before it, so after a kill -9 the last one goes first, then the one before it, and so on.
* ``python .../multipath_nmt/pipeline/tethered.py MODULE ARGS...`` (fairseq-preprocess, started
  by :func:`run_module`): ``MODULE`` run as ``__main__``, as ``python -m MODULE`` does, whose
  stdin is the lifeline; every process it forks (fairseq-preprocess's ``--workers``) watches the
  same pipe. It runs as a file, not with ``-m``: the watch starts at once, not after the 5-7 s
  that importing this package (torch, fairseq) takes, and fairseq-preprocess runs as it ships.
"""
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import threading


def die_with_parent(lifeline):
    """Kill this process once the pipe ``lifeline`` (a file descriptor) that only its parent
    writes to, and never does, ends: the parent is gone."""
    watched = os.dup(lifeline)

    def watch():
        try:
            while os.read(watched, 1):
                pass
        except OSError:  # not a pipe any more: nothing to watch
            return
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def die_with_pool_parent():
    """A pool worker's initializer: the worker dies with the process that made the pool."""
    die_with_parent(multiprocessing.parent_process().sentinel)


def run_module(module, args):
    """``python -m MODULE ARGS...`` (fairseq-preprocess) as a child that dies with this process,
    and so does every process it forks, with the child's stdout on our stderr (its log is
    progress: stdout stays free, as in every stage). Returns its exit status (-N: killed by
    signal N)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with subprocess.Popen([sys.executable, os.path.abspath(__file__), module, *args],
                          stdin=subprocess.PIPE, stdout=2) as child:
        return child.wait()  # leaving the block closes the lifeline: on an error, the child ends


def _main():
    lifeline = os.dup(0)
    die_with_parent(lifeline)
    os.register_at_fork(after_in_child=lambda: die_with_parent(lifeline))
    sys.path[0] = os.getcwd()  # as ``python -m`` has it, not this file's folder
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _main()
