"""ParameterNet FFNs: Han et al. (2023), "ParameterNet: Parameters Are All You Need"
(arXiv:2306.14525), applied to a Transformer FFN.

A chosen projection (fc1 "up", fc2 "down" or both) holds M weight matrices W_1..W_M instead of one:

- dynamic (Sec. 4.2, Eqs. 3-4, dynamic-convolution style): per sentence,
  W' = sum_i alpha_i W_i with alpha = softmax(MLP(mean-pool(x))) (pooling over non-padding tokens;
  the MLP's hidden width is the input width, as the paper's parameter count C_in^2 + C_in M has
  it), then one ordinary projection with W': about M times the parameters at nearly the same
  FLOPs in the paper's convolutions. Here every x W_i comes out of one large product and is
  weighted per token (:class:`_MixedProjection`), with no per-sentence W' to build or keep.
- routed (Sec. 4.3 and 5.4, the language models): a top-1 routed mixture (Switch-style, no
  router noise): each token's projection uses the matrix its router picks, scaled by the router
  probability, with the MoE layer's capacity and balance loss; tokens over capacity are dropped
  and the whole FFN outputs 0 for them (the residual carries them). Every router reads the FFN's
  input, the model's hidden size (Sec. 5.4: the router's input channel is the hidden size), also
  for the down projection, whose own input is the FFN width.

Every module takes time-major x [T, B, d] and padding_mask [B, T] (True = padding) or None, like
fairseq's encoder layers and :class:`multipath_nmt.modules.moe.MoEFeedForward`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.modules.moe import FlatTokens, TopKRouter, init_experts_like_linear_

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


def _expert_outputs(x, weight):
    """x W_i for every token and matrix, as one product: [N, in] @ [in, M * out] -> [N, M, out]."""
    in_features, num_experts, out_features = weight.shape
    return (x @ weight.view(in_features, -1)).view(-1, num_experts, out_features)


class _MixedProjection(torch.autograd.Function):
    """y_t = sum_i alpha_ti (x_t W_i + b_i) for tokens x [N, in], alpha [N, M] their sentence's
    coefficients, weight [in, M, out]: the same as x_t W' + b' with W' = sum_i alpha_i W_i,
    without building a W' per sentence.

    Autograd over per-sentence W' kept B * in * out values per layer for backward (30 times a
    dense FFN's saved activations at 28 tokens a sentence); this keeps x and alpha only and
    recomputes the [N, M, out] products in backward. Gradients, with z_ti = x_t W_i:
    d alpha_ti = <dy_t, z_ti + b_i>, dx_t = sum_i alpha_ti dy_t W_i^T, dW_i = sum_t x_t^T alpha_ti
    dy_t, db_i = sum_t alpha_ti dy_t (each sum over tokens one matrix product).
    """

    @staticmethod
    def forward(ctx, x, alpha, weight, bias):
        ctx.save_for_backward(x, alpha, weight, bias)
        mixed = torch.bmm(alpha.unsqueeze(1), _expert_outputs(x, weight)).squeeze(1)
        return mixed.addmm_(alpha, bias)

    @staticmethod
    def backward(ctx, grad):
        x, alpha, weight, bias = ctx.saved_tensors
        grad_x = grad_alpha = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            outputs = _expert_outputs(x, weight)
            grad_alpha = torch.bmm(outputs, grad.unsqueeze(2)).squeeze(2).addmm_(grad, bias.t())
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            # the gradient of every x_t W_i: alpha_ti dy_t, [N, M * out]
            spread = (alpha.unsqueeze(2) * grad.unsqueeze(1)).view(grad.shape[0], -1)
            if ctx.needs_input_grad[0]:
                grad_x = spread @ weight.view(weight.shape[0], -1).t()
            if ctx.needs_input_grad[2]:
                grad_weight = (x.t() @ spread).view_as(weight)
        if ctx.needs_input_grad[3]:
            grad_bias = alpha.t() @ grad
        return grad_x, grad_alpha, grad_weight, grad_bias


class DynamicLinear(nn.Module):
    """y = x W' + b' with (W', b') = sum_i alpha_i (W_i, b_i), alpha = softmax(MLP(mean-pool(x)))
    per sentence (ParameterNet Eqs. 3-4; the MLP is DynamicConv's pool -> FC -> ReLU -> FC, its
    hidden width ``in_features`` by default, as the paper's count of C_in^2 + C_in M parameters).

    ``weight`` is [in, M, out] (x @ W_i, the transpose of nn.Linear's layout, matrices side by
    side), so that x @ weight.view(in, M * out) gives every x W_i in one product
    (:class:`_MixedProjection`): M times a dense projection's multiply-adds, where building each
    sentence's W' costs B * M * in * out and moves B * in * out values, which on the CPU took
    longer at 10 to 28 tokens a sentence.
    All M matrices form every sentence's W' and get gradient from every token, so none of them
    is inactive (no ``inactive_parameter_count``).
    """

    def __init__(self, in_features, out_features, num_experts, hidden_features=None):
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.empty(in_features, num_experts, out_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features))
        hidden = in_features if hidden_features is None else hidden_features
        self.coefficients = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_experts))
        init_experts_like_linear_(self.weight, self.bias, in_features)

    def expert_weight(self, index):
        """W_i [in, out]."""
        return self.weight[:, index]

    def method_matmul_flops(self, tokens, sentences):
        """The matrix-product FLOPs of ParameterNet's Eq. 3 for ``tokens`` tokens in
        ``sentences`` sentences, without the coefficient MLP: each sentence's W' = sum_i alpha_i
        W_i (2 M in out), then one product per token (2 in out). :meth:`forward` computes M
        products per token instead (the class docstring says why)."""
        in_features, num_experts, out_features = self.weight.shape
        return 2 * in_features * out_features * (tokens + sentences * num_experts)

    def mixing_weights(self, x, padding_mask):
        """alpha [B, M], computed in fp32 (or x's dtype if wider)."""
        logits = self.coefficients(masked_mean(x, padding_mask))
        return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)

    def forward(self, x, padding_mask=None):
        """x [T, B, in] -> [T, B, out]."""
        alpha = self.mixing_weights(x, padding_mask)
        length, batch, in_features = x.shape
        # every token's coefficients, expanded in fp32: their gradient sums over the sentence
        alpha = alpha.unsqueeze(0).expand(length, batch, -1).reshape(-1, self.num_experts)
        device = x.device.type
        # the products run in the dtype autocast would pick (x's own without autocast), with
        # autocast off inside: backward then sees the dtypes forward used
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else x.dtype)
        with torch.autocast(device, enabled=False):
            out = _MixedProjection.apply(x.reshape(-1, in_features).to(dtype), alpha.to(dtype),
                                         self.weight.to(dtype), self.bias.to(dtype))
        return out.view(length, batch, -1)


class RoutedLinear(nn.Module):
    """y = p_i(r) (x W_i + b_i) for the expert i = argmax_j p_j(r) of a top-1 router with capacity
    and the Switch balance loss (:class:`~multipath_nmt.modules.moe.TopKRouter`, k = 1). The
    router reads r, ``route_input`` of :meth:`forward` ([T, B, router_features], the same tokens
    as x), or x itself when none is given."""

    def __init__(self, in_features, out_features, num_experts, capacity_factor=1.2,
                 router_noise=False, router_features=None):
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(in_features if router_features is None else router_features,
                                 num_experts, k=1, capacity_factor=capacity_factor,
                                 noise=router_noise)
        # [E, in, out] (x @ W_i), like MoEFeedForward's experts: no transposed operand, so the
        # weight gradient comes out in the weight's own layout
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features))
        init_experts_like_linear_(self.weight, self.bias, in_features)

    def forward(self, x, padding_mask=None, route_input=None):
        """Returns (y, kept): kept [T, B] bool marks the tokens the capacity let through;
        dropped and padding tokens get y = 0."""
        tokens = FlatTokens.of(x, padding_mask)
        routed = tokens if route_input is None else FlatTokens.of(route_input, padding_mask)
        routing = self.router(routed.rows, tokens.valid)
        expert_input = routing.dispatch(tokens.rows)
        expert_output = torch.baddbmm(self.bias.unsqueeze(1), expert_input, self.weight)
        y = routing.combine(expert_output)
        kept = routing.plan.kept.squeeze(1) > 0  # k = 1: one assignment per token
        return tokens.unflatten(y), tokens.unflatten(kept)

    def pop_routing_stats(self):
        return self.router.pop_routing_stats()

    def inactive_parameter_count(self):
        return (self.num_experts - 1) * (self.weight[0].numel() + self.bias[0].numel())


class ParameterNetFeedForward(nn.Module):
    """fc1 -> activation -> dropout -> fc2 with the chosen projections made ParameterNet layers.
    Routed projections are routed on the FFN's input (``embed_dim`` wide, the hidden size)."""

    def __init__(self, embed_dim, ffn_dim, num_experts, proj="up", mode="routed",
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
                                router_noise, router_features=embed_dim)

        self.fc1 = build(embed_dim, ffn_dim, proj in ("up", "both"))
        self.fc2 = build(ffn_dim, embed_dim, proj in ("down", "both"))

    def _project(self, layer, x, padding_mask, kept, route_input):
        """Apply one projection; ``kept`` [T, B]: tokens not yet dropped by a routed projection;
        ``route_input``: what a routed projection's router reads (the FFN's input)."""
        if isinstance(layer, nn.Linear):
            return layer(x), kept
        if isinstance(layer, DynamicLinear):
            return layer(x, padding_mask), kept
        if kept is not None:
            # a token dropped by fc1 must not take a place in fc2's expert capacity
            padding_mask = ~kept.t() if padding_mask is None else padding_mask | ~kept.t()
        return layer(x, padding_mask, route_input)

    def forward(self, x, padding_mask=None):
        hidden, kept = self._project(self.fc1, x, padding_mask, None, x)
        hidden = self.activation_dropout(self.activation_fn(hidden))
        out, kept = self._project(self.fc2, hidden, padding_mask, kept, x)
        if kept is not None:
            out = out * kept.unsqueeze(-1).to(out.dtype)
        return out
