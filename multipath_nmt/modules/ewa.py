"""Experts Weights Averaging (EWA): Huang et al. (2023), "Experts Weights Averaging: A New General
Training Scheme for Vision Transformers", arXiv:2308.06093.

Training: an FFN becomes E expert FFNs; the non-padding tokens are split into E random groups of
equal size (random uniform partition, no router) and each group goes through one expert. After
every optimizer step each expert is pulled towards the others (the paper's EWA update):

    W_i <- (1 - b) W_i + b / (E - 1) * sum_{j != i} W_j

with the share rate b rising linearly from 0 to its final value over training (or constant).
Inference: the experts are folded into one FFN whose weights and biases are the experts' means.
The FFN is nonlinear, so that folded FFN is *not* the mean of the experts' outputs; it is what the
paper deploys, and it is exactly what ``multipath-convert-ewa`` writes, so eval mode uses it too.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.modules.moe import MoEFeedForward, SlotPlan, init_experts_like_linear_

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

    def share_rate_at(self, num_updates):
        # checked here, not at build time: tools that only build the model (multipath-params,
        # fairseq-generate of an old config) need no training length
        if self._needs_total() and self.total_updates <= 0:
            raise ValueError("EWA with a linear schedule or a stop point needs the length of "
                             "training: set --max-update (or use --ewa-schedule constant)")
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
    shared = stacked.sum(0, keepdim=True, dtype=torch.float32).mul_(others)
    own = 1.0 - share_rate - others
    if stacked.dtype == torch.float32:
        stacked.mul_(own).add_(shared)
    else:
        stacked.copy_(stacked.float().mul_(own).add_(shared))


def ewa_average_parameters_(params, share_rate, master_views):
    """Apply the EWA update to each stacked-expert parameter where the optimizer keeps it.

    ``master_views`` maps a parameter to the optimizer's fp32 master copy of it (fairseq's
    FP16Optimizer); the update then acts on the master and the result is copied to the parameter,
    otherwise the next optimizer step would overwrite the parameter with the un-averaged master.
    """
    with torch.no_grad():
        for param in params:
            master = master_views.get(param)
            if master is None:
                average_experts_(param.data, share_rate)
            else:
                average_experts_(master, share_rate)
                param.data.copy_(master)


def uniform_partition(num_tokens, num_experts, device=None):
    """A random uniform partition of ``num_tokens`` tokens into ``num_experts`` groups whose sizes
    differ by at most one: returns (token order, expert of each slot, slot within the expert).

    Drawn from the global torch RNG, which fairseq reseeds with seed + num_updates before every
    training step, so a resumed run draws the same partitions as an uninterrupted one.
    """
    order = torch.randperm(num_tokens, device=device)
    position = torch.arange(num_tokens, device=device)
    return order, position % num_experts, position // num_experts


class EWAFeedForward(nn.Module):
    """E expert FFNs (fc1 -> activation -> dropout -> fc2) trained on a random uniform token
    partition with EWA, evaluated as the experts' mean FFN (Huang et al., 2023, Sec. 3)."""

    def __init__(self, embed_dim, ffn_dim, num_experts, schedule, activation_fn=F.relu,
                 activation_dropout=0.0):
        super().__init__()
        if num_experts < 2:
            raise ValueError(f"EWA needs at least 2 experts, got {num_experts}")
        self.num_experts = num_experts
        self.schedule = schedule
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
        return [self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias]

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
        In training, padding positions are not routed and get zeros."""
        if not self.training:
            fc1_weight, fc1_bias, fc2_weight, fc2_bias = self.folded()
            hidden = self.activation_dropout(self.activation_fn(F.linear(x, fc1_weight, fc1_bias)))
            return F.linear(hidden, fc2_weight, fc2_bias)
        tokens = x.reshape(-1, x.shape[-1])
        if padding_mask is None:
            token_index = torch.arange(tokens.shape[0], device=x.device)
        else:
            padding = padding_mask.t() if x.dim() == 3 else padding_mask
            token_index = (~padding.reshape(-1)).nonzero().squeeze(1)
        order, expert, slot = uniform_partition(token_index.numel(), self.num_experts, x.device)
        capacity = max(1, math.ceil(token_index.numel() / self.num_experts))
        plan = SlotPlan.build(tokens.shape[0], 1, self.num_experts * capacity, token_index[order],
                              expert * capacity + slot)
        grouped = plan.dispatch(tokens).view(self.num_experts, capacity, -1)
        # Transposed products, hidden^T = W x^T: the weight gradients then come out in the
        # weights' own [E, out, in] layout, where x W^T gave them transposed and autograd copied
        # them into place (a strided copy of every expert matrix, ~10% of the FFN's backward).
        hidden = torch.baddbmm(self.fc1_bias.unsqueeze(2), self.fc1_weight, grouped.transpose(1, 2))
        hidden = self.activation_dropout(self.activation_fn(hidden))
        out = torch.baddbmm(self.fc2_bias.unsqueeze(2), self.fc2_weight, hidden).transpose(1, 2)
        # padding tokens are in no group: their weight is 0 and their output zero
        return plan.combine(out.reshape(-1, out.shape[-1]), plan.kept).view_as(x)

    def ewa_after_step(self, num_updates, master_views):
        share_rate = self.schedule.share_rate_at(num_updates)
        if share_rate > 0.0:
            ewa_average_parameters_(self.expert_parameters(), share_rate, master_views)

    def inactive_parameter_count(self):
        # a token meets one FFN's worth of parameters: one expert in training, the mean at inference
        per_expert = sum(p[0].numel() for p in self.expert_parameters())
        return (self.num_experts - 1) * per_expert


class EarlyEWAMoE(MoEFeedForward):
    """A top-1 routed MoE FFN that gets the EWA update after each step until ``stop_at``
    (Huang et al., 2023, "early EWA" for naive MoEs); it stays a routed MoE at inference."""

    def __init__(self, embed_dim, ffn_dim, num_experts, schedule, **kwargs):
        super().__init__(embed_dim, ffn_dim, num_experts=num_experts, k=1, **kwargs)
        self.schedule = schedule

    def ewa_after_step(self, num_updates, master_views):
        share_rate = self.schedule.share_rate_at(num_updates)
        if share_rate > 0.0:
            ewa_average_parameters_([self.fc1_weight, self.fc1_bias, self.fc2_weight,
                                     self.fc2_bias], share_rate, master_views)
