"""Top-k routed mixture-of-experts FFN (WideNet, Xue et al. 2022, "Routing" and "Balanced Loading").

Router: g(x) = TopK(softmax(f(x) + eps)), f linear, eps ~ N(0, 1/E^2) in training only (Eqs. 1-2).
Capacity: each expert keeps at most ceil(C * k * R / E) assignments per routing call, R = its
non-padding tokens (the paper's buffer B = C K N L, N L the tokens of the call, divided by E as
in the V-MoE router it follows: without 1/E no expert could ever overflow; docs/fidelity.md).
Load-balance loss per routing call: l = E * sum_i m_i * P_i (Eq. 3), m_i the fraction of tokens
that chose expert i among their top k (Eq. 4: every selection counts, so sum_i m_i = k), P_i the
mean router probability of expert i (Eq. 5). Routing makes no host sync: every shape comes from
the input's shape (see :class:`TopKRouter`), no boolean mask, no bincount.

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
from typing import Callable, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

# Routing statistics wait in their router until a criterion pops them. Models built by our fairseq
# adapters drop unconsumed ones every step (release_routing_stats_every_step); a bare module whose
# statistics nobody pops keeps only the newest ones, so it does not leak memory, and warns once.
MAX_PENDING_STATS = 1024


class FlatTokens(NamedTuple):
    """A routed FFN's input as rows of tokens, and the way back to its shape.

    x is [T, B, d] with a padding mask [B, T] (True = padding), as fairseq's encoder layers give
    them, or [S, d] with [S]. Rows are time-major (row t * B + b): the token order in which
    routing gives earlier tokens priority.
    """

    rows: torch.Tensor  # [S, d]
    padding: Optional[torch.Tensor]  # bool [S], True at padding; None when there is no mask
    shape: torch.Size  # x's shape without its feature dimension

    @classmethod
    def of(cls, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> "FlatTokens":
        padding = None
        if padding_mask is not None:
            padding = (padding_mask.t() if x.dim() == 3 else padding_mask).reshape(-1)
        return cls(x.reshape(-1, x.size(-1)), padding, x.shape[:-1])

    @property
    def valid(self) -> Optional[torch.Tensor]:
        """bool [S], False at padding (what :class:`TopKRouter` takes), or None."""
        return None if self.padding is None else ~self.padding

    def unflatten(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token rows [S, ...] back to x's token shape: [T, B, ...] (or [S, ...])."""
        return rows.view(*self.shape, *rows.shape[1:])


@dataclass
class SlotPlan:
    """Where the (token, rank) assignments of S tokens with k ranks each sit in a flat
    [E * capacity] expert buffer, as gather maps of fixed shapes (no scatter: on CPU,
    index_add/scatter_add cost more than the rest of the dispatch and combine, and gathers are
    deterministic; no boolean masks: their shapes depend on the data, a host sync on a GPU).

    Assignments are numbered token-major (token * k + rank). An empty slot maps to token 0 and
    assignment S * k (weight 0), a dropped assignment to slot 0: what is gathered there is never
    used, because every sum over a token's assignments weighs it by ``kept`` (0 or 1).
    """

    token_of_slot: torch.Tensor  # long [E * capacity]
    assignment_of_slot: torch.Tensor  # long [E * capacity]: S * k for empty slots
    slot_of_assignment: torch.Tensor  # long [S * k]
    kept: torch.Tensor  # fp32 [S, k]: 1 for kept assignments, 0 for dropped ones and padding

    @classmethod
    def build(cls, num_tokens: int, top_k: int, num_slots: int, assignments: torch.Tensor,
              slots: torch.Tensor) -> "SlotPlan":
        """``assignments`` (token-major numbers) go to ``slots``; a slot equal to ``num_slots``
        means dropped. Assignments not listed are dropped too."""
        device = slots.device
        num_assignments = num_tokens * top_k
        has_slot = slots < num_slots
        # dropped assignments all write to one extra slot, cut off afterwards
        token_of_slot = torch.zeros(num_slots + 1, dtype=torch.long, device=device).index_copy_(
            0, slots, assignments // top_k)[:num_slots]
        assignment_of_slot = torch.full((num_slots + 1,), num_assignments, dtype=torch.long,
                                        device=device).index_copy_(0, slots, assignments)
        slot_of_assignment = torch.zeros(num_assignments, dtype=torch.long,
                                         device=device).index_copy_(
            0, assignments, torch.where(has_slot, slots, torch.zeros_like(slots)))
        kept = torch.zeros(num_assignments, device=device).index_copy_(
            0, assignments, has_slot.float()).view(num_tokens, top_k)
        return cls(token_of_slot=token_of_slot, assignment_of_slot=assignment_of_slot[:num_slots],
                   slot_of_assignment=slot_of_assignment, kept=kept)

    @property
    def num_tokens(self) -> int:
        return self.kept.size(0)

    def dispatch(self, tokens: torch.Tensor) -> torch.Tensor:
        """[S, d] tokens -> [E * capacity, d] expert inputs."""
        return _Dispatch.apply(tokens, self)

    def combine(self, expert_output: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """[E * capacity, d] expert outputs -> [S, d]: sum over each token's assignments of
        weight * output; ``weights`` [S, k] must be 0 where ``kept`` is."""
        return _Combine.apply(expert_output, weights, self)

    def _gather_slots(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.index_select(0, self.token_of_slot)

    def _sum_assignments(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum_r weights[t, r] * rows[slot of (t, r)] for every token t, in a fixed order."""
        gathered = rows.index_select(0, self.slot_of_assignment)
        weights = weights.to(rows.dtype)
        if weights.size(1) == 1:
            # top-1 (EWA, routed ParameterNet): a scaling, where bmm ran S products of 1 x 1 by
            # 1 x d matrices at about a third of the speed (same numbers: one product each)
            return gathered.mul_(weights)
        gathered = gathered.view(self.num_tokens, -1, rows.size(1))
        return torch.bmm(weights.unsqueeze(1), gathered).squeeze(1)

    def _slot_weights(self, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight of the assignment in each slot, 0 for empty slots."""
        padded = torch.cat([weights.reshape(-1).to(dtype), weights.new_zeros(1, dtype=dtype)])
        return padded.index_select(0, self.assignment_of_slot)


class _Dispatch(torch.autograd.Function):
    """out[slot] = tokens[token of slot]; gradient: each token sums its kept slots' gradients."""

    @staticmethod
    def forward(ctx, tokens, plan):
        ctx.plan = plan
        return plan._gather_slots(tokens)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):
            return ctx.plan._sum_assignments(grad, ctx.plan.kept), None


class _Combine(torch.autograd.Function):
    """out[t] = sum_r weights[t, r] * expert_output[slot of (t, r)]; gradient: each slot gets its
    token's gradient times its weight (0 for empty slots), each weight the dot product of its
    token's gradient with its slot's output."""

    @staticmethod
    def forward(ctx, expert_output, weights, plan):
        ctx.plan = plan
        with torch.autocast(expert_output.device.type, enabled=False):
            ctx.save_for_backward(expert_output, weights)
            return plan._sum_assignments(expert_output, weights)

    @staticmethod
    def backward(ctx, grad):
        expert_output, weights = ctx.saved_tensors
        plan = ctx.plan
        with torch.autocast(grad.device.type, enabled=False):
            grad_output = plan._gather_slots(grad).mul_(
                plan._slot_weights(weights, grad.dtype).unsqueeze(1))
            grad_weights = None
            if ctx.needs_input_grad[1]:
                gathered = expert_output.index_select(0, plan.slot_of_assignment).view(
                    plan.num_tokens, -1, expert_output.size(1))
                # a multiply-and-sum: a bmm over S tiny [k, d] @ [d, 1] products is slower
                grad_weights = (gathered * grad.unsqueeze(1)).sum(2).to(weights.dtype)
        return grad_output, grad_weights, None


@dataclass
class RoutingStats:
    """Statistics of one routing call (the shared protocol of MoE-style layers), all tensors."""

    balance_loss: torch.Tensor  # fp32 0-dim, with grad: E * sum_i m_i P_i (Eqs. 3-5)
    dropped_tokens: torch.Tensor  # int64 0-dim: token-to-expert assignments over capacity
    routed_tokens: torch.Tensor  # int64 0-dim: non-padding tokens in the call
    expert_load: torch.Tensor  # fp32 [E]: assignments kept per expert
    top_k: int = 1  # assignments per token: the dropped fraction is dropped / (top_k * routed)


@dataclass
class Routing:
    """One routing decision and its dispatch plan."""

    expert_index: torch.Tensor  # long [S, k]: chosen experts, best first
    gates: torch.Tensor  # fp32 [S, k]: their router probabilities (not renormalised)
    plan: SlotPlan
    capacity: int  # slots per expert in the dispatch buffer
    num_experts: int
    stats: RoutingStats

    @property
    def num_tokens(self) -> int:
        return self.expert_index.size(0)

    @property
    def top_k(self) -> int:
        return self.expert_index.size(1)

    def _kept_rank_major(self) -> torch.Tensor:
        return self.plan.kept.t().reshape(-1) > 0

    @property
    def assignment_index(self) -> torch.Tensor:
        """The kept assignments, numbered rank-major (rank * S + token), ascending. A boolean
        mask of the data: for tests and analysis, not for the forward pass (a host sync)."""
        return self._kept_rank_major().nonzero().squeeze(1)

    @property
    def slot_index(self) -> torch.Tensor:
        """The slot (expert * capacity + position) of each of ``assignment_index``."""
        slots = self.plan.slot_of_assignment.view(self.num_tokens, -1).t().reshape(-1)
        return slots[self._kept_rank_major()]

    def dispatch(self, tokens: torch.Tensor) -> torch.Tensor:
        """[S, d] tokens -> [E, capacity, d] expert inputs. Empty slots hold a copy of some token:
        their outputs are never combined and get zero gradient."""
        if tokens.size(0) != self.num_tokens:
            raise ValueError(f"routing was computed for {self.num_tokens} tokens, got "
                             f"{tokens.size(0)}; reuse a routing only for the same tokens")
        return self.plan.dispatch(tokens).view(self.num_experts, self.capacity, tokens.size(1))

    def combine(self, expert_output: torch.Tensor) -> torch.Tensor:
        """[E, capacity, d] expert outputs -> [S, d]: sum over kept assignments of gate * output
        (the gates carry the router's gradient)."""
        flat = expert_output.reshape(self.num_experts * self.capacity, -1)
        return self.plan.combine(flat, self.gates * self.plan.kept)


def init_experts_like_linear_(weight: torch.Tensor, bias: torch.Tensor, fan_in: int) -> None:
    """Stacked expert weights and biases drawn as each expert's nn.Linear(fan_in, ...) draws
    them: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (the same numbers as kaiming_uniform_(a=sqrt(5))
    expert by expert)."""
    bound = 1.0 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)
    nn.init.uniform_(bias, -bound, bound)


def _exact(capacity_factor: float) -> Fraction:
    return Fraction(capacity_factor).limit_denominator(10 ** 6)


def expert_capacity(capacity_factor: float, k: int, routed_tokens: int, num_experts: int) -> int:
    """ceil(C * k * S / E), in exact arithmetic (1.2 * 2 * 10 / 4 is 6, not 6.000000000000001):
    ceil(p * k * S / (q * E)) for C = p / q, as integer arithmetic, so that it also holds for a
    symbolic S (``torch.compile`` with dynamic shapes traces S as a SymInt)."""
    exact = _exact(capacity_factor)
    numerator, denominator = exact.numerator * k, exact.denominator * num_experts
    capacity = (routed_tokens * numerator + denominator - 1) // denominator
    # An expert never receives more than one assignment per token.
    return min(capacity, routed_tokens)


def expert_capacity_on_device(capacity_factor: float, k: int, routed_tokens: torch.Tensor,
                              num_experts: int) -> torch.Tensor:
    """:func:`expert_capacity` of a 0-dim int64 tensor of tokens, computed where it lives (no
    host sync): ceil(p * k * S / (q * E)) for C = p / q, as integer arithmetic."""
    exact = _exact(capacity_factor)
    numerator, denominator = exact.numerator * k, exact.denominator * num_experts
    capacity = torch.div(routed_tokens * numerator + (denominator - 1), denominator,
                         rounding_mode="floor")
    return torch.minimum(capacity, routed_tokens)


def check_routing_config(num_experts: int, k: int, capacity_factor: float):
    if num_experts < 1:
        raise ValueError(f"the number of experts must be at least 1, got {num_experts}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k must be between 1 and the number of experts ({num_experts}), "
                         f"got {k}")
    if not capacity_factor > 0:
        raise ValueError(f"the capacity factor must be positive, got {capacity_factor}")


class TopKRouter(nn.Module):
    """g(x) = TopK(softmax(f(x) + eps)) with expert capacity (WideNet Eq. 2), computed in fp32.

    Capacity: an expert keeps at most ceil(C * k * R / E) assignments of a routing call, R its
    non-padding tokens; its buffer has ceil(C * k * S / E) slots, S all token positions (padding
    included), a Python int from shapes, so routing needs no host sync (with padding the extra
    slots stay empty).
    ``capacity_at_inference=False``: in eval mode no assignment is dropped (buffer S slots per
    expert), so a token's output does not depend on the other tokens of its batch.
    """

    def __init__(self, embed_dim: int, num_experts: int, k: int = 2,
                 capacity_factor: float = 1.2, noise: bool = True,
                 capacity_at_inference: bool = True):
        super().__init__()
        check_routing_config(num_experts, k, capacity_factor)
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.noise = noise
        self.capacity_at_inference = capacity_at_inference
        # Switch/GShard routers have no bias.
        self.weight = nn.Parameter(torch.empty(num_experts, embed_dim))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self._pending_stats: List[RoutingStats] = []
        self._warned_unpopped = False

    def forward(self, x: torch.Tensor, valid: Optional[torch.Tensor] = None) -> Routing:
        """x: [S, d]; valid: [S] bool (False = padding, never routed) or None."""
        num_tokens = x.size(0)
        E, k = self.num_experts, self.k
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
            if self.training and self.noise:
                logits = logits + torch.randn_like(logits) / E
            probs = logits.softmax(dim=-1)
        gates, expert_index = probs.topk(k, dim=-1)

        # Rank-major assignments (all first choices, then all second choices, ...): a running
        # count per expert in this order is each assignment's position in its expert's buffer,
        # so first choices come before second choices and earlier tokens before later ones.
        selected = F.one_hot(expert_index.t().reshape(-1), E)  # [k * S, E]
        if valid is None:
            # filled on the device: torch.tensor(num_tokens, device=...) would be a blocking
            # host-to-device copy on a GPU
            routed_tokens = torch.full((), num_tokens, dtype=torch.long, device=x.device)
        else:
            selected = selected * valid.repeat(k).unsqueeze(1)
            routed_tokens = valid.sum()
        is_routed = selected.sum(1) > 0
        position = (selected.cumsum(0) * selected).sum(1) - 1  # -1 for padding

        if self.training or self.capacity_at_inference:
            capacity = expert_capacity(self.capacity_factor, k, num_tokens, E)
            limit = capacity if valid is None else expert_capacity_on_device(
                self.capacity_factor, k, routed_tokens, E)
            keep = is_routed & (position < limit)
        else:  # every token reaches its k experts: at most one assignment per token and expert
            capacity = num_tokens
            keep = is_routed
        slot = torch.where(keep, expert_index.t().reshape(-1) * capacity + position,
                           torch.full_like(position, E * capacity))

        # Eq. 4: m_i counts every top-k selection of expert i (before capacity), so sum_i m_i = k
        per_token = routed_tokens.clamp(min=1)
        selections = selected.sum(0).float() / per_token
        mean_prob = (probs if valid is None else probs * valid.unsqueeze(1)).sum(0) / per_token
        kept_selected = selected * keep.unsqueeze(1)
        stats = RoutingStats(
            balance_loss=E * (selections * mean_prob).sum(),
            dropped_tokens=(is_routed.sum() - keep.sum()).long(),
            routed_tokens=routed_tokens.long(),
            expert_load=kept_selected.sum(0).float(),
            top_k=k,
        )
        if self.training:
            self._record(stats)
        # rank-major assignment a = rank * S + token is number token * k + rank token-major
        rank_major = torch.arange(k * num_tokens, device=x.device)
        token_major = (rank_major % num_tokens) * k + rank_major // num_tokens
        return Routing(
            expert_index=expert_index,
            gates=gates,
            plan=SlotPlan.build(num_tokens, k, E * capacity, token_major, slot),
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


def pop_all_routing_stats(model: nn.Module) -> List[RoutingStats]:
    """The routing statistics every module of ``model`` recorded and nobody popped yet (and
    clear them)."""
    return [stats for module in model.modules() if hasattr(module, "pop_routing_stats")
            for stats in module.pop_routing_stats()]


def set_capacity_at_inference(model: nn.Module, enabled: bool) -> None:
    """Whether every router of ``model`` applies its capacity in eval mode too (see
    :class:`TopKRouter`)."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.capacity_at_inference = enabled


def release_routing_stats_every_step(model: nn.Module) -> None:
    """Make the routing statistics of ``model``'s training forwards live no longer than the step
    that made them, whoever consumes them (a criterion pops them between forward and backward).

    Each statistic holds its router's graph (about 9 MiB per routing call at 4,096 tokens,
    d 512). What is still pending when the backward pass starts (at the gradient of the model's
    first output) or when the next forward starts was consumed by nobody: it is dropped, with
    one warning, because then the load-balance loss is not trained.
    """
    warned = []

    def drop_unconsumed(*_):
        if pop_all_routing_stats(model) and not warned:
            warned.append(True)
            warnings.warn("routing statistics were not consumed by the criterion, so the "
                          "load-balance loss is not trained; use --criterion "
                          "label_smoothed_cross_entropy_with_moe")

    def drop_at_backward(module, inputs, output):
        first = next((leaf for leaf in tree_leaves(output)
                      if isinstance(leaf, torch.Tensor) and leaf.requires_grad), None)
        if module.training and first is not None:
            first.register_hook(drop_unconsumed)

    model.register_forward_pre_hook(drop_unconsumed)
    model.register_forward_hook(drop_at_backward)


class MoEFeedForward(nn.Module):
    """Top-k routed FFN experts run as one batched matmul over [E, capacity, d] (WideNet Sec. 3.1).

    Expert weights are stacked [experts, in, out] (x @ W_i, the package's layout, see
    :mod:`multipath_nmt.modules`): ``fc1_weight`` [E, d, ffn], ``fc2_weight`` [E, ffn, d], biases
    [E, ffn] and [E, d].
    """

    def __init__(self, embed_dim: int, ffn_dim: int, num_experts: int = 4, k: int = 2,
                 capacity_factor: float = 1.2, activation_fn: Callable = F.relu,
                 activation_dropout: float = 0.0, router_noise: bool = True):
        super().__init__()
        self.router = TopKRouter(embed_dim, num_experts, k, capacity_factor, noise=router_noise)
        self.num_experts, self.k = num_experts, k
        self.embed_dim, self.ffn_dim = embed_dim, ffn_dim
        self.activation_fn = activation_fn
        self.activation_dropout = nn.Dropout(activation_dropout)
        self.fc1_weight = nn.Parameter(torch.empty(num_experts, embed_dim, ffn_dim))
        self.fc1_bias = nn.Parameter(torch.empty(num_experts, ffn_dim))
        self.fc2_weight = nn.Parameter(torch.empty(num_experts, ffn_dim, embed_dim))
        self.fc2_bias = nn.Parameter(torch.empty(num_experts, embed_dim))
        self.reset_parameters()

    def reset_parameters(self):
        init_experts_like_linear_(self.fc1_weight, self.fc1_bias, self.embed_dim)
        init_experts_like_linear_(self.fc2_weight, self.fc2_bias, self.ffn_dim)

    def route(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> Routing:
        """The routing decision for x (one routing call: its statistics are recorded)."""
        tokens = FlatTokens.of(x, padding_mask)
        return self.router(tokens.rows, tokens.valid)

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                routing: Optional[Routing] = None) -> torch.Tensor:
        """x: [T, B, d] with padding_mask [B, T] (True = pad), or [S, d] with [S]; padding
        positions get zeros. ``routing``: reuse a decision from :meth:`route` (WideNet groups)."""
        tokens = FlatTokens.of(x, padding_mask)
        if routing is None:
            routing = self.router(tokens.rows, tokens.valid)
        expert_input = routing.dispatch(tokens.rows)
        hidden = torch.baddbmm(self.fc1_bias.unsqueeze(1), expert_input, self.fc1_weight)
        hidden = self.activation_dropout(self.activation_fn(hidden))
        expert_output = torch.baddbmm(self.fc2_bias.unsqueeze(1), hidden, self.fc2_weight)
        return tokens.unflatten(routing.combine(expert_output))

    def pop_routing_stats(self) -> List[RoutingStats]:
        return self.router.pop_routing_stats()

    def expert_parameter_count(self) -> int:
        return 2 * self.embed_dim * self.ffn_dim + self.ffn_dim + self.embed_dim

    def inactive_parameter_count(self) -> int:
        """Parameters a token does not touch: the (E - k) experts it is not routed to."""
        return (self.num_experts - self.k) * self.expert_parameter_count()
