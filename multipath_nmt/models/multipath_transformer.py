"""``multipath_transformer``: the Multi-Path Transformer (Lin et al., 2022) as a fairseq model.

fairseq's TransformerModel with the encoder layers replaced by the batched multi-path layers of
:mod:`multipath_nmt.modules.multipath` (and, with ``--decoder-paths`` > 1, the decoder layers);
embeddings, positions, sharing, LayerDrop and generation stay fairseq's. Pre-norm throughout.

Table 4 of the paper with flags (presets default to "+ Ours"):
  Multi-Path (original)   --path-weights fixed --no-path-norm   (alpha = 1/n, beta = 1)
  + PathNorm              --path-weights fixed                  (alpha = 1/sqrt(n), beta = 1)
  + Learnable Weights     (default)                             (PathNorm, learnable alpha, beta)
  - PathNorm              --no-path-norm
  + More Features         --cheap-features
"""
import logging

from fairseq.distributed import fsdp_wrap
from fairseq.incremental_decoding_utils import with_incremental_state
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerDecoder,
    TransformerEncoder,
    TransformerModel,
    base_architecture,
)
from fairseq.modules.checkpoint_activations import checkpoint_wrapper

from multipath_nmt.arch_table import MULTIPATH_PRESETS
from multipath_nmt.modules import get_activation_fn
from multipath_nmt.modules.multipath import (
    MultiPathAttention,
    MultiPathDecoderLayer,
    MultiPathEncoderLayer,
)

logger = logging.getLogger(__name__)


def _path_options(args):
    return dict(
        path_norm=not args.no_path_norm,
        learnable_weights=args.path_weights == "learnable",
        cheap_features=args.cheap_features,
        dropout=args.dropout,
        attention_dropout=args.attention_dropout,
        # fairseq falls back to --relu-dropout when --activation-dropout is 0.
        activation_dropout=args.activation_dropout or getattr(args, "relu_dropout", 0) or 0.0,
        activation_fn=get_activation_fn(args.activation_fn),
    )


def _wrap(layer, args):
    """fairseq's activation checkpointing and FSDP wrapping, as for its own layers."""
    if getattr(args, "checkpoint_activations", False):
        layer = checkpoint_wrapper(layer, offload_to_cpu=getattr(args, "offload_activations",
                                                                 False))
        return fsdp_wrap(layer, min_num_params=0)
    return fsdp_wrap(layer, min_num_params=getattr(args, "min_params_to_wrap", 1e8))


class FairseqMultiPathEncoderLayer(MultiPathEncoderLayer):
    def upgrade_state_dict_named(self, state_dict, name):
        """Nothing to upgrade: the layer has no older checkpoint formats."""


@with_incremental_state
class FairseqMultiPathDecoderLayer(MultiPathDecoderLayer):
    """fairseq's decoder-layer interface: the layer's cache lives in ``incremental_state``.

    fairseq's decoder gives a full target sequence its causal future mask (and the key padding
    mask if the batch has padding): the self-attention runs with ``is_causal`` and no mask
    instead, when the padding is known to be trailing (``self_attn_padding_is_trailing``, set
    from the task by :func:`multipath_nmt.fairseq_patches.attention.mark_decoder_self_attention`),
    so fused attention kernels can run (see :mod:`multipath_nmt.fairseq_patches.attention` for
    why it is exact)."""

    self_attn_padding_is_trailing = False

    def forward(self, x, encoder_out=None, encoder_padding_mask=None, incremental_state=None,
                prev_self_attn_state=None, prev_attn_state=None, self_attn_mask=None,
                self_attn_padding_mask=None, need_attn=False, need_head_weights=False):
        if prev_self_attn_state is not None or prev_attn_state is not None:
            raise NotImplementedError("multi-path decoder layers take no prev_*_attn_state")
        cache = None
        if incremental_state is not None:
            cache = self.get_incremental_state(incremental_state, "cache")
            if cache is None:
                cache = {}
                self.set_incremental_state(incremental_state, "cache", cache)
        causal = (self_attn_mask is not None and cache is None
                  and (self_attn_padding_mask is None or self.self_attn_padding_is_trailing))
        if causal:
            self_attn_mask = self_attn_padding_mask = None
        x = super().forward(x, encoder_out, encoder_padding_mask, self_attn_mask=self_attn_mask,
                            self_attn_padding_mask=self_attn_padding_mask, cache=cache,
                            self_attn_is_causal=causal)
        # No attention weights: multi-path layers have n x heads of them and no alignment head.
        return x, None, None

    def reorder_incremental_state(self, incremental_state, new_order):
        # each attention reorders its own cache: the encoder-decoder attention's keys/values
        # are kept per sentence in beam search and stay in place while sentences keep their beams
        cache = self.get_incremental_state(incremental_state, "cache")
        if cache is not None:
            for name, states in cache.items():
                getattr(self, name).reorder_cache(states, new_order)


# The key of the encoder output under which reorder_encoder_out keeps the hypotheses per sentence
# of the search (see MultiPathTransformerModel.set_beam_size).
BEAM_SIZE = "beam_size"


class MultiPathTransformerEncoder(TransformerEncoder):
    def build_encoder_layer(self, cfg):
        args = self.args
        return _wrap(FairseqMultiPathEncoderLayer(
            args.encoder_embed_dim, args.encoder_ffn_embed_dim, args.encoder_attention_heads,
            args.encoder_paths, **_path_options(args)), args)

    def reorder_encoder_out(self, encoder_out, new_order):
        """fairseq's reorder, plus the hypotheses per sentence (``encoder_out["beam_size"]``, 1
        for the encoder's own output): multiplied by the rows per row when ``new_order`` is
        longer than the batch (the search expanding each sentence to its beams), kept when it
        is not (beams reordered, finished sentences leaving). From shapes only."""
        reordered = super().reorder_encoder_out(encoder_out, new_order)
        beam_size = encoder_out.get(BEAM_SIZE, [1])[0]
        if encoder_out["encoder_out"]:
            rows = encoder_out["encoder_out"][0].size(1)
            if new_order.numel() > rows:
                beam_size *= new_order.numel() // rows
        reordered[BEAM_SIZE] = [beam_size]
        return reordered


class MultiPathTransformerDecoder(TransformerDecoder):
    # per-sentence encoder keys/values in beam search (MultiPathTransformerModel.set_beam_size)
    share_encoder_rows = True

    def build_decoder_layer(self, cfg, no_encoder_attn=False):
        args = self.args
        if args.decoder_paths == 1:
            return super().build_decoder_layer(cfg, no_encoder_attn)
        return _wrap(FairseqMultiPathDecoderLayer(
            args.decoder_embed_dim, args.decoder_ffn_embed_dim, args.decoder_attention_heads,
            args.decoder_paths, encoder_embed_dim=args.encoder_embed_dim,
            no_encoder_attn=no_encoder_attn, **_path_options(args)), args)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         **kwargs):
        """fairseq's, with the multi-path encoder-decoder attentions told how many rows of an
        incremental decoding step are the beams of one sentence: the encoder output's
        ``beam_size`` (see :meth:`MultiPathTransformerEncoder.reorder_encoder_out`), set at every
        call, so no search inherits the grouping of an earlier one."""
        if incremental_state is not None:
            beam_size = 1
            if self.share_encoder_rows and encoder_out is not None:
                beam_size = encoder_out.get(BEAM_SIZE, [1])[0]
            for module in self.modules():
                if isinstance(module, MultiPathAttention) and module.encoder_decoder_attention:
                    module.set_beam_size(beam_size)
        return super().extract_features(prev_output_tokens, encoder_out, incremental_state,
                                        **kwargs)


@register_model("multipath_transformer")
class MultiPathTransformerModel(TransformerModel):
    """The Multi-Path Transformer of Lin et al. (2022) on fairseq's Transformer."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--encoder-paths", type=int, metavar="N",
                            help="paths per encoder sublayer (attention and FFN); 1 is a "
                                 "pre-norm Transformer layer plus path weights/PathNorm")
        parser.add_argument("--decoder-paths", type=int, metavar="N",
                            help="paths per decoder sublayer (self-attention, encoder "
                                 "attention, FFN); 1 (default) keeps fairseq's pre-norm decoder "
                                 "layer and ignores the path flags below")
        parser.add_argument("--no-path-norm", action="store_true",
                            help="no PathNorm (LayerNorm at the end of each path)")
        parser.add_argument("--path-weights", choices=["learnable", "fixed"],
                            help="learnable: path weights alpha start at 1/sqrt(2n) and the "
                                 "residual weight beta at 1, both trained; fixed: beta = 1 and "
                                 "alpha = 1/m without PathNorm (plain average, the original "
                                 "multi-path model) or 1/sqrt(m) with PathNorm (unit-variance "
                                 "sum), m = number of summed features (n, or 2n with "
                                 "--cheap-features)")
        parser.add_argument("--cheap-features", action="store_true",
                            help="add the n averages of n-1 paths as extra features, each with "
                                 "its own PathNorm and weight (Eq. 7; none for n = 2)")

    @classmethod
    def build_model(cls, args, task):
        multipath_transformer(args)
        for flag in ("encoder_paths", "decoder_paths"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(args, flag)}")
        if getattr(args, "fp16", False) and args.path_weights == "learnable":
            logger.warning(
                "training a multi-path model with --fp16: the gradients of the path and "
                "residual weights (alpha, beta) sum over every token and channel and overflow "
                "fp16 at a loss scale several times below the rest of the model's; --amp keeps "
                "them in fp32 (docs/fidelity.md, 'Architecture and GPU-scale numerics')")
        return super().build_model(args, task)

    def set_beam_size(self, beam_size):
        """Called by fairseq's SequenceGenerator before beam search: with a beam size above 1 the
        multi-path encoder-decoder attentions keep the encoder's keys/values once per sentence
        (fairseq's own decoder layers keep theirs per hypothesis, as in stock fairseq); 1 keeps
        them per hypothesis.

        The number of beams per sentence is not taken from here: fairseq calls this only for
        beam sizes above 1 (``EnsembleModel.set_decoder_beam_size``), so a model that searched
        with beam 4 would still group a beam-1 search's rows by 4 and treat 4 sentences as one
        sentence's beams. Every search derives it from shapes instead: the encoder output counts
        the beams it was expanded to (:meth:`MultiPathTransformerEncoder.reorder_encoder_out`)
        and the decoder gives that number to its attentions at every incremental step
        (:meth:`MultiPathTransformerDecoder.extract_features`)."""
        self.decoder.share_encoder_rows = beam_size > 1

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return MultiPathTransformerEncoder(args, src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, args, tgt_dict, embed_tokens):
        return MultiPathTransformerDecoder(
            args, tgt_dict, embed_tokens, no_encoder_attn=getattr(args, "no_cross_attention",
                                                                  False))


@register_model_architecture("multipath_transformer", "multipath_transformer")
def multipath_transformer(args):
    """Transformer-base sizes, pre-norm, 2 encoder paths with PathNorm and learnable weights."""
    args.encoder_paths = getattr(args, "encoder_paths", 2)
    args.decoder_paths = getattr(args, "decoder_paths", 1)
    args.no_path_norm = getattr(args, "no_path_norm", False)
    args.path_weights = getattr(args, "path_weights", "learnable")
    args.cheap_features = getattr(args, "cheap_features", False)
    args.encoder_normalize_before = getattr(args, "encoder_normalize_before", True)
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)
    base_architecture(args)


@register_model_architecture("multipath_transformer", "multipath_transformer_wmt_en_de")
def multipath_transformer_wmt_en_de(args):
    """The paper's full method: 6 encoder layers, 2 paths, PathNorm, learnable weights."""
    multipath_transformer(args)


def _register_preset(layers, paths):
    @register_model_architecture("multipath_transformer",
                                 f"multipath_l{layers}_p{paths}_wmt_en_de")
    def preset(args):
        args.encoder_layers = getattr(args, "encoder_layers", layers)
        args.encoder_paths = getattr(args, "encoder_paths", paths)
        multipath_transformer(args)

    return preset


# The multi-path systems of Table 2 / Table 3 (the arch table's presets).
for _layers, _paths in MULTIPATH_PRESETS:
    _register_preset(_layers, _paths)
