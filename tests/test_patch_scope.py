"""The patches reach no further than the plug-in's users need (docs/patches.md): the one-line
error hooks act only in command-line tools, and the CPU fp16 overflow skip catches only the
error of fairseq's ``.cuda()`` call."""
import sys
import types

import pytest
import torch

from multipath_nmt.checkpoint_io import CheckpointError
from multipath_nmt.data_bin_checks import DataBinError
from multipath_nmt.fairseq_patches import checkpoints as checkpoint_patches
from multipath_nmt.fairseq_patches import data_bins as data_bin_patches
from multipath_nmt.fairseq_patches import numerics


def _as_main(monkeypatch, module_name, program):
    """Make this process look like ``python -m MODULE_NAME`` (None: a script) run as ``program``."""
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name=module_name) if module_name else None
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [program, "--some-flag"])


@pytest.mark.parametrize("module_name,program,one_line", [
    ("fairseq_cli.train", "/env/lib/python3/site-packages/fairseq_cli/train.py", True),
    (None, "/env/bin/fairseq-generate", True),
    (None, "/env/lib/python3/site-packages/fairseq_cli/interactive.py", True),
    ("multipath_nmt.cli.average", "/src/multipath_nmt/cli/average.py", True),
    (None, "/env/bin/multipath-average", True),
    (None, "/home/me/my_experiment.py", False),   # a user's own script
    (None, "", False),                             # the interactive interpreter, a notebook
    ("pytest", "/env/lib/python3/site-packages/pytest/__main__.py", False),
])
@pytest.mark.parametrize("patch,error", [
    (checkpoint_patches, CheckpointError("/runs/checkpoint_last.pt", "truncated checkpoint")),
    (data_bin_patches, DataBinError("/data/dict.en.txt", "no such file")),
])
def test_one_line_errors_only_in_command_line_tools(module_name, program, one_line, patch, error,
                                                    monkeypatch, capsys):
    handed_on = []
    hook = patch._one_line_errors(lambda kind, value, tb: handed_on.append(value))
    _as_main(monkeypatch, module_name, program)
    hook(type(error), error, None)
    err = capsys.readouterr().err
    if one_line:
        assert err.endswith(f": error: {error}\n") and err.count("\n") == 1 and handed_on == []
    else:  # every other process keeps Python's traceback: the error goes to the previous hook
        assert err == "" and handed_on == [error]


def test_other_errors_go_to_the_previous_hook_in_a_command_line_tool(monkeypatch, capsys):
    handed_on = []
    hook = checkpoint_patches._one_line_errors(lambda kind, value, tb: handed_on.append(value))
    _as_main(monkeypatch, "fairseq_cli.train", "/env/fairseq_cli/train.py")
    error = ValueError("not ours")
    hook(ValueError, error, None)
    assert capsys.readouterr().err == "" and handed_on == [error]


class _CpuTrainer:
    cuda = False
    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(save_dir="/nowhere"))

    def __init__(self):
        self.zeroed = False

    def get_num_updates(self):
        return 3

    def zero_grad(self):
        self.zeroed = True


def test_an_error_raised_while_an_overflow_is_handled_is_not_swallowed():
    """Only fairseq's ``.cuda()`` in its overflow handler is skipped on the CPU: any other error
    that happens while an OverflowError is handled (a bug in a criterion, a hook) is raised."""
    def train_step(self, samples, raise_oom=False):
        try:
            raise OverflowError("loss scale lowered")
        except OverflowError:
            raise ValueError("a bug somewhere else")

    trainer = _CpuTrainer()
    with pytest.raises(ValueError, match="a bug somewhere else"):
        numerics._report_update(train_step)(trainer, [])
    assert not trainer.zeroed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the crash needs a machine without CUDA")
def test_fairseqs_cuda_call_in_its_overflow_handler_is_still_skipped_on_the_cpu():
    # fairseq's trainer.py, as far as its overflow handler goes (a frame of that file name)
    source = ("def train_step(self, samples, raise_oom=False):\n"
              "    try:\n"
              "        raise OverflowError('loss scale lowered')\n"
              "    except OverflowError:\n"
              "        grad_norm = torch.tensor(0.0).cuda()\n")
    namespace = {"torch": torch}
    exec(compile(source, "/env/site-packages/fairseq/trainer.py", "exec"), namespace)
    trainer = _CpuTrainer()
    assert numerics._report_update(namespace["train_step"])(trainer, []) is None
    assert trainer.zeroed
