"""The Multi-Path Transformer as a ``transformers`` model: M2M100 (fairseq's pre-norm Transformer,
its decoder, cache and ``generate()``) with the encoder layers replaced by this package's
:class:`~multipath_nmt.modules.multipath.MultiPathEncoderLayer`.

This file is the source of the remote code that ``multipath-export-hf`` writes next to the
weights (``modeling_multipath.py``, loaded with ``trust_remote_code=True``): the export copies it,
``multipath_nmt/modules/multipath.py`` and ``multipath_nmt/modules/__init__.py`` into the model
folder and points the two imports below at the copies (:func:`multipath_nmt.hf_export.remote_code`),
so the exported model computes the package's equations from the package's own source.
"""
from transformers import M2M100Config, M2M100ForConditionalGeneration

from multipath_nmt.modules import get_activation_fn
from multipath_nmt.modules.multipath import MultiPathEncoderLayer


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
    states, the 4-D additive attention mask M2M100's encoder builds from the padding (eager and
    sdpa attention; it broadcasts over the paths' heads), a tuple back. The parameter names are
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
                output_attentions=False):
        if layer_head_mask is not None or output_attentions:
            raise ValueError("a multi-path encoder layer takes no head mask and returns no "
                             "attention weights")
        x = super().forward(hidden_states.transpose(0, 1), attn_mask=attention_mask)
        return x.transpose(0, 1), None


class MultiPathM2M100ForConditionalGeneration(M2M100ForConditionalGeneration):
    """M2M100 for translation with multi-path encoder layers (``config.encoder_paths`` paths per
    sublayer)."""

    config_class = MultiPathM2M100Config
    _no_split_modules = ["M2M100MultiPathEncoderLayer", "M2M100DecoderLayer"]
    _supports_flash_attn = False
    _supports_flex_attn = False

    def __init__(self, config):
        super().__init__(config)
        encoder = self.model.encoder
        encoder.layers = type(encoder.layers)(
            M2M100MultiPathEncoderLayer(config) for _ in range(config.encoder_layers))
