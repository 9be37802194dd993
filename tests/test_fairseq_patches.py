"""multipath_nmt.fairseq_patches: one install(), idempotent, in a stated order, and its table names
tests that exist."""
import re
import sys
from pathlib import Path

from multipath_nmt import fairseq_patches
from multipath_nmt.fairseq_patches import ewa_trainer, numerics
from multipath_nmt.fairseq_patches.wrapping import patch_name, patches_of, wrap

TESTS = Path(__file__).parent


def _patched_attributes():
    """(owner, name) of every attribute the patches replace, from the installed state."""
    from fairseq import checkpoint_utils, options
    from fairseq.data import data_utils
    from fairseq.distributed import utils as distributed_utils
    from fairseq.file_io import PathManager
    from fairseq.models import distributed_fairseq_model
    from fairseq.models.transformer import TransformerModelBase
    from fairseq.modules.multihead_attention import MultiheadAttention
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.trainer import Trainer

    return [(distributed_utils, "_broadcast_object_slow"), (options, "parse_args_and_arch"),
            (data_utils, "batch_by_size"), (FairseqTask, "get_batch_iterator"),
            (checkpoint_utils, "load_checkpoint_to_cpu"), (checkpoint_utils, "torch_persistent_save"),
            (PathManager, "copy"), (checkpoint_utils, "load_checkpoint"),
            (checkpoint_utils, "load_model_ensemble_and_task"), (Trainer, "load_checkpoint"),
            (sys, "excepthook"), (distributed_utils, "_infer_torch_distributed_launch_init"),
            (distributed_fairseq_model, "DistributedDataParallel"), (Trainer, "train_step"),
            (Trainer, "__init__"), (MultiheadAttention, "forward"),
            (TransformerModelBase, "build_model"), (Trainer, "set_num_updates")]


def test_install_twice_wraps_nothing_again():
    before = {(id(owner), name): getattr(owner, name) for owner, name in _patched_attributes()}
    fairseq_patches.install()
    fairseq_patches.install()
    for owner, name in _patched_attributes():
        current = getattr(owner, name)
        assert current == before[(id(owner), name)], name
        marks = patches_of(current)
        assert marks and len(set(marks)) == len(marks), (name, marks)


def test_train_step_is_wrapped_by_numerics_then_ewa():
    from fairseq.trainer import Trainer

    assert patches_of(Trainer.train_step) == (patch_name(numerics._report_update),
                                              patch_name(ewa_trainer._flagging_train_step))


def test_wrap_keeps_static_and_class_methods_and_marks_each_patch():
    class Owner:
        @staticmethod
        def static(x):
            return x

        @classmethod
        def made_by(cls):
            return cls

    def plus_one(original):
        return lambda x: original(x) + 1

    def named(original):
        return lambda *args: ("named", original(*args))

    assert wrap(Owner, "static", plus_one)
    assert not wrap(Owner, "static", plus_one)
    assert wrap(Owner, "static", named)
    assert Owner.static(1) == ("named", 2) and Owner().static(1) == ("named", 2)
    assert patches_of(Owner.static) == (patch_name(plus_one), patch_name(named))
    assert wrap(Owner, "made_by", named)
    assert Owner.made_by() == ("named", Owner)


def test_the_table_names_tests_that_exist():
    named = re.findall(r"tests/(test_\w+\.py)::(test_\w+)", fairseq_patches.__doc__)
    assert len(named) >= 20
    for file, test in named:
        source = (TESTS / file).read_text()
        assert re.search(rf"^def {test}\(", source, re.M), f"{file}::{test}"


def test_the_table_lists_every_patch_module():
    for module in fairseq_patches.MODULES:
        short = module.__name__.rsplit(".", 1)[1]
        assert re.search(rf"^{short}  ", fairseq_patches.__doc__, re.M), short
