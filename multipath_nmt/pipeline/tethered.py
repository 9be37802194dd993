"""Processes of ``multipath-prepare`` that die with it.

After a kill -9 of multipath-prepare, none of its children may go on writing into a stage's
``.partial`` folder while the next run removes and rebuilds it: the workers of our own pools
(tokenize, BPE) and those of fairseq-preprocess's ``--workers``, which runs in this process
(:func:`multipath_nmt.pipeline.prepare.fairseq_preprocess`). Once :func:`tether_children` has run,
every process forked from this one watches a lifeline, the read end of a pipe whose write end
only this process holds (each child closes its copy as soon as it is forked): when this process
dies, however it dies, the kernel closes that end, the read returns end-of-file, and the child
kills itself. Pools must fork, so they ask for the fork context (forkserver is Python 3.14's
default); a program started with exec holds no write end (pipes are close-on-exec).
"""
import os
import signal
import threading

_lifeline = {}  # "read": the pipe's read end; "write": its write end, in this process only


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


def _after_fork_in_child():
    write_end = _lifeline.pop("write", None)
    if write_end is not None:  # a grandchild finds it closed already
        os.close(write_end)
    die_with_parent(_lifeline["read"])


def tether_children():
    """From now on every process forked from this one, and every process forked from those,
    dies when this one ends. Idempotent."""
    if _lifeline:
        return
    _lifeline["read"], _lifeline["write"] = os.pipe()
    os.register_at_fork(after_in_child=_after_fork_in_child)
