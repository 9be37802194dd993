"""``moe_transformer``: a pre-norm Transformer whose encoder FFNs can be MoE, EWA or ParameterNet.

Everything except the FFN sub-block of the chosen encoder layers is fairseq's own
``transformer`` (same modules, same state-dict keys), so an EWA model folds into a stock
``transformer`` checkpoint (``multipath-convert-ewa``).

- ``--encoder-ffn moe``: a top-k routed MoE FFN every ``--encoder-moe-freq`` layers (WideNet's
  MoE layer, :class:`~multipath_nmt.modules.moe.MoEFeedForward`).
- ``--encoder-ffn ewa``: Experts Weights Averaging (Huang et al., 2023) in the layers chosen by
  ``--ewa-layers``; the averaging runs after every optimizer step
  (:mod:`multipath_nmt.ewa.training`, called by :mod:`multipath_nmt.fairseq_patches.ewa_trainer`).
  ``--ewa-stop-at F`` is the paper's "early EWA" (EWA used to improve a naive MoE): the layers are
  top-1 routed MoEs (learned router, capacity, balance loss) that get the EWA update after each of
  the first F * --max-update steps, then train as plain MoEs and stay MoEs at inference (so they
  cannot be folded into a dense FFN). ``--arch ewa_early_transformer_wmt_en_de`` has the paper's
  early-EWA defaults: F = 0.5, a constant share rate, capacity factor 1.05, every other layer.
- ``--encoder-ffn parameternet``: ParameterNet projections (Han et al., 2023) in every layer:
  routed by default (the paper's method for language models, Sec. 4.3 and 5.4: top-1 routing
  without router noise, on the up projection, every router reading the hidden size), or dynamic
  (its vision method: per-sentence mixing of M matrices, on both projections by our choice).
"""
import logging

from fairseq import checkpoint_utils
from fairseq.distributed import fsdp_wrap
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig, TransformerEncoder, TransformerModel
from fairseq.modules.checkpoint_activations import checkpoint_wrapper
from fairseq.modules.transformer_layer import TransformerEncoderLayerBase
from torch import nn

from multipath_nmt.ewa import training as ewa_training
from multipath_nmt.models.routing_flags import (
    DEFAULT_CAPACITY_FACTOR,
    add_routing_args,
    set_routing_defaults,
)
from multipath_nmt.models.transformer_baselines import transformer_prenorm_wmt_en_de
from multipath_nmt.modules import get_activation_fn
from multipath_nmt.modules.ewa import SCHEDULES, EarlyEWAMoE, EWAFeedForward, EWASchedule
from multipath_nmt.modules.moe import (
    MoEFeedForward,
    release_routing_stats_every_step,
    set_capacity_at_inference,
)
from multipath_nmt.modules.parameternet import MODES, PROJECTIONS, ParameterNetFeedForward

logger = logging.getLogger(__name__)

ENCODER_FFNS = ("dense", "moe", "ewa", "parameternet")
EWA_LAYER_PATTERNS = ("every-2", "last-4")
# EWA share rate: the paper tunes it per model within 0.1-0.5 (Sec. 5) and gives no single value
# in its main text; 0.3, the middle of that range, is our choice
DEFAULT_EWA_SHARE_RATE = 0.3


def ewa_layer_indices(pattern, num_layers):
    if pattern == "every-2":
        return [i for i in range(num_layers) if i % 2 == 1]
    if pattern == "last-4":
        return list(range(max(0, num_layers - 4), num_layers))
    raise ValueError(f"unknown --ewa-layers pattern {pattern!r}; choose one of "
                     f"{EWA_LAYER_PATTERNS}")


def special_ffn_layers(args):
    """Indices of the encoder layers whose FFN is replaced."""
    if args.encoder_ffn == "dense":
        return []
    if args.encoder_ffn == "moe":
        return [i for i in range(args.encoder_layers) if (i + 1) % args.encoder_moe_freq == 0]
    if args.encoder_ffn == "ewa":
        return ewa_layer_indices(args.ewa_layers, args.encoder_layers)
    return list(range(args.encoder_layers))


def has_router(args):
    """Whether the swapped FFNs route tokens (moe, early EWA, routed ParameterNet)."""
    return (args.encoder_ffn == "moe"
            or (args.encoder_ffn == "ewa" and args.ewa_stop_at is not None)
            or (args.encoder_ffn == "parameternet" and args.parameternet_mode == "routed"))


def training_stops_elsewhere(args):
    """Whether fairseq-train was given a stop point other than --max-update."""
    return bool(getattr(args, "max_epoch", 0) or getattr(args, "stop_time_hours", 0))


def check_args(args):
    """Fail at build time on impossible settings, with the flag to fix."""
    if args.encoder_ffn not in ENCODER_FFNS:
        raise ValueError(f"unknown --encoder-ffn {args.encoder_ffn!r}; choose one of {ENCODER_FFNS}")
    if getattr(args, "checkpoint_activations", False) and has_router(args):
        raise ValueError("--checkpoint-activations is not supported with routed FFNs (moe, "
                         "early EWA, routed ParameterNet): fairseq runs the checkpointed forward "
                         "without gradients and again in the backward pass, so the load-balance "
                         "loss could not train the router and the routing statistics would be "
                         "recorded twice")
    if args.encoder_ffn == "moe" and args.encoder_moe_freq < 1:
        raise ValueError(f"--encoder-moe-freq must be at least 1, got {args.encoder_moe_freq}")
    if args.encoder_ffn == "ewa":
        if args.ewa_experts < 2:
            raise ValueError(f"--ewa-experts must be at least 2 for EWA, got {args.ewa_experts}")
        ewa_training.check_supported(args)
        ewa_layer_indices(args.ewa_layers, args.encoder_layers)
        schedule = EWASchedule(args.ewa_share_rate, args.ewa_schedule, args.max_update,
                               args.ewa_stop_at)
        if schedule.needs_max_update() and training_stops_elsewhere(args):
            # fairseq-train with --max-epoch or --stop-time-hours (train.sh adds --max-epoch 20)
            # but no --max-update: refused here, before the first update, rather than there.
            # Tools that only build the model (multipath-params) set no stop point at all.
            raise ValueError(schedule.missing_length_message())
        if args.ewa_init_from and args.ewa_stop_at is not None:
            raise ValueError("--ewa-init-from is implemented for EWA layers (random partition), "
                             "not for the routed early-EWA MoE of --ewa-stop-at; drop one of "
                             "the two flags")
    if args.encoder_ffn == "parameternet":
        if args.parameternet_experts < 2:
            raise ValueError(f"--parameternet-experts must be at least 2, got "
                             f"{args.parameternet_experts}")
        if args.parameternet_proj not in PROJECTIONS or args.parameternet_mode not in MODES:
            raise ValueError(f"--parameternet-proj must be one of {PROJECTIONS} and "
                             f"--parameternet-mode one of {MODES}")


def build_ffn(args, embed_dim, ffn_dim):
    """The replacement FFN module (input [T, B, d] and padding mask [B, T])."""
    activation_fn = get_activation_fn(args.activation_fn)
    activation_dropout = args.activation_dropout or getattr(args, "relu_dropout", 0) or 0
    if args.encoder_ffn == "moe":
        return MoEFeedForward(embed_dim, ffn_dim, args.moe_experts, args.moe_top_k,
                              args.moe_capacity_factor, activation_fn, activation_dropout)
    if args.encoder_ffn == "ewa":
        schedule = EWASchedule(args.ewa_share_rate, args.ewa_schedule, args.max_update,
                               args.ewa_stop_at)
        if args.ewa_stop_at is not None:
            return EarlyEWAMoE(embed_dim, ffn_dim, args.ewa_experts, schedule,
                               capacity_factor=args.moe_capacity_factor,
                               activation_fn=activation_fn,
                               activation_dropout=activation_dropout)
        return EWAFeedForward(embed_dim, ffn_dim, args.ewa_experts, schedule, activation_fn,
                              activation_dropout)
    return ParameterNetFeedForward(embed_dim, ffn_dim, args.parameternet_experts,
                                   args.parameternet_proj, args.parameternet_mode, activation_fn,
                                   activation_dropout, args.moe_capacity_factor)


def _identity(x):
    return x


class SwappedFFNEncoderLayer(TransformerEncoderLayerBase):
    """fairseq's encoder layer with the FFN sub-block (fc1 -> activation -> dropout -> fc2)
    replaced by ``self.ffn``, which also sees the padding mask.

    fairseq's forward runs ``fc2(dropout(activation(fc1(x))))``: fc1 becomes a call of ``ffn``
    and the rest identities, so attention, LayerNorms, residuals and dropout stay fairseq's.
    """

    def __init__(self, cfg, ffn_args):
        self._ffn_args = ffn_args
        self._padding_mask = None
        super().__init__(cfg)
        self.activation_fn = _identity
        self.activation_dropout_module = nn.Identity()

    def build_fc1(self, input_dim, output_dim, q_noise, qn_block_size):
        if q_noise > 0:
            raise ValueError("--quant-noise-pq is not supported for MoE/EWA/ParameterNet FFNs")
        self.ffn = build_ffn(self._ffn_args, input_dim, output_dim)
        return self._run_ffn

    def build_fc2(self, input_dim, output_dim, q_noise, qn_block_size):
        return nn.Identity()

    def _run_ffn(self, x):
        return self.ffn(x, self._padding_mask)

    def forward(self, x, encoder_padding_mask, attn_mask=None):
        self._padding_mask = encoder_padding_mask
        try:
            return super().forward(x, encoder_padding_mask, attn_mask)
        finally:
            self._padding_mask = None


class SwappedFFNEncoder(TransformerEncoder):
    """fairseq's TransformerEncoder building :class:`SwappedFFNEncoderLayer` where chosen."""

    def __init__(self, args, dictionary, embed_tokens):
        self._special_layers = set(special_ffn_layers(args))
        self._layers_built = 0
        super().__init__(args, dictionary, embed_tokens)

    def build_encoder_layer(self, args):
        index, self._layers_built = self._layers_built, self._layers_built + 1
        if index not in self._special_layers:
            return super().build_encoder_layer(args)
        cfg = TransformerConfig.from_namespace(args)
        layer = SwappedFFNEncoderLayer(cfg, self.args)
        # the same activation checkpointing / FSDP wrapping as fairseq's own encoder layers
        if cfg.checkpoint_activations:
            layer = checkpoint_wrapper(layer, offload_to_cpu=cfg.offload_activations)
        return fsdp_wrap(layer, min_num_params=0 if cfg.checkpoint_activations
                         else cfg.min_params_to_wrap)


@register_model("moe_transformer")
class MoETransformerModel(TransformerModel):
    """Pre-norm Transformer with MoE / EWA / ParameterNet encoder FFNs (see module docstring)."""

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--encoder-ffn", choices=ENCODER_FFNS,
                            help="encoder FFN type: dense (fairseq's), moe (top-k routed MoE every "
                                 "--encoder-moe-freq layers), ewa (Experts Weights Averaging), "
                                 "parameternet (ParameterNet projections in every layer)")
        parser.add_argument("--encoder-moe-freq", type=int, metavar="K",
                            help="with --encoder-ffn moe: an MoE FFN in every K-th encoder layer")
        add_routing_args(parser)
        parser.add_argument("--ewa-layers", choices=EWA_LAYER_PATTERNS,
                            help="encoder layers whose FFN is an EWA MoE: every second layer or "
                                 "the last four, the two placements the paper tunes per model "
                                 "(every-2: our choice for EWA, the paper's placement for early "
                                 "EWA)")
        parser.add_argument("--ewa-experts", type=int, metavar="E",
                            help="experts per EWA layer, at least 2 (4 is the paper's "
                                 "default)")
        parser.add_argument("--ewa-share-rate", type=float, metavar="B",
                            help="EWA share rate b in [0, 1]: W_i <- (1-b) W_i + b/(E-1) "
                                 f"sum_(j!=i) W_j after each step ({DEFAULT_EWA_SHARE_RATE} is "
                                 f"our choice: the paper tunes it per model within 0.1-0.5)")
        parser.add_argument("--ewa-schedule", choices=SCHEDULES,
                            help="share rate schedule: linear from 0 to --ewa-share-rate over "
                                 "--max-update updates (the paper's for EWA), or constant (the "
                                 "paper's for early EWA, and the default with --ewa-stop-at)")
        parser.add_argument("--ewa-stop-at", type=float, metavar="F",
                            help="early EWA: the EWA layers become top-1 routed MoEs averaged "
                                 "only during the first fraction F of --max-update (in [0, 1]); "
                                 "the paper's early EWA stops at 0.5 with a constant schedule, "
                                 "capacity factor 1.05 and balance weight 0.01: the defaults of "
                                 "--arch ewa_early_transformer_wmt_en_de (and of the schedule "
                                 "and capacity whenever F is given)")
        parser.add_argument("--ewa-init-from", metavar="CHECKPOINT",
                            help="start every EWA expert as a copy of the FFN of the same layer "
                                 "of this dense transformer checkpoint (EWA fine-tuning)")
        parser.add_argument("--parameternet-proj", choices=PROJECTIONS,
                            help="ParameterNet: which FFN projection(s) hold M matrices; when "
                                 "not given, up in routed mode (one projection, as the paper's "
                                 "language models; up is best in its Table 7) and both in "
                                 "dynamic mode (our choice)")
        parser.add_argument("--parameternet-mode", choices=MODES,
                            help="ParameterNet: routed (the default; the paper's language "
                                 "models: a linear top-1 router per token reading the hidden "
                                 "size, no router noise, Switch balance loss via the moe "
                                 "criterion) or dynamic (the paper's vision method, Eqs. 3-4: "
                                 "softmax(MLP(mean-pool(x)))-weighted sum per sentence, the MLP "
                                 "as wide as its input)")
        parser.add_argument("--parameternet-experts", type=int, metavar="M",
                            help="ParameterNet: matrices per chosen projection, at least 2 "
                                 "(4 is the paper's default; its language models use 4 and 8)")

    @classmethod
    def build_model(cls, args, task):
        moe_transformer(args)
        check_args(args)
        model = super().build_model(args, task)
        release_routing_stats_every_step(model)
        set_capacity_at_inference(model, args.moe_capacity_at_inference)
        if args.encoder_ffn == "ewa" and args.ewa_init_from:
            init_experts_from_dense(model, args.ewa_init_from)
            # the experts now live in this model's state: the config saved in its checkpoints
            # must not make fairseq-generate (or a resume elsewhere) need the dense file
            args.ewa_initialized_from, args.ewa_init_from = args.ewa_init_from, None
        return model

    @classmethod
    def build_encoder(cls, args, src_dict, embed_tokens):
        return SwappedFFNEncoder(args, src_dict, embed_tokens)


def init_experts_from_dense(model, path):
    """Copy each EWA layer's FFN from a dense transformer checkpoint into all its experts."""
    state = checkpoint_utils.load_checkpoint_to_cpu(path)["model"]
    for index, layer in enumerate(model.encoder.layers):
        ffn = getattr(layer, "ffn", None)
        if not isinstance(ffn, EWAFeedForward):
            continue
        prefix = f"encoder.layers.{index}."
        keys = [prefix + name for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"--ewa-init-from {path}: not a dense transformer checkpoint of "
                             f"this depth, it has no {missing[0]}")
        try:
            ffn.load_dense_ffn(*(state[k] for k in keys))
        except ValueError as err:
            raise ValueError(f"--ewa-init-from {path}: layer {index}: {err}; the dense model "
                             f"needs the same --encoder-embed-dim and --encoder-ffn-embed-dim"
                             ) from None
    logger.info("EWA experts initialised from the dense FFNs of %s", path)


@register_model_architecture("moe_transformer", "moe_transformer")
def moe_transformer(args):
    args.encoder_ffn = getattr(args, "encoder_ffn", "dense")
    args.encoder_moe_freq = getattr(args, "encoder_moe_freq", 2)
    early_ewa = args.encoder_ffn == "ewa" and getattr(args, "ewa_stop_at", None) is not None
    # early EWA: the paper's capacity ratio for its 2D datasets (1.2 for 3D)
    set_routing_defaults(args, capacity_factor=1.05 if early_ewa else DEFAULT_CAPACITY_FACTOR)
    args.ewa_layers = getattr(args, "ewa_layers", "every-2")
    args.ewa_experts = getattr(args, "ewa_experts", 4)
    args.ewa_share_rate = getattr(args, "ewa_share_rate", DEFAULT_EWA_SHARE_RATE)
    args.ewa_schedule = getattr(args, "ewa_schedule", "constant" if early_ewa else "linear")
    args.ewa_stop_at = getattr(args, "ewa_stop_at", None)
    args.ewa_init_from = getattr(args, "ewa_init_from", None)
    # routed: the paper's method for its language models (Sec. 4.3, 5.4); dynamic mixing is its
    # vision method
    args.parameternet_mode = getattr(args, "parameternet_mode", "routed")
    args.parameternet_proj = getattr(args, "parameternet_proj",
                                     "up" if args.parameternet_mode == "routed" else "both")
    args.parameternet_experts = getattr(args, "parameternet_experts", 4)
    args.max_update = getattr(args, "max_update", 0)
    transformer_prenorm_wmt_en_de(args)


@register_model_architecture("moe_transformer", "moe_transformer_wmt_en_de")
def moe_transformer_wmt_en_de(args):
    args.encoder_ffn = getattr(args, "encoder_ffn", "moe")
    args.encoder_moe_freq = getattr(args, "encoder_moe_freq", 2)
    moe_transformer(args)


@register_model_architecture("moe_transformer", "ewa_transformer_wmt_en_de")
def ewa_transformer_wmt_en_de(args):
    args.encoder_ffn = getattr(args, "encoder_ffn", "ewa")
    moe_transformer(args)


@register_model_architecture("moe_transformer", "ewa_early_transformer_wmt_en_de")
def ewa_early_transformer_wmt_en_de(args):
    """Early EWA as the paper's defaults: a top-1 MoE every other layer, averaged with a constant
    share rate during the first half of training."""
    args.encoder_ffn = getattr(args, "encoder_ffn", "ewa")
    args.ewa_stop_at = getattr(args, "ewa_stop_at", 0.5)
    moe_transformer(args)


@register_model_architecture("moe_transformer", "parameternet_transformer_wmt_en_de")
def parameternet_transformer_wmt_en_de(args):
    args.encoder_ffn = getattr(args, "encoder_ffn", "parameternet")
    moe_transformer(args)
