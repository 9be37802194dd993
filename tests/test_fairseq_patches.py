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
            (sys, "excepthook"), (distributed_utils, "_infer_torch_distributed_launch_init"),
            (distributed_fairseq_model, "DistributedDataParallel"), (Trainer, "train_step"),
            (Trainer, "__init__"), (MultiheadAttention, "forward"),
            (TransformerModelBase, "build_model"), (Trainer, "set_num_updates"),
            (AMPOptimizer, "step"), (AMPOptimizer, "__init__"), (FairseqTask, "train_step"),
            (CheckpointFunction, "forward"), (TranslationTask, "setup_task"),
            (TranslationTask, "load_dataset"), (checkpoint_utils, "save_checkpoint"),
            (options, "add_optimization_args")]


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


def test_the_switch_turns_every_patch_off(tmp_path):
    """MULTIPATH_NMT_PATCHES=off: none of the attributes the patches replace is wrapped, the
    plug-in's models still register, and a wrong value is refused in one line."""
    import subprocess

    from conftest import clean_env

    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(TESTS)!r})\n"
        "import multipath_nmt\n"
        "from fairseq.models import ARCH_MODEL_REGISTRY\n"
        "from multipath_nmt.fairseq_patches.wrapping import patches_of\n"
        "from test_fairseq_patches import _patched_attributes\n"
        "print(sum(len(patches_of(getattr(o, n))) for o, n in _patched_attributes()),\n"
        "      'multipath_transformer_wmt_en_de' in ARCH_MODEL_REGISTRY)\n")
    runs = {}
    for value in ("off", "on", "no"):
        runs[value] = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True,
                                     env=clean_env(MULTIPATH_NMT_PATCHES=value))
    assert runs["off"].returncode == 0 and runs["off"].stdout.split() == ["0", "True"]
    assert "MULTIPATH_NMT_PATCHES=off: fairseq runs without the plug-in's patches" in \
        runs["off"].stderr
    wrapped, registered = runs["on"].stdout.split()
    assert int(wrapped) >= len(_patched_attributes()) and registered == "True"
    assert runs["no"].returncode != 0
    assert "ValueError: MULTIPATH_NMT_PATCHES must be 'on' or 'off', got 'no'" in runs["no"].stderr

