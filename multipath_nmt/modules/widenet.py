"""WideNet encoder stack (Xue et al. 2022, "Go Wider Instead of Deeper", Sec. 3.2, Eq. 6-8).

One attention and one MoE FFN shared by all L pre-norm layers, an individual pair of LayerNorms
per layer: x' = x + Attn(LN_i^a(x)), x'' = x' + MoE(LN_i^m(x')). Routing groups (Fig. 3): the
L layers form G groups of L / G consecutive layers, and the router of each group's first layer
decides for the whole group, so there are G routing calls; G = L (the default) routes in every
layer, as WideNet does.
"""
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.modules.moe import MoEFeedForward


class FeedForward(nn.Module):
    """The dense Transformer FFN, fc2(dropout(act(fc1(x)))), for the fully shared (ALBERT) ablation."""

    def __init__(self, embed_dim: int, ffn_dim: int, activation_fn: Callable = F.relu,
                 activation_dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.activation_fn = activation_fn
        self.activation_dropout = nn.Dropout(activation_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_dropout(self.activation_fn(self.fc1(x))))


class WideNetEncoderStack(nn.Module):
    """L pre-norm layers over lists of attention / FFN modules of length 1 (shared) or L.

    ``attentions``: modules called as ``attn(query=, key=, value=, key_padding_mask=,
    need_weights=False)`` returning ``(output, weights)`` on [T, B, d] (fairseq's
    MultiheadAttention and ``torch.nn.MultiheadAttention`` both do). ``ffns``: MoEFeedForward or
    dense FFN modules. ``share_layernorm``: one LayerNorm pair for all layers (the ablation).
    ``groups``: the number G of routing groups (None: one per layer).
    """

    def __init__(self, embed_dim: int, num_layers: int, attentions: List[nn.Module],
                 ffns: List[nn.Module], share_layernorm: bool = False,
                 groups: Optional[int] = None, dropout: float = 0.0):
        super().__init__()
        for name, modules in (("attention", attentions), ("FFN", ffns)):
            if len(modules) not in (1, num_layers):
                raise ValueError(f"give one shared {name} module or one per layer "
                                 f"({num_layers}), got {len(modules)}")
        self.is_moe = isinstance(ffns[0], MoEFeedForward)
        if groups is not None and not self.is_moe:
            raise ValueError("routing groups need MoE FFNs; a dense FFN has no router")
        groups = num_layers if groups is None else groups
        if groups < 1 or num_layers % groups:
            raise ValueError(f"the number of routing groups ({groups}) must divide the number "
                             f"of encoder layers ({num_layers})")
        self.num_layers = num_layers
        self.groups = groups
        self.layers_per_group = num_layers // groups
        self.attentions = nn.ModuleList(attentions)
        self.ffns = nn.ModuleList(ffns)
        norms = 1 if share_layernorm else num_layers
        self.attention_layer_norms = nn.ModuleList(nn.LayerNorm(embed_dim) for _ in range(norms))
        self.ffn_layer_norms = nn.ModuleList(nn.LayerNorm(embed_dim) for _ in range(norms))
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def _pick(modules: nn.ModuleList, layer: int) -> nn.Module:
        return modules[layer if len(modules) > 1 else 0]

    def forward(self, x: torch.Tensor, encoder_padding_mask: Optional[torch.Tensor] = None):
        """x: [T, B, d]; encoder_padding_mask: [B, T], True at padding, or None."""
        routing = None
        for layer in range(self.num_layers):
            attention = self._pick(self.attentions, layer)
            h = self._pick(self.attention_layer_norms, layer)(x)
            h, _ = attention(query=h, key=h, value=h, key_padding_mask=encoder_padding_mask,
                             need_weights=False)
            x = x + self.dropout(h)

            ffn = self._pick(self.ffns, layer)
            h = self._pick(self.ffn_layer_norms, layer)(x)
            if self.is_moe:
                if layer % self.layers_per_group == 0:
                    routing = ffn.route(h, encoder_padding_mask)
                h = ffn(h, encoder_padding_mask, routing=routing)
            else:
                h = ffn(h)
            x = x + self.dropout(h)
        return x
