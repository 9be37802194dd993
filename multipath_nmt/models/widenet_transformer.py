"""WideNet (Xue et al. 2022, "Go Wider Instead of Deeper") as a fairseq encoder-decoder.

The encoder shares one self-attention and one top-k MoE FFN across all its layers and keeps an
individual pair of LayerNorms per layer (pre-norm); the decoder is fairseq's pre-norm
TransformerDecoder. Ablations: ``--share-layernorm``, ``--no-moe`` (ALBERT-like full sharing with
a dense FFN), ``--no-share`` (a separate attention and MoE FFN per layer: an ordinary MoE
Transformer with an MoE in every layer).

Multi-GPU: expert weights are stored batched ([E, d, ffn]) and the router gets its gradient
through the gates, so every parameter has a gradient on every step even when an expert receives
no token; shared parameters used L times accumulate their gradient before DDP's hook fires. So
fairseq's default ``--ddp-backend pytorch_ddp`` works without ``--find-unused-parameters``.

Routing statistics never outlive their training step, whatever the criterion
(:func:`~multipath_nmt.modules.moe.release_routing_stats_every_step`), and the expert capacity
applies at inference only with ``--moe-capacity-at-inference``.
"""
import copy

from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerEncoder,
    TransformerModel,
    base_architecture,
    transformer_wmt_en_de,
)
from fairseq.modules import MultiheadAttention

from multipath_nmt.models.routing_flags import add_routing_args, set_routing_defaults
from multipath_nmt.modules import get_activation_fn
from multipath_nmt.modules.moe import (
    MoEFeedForward,
    check_routing_config,
    release_routing_stats_every_step,
    set_capacity_at_inference,
)
from multipath_nmt.modules.widenet import FeedForward, WideNetEncoderStack


def check_widenet_args(args):
    """Reject impossible settings when the model is built, naming the flag to fix."""
    layers = args.encoder_layers
    groups = routing_groups(args)
    if args.no_moe:
        if args.moe_routing_groups is not None:
            raise ValueError("--moe-groups needs a router, but --no-moe uses a dense FFN")
    else:
        try:
            check_routing_config(args.moe_experts, args.moe_top_k, args.moe_capacity_factor)
        except ValueError as error:
            raise ValueError(f"WideNet: {error} (--moe-experts {args.moe_experts}, "
                             f"--moe-top-k {args.moe_top_k}, --moe-capacity-factor "
                             f"{args.moe_capacity_factor})") from None
    if groups < 1 or layers % groups:
        raise ValueError(f"--moe-groups {groups} must divide --encoder-layers {layers}: it is "
                         f"the number of routing groups, each of --encoder-layers / "
                         f"--moe-groups consecutive layers")
    if args.no_share and groups != layers:
        raise ValueError("--moe-groups below --encoder-layers with --no-share would leave the "
                         "routers of all but the first layer of each group without gradients; "
                         "use one of the two")
    if getattr(args, "encoder_layerdrop", 0) > 0:
        raise ValueError("WideNet runs its shared encoder layers as one module: "
                         "--encoder-layerdrop is not supported")
    if getattr(args, "checkpoint_activations", False):
        raise ValueError("WideNet does not support --checkpoint-activations: recomputing the "
                         "encoder would record its routing statistics twice")


class WideNetStack(WideNetEncoderStack):
    def upgrade_state_dict_named(self, state_dict, name):
        """fairseq calls this on every encoder layer when loading; WideNet has no old format."""


class WideNetEncoder(TransformerEncoder):
    def __init__(self, args, dictionary, embed_tokens):
        # fairseq builds ``encoder_layers`` layers through build_encoder_layer; the WideNet stack
        # is ONE module that runs all layers (a group's shared routing decision never leaves one
        # call), so the base class is asked for exactly one layer. (A deep copy: ``args`` is a
        # TransformerConfig whose nested encoder config a shallow copy would share.)
        self.widenet_args = args
        one_layer = copy.deepcopy(args)
        one_layer.encoder_layers = 1
        super().__init__(one_layer, dictionary, embed_tokens)
        self.args = args

    def build_encoder_layer(self, cfg):
        args = self.widenet_args
        layers = args.encoder_layers
        dim, ffn_dim = cfg.encoder.embed_dim, cfg.encoder.ffn_embed_dim
        copies = layers if args.no_share else 1
        activation_fn = get_activation_fn(cfg.activation_fn)
        # as fairseq's encoder layer: --relu-dropout is the old name of --activation-dropout
        activation_dropout = cfg.activation_dropout or cfg.relu_dropout or 0.0
        attentions = [MultiheadAttention(dim, cfg.encoder.attention_heads,
                                         dropout=cfg.attention_dropout, self_attention=True)
                      for _ in range(copies)]
        if args.no_moe:
            ffns = [FeedForward(dim, ffn_dim, activation_fn, activation_dropout)]
        else:
            ffns = [MoEFeedForward(dim, ffn_dim, args.moe_experts, args.moe_top_k,
                                   args.moe_capacity_factor, activation_fn, activation_dropout)
                    for _ in range(copies)]
        return WideNetStack(dim, layers, attentions, ffns, share_layernorm=args.share_layernorm,
                            groups=None if args.no_moe else routing_groups(args),
                            dropout=cfg.dropout)


@register_model("widenet_transformer")
class WideNetTransformerModel(TransformerModel):
    @staticmethod
    def add_args(parser):
        TransformerModel.add_args(parser)
        add_routing_args(parser)
        parser.add_argument("--moe-groups", type=int, metavar="G", dest="moe_routing_groups",
                            help="number of routing groups (WideNet Fig. 3): the encoder layers "
                                 "form G groups of --encoder-layers / G consecutive layers, each "
                                 "routed once by its first layer; must divide --encoder-layers "
                                 "(default: --encoder-layers, a routing call in every layer)")
        parser.add_argument("--share-layernorm", action="store_true",
                            help="ablation: one LayerNorm pair for all encoder layers instead "
                                 "of an individual pair per layer")
        parser.add_argument("--no-moe", action="store_true",
                            help="ablation: share a dense FFN instead of the MoE (ALBERT-like "
                                 "full sharing)")
        parser.add_argument("--no-share", action="store_true",
                            help="ablation: a separate attention and MoE FFN in every encoder "
                                 "layer (an MoE Transformer without parameter sharing)")

    @classmethod
    def build_model(cls, args, task):
        _widenet_defaults(args)  # checkpoints of older versions may lack a flag
        check_widenet_args(args)
        model = super().build_model(args, task)
        release_routing_stats_every_step(model)
        set_capacity_at_inference(model, args.moe_capacity_at_inference)
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return WideNetEncoder(args, src_dict, embed_tokens)


def routing_groups(args) -> int:
    """The number G of routing groups. Checkpoints saved before --moe-groups counted groups
    stored ``moe_groups``, the number of layers per group."""
    if getattr(args, "moe_routing_groups", None) is not None:
        return args.moe_routing_groups
    layers_per_group = getattr(args, "moe_groups", 1)
    if layers_per_group < 1 or args.encoder_layers % layers_per_group:
        raise ValueError(f"this checkpoint's moe_groups {layers_per_group} (layers per routing "
                         f"group) does not divide its {args.encoder_layers} encoder layers")
    return args.encoder_layers // layers_per_group


def _widenet_defaults(args):
    set_routing_defaults(args)
    args.moe_routing_groups = getattr(args, "moe_routing_groups", None)
    args.share_layernorm = getattr(args, "share_layernorm", False)
    args.no_moe = getattr(args, "no_moe", False)
    args.no_share = getattr(args, "no_share", False)
    # WideNet is a pre-norm model: its per-layer LayerNorms sit before attention and FFN.
    args.encoder_normalize_before = True
    args.decoder_normalize_before = getattr(args, "decoder_normalize_before", True)


@register_model_architecture("widenet_transformer", "widenet_transformer")
def widenet_transformer(args):
    _widenet_defaults(args)
    base_architecture(args)


@register_model_architecture("widenet_transformer", "widenet_transformer_wmt_en_de")
def widenet_transformer_wmt_en_de(args):
    # Transformer-base sizes (6 layers, d 512, FFN 2048 per expert, 8 heads) with WideNet's
    # routing defaults (E 4, top-2, C 1.2): one shared layer's worth of attention and
    # 4 FFNs' worth of experts replace 6 layers of encoder parameters.
    _widenet_defaults(args)
    transformer_wmt_en_de(args)
