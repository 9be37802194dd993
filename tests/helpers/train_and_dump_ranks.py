"""``fairseq-train`` in which every rank also writes its own parameters at each checkpoint save.

fairseq saves checkpoints on rank 0 only; the distributed tests need each rank's parameters to
show that the ranks stay identical (DDP gradient all-reduce, EWA averaging after each step).
Run it like ``fairseq_cli.train`` (same arguments); each save also writes
``<save-dir>/rank<R>-update<N>.pt`` holding that rank's model state dict.
"""
import os

import torch
from fairseq import checkpoint_utils
from fairseq_cli import train


def _also_dump_this_rank(save_checkpoint):
    def save_checkpoint_and_rank_state(cfg, trainer, epoch_itr, val_loss):
        os.makedirs(cfg.save_dir, exist_ok=True)
        name = f"rank{trainer.data_parallel_rank}-update{trainer.get_num_updates()}.pt"
        torch.save(trainer.get_model().state_dict(), os.path.join(cfg.save_dir, name))
        return save_checkpoint(cfg, trainer, epoch_itr, val_loss)

    return save_checkpoint_and_rank_state


if __name__ == "__main__":
    checkpoint_utils.save_checkpoint = _also_dump_this_rank(checkpoint_utils.save_checkpoint)
    train.cli_main()
