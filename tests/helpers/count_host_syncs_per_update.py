"""``fairseq-train`` (same arguments, under ``torchrun`` or as one process) that counts the host
syncs (:class:`multipath_nmt.host_syncs.HostSyncCounter`) of each update on each rank: the
trainer's ``train_step`` and ``validate_and_save`` after it, the preemption patch's per-update
work included. Writes ``<save-dir>/host-syncs-rank<R>.json``: {update: {"total": n, "by_site":
{...}}}."""
import json
import os

from fairseq_cli import train  # first: it sets up fairseq's log format before fairseq logs

import multipath_nmt  # noqa: F401  the patches go in before the counting wrappers below
from fairseq.trainer import Trainer

from multipath_nmt.host_syncs import HostSyncCounter

COUNTS = {}


def _counted(function, key):
    def counting(*args, **kwargs):
        with HostSyncCounter() as syncs:
            result = function(*args, **kwargs)
        trainer = args[0] if key == "train_step" else args[1]
        entry = COUNTS.setdefault(trainer.get_num_updates(), {"total": 0, "by_site": {}})
        entry["total"] += syncs.total
        for site, n in syncs.by_site.items():
            entry["by_site"][site] = entry["by_site"].get(site, 0) + n
        if key == "validate_and_save":
            _dump(args[0], trainer)
        return result

    return counting


def _dump(cfg, trainer):
    os.makedirs(cfg.checkpoint.save_dir, exist_ok=True)
    path = os.path.join(cfg.checkpoint.save_dir, f"host-syncs-rank{trainer.data_parallel_rank}.json")
    with open(path, "w") as f:
        json.dump(COUNTS, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    Trainer.train_step = _counted(Trainer.train_step, "train_step")
    train.validate_and_save = _counted(train.validate_and_save, "validate_and_save")
    train.cli_main()
