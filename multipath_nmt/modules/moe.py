"""Top-k routed mixture-of-experts FFN (WideNet, Xue et al. 2022, Sec. 3.1; Switch balance loss).

Router: g(x) = TopK(softmax(f(x) + eps)), f linear, eps ~ N(0, 1/E^2) in training only (Eq. 1-2).
Each expert keeps at most ceil(C * k * S / E) tokens per routing call, S = non-padding tokens
(Eq. 3). Load-balance loss per routing call (Switch form): l = E * sum_i m_i * P_i (Eq. 4-5).

Priority when an expert overflows: all first choices come before all second choices (and so on),
and within one choice rank earlier tokens win (token order is the flattened input order; for
[T, B, d] inputs that is time-major). Overflowing assignments are dropped: the token gets no
output from that expert, its residual connection carries it.

The router noise is drawn from the global torch RNG. fairseq's trainer reseeds that RNG with
``seed + num_updates`` at the start of every update (``Trainer._set_seed``), so the noise of
update n is the same in a fresh run and after a resume (kill -9 included) without any state in
the checkpoint; a private generator would need its state saved, so we do not use one.
"""
import math
import warnings
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Routing statistics wait here until a criterion pops them. If nobody does (a criterion without
# MoE support), keep only the newest ones so training does not leak memory, and warn once.
MAX_PENDING_STATS = 1024


class _UniqueIndexSelect(torch.autograd.Function):
    """``src.index_select(0, index)`` for an index without repeats. Its gradient is a plain copy
    into zeros; autograd's generic index_select backward accumulates with scatter_add, which on
    CPU cost more than the rest of the dispatch and combine together."""

    @staticmethod
    def forward(ctx, src, index):
        ctx.save_for_backward(index)
        ctx.src_shape = src.shape
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.src_shape).index_copy_(0, index, grad), None


def unique_index_select(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _UniqueIndexSelect.apply(src, index)


@dataclass
class RoutingStats:
    """Statistics of one routing call (the shared protocol of MoE-style layers)."""

    balance_loss: torch.Tensor  # fp32 0-dim, with grad: E * sum_i m_i P_i
    dropped_tokens: torch.Tensor  # int64 0-dim: token-to-expert assignments over capacity
    routed_tokens: torch.Tensor  # int64 0-dim: non-padding tokens in the call
    expert_load: torch.Tensor  # fp32 [E]: assignments kept per expert
    top_k: int = 1  # assignments per token: the dropped fraction is dropped / (top_k * routed)


@dataclass
class Routing:
    """One routing decision and its index-based dispatch plan.

    Assignments are numbered rank-major: assignment a = rank * S + token. The kept ones are
    listed in ``assignment_index`` with their expert-buffer slot (expert * capacity + position)
    and their gate value.
    """

    expert_index: torch.Tensor  # long [S, k]: chosen experts, best first
    gates: torch.Tensor  # fp32 [S, k]: their router probabilities (not renormalised)
    assignment_index: torch.Tensor  # long [N]: kept assignments
    slot_index: torch.Tensor  # long [N]: their slot in the flat [E * capacity] expert buffer
    combine_weight: torch.Tensor  # fp32 [N]: their gate value (carries the router's gradient)
    capacity: int
    num_experts: int
    stats: RoutingStats

    @property
    def num_tokens(self) -> int:
        return self.expert_index.size(0)

    @property
    def top_k(self) -> int:
        return self.expert_index.size(1)

    def dispatch(self, tokens: torch.Tensor) -> torch.Tensor:
        """[S, d] tokens -> [E, capacity, d] expert inputs (empty slots are zero)."""
        if tokens.size(0) != self.num_tokens:
            raise ValueError(f"routing was computed for {self.num_tokens} tokens, got "
                             f"{tokens.size(0)}; reuse a routing only for the same tokens")
        # Copy each token once per rank, then pick the kept assignments: every index is unique,
        # so forward and backward are deterministic (no atomic accumulation).
        per_assignment = unique_index_select(tokens.repeat(self.top_k, 1), self.assignment_index)
        buffer = tokens.new_zeros(self.num_experts * self.capacity, tokens.size(1))
        buffer = buffer.index_copy(0, self.slot_index, per_assignment)
        return buffer.view(self.num_experts, self.capacity, tokens.size(1))

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """[E, capacity, d] expert outputs -> [S, d]: sum over kept assignments of gate * output."""
        flat = expert_output.reshape(self.num_experts * self.capacity, -1)
        weighted = unique_index_select(flat, self.slot_index) * self.combine_weight.unsqueeze(
            1).to(flat.dtype)
        # One row per (rank, token): unique indices again, then a fixed-order sum over ranks.
        per_rank = flat.new_zeros(self.top_k * self.num_tokens, flat.size(1))
        per_rank = per_rank.index_copy(0, self.assignment_index, weighted)
        return per_rank.view(self.top_k, self.num_tokens, -1).sum(0)


def init_experts_like_linear_(weight: torch.Tensor, bias: torch.Tensor, fan_in: int) -> None:
    """Stacked expert weights and biases drawn as each expert's nn.Linear(fan_in, ...) draws
    them: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (the same numbers as kaiming_uniform_(a=sqrt(5))
    expert by expert)."""
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    nn.init.uniform_(bias, -bound, bound)


def expert_capacity(capacity_factor: float, k: int, routed_tokens: int, num_experts: int) -> int:
    """ceil(C * k * S / E), in exact arithmetic (1.2 * 2 * 10 / 4 is 6, not 6.000000000000001)."""
    exact = Fraction(capacity_factor).limit_denominator(10 ** 6) * k * routed_tokens / num_experts
    # An expert never receives more than one assignment per token.
    return min(math.ceil(exact), routed_tokens)


def check_routing_config(num_experts: int, k: int, capacity_factor: float):
    if num_experts < 1:
        raise ValueError(f"the number of experts must be at least 1, got {num_experts}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be between 1 and the number of experts ({num_experts}), "
                         f"got {k}")
    if not capacity_factor > 0:
        raise ValueError(f"the capacity factor must be positive, got {capacity_factor}")


class TopKRouter(nn.Module):
    """g(x) = TopK(softmax(f(x) + eps)) with expert capacity (WideNet Eq. 1-3), computed in fp32."""

    def __init__(self, embed_dim: int, num_experts: int, k: int = 2,
                 capacity_factor: float = 1.2, noise: bool = True):
        super().__init__()
        check_routing_config(num_experts, k, capacity_factor)
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.noise = noise
        # Switch/GShard routers have no bias.
        self.weight = nn.Parameter(torch.empty(num_experts, embed_dim))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self._pending_stats: List[RoutingStats] = []
        self._warned_unpopped = False

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None) -> Routing:
        """x: [S, d]; valid: [S] bool (False = padding, never routed) or None."""
        num_tokens = x.size(0)
        E, k = self.num_experts, self.k
        if valid is None:
            valid = torch.ones(num_tokens, dtype=torch.bool, device=x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            if self.training and self.noise:
                logits = logits + torch.randn_like(logits) / E
            probs = logits.softmax(dim=-1)
        gates, expert_index = probs.topk(k, dim=-1)

        routed_tokens = valid.sum()
        # The capacity sets the expert buffer's shape, so it is a Python int: one host sync per
        # routing call.
        capacity = expert_capacity(self.capacity_factor, k, int(routed_tokens), E)

        # Rank-major assignments (all first choices, then all second choices, ...) so that a
        # stable sort by expert puts them in priority order within each expert.
        expert_flat = expert_index.t().reshape(-1)
        valid_flat = valid.repeat(k)
        key = torch.where(valid_flat, expert_flat, torch.full_like(expert_flat, E))
        sorted_key, order = torch.sort(key, stable=True)
        counts = torch.bincount(key, minlength=E + 1)
        starts = counts.cumsum(0) - counts
        position = torch.arange(key.numel(), device=x.device) - starts[sorted_key]
        is_routed = sorted_key < E
        keep = is_routed & (position < capacity)
        kept_expert = sorted_key[keep]
        assignment_index = order[keep]

        top1 = expert_index[:, 0][valid]
        fraction_top1 = torch.bincount(top1, minlength=E).float() / routed_tokens.clamp(min=1)
        mean_prob = (probs * valid.unsqueeze(1)).sum(0) / routed_tokens.clamp(min=1)
        stats = RoutingStats(
            balance_loss=E * (fraction_top1 * mean_prob).sum(),
            dropped_tokens=(is_routed.sum() - keep.sum()).long(),
            routed_tokens=routed_tokens.long(),
            expert_load=torch.bincount(kept_expert, minlength=E).float(),
            top_k=k,
        )
        if self.training:
            self._record(stats)
        return Routing(
            expert_index=expert_index,
            gates=gates,
            assignment_index=assignment_index,
            slot_index=kept_expert * capacity + position[keep],
            combine_weight=gates.t().reshape(-1).index_select(0, assignment_index),
            capacity=capacity,
            num_experts=E,
            stats=stats,
        )

    def _record(self, stats: RoutingStats):
        # Only training forwards record: evaluation and generation never pop, so recording there
        # would only accumulate (validation loss is therefore the plain translation loss).
        self._pending_stats.append(stats)
        if len(self._pending_stats) > MAX_PENDING_STATS:
            del self._pending_stats[0]
            if not self._warned_unpopped:
                self._warned_unpopped = True
                warnings.warn("routing statistics are never collected, so the load-balance "
                              "loss is not trained; use --criterion "
                              "label_smoothed_cross_entropy_with_moe")

    def pop_routing_stats(self) -> List[RoutingStats]:
        stats, self._pending_stats = self._pending_stats, []
        return stats


class MoEFeedForward(nn.Module):
    """Top-k routed FFN experts run as one batched matmul over [E, capacity, d] (WideNet Sec. 3.1).

    Expert weights are stored batched: ``fc1_weight`` [E, d, ffn], ``fc2_weight`` [E, ffn, d]
    (x @ W, i.e. the transpose of ``nn.Linear.weight``), biases [E, ffn] and [E, d].
    """

    def __init__(self, embed_dim: int, ffn_dim: int, num_experts: int = 4, k: int = 2,
                 capacity_factor: float = 1.2, activation: Callable = F.relu,
                 activation_dropout: float = 0.0, router_noise: bool = True):
        super().__init__()
        self.router = TopKRouter(embed_dim, num_experts, k, capacity_factor, noise=router_noise)
        self.num_experts, self.k = num_experts, k
        self.embed_dim, self.ffn_dim = embed_dim, ffn_dim
        self.activation = activation
        self.activation_dropout = nn.Dropout(activation_dropout)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, embed_dim, ffn_dim))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, ffn_dim))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, ffn_dim, embed_dim))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, embed_dim))
        self.reset_parameters()

    def reset_parameters(self):
        init_experts_like_linear_(self.fc1_weight, self.fc1_bias, self.embed_dim)
        init_experts_like_linear_(self.fc2_weight, self.fc2_bias, self.ffn_dim)

    @staticmethod
    def _flatten(x: torch.Tensor, padding_mask: Optional[torch.Tensor]):
        """[T, B, d] + [B, T] padding mask, or [S, d] + [S] -> tokens [S, d], valid [S] or None."""
        tokens = x.reshape(-1, x.size(-1))
        if padding_mask is None:
            return tokens, None
        valid = ~(padding_mask.t() if x.dim() == 3 else padding_mask)
        return tokens, valid.reshape(-1)

    def route(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> Routing:
        """The routing decision for x (one routing call: its statistics are recorded)."""
        tokens, valid = self._flatten(x, padding_mask)
        return self.router(tokens, valid)

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                routing: Optional[Routing] = None) -> torch.Tensor:
        """x: [T, B, d] with padding_mask [B, T] (True = pad), or [S, d] with [S]; padding
        positions get zeros. ``routing``: reuse a decision from :meth:`route` (WideNet groups)."""
        tokens, valid = self._flatten(x, padding_mask)
        if routing is None:
            routing = self.router(tokens, valid)
        expert_input = routing.dispatch(tokens)
        hidden = torch.baddbmm(self.fc1_bias.unsqueeze(1), expert_input, self.fc1_weight)
        hidden = self.activation_dropout(self.activation(hidden))
        expert_output = torch.baddbmm(self.fc2_bias.unsqueeze(1), hidden, self.fc2_weight)
        return routing.combine(expert_output).view_as(x)

    def pop_routing_stats(self) -> List[RoutingStats]:
        return self.router.pop_routing_stats()

    def expert_parameter_count(self) -> int:
        return 2 * self.embed_dim * self.ffn_dim + self.ffn_dim + self.embed_dim

    def inactive_parameter_count(self) -> int:
        """Parameters a token does not touch: the (E - k) experts it is not routed to."""
        return (self.num_experts - self.k) * self.expert_parameter_count()
