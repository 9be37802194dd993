"""``fairseq-train`` for the distributed comparisons: per-batch seeds and a state dump per rank.

Run it like ``fairseq_cli.train`` (same arguments), under ``torchrun`` or as one process.

* fairseq saves checkpoints on rank 0 only; here each save also writes
  ``<save-dir>/rank<R>-update<N>.pt`` with that rank's model state dict, to show that every rank
  holds the same parameters (DDP all-reduce, EWA averaging after each step).
* fairseq seeds the RNG once per update (``seed + num_updates``), so with ``--update-freq 2`` the
  second batch of an update draws different random numbers (router noise, EWA token groups,
  dropout) than the same batch on rank 1 of a 2-rank run. Here every batch is seeded by its
  position in the update's global batch order (batch i of rank r is batch i * W + r, exactly how
  fairseq shards batches over W ranks), so the two set-ups draw the same numbers for the same
  batch and must make the same updates.
"""
import os

from fairseq_cli import train  # first: it sets up fairseq's log format before fairseq logs

import torch
import torch.distributed as dist
from fairseq import checkpoint_utils
from fairseq.tasks import FairseqTask


def _also_dump_this_rank(save_checkpoint):
    def save_checkpoint_and_rank_state(cfg, trainer, epoch_itr, val_loss):
        os.makedirs(cfg.save_dir, exist_ok=True)
        name = f"rank{trainer.data_parallel_rank}-update{trainer.get_num_updates()}.pt"
        torch.save(trainer.get_model().state_dict(), os.path.join(cfg.save_dir, name))
        return save_checkpoint(cfg, trainer, epoch_itr, val_loss)

    return save_checkpoint_and_rank_state


def _seeded_by_global_batch_position(train_step):
    position = {"update": None, "batch": 0}

    def train_step_with_batch_seed(self, sample, model, criterion, optimizer, update_num,
                                   *args, **kwargs):
        if position["update"] != update_num:
            position.update(update=update_num, batch=0)
        ranks, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        torch.manual_seed(1_000_003 * (update_num + 1) + position["batch"] * ranks + rank)
        position["batch"] += 1
        return train_step(self, sample, model, criterion, optimizer, update_num, *args, **kwargs)

    return train_step_with_batch_seed


if __name__ == "__main__":
    checkpoint_utils.save_checkpoint = _also_dump_this_rank(checkpoint_utils.save_checkpoint)
    FairseqTask.train_step = _seeded_by_global_batch_position(FairseqTask.train_step)
    train.cli_main()
