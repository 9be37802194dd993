"""Mixed precision as fairseq 0.12 means it, made right on today's GPUs: ``--amp`` updates
correctly, ``--amp --bf16`` trains in bfloat16 autocast, and activation checkpointing recomputes
in the precision of the forward pass.

What fairseq 0.12 does, and what is changed:

* ``--amp`` unscales every gradient twice. ``AMPOptimizer.clip_grad_norm`` unscales the torch
  optimizer (``self.optimizer``), ``AMPOptimizer.step`` hands the fairseq wrapper
  (``self.fp32_optimizer``, another object) to ``GradScaler.step``, which unscales again: Adam
  then sees g / scale, which acts like eps x scale (an update of 3e-4 instead of 1e-3 for
  g = 1e-5 at a scale of 128). ``step`` now steps the object the scaler unscaled; every fairseq
  optimizer's wrapper ``step`` only calls that object's ``step``.
* ``--bf16`` means a TPU: ``options.parse_args_and_arch`` sets ``--tpu`` with it. It now does so
  only where ``torch_xla`` is installed (or ``--tpu`` is given), so ``--bf16`` trains on CUDA and
  on the CPU through fairseq's own code: bfloat16 weights and activations, fp32 master copies
  (``FP16Optimizer``), no loss scaling.
* ``--amp --bf16``: autocast to bfloat16 with fp32 weights, no loss scaling. fairseq casts the
  model to bfloat16 for ``--bf16`` and autocasts to float16 for ``--amp`` (``FairseqTask.
  train_step``); with both flags the model stays fp32, the ``AMPOptimizer`` keeps a disabled
  ``GradScaler`` (bfloat16 has float32's exponent range: nothing to scale), and the criterion
  runs under ``torch.autocast(device, dtype=torch.bfloat16)``, on CUDA and on the CPU alike.
  This is the precision ``scripts/train.sh`` picks on GPUs with bfloat16 (docs/gpu.md says why
  autocast rather than fairseq's full-bf16 ``--bf16``).
* fairseq's activation checkpointing (``--checkpoint-activations``) recomputes the forward pass
  in the backward pass, outside any autocast: under ``--amp`` the recomputed layer ran in fp32
  while the saved graph ran in half precision, so the gradients were those of another function.
  The recomputation now runs under the autocast state of the forward pass (what
  ``torch.utils.checkpoint`` does).
"""
import contextlib
import functools
import importlib.util
import sys

import torch

from multipath_nmt.fairseq_patches.wrapping import wrap

AUTOCAST_DEVICES = ("cpu", "cuda")


def _step_what_was_unscaled(step):
    @functools.wraps(step)
    def step_once_unscaled(self):
        # clip_grad_norm unscaled self.optimizer: the scaler must step that very object, or it
        # unscales again (it keys its state by the optimizer's id)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    return step_once_unscaled


def _no_loss_scaling_in_bf16(init):
    @functools.wraps(init)
    def __init__(self, cfg, params, fp32_optimizer, **kwargs):
        init(self, cfg, params, fp32_optimizer, **kwargs)
        self.autocast_dtype = torch.bfloat16 if cfg.common.bf16 else torch.float16
        if cfg.common.bf16:
            device = "cuda" if torch.cuda.is_available() and not cfg.common.cpu else "cpu"
            self._grad_scaler = torch.amp.GradScaler(device, enabled=False)

    return __init__


def _tpu_only_with_torch_xla(parse_args_and_arch):
    @functools.wraps(parse_args_and_arch)
    def parse_args_and_arch_bf16_off_tpu(parser, input_args=None, *args, **kwargs):
        parsed = parse_args_and_arch(parser, input_args, *args, **kwargs)
        namespace = parsed[0] if isinstance(parsed, tuple) else parsed
        if getattr(namespace, "bf16", False) and not _tpu_asked_for(input_args) \
                and importlib.util.find_spec("torch_xla") is None:
            namespace.tpu = False
        return parsed

    return parse_args_and_arch_bf16_off_tpu


def _tpu_asked_for(input_args):
    """Whether the command line (``input_args``, else ``sys.argv``) says ``--tpu``."""
    words = sys.argv[1:] if input_args is None else input_args
    return "--tpu" in words


def _keep_fp32_weights_under_amp_bf16(init):
    @functools.wraps(init)
    def __init__(self, cfg, *args, **kwargs):
        if not (cfg.common.amp and cfg.common.bf16):
            return init(self, cfg, *args, **kwargs)
        # fairseq casts the model to bfloat16 for --bf16 before it looks at --amp; with both,
        # the weights stay fp32 and autocast does the casting
        cfg.common.bf16 = False
        try:
            init(self, cfg, *args, **kwargs)
        finally:
            cfg.common.bf16 = True

    return __init__


class _CriterionUnderAutocast:
    """Calls the criterion (the model's forward and the loss) under ``torch.autocast``."""

    def __init__(self, criterion, device_type, dtype):
        self.criterion, self.device_type, self.dtype = criterion, device_type, dtype

    def __call__(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.criterion(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.criterion, name)


def _autocast_to_bf16(train_step):
    @functools.wraps(train_step)
    def train_step_with_amp_dtype(self, sample, model, criterion, optimizer, *args, **kwargs):
        if getattr(optimizer, "autocast_dtype", None) is torch.bfloat16:
            device = next(model.parameters()).device.type
            criterion = _CriterionUnderAutocast(criterion, device, torch.bfloat16)
        return train_step(self, sample, model, criterion, optimizer, *args, **kwargs)

    return train_step_with_amp_dtype


def autocast_state():
    """The autocast settings in force, per device type: (device, enabled, dtype)."""
    return [(device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            for device in AUTOCAST_DEVICES]


def under_autocast_state(state, function):
    """``function`` run under the autocast settings ``state`` (from :func:`autocast_state`)."""
    @functools.wraps(function)
    def run(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in state:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            return function(*args, **kwargs)

    return run


def _recompute_under_forward_autocast(forward):
    @functools.wraps(forward)
    def forward_remembering_autocast(ctx, run_function, *args):
        return forward(ctx, under_autocast_state(autocast_state(), run_function), *args)

    return forward_remembering_autocast


def install():
    from fairseq import options
    from fairseq.modules.checkpoint_activations import CheckpointFunction
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.trainer import Trainer

    wrap(AMPOptimizer, "step", _step_what_was_unscaled)
    wrap(AMPOptimizer, "__init__", _no_loss_scaling_in_bf16)
    wrap(options, "parse_args_and_arch", _tpu_only_with_torch_xla)
    wrap(Trainer, "__init__", _keep_fp32_weights_under_amp_bf16)
    wrap(FairseqTask, "train_step", _autocast_to_bf16)
    wrap(CheckpointFunction, "forward", _recompute_under_forward_autocast)
