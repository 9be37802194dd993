"""Decoder self-attention without a mask tensor, so fused attention kernels (flash) can run.

What is patched, and why:

* ``fairseq.modules.multihead_attention.MultiheadAttention.forward`` (fairseq 0.12.3). Its
  training path hands torch's ``F.multi_head_attention_forward`` the decoder's causal future
  mask as a float [T, T] tensor and, when the batch has padding, the key padding mask; torch
  merges the two into one float mask of B x heads x T x T and calls
  ``scaled_dot_product_attention`` with it, which rules out flash attention (it takes no mask
  tensor, only ``is_causal``). A self-attention marked by :func:`mark_decoder_self_attention`
  now calls ``F.multi_head_attention_forward`` with ``is_causal=True`` (torch >= 2.0; torch then
  passes no mask to ``scaled_dot_product_attention``) and no key padding mask, when the padding
  is trailing. The marked encoder-decoder attention of a full sequence took fairseq's own
  softmax path (its ``static_kv`` flag, which only matters for incremental decoding, excluded
  it from the fused path): it now takes the ``F.multi_head_attention_forward`` path too, with
  no mask when the source has no padding. Calls that return attention weights (fairseq's last
  decoder layer returns its cross-attention as the alignment), incremental decoding and every
  attention not marked go to fairseq's forward unchanged.
* ``fairseq.models.transformer.TransformerModelBase.build_model``: marks the decoder
  attentions of every model it builds (fairseq's ``transformer`` and the plug-in's models
  built on it), reading the padding side from the task (``--left-pad-target``). Only these
  change: a model built otherwise (RoBERTa's encoder-decoder, whose fairseq test wants
  incremental decoding bit-equal to a full pass, which SDPA's other summation order is not)
  runs fairseq's attention.

TorchScript: ``torch.jit.script`` of a model (or of fairseq's ``SequenceGenerator``) compiles
fairseq's own forward, not the dispatch: the wrapper's first branch, under
``torch.jit.is_scripting()``, calls ``MultiheadAttention.fairseq_forward`` (fairseq's
function under a second name) and TorchScript compiles that branch only. A scripted model is
fairseq's scripted model, without the SDPA dispatch (``tests/test_attention.py``,
``docs/serving.md``).

Why it is exact: fairseq's decoder passes a self-attention mask only for a full target sequence
(none while decoding incrementally), and that mask is its causal future mask. With the padding
at the end of each target (fairseq's default, right-padded targets), a padded key j is only
visible to queries t >= j, which are padding too: every non-padded position attends to exactly
the keys it attended to before, and the padded positions' outputs are excluded by the loss
(``ignore_index``). With --left-pad-target, a padded batch keeps both masks.
``tests/test_attention.py`` checks outputs and gradients against fairseq's own path in float64
on the CPU, and :func:`multipath_nmt.benchmark.attention_calls.attention_calls` (printed by
``scripts/gpu-check.sh``) shows which mask each attention call site passes.

Tested with fairseq 0.12.3 and torch 2.13.

Reach beyond the plug-in's own models: models built by ``TransformerModelBase.build_model``,
fairseq's own ``transformer`` included, take this path (fairseq's numbers up to summation order), so
"stock" in our benchmark is fairseq plus this dispatch (not narrowed: the benchmark compares every
system on one attention kernel).
Does nothing when: an attention not marked by ``build_model`` (RoBERTa, a decoder built directly),
incremental decoding, calls returning weights, TorchScript.
"""
import functools
import types
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fairseq.modules.transformer_layer import TransformerDecoderLayerBase

from multipath_nmt.fairseq_patches.wrapping import wrap

# fairseq's MultiheadAttention.forward under the name TorchScript compiles (see _causal_forward)
FAIRSEQ_FORWARD = "fairseq_forward"


def padding_is_trailing(task) -> bool:
    """Whether ``task`` pads targets at their end (translation unless --left-pad-target);
    False when the task does not say."""
    cfg = getattr(task, "cfg", None) or getattr(task, "args", None)
    left_pad_target = getattr(cfg, "left_pad_target", None)
    return left_pad_target is not None and not left_pad_target


def mark_decoder_self_attention(decoder, trailing_padding: bool):
    """Tell the self-attentions of ``decoder``'s layers that the mask they get from fairseq's
    decoder is its causal future mask, and whether padded targets are padded at the end; and
    let its encoder-decoder attentions take the SDPA path for a full sequence. Attentions not
    marked (models not built by ``TransformerModelBase.build_model``: RoBERTa's encoder-decoder,
    speech models, a MultiheadAttention of one's own) run fairseq's forward unchanged."""
    for module in decoder.modules():
        if isinstance(module, TransformerDecoderLayerBase):
            if module.encoder_attn is not None:
                module.encoder_attn.full_sequence_takes_sdpa = True
            if module.cross_self_attention:
                continue
            module.self_attn.mask_is_causal = True
            module.self_attn.padding_is_trailing = trailing_padding
        elif hasattr(module, "self_attn_padding_is_trailing"):  # multi-path decoder layers
            module.self_attn_padding_is_trailing = trailing_padding


def _fused_path_allowed(attention, query, incremental_state, need_weights, before_softmax,
                        need_head_weights) -> bool:
    """The conditions of fairseq's F.multi_head_attention_forward path other than static_kv:
    a full sequence (no incremental state), no attention weights returned."""
    return (incremental_state is None
            and not (need_weights or need_head_weights or before_softmax)
            and not attention.onnx_trace and query.device.type != "xla"
            and not attention.skip_embed_dim_check and not attention.use_xformers)


def _plug_in_forward(self, fairseq_forward, query, key, value, key_padding_mask,
                     incremental_state, need_weights, static_kv, attn_mask, before_softmax,
                     need_head_weights):
    """The eager dispatch: fairseq's forward unchanged (an attention not marked by
    :func:`mark_decoder_self_attention`, incremental decoding, attention weights returned), with
    static_kv off for a marked encoder-decoder attention of a full sequence, or
    ``F.multi_head_attention_forward`` with ``is_causal=True`` for a marked self-attention."""
    marked = (getattr(self, "mask_is_causal", False)
              or getattr(self, "full_sequence_takes_sdpa", False))
    if not marked or not _fused_path_allowed(self, query, incremental_state, need_weights,
                                             before_softmax, need_head_weights):
        return fairseq_forward(self, query, key, value, key_padding_mask, incremental_state,
                               need_weights, static_kv, attn_mask, before_softmax,
                               need_head_weights)
    causal = (getattr(self, "mask_is_causal", False) and attn_mask is not None
              and (key_padding_mask is None or self.padding_is_trailing)
              and key is not None and key.size(0) == query.size(0)
              and self.bias_k is None and not self.add_zero_attn)
    if not causal:
        # static_kv only selects the cached encoder keys in incremental decoding; without an
        # incremental state, fairseq's encoder-decoder attention takes its
        # F.multi_head_attention_forward path (scaled_dot_product_attention) with static_kv
        # off, instead of computing the softmax itself
        return fairseq_forward(self, query, key, value, key_padding_mask, None, False, False,
                               attn_mask, False, False)
    # fairseq's own call with is_causal=True and no key padding mask (torch requires the
    # mask as a hint with is_causal and then drops it)
    return F.multi_head_attention_forward(
        query, key, value, self.embed_dim, self.num_heads, torch.empty([0]),
        torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)), self.bias_k,
        self.bias_v, self.add_zero_attn, self.dropout_module.p, self.out_proj.weight,
        self.out_proj.bias, self.training or self.dropout_module.apply_during_inference,
        None, False, attn_mask, use_separate_proj_weight=True,
        q_proj_weight=self.q_proj.weight, k_proj_weight=self.k_proj.weight,
        v_proj_weight=self.v_proj.weight, is_causal=True)


def _causal_forward(fairseq_forward):
    # TorchScript compiles this function from its source, with fairseq's signature and types.
    # torch.jit.is_scripting() is a constant there: only the first branch is compiled, a call
    # of fairseq's own forward (FAIRSEQ_FORWARD, the same function under another name, since a
    # scripted class cannot define "forward" twice), so a scripted model is fairseq's. The
    # wrapper has no __wrapped__: TorchScript (inspect.getsource) would follow it to fairseq's
    # source and resolve its names in this module.
    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
                need_weights: bool = True, static_kv: bool = False,
                attn_mask: Optional[Tensor] = None, before_softmax: bool = False,
                need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        if torch.jit.is_scripting():
            return self.fairseq_forward(query, key, value, key_padding_mask, incremental_state,
                                        need_weights, static_kv, attn_mask, before_softmax,
                                        need_head_weights)
        return _plug_in_forward(self, fairseq_forward, query, key, value, key_padding_mask,
                                incremental_state, need_weights, static_kv, attn_mask,
                                before_softmax, need_head_weights)

    forward.__doc__ = fairseq_forward.__doc__
    return forward


def renamed(function, name):
    """A copy of ``function`` (same code, globals, defaults, annotations) called ``name``."""
    copy = types.FunctionType(function.__code__, function.__globals__, name,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__annotations__ = dict(function.__annotations__)
    copy.__module__, copy.__doc__ = function.__module__, function.__doc__
    copy.__qualname__ = function.__qualname__.rpartition(".")[0] + "." + name
    return copy


def _marking_decoder_self_attention(fairseq_build_model):
    @functools.wraps(fairseq_build_model)
    def build_model(cls, cfg, task):
        model = fairseq_build_model(cls, cfg, task)
        mark_decoder_self_attention(model.decoder, padding_is_trailing(task))
        return model

    return build_model


def install():
    from fairseq.models.transformer import TransformerModelBase
    from fairseq.modules.multihead_attention import MultiheadAttention

    fairseq_forward = MultiheadAttention.forward
    if wrap(MultiheadAttention, "forward", _causal_forward):
        # what the wrapper calls under TorchScript
        setattr(MultiheadAttention, FAIRSEQ_FORWARD, renamed(fairseq_forward, FAIRSEQ_FORWARD))
    wrap(TransformerModelBase, "build_model", _marking_decoder_self_attention)
