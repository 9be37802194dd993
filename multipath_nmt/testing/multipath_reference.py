"""Reference Multi-Path Transformer layers (Lin et al., 2022): a Python loop over ordinary modules,
the readable form of the fused layers of :mod:`multipath_nmt.modules.multipath`.

Y = beta * X + sum_f alpha_f * PathNorm_f(H_f) written the obvious way, one nn.MultiheadAttention,
one pair of nn.Linear and one nn.LayerNorm per path. Same constructor arguments as the batched
layers of :mod:`multipath_nmt.modules.multipath`; ``batched_state_dict()`` and
``load_batched_state_dict()`` convert weights between the two layouts, so the batched layers can
be tested (and benchmarked) against these.
"""
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multipath_nmt.modules.multipath import fixed_path_weight

Tensors = Dict[str, Tensor]


def _sub(tensors: Tensors, prefix: str) -> Tensors:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def _add(out: Tensors, prefix: str, tensors: Tensors) -> Tensors:
    out.update({prefix + k: v for k, v in tensors.items()})
    return out


class ReferencePathMixer(nn.Module):
    """Y = beta * X + sum_f alpha_f * LayerNorm_f(H_f), one nn.LayerNorm per feature."""

    def __init__(self, num_paths: int, dim: int, path_norm: bool = True,
                 learnable_weights: bool = True, cheap_features: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.num_paths = num_paths
        self.cheap_features = cheap_features and num_paths > 2
        self.num_features = 2 * num_paths if self.cheap_features else num_paths
        self.path_norms = (nn.ModuleList(nn.LayerNorm(dim) for _ in range(self.num_features))
                           if path_norm else None)
        self.dropout = dropout
        if learnable_weights:
            self.path_weights = nn.Parameter(
                torch.full((self.num_features,), (2 * num_paths) ** -0.5))
            self.residual_weight = nn.Parameter(torch.ones(()))
        else:
            self.register_buffer("path_weights", torch.full(
                (self.num_features,), fixed_path_weight(self.num_features, path_norm)))
            self.register_buffer("residual_weight", torch.ones(()))

    def forward(self, paths: List[Tensor], residual: Tensor) -> Tensor:
        features = list(paths)
        if self.cheap_features:
            for j in range(self.num_paths):
                others = [p for i, p in enumerate(paths) if i != j]
                features.append(sum(others) / len(others))
        if self.path_norms is not None:
            features = [norm(f) for norm, f in zip(self.path_norms, features)]
        mixed = sum(w * f for w, f in zip(self.path_weights, features))
        return self.residual_weight * residual + F.dropout(mixed, self.dropout, self.training)

    def to_batched(self, t: Tensors) -> Tensors:
        # Fixed weights are buffers: present in state dicts, absent from gradients.
        out = {k: v for k, v in t.items() if k in ("path_weights", "residual_weight")}
        if self.path_norms is not None:
            for name in ("weight", "bias"):
                out[f"path_norm.{name}"] = torch.stack(
                    [t[f"path_norms.{i}.{name}"] for i in range(self.num_features)])
        return out

    def from_batched(self, t: Tensors) -> Tensors:
        out = {k: v for k, v in t.items() if k in ("path_weights", "residual_weight")}
        if self.path_norms is not None:
            for name in ("weight", "bias"):
                for i, row in enumerate(t[f"path_norm.{name}"]):
                    out[f"path_norms.{i}.{name}"] = row
        return out


class ReferenceMultiPathAttention(nn.Module):
    """n torch nn.MultiheadAttention modules called one after the other."""

    def __init__(self, num_paths: int, embed_dim: int, num_heads: int,
                 kdim: Optional[int] = None, dropout: float = 0.0,
                 encoder_decoder_attention: bool = False):
        super().__init__()
        if (kdim or embed_dim) != embed_dim:
            raise ValueError("the reference attention supports kdim == embed_dim only")
        self.num_paths = num_paths
        self.embed_dim = embed_dim
        self.encoder_decoder_attention = encoder_decoder_attention
        self.paths = nn.ModuleList(nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout)
                                   for _ in range(num_paths))

    def forward(self, query: Tensor, key: Optional[Tensor] = None,
                key_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None) -> List[Tensor]:
        key = query if key is None else key
        return [attention(query, key, key, key_padding_mask=key_padding_mask,
                          attn_mask=attn_mask, need_weights=False)[0]
                for attention in self.paths]

    def to_batched(self, t: Tensors) -> Tensors:
        d, n = self.embed_dim, self.num_paths
        # Per path [3d, d] (q; k; v) -> rows ordered (q/k/v, path, d).
        weight = torch.stack([t[f"paths.{i}.in_proj_weight"].view(3, d, d) for i in range(n)], 1)
        bias = torch.stack([t[f"paths.{i}.in_proj_bias"].view(3, d) for i in range(n)], 1)
        out = {
            "out_proj_weight": torch.stack(
                [t[f"paths.{i}.out_proj.weight"].t() for i in range(n)]),
            "out_proj_bias": torch.stack([t[f"paths.{i}.out_proj.bias"] for i in range(n)]),
        }
        if self.encoder_decoder_attention:
            out["q_proj.weight"] = weight[0].reshape(n * d, d)
            out["q_proj.bias"] = bias[0].reshape(n * d)
            out["kv_proj.weight"] = weight[1:].reshape(2 * n * d, d)
            out["kv_proj.bias"] = bias[1:].reshape(2 * n * d)
        else:
            out["in_proj.weight"] = weight.reshape(3 * n * d, d)
            out["in_proj.bias"] = bias.reshape(3 * n * d)
        return out

    def from_batched(self, t: Tensors) -> Tensors:
        d, n = self.embed_dim, self.num_paths
        if self.encoder_decoder_attention:
            weight = torch.cat([t["q_proj.weight"].view(1, n, d, d),
                                t["kv_proj.weight"].view(2, n, d, d)])
            bias = torch.cat([t["q_proj.bias"].view(1, n, d), t["kv_proj.bias"].view(2, n, d)])
        else:
            weight = t["in_proj.weight"].view(3, n, d, d)
            bias = t["in_proj.bias"].view(3, n, d)
        out = {}
        for i in range(n):
            out[f"paths.{i}.in_proj_weight"] = weight[:, i].reshape(3 * d, d)
            out[f"paths.{i}.in_proj_bias"] = bias[:, i].reshape(3 * d)
            out[f"paths.{i}.out_proj.weight"] = t["out_proj_weight"][i].t()
            out[f"paths.{i}.out_proj.bias"] = t["out_proj_bias"][i]
        return out


class _FeedForward(nn.Module):
    def __init__(self, embed_dim, ffn_dim, activation_fn, activation_dropout):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.activation_fn = activation_fn
        self.activation_dropout = activation_dropout

    def forward(self, x):
        hidden = F.dropout(self.activation_fn(self.fc1(x)), self.activation_dropout, self.training)
        return self.fc2(hidden)


class ReferenceMultiPathFeedForward(nn.Module):
    """n two-layer FFNs called one after the other."""

    def __init__(self, num_paths: int, embed_dim: int, ffn_dim: int,
                 activation_fn: Callable = F.relu, activation_dropout: float = 0.0):
        super().__init__()
        self.num_paths = num_paths
        self.paths = nn.ModuleList(_FeedForward(embed_dim, ffn_dim, activation_fn,
                                                activation_dropout) for _ in range(num_paths))

    def forward(self, x: Tensor) -> List[Tensor]:
        return [ffn(x) for ffn in self.paths]

    def to_batched(self, t: Tensors) -> Tensors:
        n = range(self.num_paths)
        return {
            "fc1.weight": torch.cat([t[f"paths.{i}.fc1.weight"] for i in n]),
            "fc1.bias": torch.cat([t[f"paths.{i}.fc1.bias"] for i in n]),
            "fc2_weight": torch.stack([t[f"paths.{i}.fc2.weight"].t() for i in n]),
            "fc2_bias": torch.stack([t[f"paths.{i}.fc2.bias"] for i in n]),
        }

    def from_batched(self, t: Tensors) -> Tensors:
        n = self.num_paths
        fc1_weight = t["fc1.weight"].chunk(n)
        fc1_bias = t["fc1.bias"].chunk(n)
        out = {}
        for i in range(n):
            out[f"paths.{i}.fc1.weight"] = fc1_weight[i]
            out[f"paths.{i}.fc1.bias"] = fc1_bias[i]
            out[f"paths.{i}.fc2.weight"] = t["fc2_weight"][i].t()
            out[f"paths.{i}.fc2.bias"] = t["fc2_bias"][i]
        return out


class _ReferenceLayer(nn.Module):
    """Weight conversion shared by the reference layers: children with ``to_batched`` /
    ``from_batched`` are converted, LayerNorms are copied as they are."""

    def _convert(self, tensors: Tensors, direction: str) -> Tensors:
        out: Tensors = {}
        for name, child in self.named_children():
            sub = _sub(tensors, name + ".")
            _add(out, name + ".", getattr(child, direction)(sub)
                 if hasattr(child, direction) else sub)
        return out

    def batched_state_dict(self) -> Tensors:
        """This layer's weights in the batched layer's layout."""
        return self._convert(self.state_dict(), "to_batched")

    def batched_gradients(self) -> Tensors:
        """Gradients of the parameters, in the batched layer's layout."""
        return self._convert({k: p.grad for k, p in self.named_parameters()}, "to_batched")

    def load_batched_state_dict(self, state_dict: Tensors):
        """Load weights of the batched layer (e.g. ``batched_layer.state_dict()``)."""
        self.load_state_dict(self._convert(state_dict, "from_batched"))
        return self


class ReferenceMultiPathEncoderLayer(_ReferenceLayer):
    """Reference for :class:`multipath_nmt.modules.multipath.MultiPathEncoderLayer`."""

    def __init__(self, embed_dim: int, ffn_dim: int, num_heads: int, num_paths: int,
                 path_norm: bool = True, learnable_weights: bool = True,
                 cheap_features: bool = False, dropout: float = 0.0,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation_fn: Callable = F.relu):
        super().__init__()
        mixer_args = dict(path_norm=path_norm, learnable_weights=learnable_weights,
                          cheap_features=cheap_features, dropout=dropout)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim)
        self.self_attn = ReferenceMultiPathAttention(num_paths, embed_dim, num_heads,
                                                     dropout=attention_dropout)
        self.self_attn_mixer = ReferencePathMixer(num_paths, embed_dim, **mixer_args)
        self.final_layer_norm = nn.LayerNorm(embed_dim)
        self.ffn = ReferenceMultiPathFeedForward(num_paths, embed_dim, ffn_dim, activation_fn,
                                                 activation_dropout)
        self.ffn_mixer = ReferencePathMixer(num_paths, embed_dim, **mixer_args)

    def forward(self, x: Tensor, encoder_padding_mask: Optional[Tensor] = None,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        paths = self.self_attn(self.self_attn_layer_norm(x),
                               key_padding_mask=encoder_padding_mask, attn_mask=attn_mask)
        x = self.self_attn_mixer(paths, x)
        return self.ffn_mixer(self.ffn(self.final_layer_norm(x)), x)


class ReferenceMultiPathDecoderLayer(ReferenceMultiPathEncoderLayer):
    """Reference for :class:`multipath_nmt.modules.multipath.MultiPathDecoderLayer`: the encoder
    layer's sublayers with an encoder-decoder attention sublayer between them (full sequences
    only; the reference has no incremental decoding)."""

    def __init__(self, embed_dim: int, ffn_dim: int, num_heads: int, num_paths: int,
                 path_norm: bool = True, learnable_weights: bool = True,
                 cheap_features: bool = False, dropout: float = 0.0,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation_fn: Callable = F.relu, encoder_embed_dim: Optional[int] = None,
                 no_encoder_attn: bool = False):
        super().__init__(embed_dim, ffn_dim, num_heads, num_paths, path_norm, learnable_weights,
                         cheap_features, dropout, attention_dropout, activation_dropout,
                         activation_fn)
        if no_encoder_attn:
            self.encoder_attn = None
        else:
            self.encoder_attn_layer_norm = nn.LayerNorm(embed_dim)
            self.encoder_attn = ReferenceMultiPathAttention(
                num_paths, embed_dim, num_heads, kdim=encoder_embed_dim,
                dropout=attention_dropout, encoder_decoder_attention=True)
            self.encoder_attn_mixer = ReferencePathMixer(
                num_paths, embed_dim, path_norm=path_norm, learnable_weights=learnable_weights,
                cheap_features=cheap_features, dropout=dropout)

    def forward(self, x: Tensor, encoder_out: Optional[Tensor] = None,
                encoder_padding_mask: Optional[Tensor] = None,
                self_attn_mask: Optional[Tensor] = None,
                self_attn_padding_mask: Optional[Tensor] = None) -> Tensor:
        paths = self.self_attn(self.self_attn_layer_norm(x),
                               key_padding_mask=self_attn_padding_mask, attn_mask=self_attn_mask)
        x = self.self_attn_mixer(paths, x)
        if self.encoder_attn is not None:
            paths = self.encoder_attn(self.encoder_attn_layer_norm(x), encoder_out,
                                      key_padding_mask=encoder_padding_mask)
            x = self.encoder_attn_mixer(paths, x)
        return self.ffn_mixer(self.ffn(self.final_layer_norm(x)), x)
