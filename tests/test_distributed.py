"""fairseq's own distributed path (torch DDP, ``torchrun``, gloo on CPU) matches one process.

fairseq shards each epoch's batches round-robin over ranks (rank r takes batches r, r+W, ...),
and ``--update-freq W`` on one process groups the same consecutive batches into one update. DDP
averages the gradients and fairseq rescales by W / total sample size, which is what gradient
accumulation computes. With W = 2 this is even bit-exact: g0/2 + g1/2 rescaled by 2/S equals
(g0 + g1)/S in binary floating point (halving and doubling are exact), so we assert equality.
Both runs go through tests/helpers/train_and_dump_ranks.py, which seeds every batch by its global
position (see there) so that randomised layers draw the same numbers in both set-ups.
"""
import pytest

from helpers.training import (SMALL_BATCHES, assert_ranks_identical, assert_same_final_model,
                              comparable_command, load_model_state, run, run_until_killed)

pytestmark = pytest.mark.slow

TORCHRUN_TIMEOUT = 300


@pytest.mark.parametrize("model", ["multipath", "widenet"])
def test_two_ranks_match_one_process_with_update_freq_two(model, toy_data_bin, tmp_path):
    """WideNet uses its shared attention and MoE twice per step: DDP must sum both uses."""
    flags = [*SMALL_BATCHES, "--max-update", 4, "--save-interval-updates", 4,
             "--no-epoch-checkpoints"]
    output = run(comparable_command(toy_data_bin, tmp_path / "ddp", model, *flags, ranks=2),
                 timeout=TORCHRUN_TIMEOUT)
    assert "distributed init (rank 0)" in output
    assert_ranks_identical(tmp_path / "ddp", 4)

    run(comparable_command(toy_data_bin, tmp_path / "single", model, *flags, "--update-freq", 2))
    assert_same_final_model(tmp_path / "ddp", tmp_path / "single", 4)


def test_killed_two_rank_ewa_run_resumes_like_one_process(toy_data_bin, tmp_path):
    """SIGKILL a 2-rank EWA run, start it again: rank 0 loads checkpoint_last.pt and broadcasts
    it (an OmegaConf config inside, through the plug-in's allow-list), both ranks continue the
    EWA schedule from the restored update count and stay identical, and the result equals one
    process with --update-freq 2 that was never interrupted."""
    flags = [*SMALL_BATCHES, "--max-update", 10, "--save-interval-updates", 4,
             "--no-epoch-checkpoints"]
    command = comparable_command(toy_data_bin, tmp_path / "ddp", "ewa", *flags, ranks=2)
    run_until_killed(command, kill_at_update=5, timeout=TORCHRUN_TIMEOUT)
    _, saved_at = load_model_state(tmp_path / "ddp" / "checkpoint_last.pt")
    assert saved_at in (4, 8)  # killed mid-run, after a mid-epoch save
    resumed = run(command, timeout=TORCHRUN_TIMEOUT)
    assert f"(epoch 1 @ {saved_at} updates)" in resumed and "Loaded checkpoint" in resumed
    assert_ranks_identical(tmp_path / "ddp", 10)

    run(comparable_command(toy_data_bin, tmp_path / "single", "ewa", *flags, "--update-freq", 2))
    assert_same_final_model(tmp_path / "ddp", tmp_path / "single", 10)
