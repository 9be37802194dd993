"""ParameterNet FFNs: dynamic mixing = explicit per-sentence weighted sum (and = the former
autograd formulation in float64, with far fewer saved bytes), padding-blind pooling, fp32 sums
over time in half precision, the paper's router width, routed mode = a naive per-token
reference without router noise, parameter accounting, training through fairseq-train."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from multipath_nmt.modules.moe import RoutingStats
from multipath_nmt.modules.parameternet import (DynamicLinear, ParameterNetFeedForward,
                                                RoutedLinear, _MixedProjection, masked_mean)
from multipath_nmt.saved_tensors import SavedForBackward
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
        weight = sum(alpha[i] * layer.expert_weight(i) for i in range(3))
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


def _autograd_reference(layer, x, padding):
    """The former DynamicLinear.forward: every sentence's W' built and kept by autograd."""
    alpha = layer.mixing_weights(x, padding).to(x.dtype)
    in_features, num_experts, out_features = layer.weight.shape
    stacked = layer.weight.transpose(0, 1).reshape(num_experts, -1)  # [M, in * out]
    weight = (alpha @ stacked).view(-1, in_features, out_features)
    bias = alpha @ layer.bias
    return torch.baddbmm(bias.unsqueeze(1), x.transpose(0, 1), weight).transpose(0, 1)


def test_dynamic_linear_equals_the_autograd_formulation_in_float64():
    torch.manual_seed(0)
    layer = DynamicLinear(8, 5, num_experts=3).double()
    x, padding = _batch()
    x = x.double().requires_grad_()
    grad = torch.randn(6, 3, 5, dtype=torch.float64)
    results = []
    for forward in (layer, lambda x, padding: _autograd_reference(layer, x, padding)):
        out = forward(x, padding)
        grads = torch.autograd.grad(out, [x, *layer.parameters()], grad)
        results.append((out, grads))
    (out, grads), (expected, expected_grads) = results
    assert torch.allclose(out, expected, rtol=0, atol=1e-12)
    for got, want in zip(grads, expected_grads):  # x, W, b and the coefficient MLP's
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


def test_mixed_projection_passes_gradcheck():
    torch.manual_seed(0)
    # 7 tokens of 5 features, 2 matrices of 5 x 6, per-token coefficients
    inputs = (torch.randn(7, 5), torch.softmax(torch.randn(7, 2), -1), torch.randn(5, 2, 6),
              torch.randn(2, 6))
    inputs = tuple(t.double().requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(_MixedProjection.apply, inputs)


def _saved_bytes(module, x, *args):
    """Bytes of the activations autograd keeps for backward (storages counted once, parameters
    not counted)."""
    with SavedForBackward(exclude=module.parameters()) as saved:
        module(x, *args)
    return saved.nbytes


class _DenseFFN(nn.Module):
    def __init__(self, embed_dim, ffn_dim):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(embed_dim, ffn_dim), nn.Linear(ffn_dim, embed_dim)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


@pytest.mark.parametrize("length", [28, 10])
def test_dynamic_ffn_saves_at_most_twice_a_dense_ffn(length):
    """At d 256, FFN 1024, M 4, about 1,024 tokens. The kept W' grow as sentences * d * FFN, the
    activations as tokens * (d + FFN): their ratio was 2 d FFN / (length (d + FFN)), 15 at 28
    tokens a sentence here, 29 at d 512 and FFN 2048."""
    torch.manual_seed(0)
    x = torch.randn(length, 1024 // length, 256, requires_grad=True)
    dense = _saved_bytes(_DenseFFN(256, 1024), x)
    ffn = ParameterNetFeedForward(256, 1024, 4, proj="both", mode="dynamic")
    saved = _saved_bytes(ffn, x, None)
    assert saved <= 2 * dense, (saved, dense)

    class Former(nn.Module):  # the same FFN with the autograd formulation of both projections
        def __init__(self):
            super().__init__()
            self.ffn = ffn

        def forward(self, x, padding):
            hidden = F.relu(_autograd_reference(ffn.fc1, x, padding))
            return _autograd_reference(ffn.fc2, hidden, padding)

    assert _saved_bytes(Former(), x, None) > 10 * dense  # what autograd kept of every W'


def test_half_precision_follows_float32_where_a_sum_over_time_overflows_fp16():
    """300 tokens of activation 300 sum to 90,000, past fp16's largest value (65,504): the pooled
    mean and the layer's output and gradients must still follow the float32 computation."""
    torch.manual_seed(0)
    layer = DynamicLinear(4, 3, num_experts=2)
    padding = torch.zeros(2, 300, dtype=torch.bool)
    padding[1, 200:] = True
    x = torch.full((300, 2, 4), 300.0)
    assert torch.equal(masked_mean(x.half(), padding), torch.full((2, 4), 300.0).half())
    results = []
    for dtype in (torch.float32, torch.float16):
        module = DynamicLinear(4, 3, num_experts=2).to(dtype)
        module.load_state_dict(layer.state_dict())
        inputs = x.to(dtype).detach().requires_grad_()
        out = module(inputs, padding)
        out.backward(torch.full_like(out, 1e-3))
        results.append([out, inputs.grad, *(p.grad for p in module.parameters())])
    for full, half in zip(*results):
        assert torch.isfinite(half).all()
        assert torch.allclose(half.float(), full, rtol=1e-2, atol=1e-2)


def test_router_widths_and_noise_are_the_papers():
    # Eq. 4's MLP with C_in hidden units (C_in^2 + C_in M weights in the complexity analysis)
    layer = DynamicLinear(8, 5, num_experts=3)
    assert [m.weight.shape for m in layer.coefficients if isinstance(m, nn.Linear)] == [
        (8, 8), (3, 8)]
    # the language models' router: one linear layer (hidden size -> experts), no noise mentioned
    routed = ParameterNetFeedForward(8, 16, 3, proj="up", mode="routed")
    assert routed.fc1.router.weight.shape == (3, 8) and routed.fc1.router.noise is False
    # Sec. 5.4: the router's input channel is the hidden size, for the down projection too
    # (whose own input is the FFN width, 16 here)
    for proj in ("down", "both"):
        ffn = ParameterNetFeedForward(8, 16, 3, proj=proj, mode="routed")
        assert ffn.fc2.router.weight.shape == (3, 8)


def test_routed_down_projection_routes_on_the_ffn_input():
    torch.manual_seed(0)
    ffn = ParameterNetFeedForward(8, 16, 3, proj="down", mode="routed").eval()
    ffn.fc2.router.capacity_at_inference = False  # no token dropped: every one compared
    x, padding = _batch()
    out = ffn(x, padding)
    tokens, valid = x.reshape(-1, 8), ~padding.t().reshape(-1)
    hidden = F.relu(ffn.fc1(tokens))
    gate, choice = torch.softmax(tokens @ ffn.fc2.router.weight.t(), -1).max(-1)
    reference = gate.unsqueeze(1) * (
        torch.einsum("sf,sfo->so", hidden, ffn.fc2.weight[choice]) + ffn.fc2.bias[choice])
    assert torch.allclose(out.reshape(-1, 8)[valid], reference[valid], atol=1e-5)


def test_text_models_default_to_the_papers_language_method():
    from argparse import Namespace

    from multipath_nmt.models.moe_transformer import moe_transformer

    args = Namespace(encoder_ffn="parameternet")
    moe_transformer(args)
    assert (args.parameternet_mode, args.parameternet_proj) == ("routed", "up")


@pytest.mark.parametrize("mode, proj", [("routed", "up"), ("dynamic", "both")])
def test_default_projection_per_mode(mode, proj):
    from argparse import Namespace

    from multipath_nmt.models.moe_transformer import moe_transformer

    args = Namespace(encoder_ffn="parameternet", parameternet_mode=mode)
    moe_transformer(args)
    assert args.parameternet_proj == proj and args.parameternet_experts == 4


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
        ffn.fc2.weight.copy_(ffn.fc2.weight[:, :1].expand_as(ffn.fc2.weight))
        ffn.fc2.bias.copy_(ffn.fc2.bias[:1].expand_as(ffn.fc2.bias))
    x, padding = _batch()
    dense = F.linear(F.relu(ffn.fc1(x)), ffn.fc2.expert_weight(0).t(), ffn.fc2.bias[0])
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
        assert keys["encoder.layers.1.ffn.fc2.weight"].shape == (64, 4, 32)  # [in, M, out]
    if "dynamic" not in flags:
        assert "moe_balance" in log or "balance" in log


def test_dynamic_ffn_makes_no_host_sync():
    from multipath_nmt.host_syncs import HostSyncCounter

    ffn = ParameterNetFeedForward(8, 16, 3, proj="both", mode="dynamic")
    x, padding = _batch()
    x.requires_grad_()
    with HostSyncCounter() as syncs:
        ffn(x, padding).sum().backward()
    assert syncs.total == 0, syncs.by_op
