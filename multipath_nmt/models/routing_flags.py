"""The ``--moe-*`` routing flags of every model with routed FFNs (``widenet_transformer`` and
``moe_transformer``'s MoE, early EWA and routed ParameterNet), declared once with their defaults.

They configure the routers of :mod:`multipath_nmt.modules.moe` (WideNet's, Xue et al. 2022,
Eq. 2, with its capacity ratio C); the defaults are WideNet's (E 4, top-2, C 1.2).
"""

# WideNet's experimental settings: 4 experts, top-2 routing, capacity ratio 1.2
DEFAULT_EXPERTS = 4
DEFAULT_TOP_K = 2
DEFAULT_CAPACITY_FACTOR = 1.2


def add_routing_args(parser):
    """Add --moe-experts, --moe-top-k, --moe-capacity-factor and --moe-capacity-at-inference."""
    parser.add_argument("--moe-experts", type=int, metavar="E",
                        help="experts of an MoE FFN: WideNet's shared one, or each of "
                             "--encoder-ffn moe (WideNet: 4)")
    parser.add_argument("--moe-top-k", type=int, metavar="K",
                        help="experts each token is routed to in an MoE FFN (WideNet: 2)")
    parser.add_argument("--moe-capacity-factor", type=float, metavar="C",
                        help="each expert keeps at most ceil(C*K*S/E) of the S tokens of a "
                             "routing call; the rest skip it. Applies to every routed layer "
                             "(WideNet's MoE, --encoder-ffn moe, routed ParameterNet, early "
                             "EWA; WideNet: 1.2)")
    parser.add_argument("--moe-capacity-at-inference", action="store_true",
                        help="apply the expert capacity of routed layers at inference too "
                             "(validation, generation); by default no token is dropped at "
                             "inference, so a sentence's translation does not depend on its "
                             "batch")


def set_routing_defaults(args, capacity_factor=DEFAULT_CAPACITY_FACTOR):
    """Fill in the routing flags ``args`` lacks (an architecture's defaults, or a checkpoint of
    an older version)."""
    args.moe_experts = getattr(args, "moe_experts", DEFAULT_EXPERTS)
    args.moe_top_k = getattr(args, "moe_top_k", DEFAULT_TOP_K)
    args.moe_capacity_factor = getattr(args, "moe_capacity_factor", capacity_factor)
    args.moe_capacity_at_inference = getattr(args, "moe_capacity_at_inference", False)
