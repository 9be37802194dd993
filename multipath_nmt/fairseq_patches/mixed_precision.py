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
* A non-finite gradient norm without loss scaling (``--amp --bf16``; also ``--amp`` on a machine
  without CUDA, where fairseq's CUDA ``GradScaler`` disables itself) crashed with
  ``AttributeError: 'GradScaler' object has no attribute '_backoff_factor'``:
  ``AMPOptimizer.clip_grad_norm`` treats every non-finite norm as an fp16 overflow and asks the
  scaler for the next, lower scale, which a disabled scaler does not have. Giving it one would be
  worse: the trainer then retries the batch and steps anyway (a disabled scaler never skips a
  step), on NaN gradients. Without a scaler there is no overflow to retry at a lower scale, so
  ``clip_grad_norm`` now raises fairseq's fp32 error, ``FloatingPointError("gradients are
  Nan/Inf")``, inside ``Trainer.train_step``: the fp32 path follows (``crash.pt``, fairseq's
  ``NanDetector`` re-run, the error naming the update from ``numerics``), and no step is taken.
* ``--amp``'s loss scale was not saved: fairseq saves ``--fp16``'s (``FP16Optimizer.state_dict``
  holds ``loss_scale``), but ``AMPOptimizer`` inherits the plain optimizer's state dict, so a
  resumed fp16 AMP run started again at ``--fp16-init-scale`` (128) with a fresh growth count.
  The enabled scaler's state (``GradScaler.state_dict()``: scale and growth tracker) is now saved
  in the optimizer state under :data:`SCALER_STATE` and restored on resume; the scaler's
  hyper-parameters (growth and backoff factors, growth interval) come from the command line, like
  every other flag on resume. A checkpoint without it (older, or bf16) leaves the initial scale
  (``--amp-init-scale``, next item); a disabled scaler (bf16) saves nothing and ignores a saved
  state.
* ``--amp``'s loss scaler did not take ``--amp``'s flags: ``AMPOptimizer.__init__`` built its
  ``GradScaler`` with ``init_scale=--fp16-init-scale``, so ``--amp-init-scale`` was ignored, and
  for ``--amp-scale-window N`` with ``growth_interval=--amp-init-scale``: the scale grew every
  128 clean updates (``--amp-init-scale``'s value), not every N. fairseq's own constructor call now reads the
  AMP flags (during ``__init__`` the two fields it reads hold ``--amp-init-scale`` and
  ``--amp-scale-window``; the config is restored right after): the initial scale is
  ``--amp-init-scale`` (default 128) and the growth interval ``--amp-scale-window``, or
  ``GradScaler``'s 2000 when it is not given (its help: "number of updates before increasing AMP
  loss scale"). ``--fp16-init-scale`` and ``--fp16-scale-window`` are ``--fp16``'s again. Nothing
  else of the scaler changes; on a machine without CUDA fairseq's CUDA scaler still disables
  itself (above).
* Under ``--amp``, autocast cast every fp32 weight again in every micro-batch of an update
  (fairseq opens one autocast region per micro-batch, and autocast drops its casts when its
  outermost region closes): at ``--update-freq`` N, N copies of every weight per update.
  ``Trainer.train_step`` now holds one autocast nesting level open over the update, so the first
  micro-batch's casts serve the others, and drops them when the update ends. The casts are of the
  same unchanged weights: the same loss and gradients, bit for bit. What it saves is small and
  only above ``--update-freq`` 1: at 1 (what train.sh's one-card micro-batches run) there is
  nothing to share; at 2, counted on the CPU, the weight casts per update fall from 284 to 142
  of about 1,450 casts, and the kernel launches per update by 3.3%. Not measured on a GPU.
* ``--amp-batch-retries`` was a budget for the whole run, not per batch: ``Trainer.train_step``
  counts the retries of a batch after an overflow in ``Trainer._amp_retries`` and set it back to
  0 only when a batch used up the budget and was skipped, never after a successful update. So
  the retries a batch got depended on the run's history (with ``--amp-batch-retries 1``, after
  one retried overflow the next overflowing batch, however much later, was skipped at once), and
  a resumed run (a fresh ``Trainer``, count 0) retried where the uninterrupted run skipped. The
  count is now set back to 0 after every update that did not overflow, in
  ``Trainer.set_num_updates`` (fairseq calls it at the end of ``train_step`` exactly then, after
  the retry decision; and on a resume, where the count is 0 already): every batch gets
  ``--amp-batch-retries`` retries, and between updates, where checkpoints are saved, the count is
  always 0, as in the fresh ``Trainer`` of a resumed run.

Reach beyond the plug-in's own models: every run with those flags trains as described, not as stock
fairseq 0.12; ``--amp`` checkpoints hold one more key in ``last_optimizer_state``,
``amp_grad_scaler`` (stock fairseq loads them and ignores it), and a resume restores the scale and
growth count while the scaler's factors and interval stay the command line's; ``--fp16-init-scale``
and ``--fp16-scale-window`` no longer change an ``--amp`` run; ``Trainer.set_num_updates`` also sets
fairseq's ``_amp_retries`` back to 0 (only where ``--amp`` made one).
Does nothing when: fp32 without ``--amp``, ``--bf16`` or ``--checkpoint-activations``; the scaler
state is not saved for a disabled scaler (bf16), and a checkpoint without it starts at ``--amp-init-
scale``.
"""
import contextlib
import functools
import importlib.util
import logging
import sys

import torch

from multipath_nmt.fairseq_patches.wrapping import wrap

AUTOCAST_DEVICES = ("cpu", "cuda")

# Where the loss scaler's state lives in the optimizer's state dict (``last_optimizer_state`` of a
# checkpoint), next to the torch optimizer's ``state`` and ``param_groups``.
SCALER_STATE = "amp_grad_scaler"
# What the command line sets, not the checkpoint (GradScaler.state_dict() saves them too).
SCALER_FLAGS = ("growth_factor", "backoff_factor", "growth_interval")

logger = logging.getLogger(__name__)


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


def _scaler_from_the_amp_flags(init):
    @functools.wraps(init)
    def __init__(self, cfg, params, fp32_optimizer, **kwargs):
        # fairseq's __init__ builds the scaler from fp16_init_scale (init_scale) and, when
        # amp_scale_window is set, amp_init_scale (growth_interval): for that one call those two
        # fields hold the AMP flags, so the scaler is built by fairseq's own line, as it would be
        common = cfg.common
        saved = common.fp16_init_scale, common.amp_init_scale
        common.fp16_init_scale = common.amp_init_scale
        if getattr(common, "amp_scale_window", None) is not None:
            common.amp_init_scale = common.amp_scale_window
        try:
            init(self, cfg, params, fp32_optimizer, **kwargs)
        finally:
            common.fp16_init_scale, common.amp_init_scale = saved

    return __init__


def _retries_per_batch(set_num_updates):
    @functools.wraps(set_num_updates)
    def set_num_updates_new_batch(self, num_updates):
        set_num_updates(self, num_updates)
        # a batch is done and updated (train_step calls this after its retry decision, when the
        # update did not overflow): the next batch gets the whole --amp-batch-retries budget
        if hasattr(self, "_amp_retries"):
            self._amp_retries = 0

    return set_num_updates_new_batch


def _no_overflow_without_a_scaler(clip_grad_norm):
    @functools.wraps(clip_grad_norm)
    def clip_grad_norm_as_in_fp32(self, max_norm, aggregate_norm_fn=None):
        if self.scaler.is_enabled():
            return clip_grad_norm(self, max_norm, aggregate_norm_fn)
        # Nothing was scaled (unscale_ of a disabled scaler does nothing), so a non-finite norm is
        # no overflow to retry at a lower scale: raise what fairseq's trainer raises in fp32, in
        # its train_step, before any optimizer step (a disabled scaler would step on NaNs)
        grad_norm = self.fp32_optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)
        if not torch.isfinite(grad_norm).all():
            raise FloatingPointError("gradients are Nan/Inf")
        return grad_norm

    return clip_grad_norm_as_in_fp32


def _save_the_loss_scale(state_dict):
    @functools.wraps(state_dict)
    def state_dict_with_scaler(self):
        state = state_dict(self)
        if self.scaler.is_enabled():  # a disabled scaler has no state (bf16: nothing to save)
            state = {**state, SCALER_STATE: self.scaler.state_dict()}
        return state

    return state_dict_with_scaler


def _restore_the_loss_scale(load_state_dict):
    @functools.wraps(load_state_dict)
    def load_state_dict_with_scaler(self, state_dict, optimizer_overrides=None):
        saved = None
        if isinstance(state_dict, dict) and SCALER_STATE in state_dict:
            saved = state_dict[SCALER_STATE]
            # the torch optimizer gets the state dict it made, as without this patch
            state_dict = {k: v for k, v in state_dict.items() if k != SCALER_STATE}
        load_state_dict(self, state_dict, optimizer_overrides)
        if not self.scaler.is_enabled():
            return
        if saved is None:
            logger.info("the checkpoint holds no AMP loss scaler state (an older checkpoint, "
                        "or a bf16 run's): the loss scale starts at %s", self.scaler.get_scale())
            return
        self.scaler.load_state_dict({**saved, **{
            flag: getattr(self.scaler, f"get_{flag}")() for flag in SCALER_FLAGS}})

    return load_state_dict_with_scaler


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


@contextlib.contextmanager
def weight_casts_kept():
    """Keeps autocast's low-precision copies of the weights until the block ends.

    autocast keeps the copies of the weights it casts until its outermost region closes; with one
    nesting level held open over a whole update, the copies made by the first micro-batch serve
    the others. They are dropped when the block ends."""
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()


def _weights_cast_once_per_update(train_step):
    @functools.wraps(train_step)
    def train_step_casting_weights_once(self, samples, *args, **kwargs):
        if not self.cfg.common.amp or len(samples) < 2:
            return train_step(self, samples, *args, **kwargs)
        # The weights change only in the optimizer step, after the last backward, and nothing
        # runs under autocast between that step and the end of train_step.
        with weight_casts_kept():
            return train_step(self, samples, *args, **kwargs)

    return train_step_casting_weights_once


def install():
    from fairseq import options
    from fairseq.modules.checkpoint_activations import CheckpointFunction
    from fairseq.optim.amp_optimizer import AMPOptimizer
    from fairseq.tasks.fairseq_task import FairseqTask
    from fairseq.trainer import Trainer

    wrap(AMPOptimizer, "step", _step_what_was_unscaled)
    wrap(AMPOptimizer, "__init__", _scaler_from_the_amp_flags)
    wrap(AMPOptimizer, "__init__", _no_loss_scaling_in_bf16)
    wrap(AMPOptimizer, "clip_grad_norm", _no_overflow_without_a_scaler)
    wrap(AMPOptimizer, "state_dict", _save_the_loss_scale)
    wrap(AMPOptimizer, "load_state_dict", _restore_the_loss_scale)
    wrap(options, "parse_args_and_arch", _tpu_only_with_torch_xla)
    wrap(Trainer, "__init__", _keep_fp32_weights_under_amp_bf16)
    wrap(Trainer, "set_num_updates", _retries_per_batch)
    wrap(FairseqTask, "train_step", _autocast_to_bf16)
    wrap(Trainer, "train_step", _weights_cast_once_per_update)
    wrap(CheckpointFunction, "forward", _recompute_under_forward_autocast)
