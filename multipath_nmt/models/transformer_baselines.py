"""The paper's baselines as architectures of fairseq's own ``transformer`` model.

Lin et al. (2022) compare against a pre-norm Transformer-base, deep pre-norm encoders with a
6-layer decoder ("Transformer-deep", 12-48 encoder layers) and a wide model (Fig. 1). They are
stock fairseq models, so checkpoints load in plain fairseq and benchmarks compare like with like.
"""
from fairseq.models import register_model_architecture
from fairseq.models.transformer import transformer_wmt_en_de

from multipath_nmt.arch_table import DEEP_ENCODER_LAYERS, WIDE


@register_model_architecture("transformer", "transformer_prenorm_wmt_en_de")
def transformer_prenorm_wmt_en_de(args):
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    transformer_wmt_en_de(args)


def _register_deep(layers):
    @register_model_architecture("transformer", f"transformer_deep{layers}_wmt_en_de")
    def deep(args):
        args.encoder_layers = getattr(args, "encoder_layers", layers)
        transformer_prenorm_wmt_en_de(args)

    return deep


for _layers in DEEP_ENCODER_LAYERS:
    _register_deep(_layers)


@register_model_architecture("transformer", "transformer_wide_wmt_en_de")
def transformer_wide_wmt_en_de(args):
    # Fig. 1's wide baseline: every matrix dimension of the base model doubled (the arch table's
    # WIDE: d 1024, FFN 4096; 16 heads of 64).
    args.encoder_embed_dim = getattr(args, "encoder_embed_dim", WIDE.dim)
    args.encoder_ffn_embed_dim = getattr(args, "encoder_ffn_embed_dim", WIDE.ffn)
    args.encoder_attention_heads = getattr(args, "encoder_attention_heads", 16)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", WIDE.dim)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", WIDE.ffn)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 16)
    transformer_prenorm_wmt_en_de(args)
