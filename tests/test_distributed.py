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
@pytest.mark.process
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


@pytest.mark.process
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


def test_a_rank_that_finished_destroys_its_process_group_and_one_that_failed_leaves_it(tmp_path):
    """fairseq's distributed_main as each torchrun rank of train.sh runs it (one gloo rank here):
    once its training returned, the process group is destroyed, before the interpreter ends (else
    an occasional exit 134 there: fairseq_patches/distributed.py); after an error it is left for
    the error's way out, where a destroy could wait for ranks still in a collective."""
    import logging
    import sys

    import torch.distributed as dist
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    import multipath_nmt  # noqa: F401  (the patches)

    def config(rendezvous):
        args = options.parse_args_and_arch(options.get_training_parser(), [
            str(tmp_path), "--arch", "transformer", "--cpu", "--distributed-backend", "gloo",
            "--distributed-world-size", "1", "--distributed-rank", "0",
            "--distributed-init-method", f"file://{tmp_path / rendezvous}"])
        return convert_namespace_to_omegaconf(args)

    def training(cfg):
        seen.append(dist.is_initialized())

    def out_of_memory(cfg):
        raise RuntimeError("out of memory")

    seen, root_level, excepthook = [], logging.getLogger().level, sys.excepthook
    try:
        distributed_utils.distributed_main(0, training, config("finished"), {})
        assert seen == [True] and not dist.is_initialized()
        with pytest.raises(RuntimeError, match="out of memory"):
            distributed_utils.distributed_main(0, out_of_memory, config("failed"), {})
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        logging.getLogger().setLevel(root_level)
        sys.excepthook = excepthook  # init_process_group wraps it
