"""ParameterNet FFNs: dynamic mixing = explicit per-sentence weighted sum, padding-blind pooling,
routed mode = a naive per-token reference, parameter accounting, training through fairseq-train."""
import pytest
import torch
import torch.nn.functional as F

from multipath_nmt.modules.moe import RoutingStats
from multipath_nmt.modules.parameternet import (DynamicLinear, ParameterNetFeedForward,
                                                RoutedLinear, masked_mean)
from conftest import TINY_MODEL, TRAIN_FLAGS, run_fairseq


def _batch():
    x = torch.randn(6, 3, 8)  # [T, B, d]
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, 2:] = True
    return x, padding


def test_dynamic_mixing_equals_explicit_per_sentence_sum():
    layer = DynamicLinear(8, 5, num_experts=3)
    x, padding = _batch()
    out = layer(x, padding)
    for b in range(3):
        real = x[~padding[b], b]  # [t, d]
        alpha = torch.softmax(layer.coefficients(real.mean(0)), -1)
        weight = sum(alpha[i] * layer.weight[i] for i in range(3))
        bias = sum(alpha[i] * layer.bias[i] for i in range(3))
        assert torch.allclose(out[:, b], x[:, b] @ weight + bias, atol=1e-5)


def test_padding_does_not_change_the_pooled_vector():
    x, padding = _batch()
    garbage = x.clone()
    garbage[padding.t()] = 1e4
    assert torch.equal(masked_mean(x, padding), masked_mean(garbage, padding))
    layer = DynamicLinear(8, 5, num_experts=3)
    real = ~padding.t()
    assert torch.allclose(layer(x, padding)[real], layer(garbage, padding)[real])


def test_routed_linear_equals_naive_per_token_reference():
    layer = RoutedLinear(8, 5, num_experts=3, capacity_factor=1.0, router_noise=False).eval()
    x, padding = _batch()
    y, kept = layer(x, padding)

    tokens, valid = x.reshape(-1, 8), ~padding.t().reshape(-1)
    probs = torch.softmax(tokens @ layer.router.weight.t(), -1)
    gate, choice = probs.max(-1)
    capacity = -(-int(valid.sum()) // 3)  # ceil(C * k * S / E), C = k = 1
    used = [0, 0, 0]
    for t in range(tokens.shape[0]):  # earlier tokens (time-major order) win
        expected_kept = bool(valid[t]) and used[int(choice[t])] < capacity
        assert bool(kept.reshape(-1)[t]) == expected_kept
        if expected_kept:
            used[int(choice[t])] += 1
            e = int(choice[t])
            reference = gate[t] * (tokens[t] @ layer.weight[e] + layer.bias[e])
            assert torch.allclose(y.reshape(-1, 5)[t], reference, atol=1e-6)
        else:
            assert (y.reshape(-1, 5)[t] == 0).all()


def test_routed_ffn_reports_routing_stats_and_drops_whole_tokens():
    ffn = ParameterNetFeedForward(8, 16, 3, proj="both", mode="routed", capacity_factor=0.5)
    x, padding = _batch()
    out = ffn(x, padding)
    stats = [s for m in (ffn.fc1, ffn.fc2) for s in m.pop_routing_stats()]
    assert len(stats) == 2 and all(isinstance(s, RoutingStats) for s in stats)
    assert int(stats[0].routed_tokens) == int((~padding).sum())
    # a token dropped by fc1 is not routed again by fc2, and its FFN output is 0
    assert int(stats[1].routed_tokens) == int(stats[0].routed_tokens - stats[0].dropped_tokens)
    dropped = (out == 0).all(-1) & ~padding.t()
    assert int(dropped.sum()) == int(stats[0].dropped_tokens + stats[1].dropped_tokens)
    assert ffn.fc1.pop_routing_stats() == []


def _inactive(module):
    # as multipath-params counts: the sum over every module that reports
    return sum(m.inactive_parameter_count() for m in module.modules()
               if hasattr(m, "inactive_parameter_count"))


def test_active_parameter_accounting():
    routed = ParameterNetFeedForward(8, 16, 4, proj="up", mode="routed")
    assert _inactive(routed) == 3 * (16 * 8 + 16)
    both = ParameterNetFeedForward(8, 16, 4, proj="both", mode="routed")
    assert _inactive(both) == 3 * (16 * 8 + 16) + 3 * (8 * 16 + 8)
    # dynamic: every matrix forms each sentence's W', so all parameters are active
    assert _inactive(ParameterNetFeedForward(8, 16, 4, proj="both", mode="dynamic")) == 0


def test_dynamic_ffn_matches_dense_ffn_when_experts_are_equal():
    ffn = ParameterNetFeedForward(8, 16, 3, proj="down", mode="dynamic")
    with torch.no_grad():
        ffn.fc2.weight.copy_(ffn.fc2.weight[:1].expand_as(ffn.fc2.weight))
        ffn.fc2.bias.copy_(ffn.fc2.bias[:1].expand_as(ffn.fc2.bias))
    x, padding = _batch()
    dense = F.linear(F.relu(ffn.fc1(x)), ffn.fc2.weight[0].t(), ffn.fc2.bias[0])
    assert torch.allclose(ffn(x, padding), dense, atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(proj="sideways"), "unknown ParameterNet projection"),
    (dict(mode="static"), "unknown ParameterNet mode"),
    (dict(num_experts=1), "at least 2"),
])
def test_rejects_impossible_settings(kwargs, message):
    settings = dict(embed_dim=8, ffn_dim=16, num_experts=3)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ParameterNetFeedForward(**settings)


@pytest.mark.slow
@pytest.mark.parametrize("arch, flags", [
    # half precision on CPU (--memory-efficient-fp16) for the ParameterNet layers' own maths
    ("parameternet_transformer_wmt_en_de", ["--parameternet-mode", "dynamic",
                                            "--parameternet-proj", "both",
                                            "--memory-efficient-fp16"]),
    ("parameternet_transformer_wmt_en_de", ["--parameternet-mode", "routed",
                                            "--parameternet-proj", "up",
                                            "--parameternet-experts", "3",
                                            "--memory-efficient-fp16"]),
    ("moe_transformer_wmt_en_de", []),
], ids=["parameternet-dynamic", "parameternet-routed", "moe-every-2"])
def test_fairseq_train(toy_data_bin, tmp_path, arch, flags):
    from fairseq import checkpoint_utils

    proc = run_fairseq("train", toy_data_bin, "--arch", arch, *TINY_MODEL, *TRAIN_FLAGS, *flags,
                       "--criterion", "label_smoothed_cross_entropy_with_moe",
                       "--max-update", "2", "--save-dir", tmp_path, "--no-epoch-checkpoints")
    log = proc.stdout + proc.stderr
    assert "num_updates 2" in log
    keys = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "checkpoint_last.pt"))["model"]
    if arch.startswith("moe"):
        # MoE every second layer: layer 0 dense, layer 1 routed
        assert "encoder.layers.0.fc1.weight" in keys and "encoder.layers.1.ffn.router.weight" in keys
    elif "routed" in flags:
        assert "encoder.layers.0.ffn.fc1.router.weight" in keys
        assert "encoder.layers.0.ffn.fc2.weight" in keys and keys[
            "encoder.layers.0.ffn.fc2.weight"].dim() == 2
    else:
        assert keys["encoder.layers.1.ffn.fc2.weight"].shape == (4, 64, 32)  # [M, in, out]
    if "dynamic" not in flags:
        assert "moe_balance" in log or "balance" in log
