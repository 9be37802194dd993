"""WideNet: the shared encoder stack, the fairseq architecture and the LayerNorm divergence."""
import pytest
import torch
from conftest import TINY_MODEL, USER_DIR
from torch import nn

from multipath_nmt.analysis.layernorm_divergence import (
    block_divergence,
    layernorm_divergence,
    plot_layernorm_divergence,
)
from multipath_nmt.modules.moe import MoEFeedForward
from multipath_nmt.modules.widenet import FeedForward, WideNetEncoderStack


def make_stack(layers=4, groups=None, share_layernorm=False, dim=8):
    attention = nn.MultiheadAttention(dim, 2)
    moe = MoEFeedForward(dim, 16, num_experts=4, k=2, capacity_factor=1.0)
    return WideNetEncoderStack(dim, layers, [attention], [moe], share_layernorm=share_layernorm,
                               groups=groups)


def reference_forward(stack, x, padding_mask, routed_layers):
    """The WideNet equations written out layer by layer, routing in ``routed_layers``."""
    attention, moe = stack.attentions[0], stack.ffns[0]
    for layer in range(stack.num_layers):
        h = stack.attention_layer_norms[layer](x)
        x = x + attention(h, h, h, key_padding_mask=padding_mask, need_weights=False)[0]
        h = stack.ffn_layer_norms[layer](x)
        if layer in routed_layers:
            routing = moe.route(h, padding_mask)
        x = x + moe(h, padding_mask, routing=routing)
    return x


# G groups (WideNet Fig. 3) of 12 / G layers; G = 12 routes in every layer, G = 1 only once
@pytest.mark.parametrize("groups,routed_layers", [
    (12, range(12)), (None, range(12)), (4, [0, 3, 6, 9]), (3, [0, 4, 8]), (2, [0, 6]), (1, [0])])
def test_stack_shares_one_block_and_reuses_routing_within_groups(groups, routed_layers):
    torch.manual_seed(0)
    stack = make_stack(layers=12, groups=groups).train()
    x = torch.randn(5, 3, 8)
    padding_mask = torch.zeros(3, 5, dtype=torch.bool)
    padding_mask[2, 3:] = True
    torch.manual_seed(11)
    out = stack(x, padding_mask)
    calls = stack.ffns[0].pop_routing_stats()
    assert len(calls) == len(routed_layers)  # one routing call (and balance term) per group
    assert all(c.routed_tokens.item() == 13 for c in calls)
    torch.manual_seed(11)
    expected = reference_forward(stack, x, padding_mask, routed_layers)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_parameters_grow_only_by_layernorms_with_depth():
    def count(module):
        return sum(p.numel() for p in module.parameters())

    shallow, deep = make_stack(layers=2), make_stack(layers=6)
    assert count(deep) - count(shallow) == 4 * 2 * (2 * 8)  # 4 more layers x 2 LNs x (g, b)
    assert count(make_stack(layers=6, share_layernorm=True)) == count(shallow) - 2 * 2 * 8


def test_stack_rejects_impossible_settings():
    with pytest.raises(ValueError, match=r"the number of routing groups \(4\) must divide the "
                                         r"number of encoder layers \(6\)"):
        make_stack(layers=6, groups=4)
    dense = FeedForward(8, 16)
    with pytest.raises(ValueError, match="routing groups need MoE FFNs"):
        WideNetEncoderStack(8, 4, [nn.MultiheadAttention(8, 2)], [dense], groups=2)
    with pytest.raises(ValueError, match=r"one shared attention module or one per layer \(4\)"):
        WideNetEncoderStack(8, 4, [nn.MultiheadAttention(8, 2)] * 2, [dense])


def build_fairseq(data, *extra):
    from fairseq import options, tasks

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(data), "--arch", "widenet_transformer_wmt_en_de", *TINY_MODEL,
        "--share-all-embeddings", "--cpu", "--user-dir", str(USER_DIR),
        "--criterion", "label_smoothed_cross_entropy_with_moe", "--label-smoothing", "0.1",
        *extra])
    task = tasks.setup_task(args)
    return args, task, task.build_model(args)


def encoder_parameters(model):
    return sum(p.numel() for name, p in model.named_parameters()
               if name.startswith("encoder.layers."))


def test_fairseq_model_sharing_and_ablations(toy_data_bin):
    d, ffn, layers = 32, 64, 2
    attention = 4 * (d * d + d)
    expert = 2 * d * ffn + ffn + d
    moe = 4 * expert + 4 * d  # 4 experts and the router
    norms = 2 * 2 * d  # per layer
    _, _, widenet = build_fairseq(toy_data_bin)
    assert encoder_parameters(widenet) == attention + moe + layers * norms
    moe_modules = [m for m in widenet.modules() if isinstance(m, MoEFeedForward)]
    assert len(moe_modules) == 1 and moe_modules[0].k == 2
    assert sum(m.inactive_parameter_count() for m in widenet.modules()
               if hasattr(m, "inactive_parameter_count")) == 2 * expert
    _, _, no_share = build_fairseq(toy_data_bin, "--no-share")
    assert encoder_parameters(no_share) == layers * (attention + moe + norms)
    _, _, albert = build_fairseq(toy_data_bin, "--no-moe", "--share-layernorm")
    assert encoder_parameters(albert) == attention + (2 * d * ffn + ffn + d) + norms
    assert widenet.decoder.cfg.decoder.normalize_before  # pre-norm decoder


def routing_calls(model):
    model.train()
    model(src_tokens=torch.randint(4, 20, (2, 6)), src_lengths=torch.tensor([6, 6]),
          prev_output_tokens=torch.randint(4, 20, (2, 5)))
    return len([s for m in model.modules() if isinstance(m, MoEFeedForward)
                for s in m.pop_routing_stats()])


@pytest.mark.parametrize("flags,calls", [([], 4), (["--moe-groups", "4"], 4),
                                         (["--moe-groups", "2"], 2), (["--moe-groups", "1"], 1)])
def test_moe_groups_is_the_number_of_routing_groups(toy_data_bin, flags, calls):
    """WideNet Fig. 3: G groups of D / G blocks, one routing call each; G = D (the default)
    routes in every block."""
    _, _, model = build_fairseq(toy_data_bin, "--encoder-layers", "4", *flags)
    assert routing_calls(model) == calls


def test_checkpoints_with_the_old_layers_per_group_value_keep_their_routing(toy_data_bin):
    """Before --moe-groups counted groups, checkpoints stored moe_groups = layers per group."""
    from multipath_nmt.models.widenet_transformer import routing_groups

    args, task, _ = build_fairseq(toy_data_bin, "--encoder-layers", "4")
    del args.moe_routing_groups
    args.moe_groups = 4  # one routing decision for the 4 layers
    assert routing_groups(args) == 1
    assert routing_calls(task.build_model(args)) == 1
    args.moe_groups = 1  # the old default: every layer routes
    assert routing_groups(args) == 4


@pytest.mark.parametrize("flags,message", [
    (["--moe-experts", "2", "--moe-top-k", "3"],
     "top-k must be between 1 and the number of experts"),
    (["--moe-capacity-factor", "0"], "capacity factor must be positive"),
    (["--moe-experts", "0", "--moe-top-k", "1"], "number of experts must be at least 1"),
    (["--moe-groups", "3"], "--moe-groups 3 must divide --encoder-layers 2"),
    (["--no-moe", "--moe-groups", "2"], "--no-moe uses a dense FFN"),
    (["--no-share", "--moe-groups", "1"], "--moe-groups below --encoder-layers with --no-share"),
    (["--checkpoint-activations"], "WideNet does not support --checkpoint-activations"),
])
def test_fairseq_model_rejects_impossible_flags(toy_data_bin, flags, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_fairseq(toy_data_bin, *flags)


def test_every_parameter_gets_a_gradient_even_for_idle_experts(toy_data_bin):
    """So DDP needs no --find-unused-parameters: idle experts still get (zero) gradients."""
    _, _, model = build_fairseq(toy_data_bin)
    moe = next(m for m in model.modules() if isinstance(m, MoEFeedForward))
    with torch.no_grad():  # a uniform router: every token picks the same two tied experts
        moe.router.weight.zero_()
    moe.router.noise = False
    model.train()
    out, _ = model(src_tokens=torch.randint(4, 20, (2, 6)), src_lengths=torch.tensor([6, 6]),
                   prev_output_tokens=torch.randint(4, 20, (2, 5)))
    idle = [expert for expert, load in enumerate(moe.pop_routing_stats()[0].expert_load)
            if load == 0]
    assert len(idle) == 2
    out.sum().backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []
    assert moe.fc1_weight.grad[idle].abs().sum().item() == 0.0


def test_layernorm_divergence_hand_example(tmp_path):
    """Eq. 9 per block: y_j = 1/(M^2 N) sum_i sum_m sum_(n != j) |v_ij - v_mn|."""
    prefix = "encoder.layers.0"
    state = {}
    gammas = [torch.tensor([1.0, 1.0]), torch.tensor([3.0, 1.0]), torch.tensor([2.0, 4.0])]
    for layer, gamma in enumerate(gammas):
        for position in ("attention", "ffn"):
            state[f"{prefix}.{position}_layer_norms.{layer}.weight"] = gamma
            state[f"{prefix}.{position}_layer_norms.{layer}.bias"] = torch.zeros(2)
    state["encoder.embed_tokens.weight"] = torch.ones(3, 2)
    rows = layernorm_divergence(state)
    # M = 2, N = 3, so each block's sum is divided by M^2 N = 12:
    # block 0 [1, 1] vs {3, 1, 2, 4}: (2+0+1+3) + (2+0+1+3) = 12 -> 1
    # block 1 [3, 1] vs {1, 1, 2, 4}: (2+2+1+1) + (0+0+1+3) = 10 -> 5/6
    # block 2 [2, 4] vs {1, 1, 3, 1}: (1+1+1+1) + (3+3+1+3) = 14 -> 7/6
    assert [row["layer"] for row in rows] == [0, 1, 2]
    assert [row["ffn_gamma"] for row in rows] == pytest.approx([1.0, 5 / 6, 7 / 6])
    assert [row["attention_gamma"] for row in rows] == pytest.approx([1.0, 5 / 6, 7 / 6])
    assert [row["ffn_beta"] for row in rows] == [0.0, 0.0, 0.0]
    assert rows[0]["stack"] == prefix
    # Eq. 9 as printed, y_i = 1/(M N^2) sum_j sum_m sum_n [j != n] |v_ij - v_mn|:
    # y_0 = (6 + 6 + 4) / 18, y_1 = (6 + 4 + 10) / 18; their mean is the mean over blocks
    assert sum(row["ffn_gamma"] for row in rows) / 3 == pytest.approx((16 / 18 + 20 / 18) / 2)

    plot = tmp_path / "divergence.png"
    plot_layernorm_divergence(rows, plot)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["divergence.png"]

    with pytest.raises(ValueError, match="no per-layer encoder LayerNorms"):
        layernorm_divergence({"decoder.layers.0.final_layer_norm.weight": torch.ones(2)})


def test_block_divergence_matches_the_sum_written_out():
    torch.manual_seed(3)
    vectors = torch.randn(5, 7, dtype=torch.float64)
    N, M = vectors.shape
    expected = [sum(abs(float(vectors[j, i] - vectors[n, m])) for i in range(M)
                    for n in range(N) if n != j for m in range(M)) / (M * M * N)
                for j in range(N)]
    assert block_divergence(vectors).tolist() == pytest.approx(expected, rel=1e-12)


def test_layernorm_divergence_of_fairseq_pre_norm_transformers(toy_data_bin):
    """The baseline side of the paper's Figs. 4-5: a pre-norm Transformer's LayerNorm before
    the FFN is final_layer_norm; a post-norm one is refused (it follows the FFN)."""
    from fairseq import options, tasks

    def state_dict(arch):
        args = options.parse_args_and_arch(options.get_training_parser(), [
            str(toy_data_bin), "--arch", arch, *TINY_MODEL, "--share-all-embeddings", "--cpu",
            "--user-dir", str(USER_DIR)])
        return tasks.setup_task(args).build_model(args).state_dict()

    state = state_dict("transformer_prenorm_wmt_en_de")
    with torch.no_grad():
        state["encoder.layers.1.final_layer_norm.weight"].fill_(3.0)  # block 0 keeps 1s
    rows = layernorm_divergence(state)
    assert [(row["stack"], row["layer"]) for row in rows] == [("encoder.layers", 0),
                                                                ("encoder.layers", 1)]
    # N = 2: each element is |1 - 3| = 2 from all M elements of the other block: 2 M^2 / (2 M^2)
    assert [row["ffn_gamma"] for row in rows] == pytest.approx([1.0, 1.0])
    assert [row["attention_gamma"] for row in rows] == [0.0, 0.0]  # untrained: all ones
    with pytest.raises(ValueError, match="a post-norm encoder"):
        layernorm_divergence(state_dict("transformer"))
