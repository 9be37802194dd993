"""A command run in the test's process (tests/helpers/in_process.py) ends as its own process's
exit would end it: its data-loader workers stopped and its signal handlers gone. Otherwise every
later test of the worker pays for them: a loader collected later waits 5 s for its worker, and a
pool forked later cannot terminate its workers, which ignore SIGTERM as a training's children
do (fairseq_patches/preemption.py), and waits for ever."""
import os
import signal

import pytest

from helpers.processes import process_tree
from helpers.training import run, train_command

from multipath_nmt.pipeline import text


def _upper(lines):
    return [line.upper() for line in lines]


def _no_init():
    pass


@pytest.mark.slow
def test_an_in_process_training_leaves_no_loader_worker_nor_signal_handler(toy_data_bin,
                                                                           tmp_path):
    handlers = {signum: signal.getsignal(signum) for signum in
                (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    children = set(process_tree(os.getpid())[1:])
    # fairseq's default: one forked data-loader worker for each pass
    run(train_command(toy_data_bin, tmp_path / "ckpt", "baseline", "--max-update", 2,
                      "--num-workers", 1))
    assert set(process_tree(os.getpid())[1:]) <= children
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    # and a tokenizer pool forked now ends: its workers die of the pool's SIGTERM
    source = tmp_path / "in.txt"
    source.write_text("".join(f"line {i}\n" for i in range(50)))
    text.map_file(source, tmp_path / "out.txt", _upper, _no_init, (), workers=2, label="test",
                  chunk_lines=7)
    assert (tmp_path / "out.txt").read_text() == source.read_text().upper()
