"""fairseq's own distributed path (torch DDP, ``torchrun``, gloo on CPU) matches one process.

fairseq shards each epoch's batches round-robin over ranks (rank r takes batches r, r+W, ...),
and ``--update-freq W`` on one process groups the same consecutive batches into one update; DDP
averages the gradients and fairseq rescales by W / total sample size, which is what gradient
accumulation computes. So W ranks and one process with ``--update-freq W`` make the same updates,
up to float summation order.
"""
import pytest
import torch

from helpers.training import (MODELS, SMALL_BATCHES, assert_same_tensors, load_model_state, run,
                              torchrun_command, train_command)

pytestmark = pytest.mark.slow

UPDATES = 4
# No dropout, so both runs draw no random numbers in the layers fairseq seeds per update.
COMPARABLE = [*SMALL_BATCHES, "--dropout", "0", "--max-update", UPDATES, "--no-epoch-checkpoints",
              "--save-interval-updates", UPDATES]


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_ranks_match_one_process_with_update_freq_two(model, toy_data_bin, tmp_path):
    output = run(torchrun_command(toy_data_bin, tmp_path / "ddp", model, *COMPARABLE), timeout=240)
    assert "distributed init (rank 0)" in output and "initialized host" in output

    rank0 = torch.load(tmp_path / "ddp" / f"rank0-update{UPDATES}.pt")
    rank1 = torch.load(tmp_path / "ddp" / f"rank1-update{UPDATES}.pt")
    assert_same_tensors(rank1, rank0)  # every rank holds the same model after each update

    run(train_command(toy_data_bin, tmp_path / "single", model, *COMPARABLE, "--update-freq", 2))
    expected, expected_updates = load_model_state(tmp_path / "single" / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(tmp_path / "ddp" / "checkpoint_last.pt")
    assert actual_updates == expected_updates == UPDATES
    assert_same_tensors(actual, expected)


RESUME_MODEL = "baseline"


def test_two_rank_run_resumes_from_checkpoint_last(toy_data_bin, tmp_path):
    """Rank 0 loads checkpoint_last.pt and broadcasts it (an OmegaConf config inside): works on
    today's torch, and the resumed ranks continue exactly where one process would have been."""
    flags = [*SMALL_BATCHES, "--dropout", "0", "--no-epoch-checkpoints"]
    run(torchrun_command(toy_data_bin, tmp_path / "ddp", RESUME_MODEL, *flags,
                         "--max-update", UPDATES), timeout=240)
    resumed = run(torchrun_command(toy_data_bin, tmp_path / "ddp", RESUME_MODEL, *flags,
                                   "--max-update", 2 * UPDATES), timeout=240)
    assert f"Loaded checkpoint {tmp_path / 'ddp' / 'checkpoint_last.pt'} (epoch 1 @ {UPDATES} updates)" in resumed

    rank0 = torch.load(tmp_path / "ddp" / f"rank0-update{2 * UPDATES}.pt")
    rank1 = torch.load(tmp_path / "ddp" / f"rank1-update{2 * UPDATES}.pt")
    assert_same_tensors(rank1, rank0)

    run(train_command(toy_data_bin, tmp_path / "single", RESUME_MODEL, *flags,
                      "--max-update", 2 * UPDATES, "--update-freq", 2))
    expected, _ = load_model_state(tmp_path / "single" / "checkpoint_last.pt")
    actual, actual_updates = load_model_state(tmp_path / "ddp" / "checkpoint_last.pt")
    assert actual_updates == 2 * UPDATES
    assert_same_tensors(actual, expected)
