"""Multi-Path Transformer layers, batched over paths: Lin et al. (2022), "Multi-Path Transformer
is Better: A Case Study on Neural Machine Translation".

Every sublayer computes Y = beta * X + sum_f alpha_f * PathNorm_f(H_f) (Sec. 3.1, Eqs. 4-6),
where H_1..H_n are the outputs of n independent paths F_i(LN(X)) (attentions or FFNs) and, with
cheap features, H_{n+j} is the average of the paths other than j (Eq. 7). All paths of a
sublayer run as batched tensor operations: one input projection for every path, one attention
call over n x heads, per-path output projections as one batched matmul. Path outputs are kept
path-major, [n, T, B, d], the layout ``torch.baddbmm`` produces, so PathNorm and the weighted sum
need no copies.

The readable form of these layers, one ``nn.MultiheadAttention``, ``nn.Linear`` pair and
``nn.LayerNorm`` per path in a Python loop, is ``multipath_nmt/testing/multipath_reference.py``
(:mod:`multipath_nmt.testing.multipath_reference`): the tests hold every layer here to it in
float64, outputs and gradients, and its ``load_batched_state_dict`` maps the weights between the
two.
"""
import math
from functools import partial
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def fixed_path_weight(num_features: int, path_norm: bool) -> float:
    """alpha of ``--path-weights fixed``: 1/n without PathNorm (the original multi-path model
    averages its paths), 1/sqrt(n) with PathNorm (n unit-variance features weighted by 1/sqrt(n)
    sum to unit variance). n counts every summed feature, cheap features included."""
    return num_features ** -0.5 if path_norm else 1.0 / num_features


class PathNorm(nn.Module):
    """The parameters of PathNorm (Lin et al., 2022), a LayerNorm at the end of each feature:
    LN_f(H_f) = gamma_f * (H_f - mean) / sqrt(var + eps) + beta_f, an affine pair per feature.
    :meth:`PathMixer.normalized_sum` applies it fused with the weighted sum over features."""

    def __init__(self, num_features: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features, dim))
        self.bias = nn.Parameter(torch.zeros(num_features, dim))


def sums_of_others(paths: Tensor) -> Tensor:
    """S - P_j for every path j of ``paths`` [n, ...], S the sum of all paths: the cheap features
    times n - 1, in O(n)."""
    return paths.sum(0, keepdim=True) - paths


def others_matrix(n: int) -> Tensor:
    """The [n, n] pattern of the cheap features (S - P_j) / (n - 1) = (1 / (n - 1)) M P: M is 1 off
    the diagonal, 0 on it (symmetric), exact in every dtype a model is cast to; the factor
    1 / (n - 1) is applied in the compute dtype."""
    return 1 - torch.eye(n)


class _NormalizedSum(torch.autograd.Function):
    """sum_f LN(H_f; weight s_f, eps) + bias over the features H of paths P [n, N, d]: the n paths
    and, with cheap features, C = M P / (n - 1), C_j = (S - P_j) / (n - 1) (S the sum of the paths,
    M the [n, n] pattern of :func:`others_matrix`, passed in as ``others``, None without cheap
    features).

    As many kernels whatever the number f of features: forward, one LayerNorm (no affine) over
    the [f, N, d] features, the folded weights s_f (PathNorm's gamma times the path weight alpha)
    applied in place, one sum over the features; backward, one LayerNorm backward and, with
    cheap features, the gradient of the paths dP = dH + M^T dC / (n - 1) in one ``addmm``. The cheap
    features are one matrix product written next to a copy of the paths in one [2n, N, d]
    buffer, so the paths' features are exact copies whatever the matmul precision (TF32).

    Computed in the dtype of ``scales`` (fp32 for half-precision paths). Saved for backward,
    besides the per-token LayerNorm statistics: half-precision paths in their own dtype (their
    fp32 features, 2x or, with cheap features, 4x their bytes, are formed again in backward);
    full-precision features as they are: the paths themselves or, with cheap features, the
    [2n, N, d] buffer of the paths and the cheap features. Autograd over the same ops would save
    the normalized features as well.

    The price of one kernel for all features is transient memory in the compute dtype: the
    features and their normalized form in forward, the features, the gradient of the normalized
    features and that of the features in backward, each [f, N, d] (n = 4 with cheap features and
    fp16 paths: peaks of 17 and 24 fp32 [N, d] buffers, forward and backward, where a loop over
    the features needs 6 and 15).
    """

    @staticmethod
    def _features(paths, dtype, others):
        """The features [f, N, d] of ``paths`` in ``dtype``: the paths themselves (no copy in
        their own dtype) or, with cheap features (``others``), a new [2n, N, d] tensor."""
        if others is None:
            return paths.to(dtype)
        n = paths.size(0)
        features = torch.empty((2 * n, *paths.shape[1:]), dtype=dtype, device=paths.device)
        features[:n].copy_(paths)
        features[n:].view(n, -1).addmm_(others.to(dtype), features[:n].view(n, -1), beta=0,
                                        alpha=1 / (n - 1))
        return features

    @staticmethod
    def forward(ctx, paths, scales, bias, eps, others):
        features = _NormalizedSum._features(paths, scales.dtype, others)
        normalized, means, rstds = torch.native_layer_norm(
            features, (features.size(-1),), None, None, eps)
        mixed = normalized.mul_(scales[:, None]).sum(0).add_(bias)
        ctx.eps = eps
        ctx.recompute = paths.dtype != scales.dtype
        ctx.save_for_backward(paths if ctx.recompute else features, scales, means, rstds, others)
        return mixed

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        saved, scales, means, rstds, others = ctx.saved_tensors
        features = (_NormalizedSum._features(saved, scales.dtype, others)
                    if ctx.recompute else saved)
        dim = features.size(-1)
        grad = grad.contiguous()
        grad_scales = None
        if ctx.needs_input_grad[1]:
            normalized = torch.native_layer_norm(features, (dim,), None, None, ctx.eps)[0]
            grad_scales = normalized.mul_(grad).sum(1)
            del normalized
        grad_features = torch.ops.aten.native_layer_norm_backward(
            grad * scales[:, None], features, (dim,), means, rstds, None, None,
            [True, False, False])[0]
        del features
        if others is not None:
            n = grad_features.size(0) // 2
            grad_paths = torch.addmm(grad_features[:n].view(n, -1), others.to(scales.dtype),
                                     grad_features[n:].view(n, -1), alpha=1 / (n - 1))
            grad_paths = grad_paths.view(n, *grad_features.shape[1:])
        else:
            grad_paths = grad_features
        grad_bias = grad.sum(0) if ctx.needs_input_grad[2] else None
        return grad_paths.to(saved.dtype), grad_scales, grad_bias, None, None


class PathMixer(nn.Module):
    """The sublayer output of Lin et al. (2022): Y = beta * X + sum_f alpha_f * PathNorm_f(H_f),
    H = the n path outputs plus, with ``cheap_features`` and n > 2, the n averages of n - 1 paths
    (Eq. 7, before PathNorm). Learnable alpha starts at 1/sqrt(2n) (n raw paths), beta at 1.
    The readable form: ``ReferencePathMixer`` in multipath_nmt/testing/multipath_reference.py."""

    def __init__(self, num_paths: int, dim: int, path_norm: bool = True,
                 learnable_weights: bool = True, cheap_features: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.num_paths = num_paths
        self.cheap_features = cheap_features and num_paths > 2
        num_features = 2 * num_paths if self.cheap_features else num_paths
        self.path_norm = PathNorm(num_features, dim) if path_norm else None
        self.dropout = dropout
        # not saved: checkpoints hold what they held before, and it follows the model's device
        self.register_buffer("others_matrix", others_matrix(num_paths) if self.cheap_features
                             else None, persistent=False)
        if learnable_weights:
            self.path_weights = nn.Parameter(torch.full((num_features,), (2 * num_paths) ** -0.5))
            self.residual_weight = nn.Parameter(torch.ones(()))
        else:
            # Buffers, not constants, so checkpoints record the weights the model used.
            self.register_buffer("path_weights", torch.full(
                (num_features,), fixed_path_weight(num_features, path_norm)))
            self.register_buffer("residual_weight", torch.ones(()))

    def features(self, paths: Tensor) -> Tensor:
        """Raw path outputs [n, ...] followed by the cheap features (S - P_j) / (n - 1)."""
        if not self.cheap_features:
            return paths
        return torch.cat([paths, sums_of_others(paths) / (self.num_paths - 1)], 0)

    def normalized_sum(self, paths: Tensor) -> Tensor:
        """sum_f alpha_f * PathNorm_f(H_f): each feature's LayerNorm output is scaled by
        alpha_f * gamma_f (see :class:`_NormalizedSum`). Half-precision paths are normalized and
        summed in fp32 (their squares overflow fp16)."""
        dtype = torch.float32 if paths.dtype in (torch.float16, torch.bfloat16) else paths.dtype
        norm = self.path_norm
        with torch.autocast(paths.device.type, enabled=False):
            weights = self.path_weights.to(dtype)
            scales = weights[:, None] * norm.weight.to(dtype)
            bias = weights @ norm.bias.to(dtype)
            shape = paths.shape
            paths = paths.reshape(shape[0], -1, shape[-1])
            mixed = _NormalizedSum.apply(paths, scales, bias, norm.eps, self.others_matrix)
        return mixed.view(shape[1:])

    def forward(self, paths: Tensor, residual: Tensor) -> Tensor:
        """``paths`` [n, ..., d], ``residual`` [..., d]."""
        if self.path_norm is None:
            mixed = torch.tensordot(self.path_weights.to(paths.dtype), self.features(paths),
                                    dims=1)
        else:
            mixed = self.normalized_sum(paths).to(paths.dtype)
        # Dropout on the mixed sublayer output, where fairseq's pre-norm layer drops the sublayer
        # output before the residual sum: one mask per token, not one per path.
        mixed = F.dropout(mixed, self.dropout, self.training)
        return torch.addcmul(mixed, residual, self.residual_weight.to(residual.dtype))


def _padding_concat(previous: Optional[Tensor], current: Optional[Tensor], batch: int,
                    previous_len: int, current_len: int, device) -> Optional[Tensor]:
    """Key padding mask of cached keys followed by new keys (missing masks mean no padding)."""
    if previous is None and current is None:
        return None
    if previous is None:
        previous = torch.zeros(batch, previous_len, dtype=torch.bool, device=device)
    if current is None:
        current = torch.zeros(batch, current_len, dtype=torch.bool, device=device)
    return torch.cat([previous, current], 1)


def attention_mask(key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                   dtype: torch.dtype) -> Optional[Tensor]:
    """One ``scaled_dot_product_attention`` mask from fairseq's two: ``key_padding_mask`` [B, S]
    (True = padding) and ``attn_mask`` [T, S] (bool, True = masked, or additive float)."""
    padding = None if key_padding_mask is None else key_padding_mask[:, None, None, :]
    if attn_mask is None:
        return None if padding is None else ~padding
    if attn_mask.dtype == torch.bool:
        return ~attn_mask if padding is None else ~(attn_mask | padding)
    attn_mask = attn_mask.to(dtype)
    if padding is None:
        return attn_mask
    return attn_mask + torch.zeros(padding.shape, dtype=dtype,
                                   device=attn_mask.device).masked_fill(padding, float("-inf"))


class MultiPathAttention(nn.Module):
    """n independent multi-head attentions (the attention paths F_i of Lin et al., 2022) as one:
    q/k/v of every path from one projection d -> 3nd, one attention over n x heads, the per-path
    output projections as one batched matmul. Returns path outputs [n, T, B, d]. The readable
    form: ``ReferenceMultiPathAttention`` in multipath_nmt/testing/multipath_reference.py.

    Beam search (:meth:`set_beam_size`): the B = sentences x beam rows of an encoder-decoder
    attention come in groups of ``beam_size`` beams of one sentence, which share the encoder's
    keys and values, as in fairseq's own encoder-decoder attention. They are computed and cached
    once per sentence, each sentence's beams attend to them as one query block, and reordering
    the beams of a sentence leaves them in place (:meth:`reorder_cache`). Only incremental
    decoding (a ``cache``) groups rows; a full-sequence call treats every row on its own.
    """

    def __init__(self, num_paths: int, embed_dim: int, num_heads: int,
                 kdim: Optional[int] = None, dropout: float = 0.0,
                 encoder_decoder_attention: bool = False):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        self.num_paths = num_paths
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.encoder_decoder_attention = encoder_decoder_attention
        self.beam_size = 1
        kdim = kdim or embed_dim
        # Output rows are ordered (q/k/v, path, head, head_dim), as nn.MultiheadAttention's are
        # within one path.
        if encoder_decoder_attention:
            self.q_proj = nn.Linear(embed_dim, num_paths * embed_dim)
            self.kv_proj = nn.Linear(kdim, 2 * num_paths * embed_dim)
        else:
            self.in_proj = nn.Linear(embed_dim, 3 * num_paths * embed_dim)
        # [path, in, out]: path i computes x @ out_proj_weight[i] + out_proj_bias[i].
        self.out_proj_weight = nn.Parameter(torch.empty(num_paths, embed_dim, embed_dim))
        self.out_proj_bias = nn.Parameter(torch.zeros(num_paths, embed_dim))
        self.reset_parameters(kdim)

    def reset_parameters(self, kdim: int):
        # fairseq's per-path initialisation: Xavier-uniform q/k/v (gain 1/sqrt(2)) and output
        # projections computed on each path's own d x d block; zero output bias.
        def xavier_(weight, fan_in, fan_out, gain):
            bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
            nn.init.uniform_(weight, -bound, bound)

        d = self.embed_dim
        if self.encoder_decoder_attention:
            xavier_(self.q_proj.weight, d, d, 2 ** -0.5)
            xavier_(self.kv_proj.weight, kdim, d, 2 ** -0.5)
        else:
            xavier_(self.in_proj.weight, d, d, 2 ** -0.5)
        xavier_(self.out_proj_weight, d, d, 1.0)
        nn.init.zeros_(self.out_proj_bias)

    def _heads(self, x: Tensor, parts: int) -> Tensor:
        """[S, B, parts * n * d] -> [parts, B, n * heads, S, head_dim] (a view)."""
        S, B, _ = x.shape
        return x.view(S, B, parts, self.num_paths * self.num_heads, self.head_dim).permute(
            2, 1, 3, 0, 4)

    def set_beam_size(self, beam_size: int):
        """Rows of the query are groups of ``beam_size`` beams of one sentence; encoder-decoder
        attention then keeps one copy of the encoder's keys and values per sentence.
        Self-attention ignores it. It must be the current search's: the fairseq model sets it
        at every incremental decoding step, from the shapes of that search
        (``MultiPathTransformerDecoder.extract_features`` in multipath_nmt/models), because
        fairseq itself announces only beam sizes above 1 and a value left from an earlier search
        would group the rows wrongly."""
        self.beam_size = beam_size

    def reorder_cache(self, cache: Dict[str, Tensor], new_order: Tensor):
        """Reorder this attention's ``cache`` to the rows ``new_order`` (a beam search step).
        Per-sentence encoder keys/values stay as they are while every sentence keeps its beams
        (new_order only permutes beams within sentences) and follow the sentences that remain
        when finished ones leave the batch."""
        beam = self.beam_size if self.encoder_decoder_attention else 1
        for name, state in cache.items():
            if beam > 1:
                if state.size(0) * beam == new_order.size(0):
                    continue
                cache[name] = state.index_select(0, new_order.view(-1, beam)[:, 0] // beam)
            else:
                cache[name] = state.index_select(0, new_order)

    def forward(self, query: Tensor, key: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                cache: Optional[Dict[str, Tensor]] = None, is_causal: bool = False) -> Tensor:
        """``query`` [T, B, d], ``key`` [S, B, kdim] (encoder-decoder attention only);
        ``cache``: a dict this call reads and extends for incremental decoding (keys/values of
        earlier steps for self-attention, the encoder's keys/values for cross-attention);
        ``is_causal``: self-attention of a full sequence where query t sees keys <= t, passed
        to ``scaled_dot_product_attention`` as such instead of a mask (``attn_mask`` must be
        None; a key padding mask is the caller's to drop, where the padding is trailing)."""
        T, B, d = query.shape
        beams = 1
        if self.encoder_decoder_attention:
            q = self._heads(self.q_proj(query), 1)[0]
            if self.beam_size > 1 and cache is not None:
                if B % self.beam_size:
                    raise ValueError(f"{B} query rows are not groups of beam size "
                                     f"{self.beam_size}")
                # the beams of a sentence share its encoder rows: keep the first beam's
                beams = self.beam_size
                if key is not None:
                    key = key[:, ::beams]
                if key_padding_mask is not None:
                    key_padding_mask = key_padding_mask[::beams]
            if cache is not None and "key" in cache:
                k, v = cache["key"], cache["value"]
            else:
                k, v = self._heads(self.kv_proj(key), 2).unbind(0)
                if cache is not None:
                    cache["key"], cache["value"] = k, v
            if beams > 1:
                # [B, n * heads, T, hd] -> [B / beams, n * heads, beams * T, hd]
                q = q.unflatten(0, (-1, beams)).transpose(1, 2).flatten(2, 3)
        else:
            q, k, v = self._heads(self.in_proj(query), 3).unbind(0)
            if cache is not None:
                if "key" in cache:
                    previous_len = cache["key"].size(2)
                    k = torch.cat([cache["key"], k], 2)
                    v = torch.cat([cache["value"], v], 2)
                    key_padding_mask = _padding_concat(
                        cache.get("key_padding_mask"), key_padding_mask, B, previous_len, T,
                        query.device)
                cache["key"], cache["value"] = k, v
                if key_padding_mask is not None:
                    cache["key_padding_mask"] = key_padding_mask
        if is_causal and (attn_mask is not None or k.size(2) != T):
            raise ValueError("is_causal takes no attn_mask and a full sequence (no cached keys)")
        mask = attention_mask(key_padding_mask, attn_mask, q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal)
        if beams > 1:
            out = out.unflatten(2, (beams, T)).transpose(1, 2).flatten(0, 1)
        # [B, n * heads, T, head_dim] -> [n, T * B, d] for the batched output projections.
        out = out.reshape(B, self.num_paths, self.num_heads, T, self.head_dim).permute(
            1, 3, 0, 2, 4).reshape(self.num_paths, T * B, d)
        out = torch.baddbmm(self.out_proj_bias.unsqueeze(1), out, self.out_proj_weight)
        return out.view(self.num_paths, T, B, d)


class MultiPathFeedForward(nn.Module):
    """n independent FFNs (the FFN paths F_i of Lin et al., 2022): the first projections of all
    paths as one d -> n * ffn matmul (they share their input LN(X)), the second as one batched
    matmul. Returns path outputs [n, T, B, d]. The readable form:
    ``ReferenceMultiPathFeedForward`` in multipath_nmt/testing/multipath_reference.py."""

    def __init__(self, num_paths: int, embed_dim: int, ffn_dim: int,
                 activation_fn: Callable = F.relu, activation_dropout: float = 0.0):
        super().__init__()
        self.num_paths = num_paths
        self.ffn_dim = ffn_dim
        self.activation_fn = activation_fn
        self.activation_dropout = activation_dropout
        self.fc1 = nn.Linear(embed_dim, num_paths * ffn_dim)
        # [path, in, out]; initialised as nn.Linear(ffn_dim, embed_dim) initialises each path.
        bound = 1.0 / math.sqrt(ffn_dim)
        self.fc2_weight = nn.Parameter(torch.empty(num_paths, ffn_dim, embed_dim).uniform_(
            -bound, bound))
        self.fc2_bias = nn.Parameter(torch.empty(num_paths, embed_dim).uniform_(-bound, bound))

    def forward(self, x: Tensor) -> Tensor:
        T, B, d = x.shape
        hidden = self.activation_fn(self.fc1(x))
        hidden = F.dropout(hidden, self.activation_dropout, self.training)
        hidden = hidden.view(T * B, self.num_paths, self.ffn_dim).transpose(0, 1)
        out = torch.baddbmm(self.fc2_bias.unsqueeze(1), hidden, self.fc2_weight)
        return out.view(self.num_paths, T, B, d)


class _PreNormMultiPathLayer(nn.Module):
    """What the encoder and decoder layers share: pre-norm sublayers, each a LayerNorm, the paths
    F_1..F_n and their PathMixer, Y = beta * X + sum_f alpha_f * PathNorm_f(F_f(LN(X))), every
    mixer with the same options. A layer adds its sublayers in the order they run (self-attention
    first, FFN last), which is the order of its parameters in checkpoints and optimizer states,
    and of their initialisation from the random seed; the names are those of fairseq's layers."""

    def __init__(self, num_paths: int, embed_dim: int, path_norm: bool, learnable_weights: bool,
                 cheap_features: bool, dropout: float):
        super().__init__()
        self.num_paths = num_paths
        self.embed_dim = embed_dim
        self._new_mixer = partial(PathMixer, num_paths, embed_dim, path_norm=path_norm,
                                  learnable_weights=learnable_weights,
                                  cheap_features=cheap_features, dropout=dropout)

    def _add_self_attention(self, num_heads: int, attention_dropout: float):
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.self_attn = MultiPathAttention(self.num_paths, self.embed_dim, num_heads,
                                            dropout=attention_dropout)
        self.self_attn_mixer = self._new_mixer()

    def _add_feed_forward(self, ffn_dim: int, activation_fn: Callable, activation_dropout: float):
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)
        self.ffn = MultiPathFeedForward(self.num_paths, self.embed_dim, ffn_dim, activation_fn,
                                        activation_dropout)
        self.ffn_mixer = self._new_mixer()

    def _self_attention(self, x: Tensor, **attention_options) -> Tensor:
        """The self-attention sublayer; ``attention_options`` go to
        :meth:`MultiPathAttention.forward`."""
        paths = self.self_attn(self.self_attn_layer_norm(x), **attention_options)
        return self.self_attn_mixer(paths, x)

    def _feed_forward(self, x: Tensor) -> Tensor:
        return self.ffn_mixer(self.ffn(self.final_layer_norm(x)), x)


class MultiPathEncoderLayer(_PreNormMultiPathLayer):
    """A pre-norm Multi-Path Transformer encoder layer (Lin et al., 2022, Fig. 2): self-attention
    and FFN sublayers, each Y = beta * X + sum_f alpha_f * PathNorm_f(F_f(LN(X))). The readable
    form: ``ReferenceMultiPathEncoderLayer`` in multipath_nmt/testing/multipath_reference.py."""

    def __init__(self, embed_dim: int, ffn_dim: int, num_heads: int, num_paths: int,
                 path_norm: bool = True, learnable_weights: bool = True,
                 cheap_features: bool = False, dropout: float = 0.0,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation_fn: Callable = F.relu):
        super().__init__(num_paths, embed_dim, path_norm, learnable_weights, cheap_features,
                         dropout)
        self._add_self_attention(num_heads, attention_dropout)
        self._add_feed_forward(ffn_dim, activation_fn, activation_dropout)

    def forward(self, x: Tensor, encoder_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        """``x`` [T, B, d]; ``encoder_padding_mask`` [B, T], True at padding."""
        x = self._self_attention(x, key_padding_mask=encoder_padding_mask, attn_mask=attn_mask)
        return self._feed_forward(x)


class MultiPathDecoderLayer(_PreNormMultiPathLayer):
    """A pre-norm Multi-Path decoder layer: the encoder layer's construction applied to masked
    self-attention, encoder-decoder attention and FFN (an extension beyond Lin et al., 2022). The
    readable form (full sequences): ``ReferenceMultiPathDecoderLayer`` in
    multipath_nmt/testing/multipath_reference.py."""

    def __init__(self, embed_dim: int, ffn_dim: int, num_heads: int, num_paths: int,
                 path_norm: bool = True, learnable_weights: bool = True,
                 cheap_features: bool = False, dropout: float = 0.0,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation_fn: Callable = F.relu, encoder_embed_dim: Optional[int] = None,
                 no_encoder_attn: bool = False):
        super().__init__(num_paths, embed_dim, path_norm, learnable_weights, cheap_features,
                         dropout)
        self._add_self_attention(num_heads, attention_dropout)
        if no_encoder_attn:
            self.encoder_attn = None
        else:
            self.encoder_attn_layer_norm = nn.LayerNorm(embed_dim)
            self.encoder_attn = MultiPathAttention(
                num_paths, embed_dim, num_heads, kdim=encoder_embed_dim or embed_dim,
                dropout=attention_dropout, encoder_decoder_attention=True)
            self.encoder_attn_mixer = self._new_mixer()
        self._add_feed_forward(ffn_dim, activation_fn, activation_dropout)

    def forward(self, x: Tensor, encoder_out: Optional[Tensor] = None,
                encoder_padding_mask: Optional[Tensor] = None,
                self_attn_mask: Optional[Tensor] = None,
                self_attn_padding_mask: Optional[Tensor] = None,
                cache: Optional[Dict[str, Dict[str, Tensor]]] = None,
                self_attn_is_causal: bool = False) -> Tensor:
        """``x`` [T, B, d] (the new positions only when ``cache`` holds earlier steps);
        ``cache``: a dict this layer keeps its incremental-decoding state in;
        ``self_attn_is_causal``: causal self-attention without a mask tensor (see
        :meth:`MultiPathAttention.forward`)."""
        self_cache = None if cache is None else cache.setdefault("self_attn", {})
        x = self._self_attention(x, key_padding_mask=self_attn_padding_mask,
                                 attn_mask=self_attn_mask, cache=self_cache,
                                 is_causal=self_attn_is_causal)
        if self.encoder_attn is not None:
            cross_cache = None if cache is None else cache.setdefault("encoder_attn", {})
            paths = self.encoder_attn(self.encoder_attn_layer_norm(x), encoder_out,
                                      key_padding_mask=encoder_padding_mask, cache=cross_cache)
            x = self.encoder_attn_mixer(paths, x)
        return self._feed_forward(x)
