"""Experts Weights Averaging (EWA): Huang et al. (2023), "Experts Weights Averaging: A New General
Training Scheme for Vision Transformers", arXiv:2308.06093.

Training: an FFN becomes E expert FFNs; the non-padding tokens are split into E random groups of
equal size (random uniform partition, no router; Eqs. 4-5) and each group goes through one
expert. After every optimizer step each expert is pulled towards the others (Eq. 6):

    W_i <- (1 - b) W_i + b / (E - 1) * sum_{j != i} W_j

with the share rate b rising linearly from 0 to its final value over training (or constant).
Inference: the experts are folded into one FFN whose weights and biases are the experts' means
(Eq. 7). The FFN is nonlinear, so that folded FFN is *not* the mean of the experts' outputs; it is
what the paper deploys, and it is exactly what ``multipath-convert-ewa`` writes, so eval mode uses
it too.

Half-precision experts that no optimizer keeps an fp32 master of (``--memory-efficient-fp16``,
``--memory-efficient-bf16``) are averaged on fp32 copies the module keeps (and saves in its state
dict): an early update b (W_j - W_i) / (E - 1) is often below half an fp16 step of W_i, and
averaging the fp16 weights in place would round it away at every step.

This module is EWA's layer in plain PyTorch. Its fairseq side is :mod:`multipath_nmt.ewa`: the
averaging after every optimizer step (:mod:`multipath_nmt.ewa.training`, called from fairseq-train
by :mod:`multipath_nmt.fairseq_patches.ewa_trainer`) and the folding of a trained checkpoint
(:mod:`multipath_nmt.ewa.folding`, ``multipath-convert-ewa``). The architectures are
``ewa_transformer_wmt_en_de`` and ``ewa_early_transformer_wmt_en_de`` of
:mod:`multipath_nmt.models.moe_transformer`.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.modules.moe import (
    FlatTokens,
    MoEFeedForward,
    SlotPlan,
    init_experts_like_linear_,
)

SCHEDULES = ("linear", "constant")


class EWASchedule:
    """The share rate b after update ``n``: linear from 0 (n = 0) to ``share_rate`` (n = total),
    or constant; 0 once ``stop_at * total`` updates are done (early EWA)."""

    def __init__(self, share_rate, schedule="linear", total_updates=0, stop_at=None):
        if not 0.0 <= share_rate <= 1.0:
            raise ValueError(f"EWA share rate must be in [0, 1], got {share_rate}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown EWA schedule {schedule!r}; choose one of {SCHEDULES}")
        if stop_at is not None and not 0.0 <= stop_at <= 1.0:
            raise ValueError(f"EWA stop-at must be a fraction of training in [0, 1], got {stop_at}")
        self.share_rate = share_rate
        self.schedule = schedule
        self.total_updates = total_updates
        self.stop_at = stop_at

    def _needs_total(self):
        return self.schedule == "linear" or self.stop_at is not None

    def needs_max_update(self):
        """Whether the schedule reads --max-update (a linear rise or a stop point) and none was
        given."""
        return self._needs_total() and self.total_updates <= 0

    def missing_length_message(self):
        """One line naming what to pass: a stop point (early EWA) is a fraction of --max-update
        whatever the schedule; only a linear schedule without one can turn constant instead."""
        if self.stop_at is not None:
            return (f"EWA with --ewa-stop-at {self.stop_at:g} stops averaging at a fraction of "
                    "--max-update: pass --max-update N (--max-epoch and --stop-time-hours do "
                    "not give it)")
        return ("EWA's linear share-rate schedule rises over --max-update: pass --max-update N, "
                "or --ewa-schedule constant")

    def share_rate_at(self, num_updates):
        # checked here, not at build time: tools that only build the model (multipath-params,
        # fairseq-generate of an old config) need no training length
        if self._needs_total() and self.total_updates <= 0:
            raise ValueError(self.missing_length_message())
        if self.stop_at is not None and num_updates > self.stop_at * self.total_updates:
            return 0.0
        if self.schedule == "constant":
            return self.share_rate
        return self.share_rate * min(num_updates, self.total_updates) / self.total_updates


def average_experts_(stacked, share_rate):
    """The EWA update in place on experts stacked along dim 0 (computed in fp32)."""
    num_experts = stacked.shape[0]
    others = share_rate / (num_experts - 1)
    # (1 - b) W_i + b/(E-1) (S - W_i) = (1 - b - b/(E-1)) W_i + b/(E-1) S, S the sum over all
    # experts; fp32 experts (the optimizer's master copies) are updated without a copy
    dtype = torch.promote_types(stacked.dtype, torch.float32)
    shared = stacked.sum(0, keepdim=True, dtype=dtype).mul_(others)
    own = 1.0 - share_rate - others
    if stacked.dtype == dtype:
        stacked.mul_(own).add_(shared)
    else:
        stacked.copy_(stacked.float().mul_(own).add_(shared))


EXPERT_TENSORS = ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")
HALF_DTYPES = (torch.float16, torch.bfloat16)


class ExpertsWeightsAveraging:
    """The EWA update after each optimizer step, for a module whose experts are stacked along dim
    0 in ``EXPERT_TENSORS`` and whose share rate comes from ``self.schedule``.

    Each expert tensor is averaged where its fp32 values live: the optimizer's master copy
    (fairseq's FP16Optimizer; the result is copied into the model, or the next step would
    overwrite it), the parameter itself when it is fp32, else an fp32 copy kept here. That copy
    follows the optimizer: before each update it takes the parameter's change since the copy was
    last written to it (exact in fp32), so what the fp16 weights cannot hold accumulates there.
    The copies are saved in the state dict (``fp32_experts.<name>``) for an exact resume.
    """

    def _init_averaging(self, schedule):
        self.schedule = schedule
        self.fp32_experts = {}
        self.register_state_dict_post_hook(_save_fp32_experts)
        self.register_load_state_dict_pre_hook(_load_fp32_experts)

    def ewa_after_step(self, num_updates, master_views):
        share_rate = self.schedule.share_rate_at(num_updates)
        if share_rate == 0.0:
            self.fp32_experts.clear()  # averaging is over (early EWA): no copy to keep
            return
        with torch.no_grad():
            for name in EXPERT_TENSORS:
                param = getattr(self, name)
                master = master_views.get(param)
                if master is not None or param.dtype not in HALF_DTYPES:
                    self.fp32_experts.pop(name, None)
                    average_experts_(param.data if master is None else master, share_rate)
                    if master is not None:
                        param.data.copy_(master)
                    continue
                copy = self.fp32_experts.get(name)
                if copy is None:
                    copy = param.detach().float()
                else:
                    copy.add_(param.float().sub_(copy.to(param.dtype).float()))
                average_experts_(copy, share_rate)
                param.data.copy_(copy)
                self.fp32_experts[name] = copy


def _save_fp32_experts(module, state_dict, prefix, local_metadata):
    for name, copy in module.fp32_experts.items():
        state_dict[f"{prefix}fp32_experts.{name}"] = copy.detach().clone()


def _load_fp32_experts(module, state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs):
    module.fp32_experts.clear()
    for name in EXPERT_TENSORS:
        copy = state_dict.pop(f"{prefix}fp32_experts.{name}", None)
        if copy is not None:
            module.fp32_experts[name] = copy.to(getattr(module, name).device, torch.float32)


def uniform_partition(num_tokens, num_experts, padding=None, device=None):
    """A random uniform partition of the non-padding tokens among ``num_experts`` experts, with
    shapes that depend on ``num_tokens`` only (no host sync): returns (token at each position,
    expert of each position, slot of each position within its expert).

    Positions are dealt round-robin (expert = position % E), the non-padding tokens first in a
    uniformly random order, so the experts' shares of them differ by at most one; the padding
    tokens (``padding`` [num_tokens] bool, True = padding) fill the last positions.
    The partition is made on ``device``, which must be the tokens' (``padding``'s when it is
    given; None: the default device): a partition made on the CPU would meet GPU tokens in the
    dispatch (tests/test_device_semantics.py).
    Drawn from the global torch RNG of that device, which fairseq reseeds with seed + num_updates
    before every training step, so a resumed run draws the same partitions as an uninterrupted
    one.
    """
    if padding is not None:
        device = padding.device
    order = torch.randperm(num_tokens, device=device)
    if padding is not None:
        order = order[padding[order].argsort(stable=True)]  # a stable sort keeps the order random
    position = torch.arange(num_tokens, device=device)
    return order, position % num_experts, position // num_experts


class EWAFeedForward(ExpertsWeightsAveraging, nn.Module):
    """E expert FFNs (fc1 -> activation -> dropout -> fc2) trained on a random uniform token
    partition with EWA, evaluated as the experts' mean FFN (Huang et al., 2023, Sec. 3.2).

    Expert weights are stacked [E, out, in], ``nn.Linear``'s layout (not the package's
    [E, in, out], see :mod:`multipath_nmt.modules`): their mean is a dense FFN's ``fc1.weight``
    and ``fc2.weight`` as they are, which eval mode, ``multipath-convert-ewa`` and
    ``--ewa-init-from`` use.
    """

    def __init__(self, embed_dim, ffn_dim, num_experts, schedule, activation_fn=F.relu,
                 activation_dropout=0.0):
        super().__init__()
        if num_experts < 2:
            raise ValueError(f"EWA needs at least 2 experts, got {num_experts}")
        self.num_experts = num_experts
        self._init_averaging(schedule)
        self.activation_fn = activation_fn
        self.activation_dropout = nn.Dropout(activation_dropout)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, ffn_dim, embed_dim))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, ffn_dim))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, embed_dim, ffn_dim))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, embed_dim))
        self.reset_parameters()

    def reset_parameters(self):
        for weight, bias in ((self.fc1_weight, self.fc1_bias), (self.fc2_weight, self.fc2_bias)):
            init_experts_like_linear_(weight, bias, weight.shape[-1])  # [E, out, in]

    def expert_parameters(self):
        return [getattr(self, name) for name in EXPERT_TENSORS]

    def load_dense_ffn(self, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        """Start every expert as a copy of one dense FFN (EWA fine-tuning)."""
        with torch.no_grad():
            for stacked, dense in zip(self.expert_parameters(),
                                      (fc1_weight, fc1_bias, fc2_weight, fc2_bias)):
                if tuple(dense.shape) != tuple(stacked.shape[1:]):
                    raise ValueError(f"dense FFN tensor of shape {tuple(dense.shape)} does not "
                                     f"fit an expert of shape {tuple(stacked.shape[1:])}")
                stacked.copy_(dense.unsqueeze(0).expand_as(stacked))

    def folded(self):
        """The inference FFN: the mean of the experts' weights and biases."""
        return tuple(p.mean(0) for p in self.expert_parameters())

    def forward(self, x, padding_mask=None):
        """x: [T, B, d] with padding_mask [B, T] (True = padding), or [S, d] with [S], or None.
        In training, padding positions are in no expert's share of the real tokens and get zeros.
        Every shape follows from x's (the experts also run on the padding rows, which costs the
        batch's padding fraction but needs no host sync)."""
        if not self.training:
            fc1_weight, fc1_bias, fc2_weight, fc2_bias = self.folded()
            hidden = self.activation_dropout(self.activation_fn(F.linear(x, fc1_weight, fc1_bias)))
            return F.linear(hidden, fc2_weight, fc2_bias)
        tokens = FlatTokens.of(x, padding_mask)
        rows, padding = tokens.rows, tokens.padding
        num_tokens = rows.shape[0]
        if padding is None:
            weights = rows.new_ones(num_tokens, 1)
        else:
            weights = tokens.valid.unsqueeze(1).to(rows.dtype)
        order, expert, slot = uniform_partition(num_tokens, self.num_experts, padding,
                                                 device=rows.device)
        capacity = max(1, math.ceil(num_tokens / self.num_experts))
        plan = SlotPlan.build(num_tokens, 1, self.num_experts * capacity, order,
                              expert * capacity + slot)
        grouped = plan.dispatch(rows).view(self.num_experts, capacity, -1)
        # Transposed products, hidden^T = W x^T: the weight gradients then come out in the
        # weights' own [E, out, in] layout, where x W^T gave them transposed and autograd copied
        # them into place (a strided copy of every expert matrix in every backward).
        hidden = torch.baddbmm(self.fc1_bias.unsqueeze(2), self.fc1_weight, grouped.transpose(1, 2))
        hidden = self.activation_dropout(self.activation_fn(hidden))
        out = torch.baddbmm(self.fc2_bias.unsqueeze(2), self.fc2_weight, hidden).transpose(1, 2)
        # padding tokens weigh 0: their output is zero and they pass no gradient
        return tokens.unflatten(plan.combine(out.reshape(-1, out.shape[-1]), weights))

    def inactive_parameter_count(self):
        # a token meets one FFN's worth of parameters: one expert in training, the mean at inference
        per_expert = sum(p[0].numel() for p in self.expert_parameters())
        return (self.num_experts - 1) * per_expert


class EarlyEWAMoE(ExpertsWeightsAveraging, MoEFeedForward):
    """A top-1 routed MoE FFN that gets the EWA update after each step until ``stop_at``
    (Huang et al., 2023, Sec. 6, "early EWA" for naive MoEs); it stays a routed MoE at
    inference."""

    def __init__(self, embed_dim, ffn_dim, num_experts, schedule, **kwargs):
        super().__init__(embed_dim, ffn_dim, num_experts=num_experts, k=1, **kwargs)
        self._init_averaging(schedule)
