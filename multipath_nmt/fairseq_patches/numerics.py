"""A NaN or Inf during training is reported with the update number, also in CPU fp16 runs.

What fairseq 0.12 does on today's PyTorch, and what is changed:

* fp32/bf16: a non-finite gradient norm raises ``FloatingPointError("gradients are Nan/Inf")``
  after saving ``crash.pt``; fairseq then re-runs the batch under its ``NanDetector`` to log the
  first module with a NaN, and on torch >= 2.x that diagnostic run itself dies with a bare
  ``StopIteration`` (its deprecated backward hooks on modules returning dicts), which hides the
  real error. Neither message says at which update training broke.
* fp16 (``--fp16``/``--memory-efficient-fp16``): an overflow lowers the loss scale and skips the
  update, as designed; only when the scale reaches ``--min-loss-scale`` does fairseq raise
  ``FloatingPointError("Minimum loss scale reached ...")``. On CPU the very first overflow
  crashes instead (the trainer zeroes ``grad_norm`` with ``torch.tensor(0.0).cuda()``).

``Trainer.train_step`` is wrapped: any of these failures becomes one
:class:`NonFiniteLossError` (a ``FloatingPointError``) naming the update, the original message,
``crash.pt`` and what to try; and a CPU fp16 overflow is skipped like on a GPU.

Reach beyond the plug-in's own models: every ``Trainer``: the same failures, reworded, the original
chained; an error raised while an OverflowError is handled is skipped only when it is fairseq's
``.cuda()`` call (narrowed: it was any error then).
Does nothing when: an update that raises nothing; any error without a ``FloatingPointError`` behind
it.
"""
import functools
import os
import traceback

import torch

from multipath_nmt.checkpoint_io import CheckpointSaveError
from multipath_nmt.fairseq_patches.wrapping import wrap


class NonFiniteLossError(FloatingPointError):
    """The loss or the gradients of an update are NaN or Inf."""


def _floating_point_error(err):
    """The FloatingPointError behind ``err`` (itself, or the one fairseq's NanDetector re-run was
    handling when it crashed), else None."""
    for candidate in (err, err.__context__):
        if isinstance(candidate, FloatingPointError):
            return candidate
    return None


def _is_cpu_overflow_crash(trainer, err):
    """fairseq's overflow handler calls ``.cuda()``; without CUDA that raises while the
    OverflowError (the loss scaler lowering the scale) is being handled. Only that error: it is
    raised in ``torch.cuda`` (its lazy init), called from fairseq's ``trainer.py``. Any other
    error, also one raised while an OverflowError is handled, goes on up unchanged."""
    if trainer.cuda or not isinstance(err.__context__, OverflowError):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    files = [os.path.normpath(frame.filename) for frame in frames]
    return bool(files) and os.path.join("torch", "cuda") + os.sep in files[-1] \
        and any(f.endswith(os.path.join("fairseq", "trainer.py")) for f in files)


def _report_update(train_step):
    @functools.wraps(train_step)
    def train_step_reporting_update(self, samples, raise_oom=False):
        update = self.get_num_updates() + 1
        try:
            return train_step(self, samples, raise_oom)
        except NonFiniteLossError:
            raise
        except Exception as err:
            if _is_cpu_overflow_crash(self, err):
                # What fairseq does after that line on a GPU: drop the gradients, skip the update.
                self.zero_grad()
                return None
            cause = _floating_point_error(err)
            if cause is None:
                raise
            crash = os.path.join(self.cfg.checkpoint.save_dir, "crash.pt")
            if isinstance(err, CheckpointSaveError):  # fairseq's save of crash.pt failed too
                saved = f"Saving the model before this update failed: {err}"
            else:
                saved = f"The model before this update is in {crash}"
            raise NonFiniteLossError(
                f"non-finite loss or gradients at update {update}: {str(cause).rstrip('.')}. "
                f"{saved} (a warning above may name the first module with a NaN or Inf). Try a lower --lr, a longer --warmup-updates or "
                "--clip-norm (with fp16, also fp32), then run the command again: it "
                "resumes from checkpoint_last.pt."
            ) from cause

    return train_step_reporting_update


class Fp16NeedsCudaError(RuntimeError):
    """``--fp16`` on a machine without CUDA."""


def _refuse_fp16_without_cuda(init):
    @functools.wraps(init)
    def __init__(self, cfg, *args, **kwargs):
        # fairseq's FP16Optimizer keeps its fp32 master copies on the current CUDA device; without
        # one it dies deep inside with "Torch not compiled with CUDA enabled".
        if cfg.common.fp16 and not cfg.common.memory_efficient_fp16 and \
                not torch.cuda.is_available():
            raise Fp16NeedsCudaError(
                "--fp16 needs a CUDA GPU and none is available: drop --fp16 to train in fp32 on "
                "the CPU (scripts/train.sh does this by itself), or use --memory-efficient-fp16 "
                "to run half precision on the CPU")
        init(self, cfg, *args, **kwargs)

    return __init__


def install():
    from fairseq.trainer import Trainer

    wrap(Trainer, "train_step", _report_update)
    wrap(Trainer, "__init__", _refuse_fp16_without_cuda)
