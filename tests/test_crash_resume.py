"""``kill -9`` during ``fairseq-train``, then the same command again, loses nothing.

fairseq restores the data iterator mid-epoch, the optimizer, the learning-rate schedule and the
update count (``set_num_updates``), and seeds every update with ``seed + num_updates``; our
modules keep any update-dependent state in parameters, buffers or ``set_num_updates``. So on CPU,
single-threaded, a killed-and-resumed run ends bit-exactly where an uninterrupted run ends. The
guarantee holds inside an epoch; docs/troubleshooting.md explains why not across epoch ends.
"""
import pytest

from helpers.training import (MODELS, SMALL_BATCHES, assert_same_tensors, load_model_state, run,
                              run_until_killed, train_command)

pytestmark = pytest.mark.slow

MAX_UPDATE = 14
SAVE_EVERY = 4
KILL_AT = 6  # killed two updates after the save at update 4, long before the save at 8


@pytest.fixture(scope="module")
def save_root(tmp_path_factory):
    return tmp_path_factory.mktemp("crash")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_sigkill_then_same_command_resumes_bit_exactly(model, toy_data_bin, save_root):
    flags = [*SMALL_BATCHES, "--max-update", MAX_UPDATE, "--save-interval-updates", SAVE_EVERY,
             "--no-epoch-checkpoints"]
    reference = save_root / f"{model}-uninterrupted"
    run(train_command(toy_data_bin, reference, model, *flags))

    crashed = save_root / f"{model}-killed"
    command = train_command(toy_data_bin, crashed, model, *flags)
    _, saved_at = run_until_killed(command, KILL_AT)
    assert saved_at < MAX_UPDATE
    _, updates_on_disk = load_model_state(crashed / "checkpoint_last.pt")
    assert updates_on_disk == saved_at

    resumed = run(command)
    assert "Loaded checkpoint" in resumed and f"(epoch 1 @ {saved_at} updates)" in resumed
    # Resumed inside the first epoch: the iterator continued mid-epoch, not from its start.
    assert "epoch 002" not in resumed

    expected, expected_updates = load_model_state(reference / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(crashed / "checkpoint_last.pt")
    assert actual_updates == expected_updates == MAX_UPDATE
    assert_same_tensors(actual, expected)
