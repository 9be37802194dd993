"""Send a signal to ``fairseq-train`` (or one worker of a ``torchrun`` job) once it has logged a
given update, and let it finish on its own."""
import os

from helpers.processes import process_tree
from helpers.training import UPDATE_LOGGED, _fail, started


def alive(pid):
    """Whether the process ``pid`` runs (not ended, nor a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def worker_of_rank(pid, rank):
    """The topmost process below ``pid`` whose environment says RANK=``rank`` (torchrun's worker)."""
    for member in process_tree(pid)[1:]:
        try:
            with open(f"/proc/{member}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode():
            return member
    raise LookupError(f"no process with RANK={rank} below {pid}")


def run_and_signal(cmd, at_update, signum, rank=None, timeout=240):
    """Start ``cmd``, send ``signum`` once it logs update ``at_update`` (to the worker of
    ``rank`` under torchrun, else to the process itself), let it exit; return (status, output).
    The signal lands a few updates later on a busy machine: read the checkpoint for the update."""
    lines, sent = [], False
    with started(cmd, timeout) as proc:
        for line in proc.stdout:
            lines.append(line)
            logged = UPDATE_LOGGED.search(line)
            if not sent and logged and int(logged.group(1)) >= at_update:
                os.kill(proc.pid if rank is None else worker_of_rank(proc.pid, rank), signum)
                sent = True
        proc.wait()
    output = "".join(lines)
    if proc.timed_out:
        _fail(cmd, f"was killed after a {timeout} s timeout", output)
    if not sent:
        _fail(cmd, f"exited {proc.returncode} before update {at_update}", output)
    return proc.returncode, output
