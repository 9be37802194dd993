"""train.sh's save dir before it starts fairseq-train: refused in one line when no run could
write it or another run holds it, and nothing written into it: a second train.sh that wrote
its batch record into the save dir of a live run, to be refused afterwards, would leave the first
run's own command unable to continue its epoch. The batch record is left to
fairseq-train's rank 0, which writes it once it holds the save dir's lock
(:data:`multipath_nmt.folder_locks.SAVE_DIR_FILES`, multipath_nmt/fairseq_patches/save_dirs.py)."""
import json
import os
from pathlib import Path
from typing import Dict, Sequence

from multipath_nmt.atomic_files import os_error_reason, unwritable_folder
from multipath_nmt.folder_locks import SAVE_DIR_FILES, SAVE_DIR_LOCK, FolderInUseError, FolderLock
from multipath_nmt.recipe.archs import RecipeError
from multipath_nmt.recipe.commands import batch_record
from multipath_nmt.recipe.launcher import nodes_of


def check_save_dir(save_dir, nodes: int = 1) -> None:
    """Raise :class:`RecipeError` unless a run could write ``save_dir`` (created if missing) and,
    on one node, no other run holds it: its lock is taken and given back at once (several nodes
    start at the same moment, so there only fairseq-train's rank 0 takes it)."""
    problem = unwritable_folder(save_dir)
    if problem:
        raise RecipeError(f"{problem}; choose another SAVE_DIR")
    try:
        if nodes > 1:
            os.makedirs(save_dir, exist_ok=True)
        else:
            FolderLock(Path(save_dir) / SAVE_DIR_LOCK).acquire().release()
    except FolderInUseError as error:
        raise RecipeError(f"SAVE_DIR {error}: another training run writes its checkpoints "
                          "there; wait for it to end, or give this run another SAVE_DIR") from None
    except OSError as error:
        raise RecipeError(f"cannot write {save_dir}: {os_error_reason(error)}; choose another "
                          "SAVE_DIR") from None


def fairseq_train_environment(save_dir, argv: Sequence[str]) -> Dict[str, str]:
    """After :func:`check_save_dir` (on the nodes of fairseq-train's command line ``argv``): the
    environment entries that have its rank 0 write train.sh's batch record for ``argv`` once it
    holds the save dir."""
    check_save_dir(save_dir, nodes_of(argv))
    return {SAVE_DIR_FILES: json.dumps(dict([batch_record(argv)]))}
