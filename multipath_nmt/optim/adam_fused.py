"""``--optimizer adam_fused``: fairseq's Adam with PyTorch's fused kernel, one call for all tensors.

fairseq's ``--optimizer adam`` (without apex) updates one tensor at a time with about seven
elementwise passes over it (moments, square root, eps, step). PyTorch's fused Adam (CPU since
torch 2.4, CUDA) reads parameter, gradient and both moments once and writes them once, for a
whole list of tensors per call, so the update takes a fraction of fairseq's time (``python -m
multipath_nmt.benchmark.update_timing`` times both). Its multi-tensor ``foreach`` form, one kernel
per pass over all tensors, is slower than fairseq's loop on the CPU (each pass streams every
parameter through memory again); it is used only on devices without a fused kernel.

The update is fairseq's (``fairseq.optim.adam.Adam``: Kingma & Ba 2015, Algorithm 1, with
Loshchilov & Hutter's decoupled weight decay, i.e. AdamW):

    m <- b1 m + (1 - b1) g,   v <- b2 v + (1 - b2) g^2
    p <- p - lr wd p - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)

PyTorch divides sqrt(v) by sqrt(1 - b2^t) before it adds eps; given eps / sqrt(1 - b2^t) instead
it makes the same update, so each call passes that. The state is fairseq's Adam's (integer
``step``, ``exp_avg`` and ``exp_avg_sq``, fp32 for half-precision tensors), and fp16/bf16
parameters (``--memory-efficient-fp16``) are updated as fairseq's Adam does it: in fp32 copies,
written back.
"""
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, List

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from fairseq.optim.adam import FairseqAdam
from omegaconf import II
from torch.optim.adamw import adamw
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # torch.optim's own test

HALF = (torch.float16, torch.bfloat16)


class TorchFusedAdam(torch.optim.Optimizer):
    """fairseq's Adam (decoupled weight decay, eps added to sqrt(v)) through
    ``torch.optim.adamw.adamw`` with ``fused=True`` (``foreach`` where no fused kernel exists)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    @property
    def supports_memory_efficient_fp16(self):
        return True

    @property
    def supports_flat_params(self):
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # One call per (step count, device, half precision or not): the eps correction
            # depends on the step count, which differs only for tensors that missed updates.
            calls = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("adam_fused does not support sparse gradients")
                state = self.state[p]
                if not state:
                    moment_dtype = torch.float32 if p.dtype in HALF else p.dtype
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype)
                calls[state["step"], p.device, p.dtype in HALF].append(p)
            for (step, device, half), params in calls.items():
                self._update(group, params, step, device, half)
        return loss

    def _update(self, group, params, step, device, half):
        states = [self.state[p] for p in params]
        grads = [p.grad.float() if p.grad.dtype in HALF else p.grad for p in params]
        params32 = [p.float() for p in params] if half else params
        beta1, beta2 = group["betas"]
        fused = device.type in _get_fused_kernels_supported_devices()
        # distinct 0-dim step tensors (PyTorch increments each) from one allocation
        steps = list(torch.full((len(params),), float(step), device=device if fused else "cpu"))
        adamw(params32, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], steps, foreach=not fused, fused=fused, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=group["lr"], weight_decay=group["weight_decay"], maximize=False,
              eps=group["eps"] / math.sqrt(1 - beta2 ** (step + 1)))
        if half:
            torch._foreach_copy_(params, params32)
        for state in states:
            state["step"] = step + 1


@dataclass
class FairseqAdamFusedConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer "
                                                    "(added to sqrt(v), as --optimizer adam)"})
    weight_decay: float = field(default=0.0, metadata={"help": "decoupled weight decay "
                                                       "(as --optimizer adam: AdamW's form)"})
    lr: List[float] = II("optimization.lr")


@register_optimizer("adam_fused", dataclass=FairseqAdamFusedConfig)
class FairseqAdamFused(FairseqAdam):
    """``--optimizer adam``'s update and state with PyTorch's fused kernel (module docstring)."""

    def __init__(self, cfg, params):
        # FairseqAdam's own __init__ would build its per-tensor (or apex) Adam; keep only its
        # optimizer_config (--adam-betas, --adam-eps, --weight-decay, --lr) and average_params.
        FairseqOptimizer.__init__(self, cfg)
        self._optimizer = TorchFusedAdam(params, **self.optimizer_config)
