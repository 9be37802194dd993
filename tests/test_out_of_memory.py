"""A micro-batch that does not fit the GPU stops training in one line that names it.

fairseq 0.12's ``Trainer.train_step`` catches CUDA's out-of-memory error, logs a warning, drops the
whole update and goes on (on one process; on several, the rank that dropped its part leaves the
others in DDP's all-reduce: a hang or a garbled reduction). The batches are the same every epoch,
so the same update is dropped in every epoch, and the run ends with status 0. With the plug-in
(``multipath_nmt/fairseq_patches/out_of_memory.py``) the run stops at that update with one line
that names the update, the micro-batch, its size and ``--max-tokens``, status 1; on 2 ranks both
stop. The error is raised where CUDA raises it, in the micro-batch's ``train_step``, by the test
plug-in ``tests/fixtures/out_of_memory_plugin`` (``--oom-at-update N``); training is otherwise
fairseq's defaults (a loader worker process, validation).
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_MODEL, TRAIN_FLAGS, run_command
from helpers.training import free_port

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).parent / "fixtures" / "out_of_memory_plugin"
# TRAIN_FLAGS without the suite's --num-workers 0 and --disable-validation: fairseq's defaults.
DEFAULT_FLAGS = [word for i, word in enumerate(TRAIN_FLAGS)
                 if word not in ("--num-workers", "--disable-validation")
                 and TRAIN_FLAGS[i - 1] != "--num-workers"]
TIMEOUT = 240
# The remedy every message ends with (TRAIN_FLAGS' --max-tokens 400).
REMEDY = ("Lower --max-tokens (scripts/train.sh: --max-tokens 200; it keeps the tokens per update "
          "with a higher --update-freq) or add --checkpoint-activations")


def _command(data_bin, save_dir, *flags):
    return [sys.executable, "-m", "fairseq_cli.train", str(data_bin), "--task",
            "translation_out_of_memory", "--arch", "transformer_prenorm_wmt_en_de", *TINY_MODEL,
            *DEFAULT_FLAGS, "--max-update", "6", "--save-dir", str(save_dir),
            "--user-dir", str(PLUGIN), *map(str, flags)]


def _run(command):
    """The command's exit status and output (stdout and stderr); a run that has not ended after
    TIMEOUT seconds (a hang) fails the test, killed with its children."""
    try:
        proc = run_command(command, timeout=TIMEOUT, merge_stderr=True)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"still running after {TIMEOUT} s (hung)\n{(hung.output or '')[-4000:]}")
    return proc.returncode, proc.stdout


def _error_lines(output):
    """The lines ``train.py: error: ...``, without the ``[rankN]: `` that torchrun puts before
    each line of its workers."""
    lines = (re.sub(r"^\[rank\d+\]: ", "", line) for line in output.splitlines())
    return [line for line in lines if line.startswith("train.py: error: ")]


def _micro_batch_line(update, micro_batch, micro_batches, rank=""):
    return re.compile(
        rf"train\.py: error: out of memory{rank} in update {update}'s micro-batch {micro_batch} "
        rf"of {micro_batches} \((\d+) sentences, ([\d,]+) tokens with padding, --max-tokens "
        rf"400\): CUDA out of memory\. Tried to allocate 2\.00 GiB\. {re.escape(REMEDY)}")


@pytest.mark.process  # a --user-dir of its own
def test_out_of_memory_in_a_micro_batch_stops_in_one_line(toy_data_bin, tmp_path):
    """Update 2's second micro-batch (--update-freq 2) does not fit: the run stops there with
    status 1 and one line, instead of dropping the update (in every epoch) and ending with 0."""
    code, output = _run(_command(toy_data_bin, tmp_path / "ckpt", "--update-freq", 2,
                                 "--oom-at-update", 2, "--oom-micro-batch", 2))
    [line] = _error_lines(output)
    found = _micro_batch_line(2, 2, 2).fullmatch(line)
    assert code == 1 and found, output[-4000:]
    assert 0 < int(found.group(2).replace(",", "")) <= 400
    assert "Traceback" not in output
    assert "num_updates=2" not in output and "num_updates=1" in output  # update 1 trained


@pytest.mark.process  # a --user-dir of its own
def test_out_of_memory_in_the_optimizer_step_stops_in_one_line(toy_data_bin, tmp_path):
    """After the micro-batches (the gradients' reduction, the optimizer step): fairseq re-raised
    it with a traceback; now one line as well."""
    code, output = _run(_command(toy_data_bin, tmp_path / "ckpt", "--update-freq", 2,
                                 "--oom-at-update", 3, "--oom-micro-batch", 0))
    assert code == 1 and "Traceback" not in output, output[-4000:]
    assert _error_lines(output) == [
        "train.py: error: out of memory in update 3 after its 2 micro-batches (the gradients' "
        "reduction, clipping or the optimizer step): CUDA out of memory. Tried to allocate "
        f"2.00 GiB. {REMEDY}"]


@pytest.mark.process
def test_out_of_memory_on_one_of_two_ranks_stops_both(toy_data_bin, tmp_path):
    """torchrun, 2 gloo ranks: rank 1 runs out of memory in update 2, rank 0 does not. Rank 1
    stops in one line; rank 0, waiting for it in one of DDP's collectives, stops too (no hang:
    the test's timeout; stock fairseq hung), and torchrun exits 1."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
               str(free_port()), *_command(toy_data_bin, tmp_path / "ckpt", "--oom-at-update", 2,
                                           "--oom-rank", 1)[1:],
               "--distributed-world-size", "2", "--distributed-backend", "gloo"]
    code, output = _run(command)
    assert code == 1, output[-4000:]
    lines = _error_lines(output)
    assert any(_micro_batch_line(2, 1, 1, rank=" on rank 1").fullmatch(line) for line in lines), \
        output[-4000:]
