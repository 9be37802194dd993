"""Run ``fairseq-train`` from tests: to completion, until a SIGKILL, or under ``torchrun``.

Every run is single-threaded (``clean_env``) so CPU results are bit-reproducible, and every
subprocess has a hard timeout so a hung run fails the test instead of the CI job.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import TINY_MODEL, TRAIN_FLAGS, USER_DIR, clean_env

UPDATE_LOGGED = re.compile(r"num_updates=(\d+)")
CHECKPOINT_SAVED = re.compile(r"Saved checkpoint \S+ \(epoch \d+ @ (\d+) updates")

# One tiny configuration per model family of the project. Flags after the arch override
# TRAIN_FLAGS (argparse keeps the last value).
MODELS = {
    "baseline": ["--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL],
}

# About 40 batches per epoch of the toy corpus, so short runs stay inside the first epoch.
SMALL_BATCHES = ["--batch-size", "8", "--required-batch-size-multiple", "1"]


def train_command(data, save_dir, model, *extra):
    return [sys.executable, "-m", "fairseq_cli.train", str(data), *MODELS[model], *TRAIN_FLAGS,
            "--save-dir", str(save_dir), "--user-dir", str(USER_DIR), *map(str, extra)]


def _fail(cmd, returncode, output):
    pytest.fail(f"{' '.join(map(str, cmd))} exited {returncode}\n--- output\n{output[-8000:]}")


def run(cmd, timeout=180, env=None):
    """Run to completion; fail the test with the output on a non-zero exit. Returns the output."""
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env or clean_env(), timeout=timeout)
    if proc.returncode != 0:
        _fail(cmd, proc.returncode, proc.stdout)
    return proc.stdout


def run_until_killed(cmd, kill_at_update, timeout=180):
    """Start ``cmd`` and SIGKILL it as soon as it logs update ``kill_at_update`` after a save.

    Returns (output, update of the last checkpoint saved before the kill). Killing on a log line
    makes the moment deterministic up to the few updates the child may run before the signal lands.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env())
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    lines, last_saved = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            saved = CHECKPOINT_SAVED.search(line)
            if saved:
                last_saved = int(saved.group(1))
            logged = UPDATE_LOGGED.search(line)
            if last_saved is not None and logged and int(logged.group(1)) >= kill_at_update:
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.stdout.read()  # drain what was written before the kill landed
        proc.wait()
    finally:
        watchdog.cancel()
        proc.stdout.close()
    output = "".join(lines)
    if proc.returncode != -signal.SIGKILL or last_saved is None:
        _fail(cmd, proc.returncode, output + "\n(expected to be killed after a checkpoint save)")
    return output, last_saved


DUMP_RANKS = Path(__file__).with_name("train_and_dump_ranks.py")


def torchrun_command(data, save_dir, model, *extra, ranks=2):
    """``fairseq-train`` under ``torchrun`` on CPU: gloo over loopback, every rank dumping its state."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc_per_node", str(ranks), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(DUMP_RANKS),
            *train_command(data, save_dir, model, *extra)[3:],
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
