"""Run ``fairseq-train`` from tests: to completion, until a SIGKILL, or under ``torchrun``.

Every run is single-threaded (``clean_env``) so CPU results are bit-reproducible, and every
subprocess has a hard timeout so a hung run fails the test instead of the CI job.
"""
import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import (TINY_MODEL, TRAIN_FLAGS, USER_DIR, fail_unless_marked_slow,
                      run_command, start_command)
from helpers import in_process
from helpers.processes import kill_tree

UPDATE_LOGGED = re.compile(r"num_updates=(\d+)")
CHECKPOINT_SAVED = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ \d+ updates")

# One tiny configuration per model family of the project. Flags after the arch override
# TRAIN_FLAGS (argparse keeps the last value).
MODELS = {
    "baseline": ["--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL],
    # 3 paths with cheap features in the encoder, 2 paths in the decoder.
    "multipath": ["--arch", "multipath_transformer_wmt_en_de", *TINY_MODEL, "--encoder-paths", "3",
                  "--cheap-features", "--decoder-paths", "2"],
    # One attention and one routed MoE FFN shared by both encoder layers: each shared parameter
    # is used twice per step; router noise draws random numbers.
    "widenet": ["--arch", "widenet_transformer_wmt_en_de", *TINY_MODEL,
                "--criterion", "label_smoothed_cross_entropy_with_moe"],
    # EWA: random token groups, and an averaging after each step whose share rate rises with the
    # update count (linear schedule over --max-update).
    "ewa": ["--arch", "ewa_transformer_wmt_en_de", *TINY_MODEL, "--ewa-share-rate", "0.5",
            "--ewa-schedule", "linear"],
}

# About 40 batches per epoch of the toy corpus, so short runs stay inside the first epoch.
SMALL_BATCHES = ["--batch-size", "8", "--required-batch-size-multiple", "1"]


def train_command(data, save_dir, model, *extra):
    return [sys.executable, "-m", "fairseq_cli.train", str(data), *MODELS[model], *TRAIN_FLAGS,
            "--save-dir", str(save_dir), "--user-dir", str(USER_DIR), *map(str, extra)]


def _fail(cmd, what_happened, output):
    pytest.fail(f"{' '.join(map(str, cmd))} {what_happened}\n--- output\n{output[-8000:]}")


def run(cmd, timeout=180, env=None):
    """Run to completion; fail the test with the output on a non-zero exit or a timeout (which
    kills the whole process tree, torchrun workers included). Returns the output (stdout, then
    stderr). A fairseq-train command (:func:`train_command`) without ``env`` runs in this
    process (:func:`helpers.in_process.fairseq`); any other command starts a process."""
    if cmd[1:3] == ["-m", "fairseq_cli.train"] and env is None:
        proc = in_process.fairseq("train", cmd[3:])
        proc.stdout += proc.stderr
    else:
        try:
            proc = run_command(cmd, env=env, timeout=timeout, merge_stderr=True)
        except subprocess.TimeoutExpired as timed_out:
            _fail(cmd, f"was killed after a {timeout} s timeout", timed_out.output or "")
    output = proc.stdout
    if proc.returncode != 0:
        _fail(cmd, f"exited {proc.returncode}", output)
    fail_unless_marked_slow(output, " ".join(map(str, cmd[:3])))
    return output


def train_to_its_end(cmd):
    """A fairseq-train command (:func:`train_command`) run in this process whatever its exit,
    for a test of how it ends: a ``subprocess.CompletedProcess``."""
    assert cmd[1:3] == ["-m", "fairseq_cli.train"], cmd[:3]
    return in_process.fairseq("train", cmd[3:])


def stop(proc):
    """Close the output of a command from ``start_command``. One not yet waited for (the test
    failed while reading it) is first killed with its children and waited for: nothing trains
    on."""
    if proc.returncode is None:
        kill_tree(proc.pid)
        proc.stdout.read()
        proc.wait()
    proc.stdout.close()


@contextlib.contextmanager
def started(cmd, timeout, env=None):
    """``cmd`` started (``start_command``, its output merged on ``proc.stdout``) for a test to
    read and signal; should it outlive ``timeout`` seconds, a watchdog kills it with its children
    (``proc.timed_out`` says so afterwards), so a hung run fails the test, not the CI job. At the
    end it is stopped (:func:`stop`)."""
    proc = start_command(cmd, env=env)
    watchdog = threading.Timer(timeout, kill_tree, (proc.pid,))
    watchdog.start()
    try:
        yield proc
    finally:
        proc.timed_out = watchdog.finished.is_set()  # set only if it fired
        watchdog.cancel()
        stop(proc)


def read_until(proc, cmd, found, awaited):
    """``proc``'s output lines up to the first of which ``found(line)`` is true; the test fails
    with the output when it ends first (``awaited``: what it never printed)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if found(line):
            return lines
    _fail(cmd, f"ended (status {proc.wait()}) before {awaited}", "".join(lines))


def run_until_killed(cmd, kill_at_update, timeout=180):
    """Start ``cmd`` and SIGKILL it (with any workers) as soon as it logs update
    ``kill_at_update`` after a checkpoint save.

    Returns the output. Killing on a log line makes the moment deterministic up to the few
    updates the child may run before the signal lands (read the checkpoint for the update count).
    """
    lines, killed = [], False
    with started(cmd, timeout) as proc:
        saved = False
        for line in proc.stdout:
            lines.append(line)
            saved = saved or CHECKPOINT_SAVED.search(line) is not None
            logged = UPDATE_LOGGED.search(line)
            if saved and logged and int(logged.group(1)) >= kill_at_update:
                kill_tree(proc.pid)
                killed = True
                break
        proc.stdout.read()  # drain what was written before the kill landed
        proc.wait()
    output = "".join(lines)
    if proc.timed_out:
        _fail(cmd, f"was killed after a {timeout} s timeout", output)
    if not killed or proc.returncode != -signal.SIGKILL:
        _fail(cmd, f"exited {proc.returncode} before it was killed after a checkpoint save",
              output)
    return output


DUMP_RANKS = Path(__file__).with_name("train_and_dump_ranks.py")


def comparable_command(data, save_dir, model, *extra, ranks=1):
    """``fairseq-train`` through ``train_and_dump_ranks.py`` (per-batch seeds, per-rank states);
    with ranks > 1 under ``torchrun`` on CPU: gloo over loopback."""
    args = [str(DUMP_RANKS), *train_command(data, save_dir, model, *extra)[3:]]
    if ranks == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *args,
            "--distributed-world-size", str(ranks), "--distributed-backend", "gloo"]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_model_state(path):
    """(model state dict, number of updates) of a checkpoint, loaded the way fairseq-train does."""
    import multipath_nmt  # noqa: F401  (allow-lists what fairseq checkpoints pickle)
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    return state["model"], state["optimizer_history"][-1]["num_updates"]


def assert_same_tensors(actual, expected, atol=0.0, rtol=0.0):
    """Every tensor of two state dicts equal (bit-exact unless a tolerance is given)."""
    assert sorted(actual) == sorted(expected)
    mismatched = []
    for name, tensor in expected.items():
        other = actual[name]
        assert other.shape == tensor.shape and other.dtype == tensor.dtype, name
        if atol == 0 and rtol == 0:
            same = torch.equal(other, tensor)
        else:
            same = torch.allclose(other.float(), tensor.float(), atol=atol, rtol=rtol)
        if not same:
            diff = (other.double() - tensor.double()).abs().max().item()
            mismatched.append(f"{name}: max |diff| {diff:.3g}")
    assert not mismatched, "tensors differ:\n" + "\n".join(mismatched)


def assert_same_final_model(actual_dir, expected_dir, updates):
    """Both runs' checkpoint_last.pt are at ``updates`` updates and bit-identical."""
    expected, expected_updates = load_model_state(expected_dir / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(actual_dir / "checkpoint_last.pt")
    assert actual_updates == expected_updates == updates
    assert_same_tensors(actual, expected)


def assert_ranks_identical(save_dir, update):
    """The two ranks' states dumped after ``update`` (train_and_dump_ranks.py) are identical."""
    rank0 = torch.load(save_dir / f"rank0-update{update}.pt")
    rank1 = torch.load(save_dir / f"rank1-update{update}.pt")
    assert_same_tensors(rank1, rank0)

