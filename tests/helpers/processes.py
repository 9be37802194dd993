"""The process trees of the commands the tests start: listed, killed at once, run with a timeout."""
import os
import signal
import subprocess


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:  # already gone
        return []


def process_tree(pid):
    """``pid`` and its descendants, each after its parent (from /proc, at this moment)."""
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
