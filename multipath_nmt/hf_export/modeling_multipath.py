"""The Multi-Path Transformer as a ``transformers`` model: M2M100 (fairseq's pre-norm Transformer,
its decoder, cache and ``generate()``) with the encoder layers replaced by this package's
:class:`~multipath_nmt.modules.multipath.MultiPathEncoderLayer`.

This file is the source of the remote code that ``multipath-export-hf`` writes next to the
weights (``modeling_multipath.py``, loaded with ``trust_remote_code=True``): the export copies it,
``multipath_nmt/modules/multipath.py`` and ``multipath_nmt/modules/__init__.py`` into the model
folder and points the two imports below at the copies (:func:`multipath_nmt.hf_export.remote_code`),
so the exported model computes the package's equations from the package's own source.
"""
import torch
import transformers
from torch import nn
from transformers import M2M100Config, M2M100ForConditionalGeneration
from transformers.models.m2m_100.modeling_m2m_100 import M2M100Encoder

from multipath_nmt.modules import get_activation_fn
from multipath_nmt.modules.multipath import MultiPathEncoderLayer, PathMixer, others_matrix

# M2M100's encoder reads a layer's output as a tuple (hidden states, attention weights) up to
# transformers 4.x and as the hidden states themselves from 5.0 on.
_LAYERS_RETURN_TENSORS = int(transformers.__version__.split(".")[0]) >= 5


class MultiPathM2M100Config(M2M100Config):
    """M2M100's settings plus the encoder's paths: ``encoder_paths``, ``path_norm``,
    ``learnable_weights``, ``cheap_features`` (the options of ``multipath_transformer``) and
    ``fairseq_activation_fn`` (fairseq's name of the FFN activation, the function of
    :func:`multipath_nmt.modules.get_activation_fn`)."""

    model_type = "multipath_m2m100"

    def __init__(self, encoder_paths=2, path_norm=True, learnable_weights=True,
                 cheap_features=False, fairseq_activation_fn="relu", **kwargs):
        self.encoder_paths = encoder_paths
        self.path_norm = path_norm
        self.learnable_weights = learnable_weights
        self.cheap_features = cheap_features
        self.fairseq_activation_fn = fairseq_activation_fn
        super().__init__(**kwargs)


class M2M100MultiPathEncoderLayer(MultiPathEncoderLayer):
    """The multi-path encoder layer behind M2M100's encoder-layer interface: batch-first hidden
    states, the 4-D attention mask M2M100's encoder builds from the padding (additive in
    transformers 4, boolean with True = attend in 5; it broadcasts over the paths' heads), and the
    output in the form the installed transformers reads. The parameter names are
    the fairseq layer's, so the checkpoint's weights load as they are."""

    def __init__(self, config):
        super().__init__(config.d_model, config.encoder_ffn_dim, config.encoder_attention_heads,
                         config.encoder_paths, path_norm=config.path_norm,
                         learnable_weights=config.learnable_weights,
                         cheap_features=config.cheap_features, dropout=config.dropout,
                         attention_dropout=config.attention_dropout,
                         activation_dropout=config.activation_dropout,
                         activation_fn=get_activation_fn(config.fairseq_activation_fn))

    def forward(self, hidden_states, attention_mask=None, layer_head_mask=None,
                output_attentions=False, **kwargs):
        # transformers 5 passes its attention kwargs (use_cache, ...) to every layer; none
        # of them changes an encoder layer without head masks or returned attention weights
        if layer_head_mask is not None or output_attentions:
            raise ValueError("a multi-path encoder layer takes no head mask and returns no "
                             "attention weights")
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            attention_mask = ~attention_mask  # transformers 5: True attends; the layer: True masks
        x = super().forward(hidden_states.transpose(0, 1), attn_mask=attention_mask)
        x = x.transpose(0, 1)
        return x if _LAYERS_RETURN_TENSORS else (x, None)


class MultiPathM2M100Encoder(M2M100Encoder):
    """M2M100's encoder with multi-path layers."""

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(M2M100MultiPathEncoderLayer(config)
                                    for _ in range(config.encoder_layers))

    def _init_weights(self, module):
        # transformers 5 builds a model without memory, loads the weights file and fills the
        # rest through this hook: the cheap features' pattern is such a buffer (never saved)
        super()._init_weights(module)
        if isinstance(module, PathMixer) and module.others_matrix is not None:
            with torch.no_grad():
                module.others_matrix.copy_(others_matrix(module.num_paths))


class MultiPathM2M100ForConditionalGeneration(M2M100ForConditionalGeneration):
    """M2M100 for translation with multi-path encoder layers (``config.encoder_paths`` paths per
    sublayer)."""

    config_class = MultiPathM2M100Config
    _no_split_modules = ["M2M100MultiPathEncoderLayer", "M2M100DecoderLayer"]
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config):
        super().__init__(config)
        encoder = MultiPathM2M100Encoder(config)
        encoder.embed_tokens = self.model.encoder.embed_tokens  # the shared embeddings
        self.model.encoder = encoder
