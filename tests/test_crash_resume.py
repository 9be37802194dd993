"""``kill -9`` during ``fairseq-train``, then the same command again, loses nothing.

fairseq restores the data iterator mid-epoch, the optimizer, the learning-rate schedule and the
update count (``set_num_updates``), and seeds every update with ``seed + num_updates``; our
modules keep any update-dependent state in parameters, buffers or ``set_num_updates`` (the EWA
schedule) and draw their randomness (router noise, EWA token groups) from that seeded RNG. So on
CPU, single-threaded, a killed-and-resumed run ends bit-exactly where an uninterrupted run ends.
Across epoch ends too: fairseq builds the batches once, with --seed + the epoch the iterator is
created in, so a run resumed in epoch 2 would build other batches than the uninterrupted run
(which keeps those of epoch 1); the plug-in builds them as in epoch 1
(multipath_nmt/fairseq_patches/batching.py).
"""
import os
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers.training import (MODELS, SMALL_BATCHES, assert_same_tensors, load_model_state, run,
                              run_until_killed, train_command)
from multipath_nmt.checkpoint_io.reading import read_checkpoint, saved_at

MAX_UPDATE = 14
SAVE_EVERY = 4
KILL_AT = 5  # killed right after the save at update 4 (or, on a busy machine, the one at 8)
FLAGS = [*SMALL_BATCHES, "--max-update", MAX_UPDATE, "--save-interval-updates", SAVE_EVERY,
         "--no-epoch-checkpoints"]


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.process
def test_sigkill_then_same_command_resumes_bit_exactly(model, toy_data_bin, tmp_path):
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted reference runs alongside
        reference = pool.submit(run, train_command(toy_data_bin, tmp_path / "uninterrupted",
                                                   model, *FLAGS))
        command = train_command(toy_data_bin, tmp_path / "killed", model, *FLAGS)
        run_until_killed(command, KILL_AT)
        _, saved_at = load_model_state(tmp_path / "killed" / "checkpoint_last.pt")
        assert saved_at % SAVE_EVERY == 0 and saved_at < MAX_UPDATE  # killed mid-run

        resumed = run(command)
        reference.result()
    assert f"Loaded checkpoint {tmp_path / 'killed' / 'checkpoint_last.pt'} " \
           f"(epoch 1 @ {saved_at} updates)" in resumed
    assert "epoch 002" not in resumed  # the iterator continued mid-epoch, not from a new epoch

    expected, expected_updates = load_model_state(tmp_path / "uninterrupted" / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(tmp_path / "killed" / "checkpoint_last.pt")
    assert actual_updates == expected_updates == MAX_UPDATE
    assert_same_tensors(actual, expected)


@pytest.mark.slow
@pytest.mark.process
def test_sigkill_with_asynchronous_writes_resumes_from_the_last_complete_save(toy_data_bin, tmp_path):
    """--write-checkpoints-asynchronously, then kill -9: the rerun resumes from the last save that
    completed and ends where an uninterrupted run ends. fairseq 0.12 wrote only the first file
    of each save in this mode (checkpoint_1_4.pt, ...), never checkpoint_last.pt: the rerun
    started at update 0 with those files on disk."""
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run, train_command(toy_data_bin, tmp_path / "uninterrupted",
                                                   "baseline", *FLAGS))
        command = train_command(toy_data_bin, tmp_path / "killed", "baseline", *FLAGS,
                                "--write-checkpoints-asynchronously")
        # two updates after the save at 4 logged "Saved checkpoint": its background write, a few
        # milliseconds, is done by then
        run_until_killed(command, SAVE_EVERY + 3)
        killed = tmp_path / "killed"
        _, saved = load_model_state(killed / "checkpoint_last.pt")
        assert saved % SAVE_EVERY == 0 and 0 < saved < MAX_UPDATE
        # every complete save of the killed run is at most as new as checkpoint_last.pt
        assert all(load_model_state(p)[1] <= saved for p in killed.glob("checkpoint_*_*.pt"))

        resumed = run(command)
        reference.result()
    assert f"Loaded checkpoint {killed / 'checkpoint_last.pt'} (epoch 1 @ {saved} updates)" in resumed
    expected, expected_updates = load_model_state(tmp_path / "uninterrupted" / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(killed / "checkpoint_last.pt")
    assert actual_updates == expected_updates == MAX_UPDATE
    assert_same_tensors(actual, expected)


# The toy corpus makes 38 batches of SMALL_BATCHES per epoch: epoch 2 runs from update 39 to 76.
EPOCH_1_UPDATES = 38
LATER_MAX_UPDATE = 56
LATER_FLAGS = [*SMALL_BATCHES, "--max-update", LATER_MAX_UPDATE, "--save-interval-updates", SAVE_EVERY,
               "--no-epoch-checkpoints"]


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.process
def test_sigkill_in_epoch_2_then_same_command_resumes_bit_exactly(model, toy_data_bin, tmp_path):
    kill_at = random.Random(model).randint(EPOCH_1_UPDATES + 6, LATER_MAX_UPDATE - 6)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run, train_command(toy_data_bin, tmp_path / "uninterrupted",
                                                   model, *LATER_FLAGS))
        command = train_command(toy_data_bin, tmp_path / "killed", model, *LATER_FLAGS)
        run_until_killed(command, kill_at)
        epoch, updates = saved_at(read_checkpoint(tmp_path / "killed" / "checkpoint_last.pt"))
        assert epoch == 2 and EPOCH_1_UPDATES < updates < LATER_MAX_UPDATE  # killed in epoch 2

        resumed = run(command)
        reference.result()
    assert f"(epoch 2 @ {updates} updates)" in resumed
    assert "creating new batches for epoch 1" in resumed  # not fairseq's "for epoch 2"

    expected, expected_updates = load_model_state(tmp_path / "uninterrupted" / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(tmp_path / "killed" / "checkpoint_last.pt")
    assert actual_updates == expected_updates == LATER_MAX_UPDATE
    assert_same_tensors(actual, expected)


@pytest.mark.slow
def test_same_seed_same_checkpoint(toy_data_bin, tmp_path):
    """Two identical CPU runs of a model with dropout, router noise and random token groups."""
    for name in ("first", "second"):
        run(train_command(toy_data_bin, tmp_path / name, "ewa", *SMALL_BATCHES, "--max-update", 6))
    first, _ = load_model_state(tmp_path / "first" / "checkpoint_last.pt")
    second, _ = load_model_state(tmp_path / "second" / "checkpoint_last.pt")
    assert_same_tensors(second, first)


def _copy_forever(copy, sources, destination):
    while True:
        for source in sources:
            copy(str(source), str(destination), overwrite=True)


def _kill_during_copies(copy, sources, destination, kills, rng):
    """Fork a process that copies ``sources`` over ``destination`` in a loop, SIGKILL it at a
    random moment, ``kills`` times; return how many kills left ``destination`` unloadable."""
    expected = [torch.load(s) for s in sources]
    broken = 0
    for _ in range(kills):
        pid = os.fork()
        if pid == 0:  # child: nothing but file copies, then never return into pytest
            try:
                _copy_forever(copy, sources, destination)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.01, 0.15))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        try:
            loaded = torch.load(destination)
            if not any(torch.equal(loaded["model"]["w"], e["model"]["w"]) for e in expected):
                broken += 1
        except Exception:  # noqa: BLE001  any failure to load counts as broken
            broken += 1
    return broken


def test_sigkill_during_checkpoint_copy_leaves_a_loadable_checkpoint_last(tmp_path):
    """fairseq writes checkpoint_N.pt atomically but copies it to checkpoint_last.pt in place;
    the plug-in makes that copy atomic. SIGKILL at many random moments of repeated copies:
    checkpoint_last.pt is always one complete checkpoint. The same kills against a plain copy
    do leave broken files, so the check has teeth."""
    from fairseq.file_io import PathManager

    sources = []
    for i, megabytes in enumerate((6, 10)):
        sources.append(tmp_path / f"checkpoint_{i}.pt")
        torch.save({"model": {"w": torch.full((megabytes << 18,), float(i))}}, sources[-1])
    last = tmp_path / "checkpoint_last.pt"
    shutil.copyfile(sources[0], last)
    rng = random.Random(0)

    assert _kill_during_copies(PathManager.copy, sources, last, kills=15, rng=rng) == 0

    def plain_copy(src, dst, overwrite=False):
        shutil.copyfile(src, dst)

    assert _kill_during_copies(plain_copy, sources, last, kills=15, rng=rng) > 0
