"""ParameterNet FFNs: Han et al. (2023), "ParameterNet: Parameters Are All You Need"
(arXiv:2306.14525), applied to a Transformer FFN.

A chosen projection (fc1 "up", fc2 "down" or both) holds M weight matrices W_1..W_M instead of one:

- dynamic (Sec. 4.2, Eqs. 3-4, dynamic-convolution style): per sentence,
  W' = sum_i alpha_i W_i with alpha = softmax(MLP(mean-pool(x))) (pooling over non-padding tokens;
  the MLP's hidden width is the input width, as the paper's parameter count C_in^2 + C_in M has
  it), then one ordinary projection with W': about M times the parameters at nearly the same
  FLOPs. W' is rebuilt in backward instead of being kept (:class:`_MixedProjection`).
- routed (Sec. 4.3, the language models): a top-1 routed mixture (Switch-style, no router noise):
  each token's projection uses the matrix its router picks, scaled by the router probability,
  with the MoE layer's capacity and balance loss; tokens over capacity are dropped and the whole
  FFN outputs 0 for them (the residual carries them).

Every module takes time-major x [T, B, d] and padding_mask [B, T] (True = padding) or None, like
fairseq's encoder layers and :class:`multipath_nmt.modules.moe.MoEFeedForward`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.modules.moe import TopKRouter, init_experts_like_linear_

PROJECTIONS = ("up", "down", "both")
MODES = ("routed", "dynamic")


def masked_mean(x, padding_mask):
    """Mean over the non-padding time steps of x [T, B, d] -> [B, d], summed in fp32 (a sum of
    half-precision activations over a sentence overflows fp16's 65,504), returned in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    if padding_mask is None:
        return x.mean(0, dtype=dtype).to(x.dtype)
    keep = (~padding_mask).t().unsqueeze(-1)
    total = x.masked_fill(~keep, 0).sum(0, dtype=dtype)
    return (total / keep.sum(0).clamp(min=1)).to(x.dtype)


def _mixed_weights(alpha, weight):
    """W'_b = sum_i alpha_bi W_i for every sentence b: [B, M] x [M, in, out] -> [B, in, out]."""
    num_experts, in_features, out_features = weight.shape
    return (alpha @ weight.view(num_experts, -1)).view(-1, in_features, out_features)


class _MixedProjection(torch.autograd.Function):
    """y_b = x_b W'_b + b'_b with (W'_b, b'_b) = sum_i alpha_bi (W_i, b_i), for x [B, T, in].

    Autograd would keep every sentence's W' (B * in * out values per layer, 30 times a dense
    FFN's saved activations at 28 tokens a sentence); this keeps only x and alpha and rebuilds
    W' in backward (one [B, M] @ [M, in * out] product more, the FLOPs stay the dense
    projection's plus O(B * M * in * out)). Gradients, with G_b = x_b^T dy_b [in, out]:
    dx_b = dy_b W'_b^T, d alpha_bi = <G_b, W_i> + <sum_t dy_bt, b_i>,
    dW_i = sum_b alpha_bi G_b, db_i = sum_b alpha_bi sum_t dy_bt (sums over time in fp32).
    """

    @staticmethod
    def forward(ctx, x, alpha, weight, bias):
        ctx.save_for_backward(x, alpha, weight, bias)
        return torch.baddbmm((alpha @ bias).unsqueeze(1), x, _mixed_weights(alpha, weight))

    @staticmethod
    def backward(ctx, grad):
        x, alpha, weight, bias = ctx.saved_tensors
        grad_x = grad_alpha = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.bmm(grad, _mixed_weights(alpha, weight).transpose(1, 2))
        if any(ctx.needs_input_grad[1:]):
            num_experts = weight.shape[0]
            grad_sum = grad.sum(1, dtype=torch.promote_types(grad.dtype, torch.float32)).to(
                grad.dtype)  # [B, out]
            grad_mixed = torch.bmm(x.transpose(1, 2), grad).view(x.shape[0], -1)  # [B, in*out]
            grad_alpha = grad_mixed @ weight.view(num_experts, -1).t() + grad_sum @ bias.t()
            grad_weight = (alpha.t() @ grad_mixed).view_as(weight)
            grad_bias = alpha.t() @ grad_sum
        return grad_x, grad_alpha, grad_weight, grad_bias


class DynamicLinear(nn.Module):
    """y = x W' + b' with (W', b') = sum_i alpha_i (W_i, b_i), alpha = softmax(MLP(mean-pool(x)))
    per sentence (ParameterNet Eqs. 3-4; the MLP is DynamicConv's pool -> FC -> ReLU -> FC, its
    hidden width ``in_features`` by default, as the paper's count of C_in^2 + C_in M parameters).

    ``weight`` is [M, in, out] (x @ W_i, the transpose of nn.Linear's layout), so that every
    sentence's W' comes out of one [B, M] @ [M, in * out] matmul in the layout its batched
    product reads, and so do the gradients.
    All M matrices form every sentence's W' and get gradient from every token, so none of them
    is inactive (no ``inactive_parameter_count``): the saving is in FLOPs, not in parameters.
    """

    def __init__(self, in_features, out_features, num_experts, hidden_features=None):
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features))
        hidden = in_features if hidden_features is None else hidden_features
        self.coefficients = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_experts))
        init_experts_like_linear_(self.weight, self.bias, in_features)

    def mixing_weights(self, x, padding_mask):
        """alpha [B, M], computed in fp32."""
        return torch.softmax(self.coefficients(masked_mean(x, padding_mask)).float(), dim=-1)

    def forward(self, x, padding_mask=None):
        """x [T, B, in] -> [T, B, out] (a transposed view of a [B, T, out] result)."""
        alpha = self.mixing_weights(x, padding_mask)
        device = x.device.type
        # the product runs in the dtype autocast would pick (x's own without autocast), with
        # autocast off inside: backward then sees the dtypes forward used
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x.dtype)
        with torch.autocast(device, enabled=False):
            out = _MixedProjection.apply(x.transpose(0, 1).to(dtype), alpha.to(dtype),
                                         self.weight.to(dtype), self.bias.to(dtype))
        return out.transpose(0, 1)


class RoutedLinear(nn.Module):
    """y = p_i(x) (x W_i + b_i) for the expert i = argmax_j p_j(x) of a top-1 router with capacity
    and the Switch balance loss (:class:`~multipath_nmt.modules.moe.TopKRouter`, k = 1)."""

    def __init__(self, in_features, out_features, num_experts, capacity_factor=1.2,
                 router_noise=False):
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(in_features, num_experts, k=1, capacity_factor=capacity_factor,
                                 noise=router_noise)
        # [E, in, out] (x @ W_i), like MoEFeedForward's experts: no transposed operand, so the
        # weight gradient comes out in the weight's own layout
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features))
        init_experts_like_linear_(self.weight, self.bias, in_features)

    def forward(self, x, padding_mask=None):
        """Returns (y, kept): kept [T, B] bool marks the tokens the capacity let through;
        dropped and padding tokens get y = 0."""
        tokens = x.reshape(-1, x.shape[-1])
        valid = None if padding_mask is None else ~padding_mask.t().reshape(-1)
        routing = self.router(tokens, valid)
        expert_input = routing.dispatch(tokens)
        expert_output = torch.baddbmm(self.bias.unsqueeze(1), expert_input, self.weight)
        y = routing.combine(expert_output)
        kept = routing.plan.kept.squeeze(1) > 0  # k = 1: one assignment per token
        return y.view(*x.shape[:-1], -1), kept.view(x.shape[:-1])

    def pop_routing_stats(self):
        return self.router.pop_routing_stats()

    def inactive_parameter_count(self):
        return (self.num_experts - 1) * (self.weight[0].numel() + self.bias[0].numel())


class ParameterNetFeedForward(nn.Module):
    """fc1 -> activation -> dropout -> fc2 with the chosen projections made ParameterNet layers."""

    def __init__(self, embed_dim, ffn_dim, num_experts, proj="both", mode="dynamic",
                 activation_fn=F.relu, activation_dropout=0.0, capacity_factor=1.2,
                 router_noise=False):
        super().__init__()
        if proj not in PROJECTIONS:
            raise ValueError(f"unknown ParameterNet projection {proj!r}; choose one of {PROJECTIONS}")
        if mode not in MODES:
            raise ValueError(f"unknown ParameterNet mode {mode!r}; choose one of {MODES}")
        if num_experts < 2:
            raise ValueError(f"ParameterNet needs at least 2 weight matrices, got {num_experts}")
        self.activation_fn = activation_fn
        self.activation_dropout = nn.Dropout(activation_dropout)

        def build(in_features, out_features, chosen):
            if not chosen:
                return nn.Linear(in_features, out_features)
            if mode == "dynamic":
                return DynamicLinear(in_features, out_features, num_experts)
            return RoutedLinear(in_features, out_features, num_experts, capacity_factor,
                                router_noise)

        self.fc1 = build(embed_dim, ffn_dim, proj in ("up", "both"))
        self.fc2 = build(ffn_dim, embed_dim, proj in ("down", "both"))

    def _project(self, layer, x, padding_mask, kept):
        """Apply one projection; ``kept`` [T, B]: tokens not yet dropped by a routed projection."""
        if isinstance(layer, nn.Linear):
            return layer(x), kept
        if isinstance(layer, DynamicLinear):
            return layer(x, padding_mask), kept
        if kept is not None:
            # a token dropped by fc1 must not take a place in fc2's expert capacity
            padding_mask = ~kept.t() if padding_mask is None else padding_mask | ~kept.t()
        return layer(x, padding_mask)

    def forward(self, x, padding_mask=None):
        hidden, kept = self._project(self.fc1, x, padding_mask, None)
        hidden = self.activation_dropout(self.activation_fn(hidden))
        out, kept = self._project(self.fc2, hidden, padding_mask, kept)
        if kept is not None:
            out = out * kept.unsqueeze(-1).to(out.dtype)
        return out
