"""What ``MULTIPATH_NMT_PATCHES`` installs, for each of several values, from one process.

Patches install when ``multipath_nmt`` is imported, so each value needs a process that has not
imported it yet. Importing fairseq takes seconds, ``multipath_nmt`` after it a fraction of one:
``python patch_switch.py VALUE...`` imports fairseq once, then forks one child per value; the child
sets the variable, imports ``multipath_nmt`` (as ``--user-dir`` does, after fairseq) and reports
which patch modules' wrappers are in place. It prints one JSON object: value -> report.

This file must not import ``multipath_nmt`` at module level (the parent would be patched).
"""
import json
import os
import sys
import tempfile
import traceback


def patched_attributes():
    """(owner, name) of every attribute the patches replace, fairseq_cli.train's included."""
    from fairseq import checkpoint_utils, options
    from fairseq import utils as fairseq_utils
    from fairseq.data import data_utils
    from fairseq.distributed import utils as distributed_utils
    from fairseq.file_io import PathManager
    from fairseq.models import distributed_fairseq_model
    from fairseq.models.transformer import TransformerModelBase
    from fairseq.modules.checkpoint_activations import CheckpointFunction
    from fairseq.modules.multihead_attention import MultiheadAttention
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.tasks.translation import TranslationTask
    from fairseq.trainer import Trainer

    return [(distributed_utils, "_broadcast_object_slow"), (options, "parse_args_and_arch"),
            (data_utils, "batch_by_size"), (FairseqTask, "get_batch_iterator"),
            (checkpoint_utils, "load_checkpoint_to_cpu"), (checkpoint_utils, "torch_persistent_save"),
            (PathManager, "copy"), (checkpoint_utils, "load_checkpoint"),
            (checkpoint_utils, "load_model_ensemble_and_task"), (Trainer, "load_checkpoint"),
            (Trainer, "state_dict"),
            (sys, "excepthook"), (distributed_utils, "_infer_torch_distributed_launch_init"),
            (distributed_fairseq_model, "DistributedDataParallel"), (Trainer, "train_step"),
            (Trainer, "__init__"), (MultiheadAttention, "forward"),
            (TransformerModelBase, "build_model"), (Trainer, "set_num_updates"),
            (AMPOptimizer, "step"), (AMPOptimizer, "__init__"), (FairseqTask, "train_step"),
            (CheckpointFunction, "forward"), (TranslationTask, "setup_task"),
            (TranslationTask, "load_dataset"), (checkpoint_utils, "save_checkpoint"),
            (options, "add_optimization_args"), (fairseq_utils, "multi_tensor_total_norm")]


def _train_script_attributes():
    import fairseq_cli.train

    return [(fairseq_cli.train, "validate_and_save"), (fairseq_cli.train, "train"),
            (fairseq_cli.train, "main")]


def _report(value):
    """In a fresh child: import the plug-in under ``value`` and say what it patched."""
    os.environ["MULTIPATH_NMT_PATCHES"] = value
    try:
        import argparse

        import torch

        import multipath_nmt  # noqa: F401  (installs the patches)
        from fairseq.models import ARCH_MODEL_REGISTRY
        from multipath_nmt.fairseq_patches.wrapping import patches_of

        known = [mark for owner, name in patched_attributes()
                 for mark in patches_of(getattr(owner, name))]
        marks = known + [mark for owner, name in _train_script_attributes()
                         for mark in patches_of(getattr(owner, name))]
        safe = getattr(torch.serialization, "get_safe_globals", lambda: [])()
        return {"returncode": 0,
                # "multipath_nmt.fairseq_patches.<module>.<wrapper>" -> module
                "modules": sorted({mark.split(".")[2] for mark in marks}),
                "wrapped": len(known),
                "namespace_allowed": argparse.Namespace in safe,
                "registered": "multipath_transformer_wmt_en_de" in ARCH_MODEL_REGISTRY}
    except Exception:  # noqa: BLE001 what an uncaught error prints in a process of its own
        traceback.print_exc()
        return {"returncode": 1}


def main(values):
    import fairseq_cli.train  # noqa: F401  (the preemption patch wraps it when it is loaded)

    import logging

    patched_attributes()  # import fairseq before the forks: each child only adds the plug-in
    # fairseq_cli.train's basicConfig logs to stdout; without it the plug-in's warnings go to
    # stderr, as when a user's script imports it.
    logging.getLogger().handlers.clear()
    reports = {}
    for value in values:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: its stderr (logging, tracebacks) goes to a file of its own
                os.dup2(err.fileno(), 2)
                report = _report(value)
                sys.stderr.flush()
                out.write(json.dumps(report).encode())
                out.flush()
                os._exit(0)
            os.waitpid(pid, 0)
            out.seek(0)
            err.seek(0)
            reports[value] = {**json.loads(out.read() or b'{"returncode": 2}'),
                              "stderr": err.read().decode(errors="replace")}
    print(json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1:])
