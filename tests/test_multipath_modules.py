"""The batched multi-path layers against the loop-over-modules reference and fairseq's layer."""
import itertools
import math

import pytest
import torch

from multipath_nmt.benchmark.kernels import KernelLaunchCounter
from multipath_nmt.modules.multipath import (
    MultiPathDecoderLayer,
    MultiPathEncoderLayer,
    PathMixer,
    _NormalizedSum,
    others_matrix,
)
from multipath_nmt.testing.multipath_reference import (
    ReferenceMultiPathDecoderLayer,
    ReferenceMultiPathEncoderLayer,
)
from multipath_nmt.saved_tensors import SavedForBackward

D, FFN, HEADS = 16, 24, 4
# Equivalences are checked in float64: rounding is then ~1e-15, so a tolerance of 1e-10 is immune
# to how a machine's BLAS orders its sums (fp32 differences of 1e-6 come and go with the CPU) and
# still catches any real difference between the implementations.
EXACT = dict(atol=1e-10, rtol=1e-10)


def _randomize_(module):
    """Move every parameter off its initial value (PathNorm affine, path weights, biases) so the
    comparison exercises them."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return module


def _pair(layer_cls, reference_cls, dtype=torch.float64, **options):
    reference = _randomize_(reference_cls(D, FFN, HEADS, **options)).to(dtype)
    batched = layer_cls(D, FFN, HEADS, **options).to(dtype)
    batched.load_state_dict(reference.batched_state_dict())
    return batched.eval(), reference.eval()


def _inputs(T=7, B=3, dtype=torch.float64):
    x = torch.randn(T, B, D, dtype=dtype)
    padding = torch.zeros(B, T, dtype=torch.bool)
    padding[1, -2:] = True  # right padding
    padding[2, :3] = True  # left padding (fairseq's source side)
    return x, padding


def _assert_layers_agree(batched, reference, x, *inputs):
    """``batched(x, *inputs)`` and ``reference(x, *inputs)``: the same outputs and, under one
    random upstream gradient, the same gradients of ``x`` and of every parameter."""
    x_batched, x_reference = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_batched = batched(x_batched, *inputs)
    out_reference = reference(x_reference, *inputs)
    torch.testing.assert_close(out_batched, out_reference, **EXACT)
    upstream = torch.randn_like(out_batched)
    (out_batched * upstream).sum().backward()
    (out_reference * upstream).sum().backward()
    torch.testing.assert_close(x_batched.grad, x_reference.grad, **EXACT)
    expected = reference.batched_gradients()
    for name, p in batched.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **EXACT, msg=name)
    assert set(expected) >= {n for n, _ in batched.named_parameters()}


OPTIONS = [dict(num_paths=n, path_norm=norm, learnable_weights=learn, cheap_features=cheap)
           for n, norm, learn, cheap in itertools.product((1, 2, 3, 4), (True, False),
                                                          (True, False), (False, True))
           if n > 2 or not cheap]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_encoder_layer_matches_reference_outputs_and_gradients(options):
    batched, reference = _pair(MultiPathEncoderLayer, ReferenceMultiPathEncoderLayer, **options)
    x, padding = _inputs()
    _assert_layers_agree(batched, reference, x, padding)


@pytest.mark.parametrize("options", [
    dict(num_paths=1, path_norm=False, learnable_weights=False),
    dict(num_paths=2),
    dict(num_paths=3, cheap_features=True),
    dict(num_paths=4, path_norm=False, cheap_features=True),
], ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_decoder_layer_matches_reference_outputs_and_gradients(options):
    batched, reference = _pair(MultiPathDecoderLayer, ReferenceMultiPathDecoderLayer, **options)
    x, target_padding = _inputs(T=6)
    target_padding[2] = False  # targets are right-padded only
    encoder_out, source_padding = _inputs(T=8)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)  # True = masked, like the padding mask
    _assert_layers_agree(batched, reference, x, encoder_out, source_padding, future,
                         target_padding)


def test_weights_round_trip_between_batched_and_reference():
    batched = _randomize_(MultiPathEncoderLayer(D, FFN, HEADS, 3, cheap_features=True))
    reference = ReferenceMultiPathEncoderLayer(D, FFN, HEADS, 3, cheap_features=True)
    reference.load_batched_state_dict(batched.state_dict())
    round_trip = reference.batched_state_dict()
    for name, tensor in batched.state_dict().items():
        assert torch.equal(round_trip[name], tensor), name


@pytest.mark.parametrize("num_paths,cheap", [(1, False), (3, False), (3, True)])
def test_incremental_decoding_equals_full_sequence(num_paths, cheap):
    layer = _randomize_(MultiPathDecoderLayer(D, FFN, HEADS, num_paths,
                                              cheap_features=cheap)).double().eval()
    x, _ = _inputs(T=5)
    encoder_out, source_padding = _inputs(T=8)
    future = torch.triu(torch.full((5, 5), float("-inf")), 1)
    full = layer(x, encoder_out, source_padding, future)
    cache = {}
    steps = [layer(x[t:t + 1], encoder_out, source_padding, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps), full, **EXACT)
    assert cache["self_attn"]["key"].shape == (3, num_paths * HEADS, 5, D // HEADS)


def test_one_path_without_path_norm_is_fairseqs_prenorm_encoder_layer():
    from argparse import Namespace

    from fairseq.modules import TransformerEncoderLayer

    args = Namespace(encoder_embed_dim=D, encoder_ffn_embed_dim=FFN,
                     encoder_attention_heads=HEADS, encoder_normalize_before=True, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, activation_fn="relu")
    fairseq_layer = _randomize_(TransformerEncoderLayer(args)).double().eval()
    layer = MultiPathEncoderLayer(D, FFN, HEADS, 1, path_norm=False,
                                  learnable_weights=False).double().eval()
    assert layer.self_attn_mixer.path_weights.tolist() == [1.0]
    assert layer.ffn_mixer.residual_weight.item() == 1.0
    attn = fairseq_layer.self_attn
    layer.load_state_dict({
        "self_attn_layer_norm.weight": fairseq_layer.self_attn_layer_norm.weight,
        "self_attn_layer_norm.bias": fairseq_layer.self_attn_layer_norm.bias,
        "self_attn.in_proj.weight": torch.cat(
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        "self_attn.in_proj.bias": torch.cat([attn.q_proj.bias, attn.k_proj.bias,
                                             attn.v_proj.bias]),
        "self_attn.out_proj_weight": attn.out_proj.weight.t()[None],
        "self_attn.out_proj_bias": attn.out_proj.bias[None],
        "self_attn_mixer.path_weights": torch.ones(1),
        "self_attn_mixer.residual_weight": torch.tensor(1.0),
        "final_layer_norm.weight": fairseq_layer.final_layer_norm.weight,
        "final_layer_norm.bias": fairseq_layer.final_layer_norm.bias,
        "ffn.fc1.weight": fairseq_layer.fc1.weight,
        "ffn.fc1.bias": fairseq_layer.fc1.bias,
        "ffn.fc2_weight": fairseq_layer.fc2.weight.t()[None],
        "ffn.fc2_bias": fairseq_layer.fc2.bias[None],
        "ffn_mixer.path_weights": torch.ones(1),
        "ffn_mixer.residual_weight": torch.tensor(1.0),
    })
    x, padding = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(layer(x, padding), fairseq_layer(x, padding), **EXACT)


@pytest.mark.parametrize("num_paths,path_norm,cheap,expected", [
    (4, False, False, 1 / 4),  # original multi-path: plain average
    (4, True, False, 1 / 2),  # + PathNorm: 1/sqrt(n)
    (3, True, True, 1 / math.sqrt(6)),  # 2n summed features
    (3, False, True, 1 / 6),
])
def test_fixed_path_weights(num_paths, path_norm, cheap, expected):
    mixer = PathMixer(num_paths, D, path_norm=path_norm, learnable_weights=False,
                      cheap_features=cheap)
    assert list(mixer.parameters()) == list(mixer.path_norm.parameters() if path_norm else [])
    torch.testing.assert_close(mixer.path_weights,
                               torch.full((len(mixer.path_weights),), expected))
    assert mixer.residual_weight.item() == 1.0


@pytest.mark.parametrize("num_paths,cheap,features", [(2, False, 2), (2, True, 2), (4, True, 8)])
def test_learnable_weights_start_at_one_over_sqrt_2n(num_paths, cheap, features):
    mixer = PathMixer(num_paths, D, cheap_features=cheap)
    assert mixer.path_weights.requires_grad and mixer.residual_weight.requires_grad
    torch.testing.assert_close(mixer.path_weights,
                               torch.full((features,), 1 / math.sqrt(2 * num_paths)))
    assert mixer.residual_weight.item() == 1.0


@pytest.mark.parametrize("cheap", [False, True])
def test_fused_path_norm_sum_passes_gradcheck(cheap):
    # the hand-written backward of PathNorm + weighted sum (+ cheap features) against finite
    # differences, for the paths, the folded LayerNorm weights and the summed bias
    n, d = 3, 5
    paths = torch.randn(n, 4, d, dtype=torch.float64, requires_grad=True)
    scales = torch.randn(2 * n if cheap else n, d, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda p, s, b: _NormalizedSum.apply(p, s, b, 1e-5, others_matrix(n) if cheap else None),
        (paths, scales, bias))


def test_frozen_path_norm_still_trains_the_paths():
    mixer = _randomize_(PathMixer(3, D, cheap_features=True)).double()
    reference = PathMixer(3, D, cheap_features=True).double()
    reference.load_state_dict(mixer.state_dict())
    for p in mixer.parameters():
        p.requires_grad_(False)
    paths = torch.randn(3, 5, 2, D, dtype=torch.float64)
    residual = torch.randn(5, 2, D, dtype=torch.float64)
    got = torch.autograd.grad(mixer.eval()(paths.requires_grad_(), residual).sum(), paths)[0]
    expected = torch.autograd.grad(reference.eval()(paths, residual).sum(), paths)[0]
    torch.testing.assert_close(got, expected, **EXACT)


def test_cheap_features_are_averages_of_the_other_paths():
    mixer = PathMixer(4, D, cheap_features=True)
    paths = torch.randn(4, 5, 2, D)
    features = mixer.features(paths)
    assert features.shape == (8, 5, 2, D)
    torch.testing.assert_close(features[:4], paths)
    for j in range(4):
        others = torch.stack([paths[i] for i in range(4) if i != j]).mean(0)
        torch.testing.assert_close(features[4 + j], others)


@pytest.mark.parametrize("cheap", [False, True])
def test_path_norm_half_precision_does_not_overflow(cheap):
    mixer = _randomize_(PathMixer(3, D, cheap_features=cheap)).eval()
    paths = 2000 * torch.randn(3, 5, 2, D)  # squares overflow fp16 (max 65504)
    residual = torch.randn(5, 2, D)
    expected = mixer(paths, residual)
    got = mixer.half()(paths.half(), residual.half())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


def test_layers_run_in_half_precision_and_bf16_autocast():
    batched, _ = _pair(MultiPathDecoderLayer, ReferenceMultiPathDecoderLayer, torch.float32,
                       num_paths=3, cheap_features=True)
    x, _ = _inputs(T=5, dtype=torch.float32)
    encoder_out, source_padding = _inputs(T=8, dtype=torch.float32)
    future = torch.triu(torch.full((5, 5), float("-inf")), 1)
    expected = batched(x, encoder_out, source_padding, future)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = batched(x, encoder_out, source_padding, future)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, atol=0.15, rtol=0.05)
    encoder = _randomize_(MultiPathEncoderLayer(D, FFN, HEADS, 2)).eval()
    big = 300 * x  # pre-norm residual stream with large activations
    expected = encoder(big)
    got = encoder.half()(big.half())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), expected, atol=0.5, rtol=1e-2)


def _saved_activations(module, *inputs):
    """Tensors ``module(*inputs)`` saves for backward (parameters excluded), one per storage."""
    with SavedForBackward(exclude=module.parameters()) as saved:
        out = module(*inputs)
    return out, saved.tensors


@pytest.mark.parametrize("cheap", [False, True])
def test_half_precision_layer_saves_no_fp32_copy_of_its_paths(cheap):
    # PathNorm upcasts fp16 paths to fp32 one feature at a time; saving the upcast paths (and
    # cheap features) for backward cost 2-3x the paths' own fp16 bytes per sublayer
    num_paths, T, B = 3, 5, 2
    layer = _randomize_(MultiPathEncoderLayer(D, FFN, HEADS, num_paths,
                                              cheap_features=cheap)).half()
    x = torch.randn(T, B, D).half().requires_grad_()
    out, saved = _saved_activations(layer, x)
    # fp32 only for per-token statistics (LayerNorm means and 1/std, softmax log-sum-exp): no
    # fp32 tensor as large as one path's output, let alone the n paths
    fp32 = [tuple(t.shape) for t in saved if t.dtype == torch.float32]
    assert fp32 and all(math.prod(shape) < T * B * D for shape in fp32), fp32
    paths = [t for t in saved if t.shape == (num_paths, T * B, D)]
    assert paths and all(t.dtype == torch.float16 for t in paths)
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("cheap", [False, True])
def test_half_precision_mixer_gradients_match_fp32(cheap):
    mixer = _randomize_(PathMixer(3, D, cheap_features=cheap))
    paths = torch.randn(3, 5, 2, D)
    residual = torch.randn(5, 2, D)
    upstream = torch.randn(5, 2, D)
    expected = torch.autograd.grad((mixer(paths.requires_grad_(), residual) * upstream).sum(),
                                   [paths, *mixer.parameters()])
    half_paths = paths.detach().half().requires_grad_()
    mixer = mixer.half()
    got = torch.autograd.grad((mixer(half_paths, residual.half()).float() * upstream).sum(),
                              [half_paths, *mixer.parameters()])
    for g, e in zip(got, expected):
        assert g.dtype == torch.float16
        torch.testing.assert_close(g.float(), e, atol=0.05, rtol=0.02)


def _kernels_of_training_step(module, *inputs, autocast=False):
    """The kernel-running ATen ops (:mod:`multipath_nmt.benchmark.kernels`) of one forward and
    backward of ``module`` in training mode into fresh gradients, after a first one (caches
    warm)."""
    def step():
        module.zero_grad(set_to_none=True)
        for x in inputs:
            x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(*inputs)
        out.float().sum().backward()

    step()
    with KernelLaunchCounter() as kernels:
        step()
    return kernels.total


@pytest.mark.parametrize("autocast,plain_layer,cheap_layer", [(False, 83, 89), (True, 114, 120)])
def test_cheap_features_add_at_most_a_tenth_to_the_kernel_launches(autocast, plain_layer,
                                                                   cheap_layer):
    # The target: cheap features cost at most 1.1x the kernel launches of the same
    # multi-path model without them. _NormalizedSum normalizes every feature with one LayerNorm
    # kernel, so cheap features add three kernels per PathMixer whatever n is: the copy of the
    # paths into the [2n, N, d] features and the matrix product that forms the cheap features
    # (forward), the addmm that folds their gradient into that of the paths (backward). Before,
    # a LayerNorm and an add_ per feature forward, a LayerNorm backward per feature and 2n
    # kernels to assemble the paths' gradient made 56 kernels against 35 (PathMixer, n = 4),
    # 139 against 97 (encoder layer, fp32) and 214 against 140 (bf16 autocast, whose fp32
    # features were formed again in backward). Counts of torch 2.13 on the CPU.
    num_paths, T, B = 4, 7, 3
    counts = {}
    for cheap in (False, True):
        torch.manual_seed(0)
        layer = MultiPathEncoderLayer(D, FFN, HEADS, num_paths, cheap_features=cheap)
        x = torch.randn(T, B, D, requires_grad=True)
        mixer = PathMixer(num_paths, D, cheap_features=cheap)
        paths = torch.randn(num_paths, T, B, D, requires_grad=True)
        counts[cheap] = (_kernels_of_training_step(layer, x, autocast=autocast),
                         _kernels_of_training_step(mixer, paths, x, autocast=autocast))
    # (one encoder layer: two PathMixers and the rest of the layer, one PathMixer alone: its
    # fp32 paths and residual take the same ops under autocast), forward and backward, the
    # gradients of the inputs and parameters included
    assert counts == {False: (plain_layer, 28), True: (cheap_layer, 31)}
    assert counts[True][0] <= 1.1 * counts[False][0]


def test_beam_search_cache_keeps_encoder_keys_per_sentence():
    # 3 sentences x 2 beams: with set_beam_size the encoder-decoder attention keeps one copy of
    # the encoder's keys/values per sentence and the beam reorders leave it alone, with the same
    # outputs as keys/values per hypothesis reordered at every step; a finished sentence leaving
    # the batch takes its copy with it
    layer = _randomize_(MultiPathDecoderLayer(D, FFN, HEADS, 3, cheap_features=True)).double()
    layer.eval()
    beams, sentences = 2, 3
    x = torch.randn(4, sentences * beams, D, dtype=torch.float64)
    encoder_out, source_padding = _inputs(T=8, B=sentences)
    encoder_out = encoder_out.repeat_interleave(beams, 1)  # as fairseq expands the encoder output
    source_padding = source_padding.repeat_interleave(beams, 0)
    orders = [torch.tensor([1, 0, 2, 2, 5, 4]), torch.tensor([0, 0, 3, 2, 4, 5]),
              torch.tensor([0, 1, 4, 5])]  # within sentences, within sentences, sentence 1 done

    def decode(beam_size):
        for attention in (layer.self_attn, layer.encoder_attn):
            attention.set_beam_size(beam_size)
        cache, rows, steps = {}, torch.arange(sentences * beams), []
        for t in range(4):
            if t:
                order = orders[t - 1]
                layer.self_attn.reorder_cache(cache["self_attn"], order)
                layer.encoder_attn.reorder_cache(cache["encoder_attn"], order)
                rows = rows[order]
            steps.append(layer(x[t:t + 1, rows], encoder_out[:, rows], source_padding[rows],
                               cache=cache))
        return steps, cache

    expected, per_hypothesis = decode(1)
    got, per_sentence = decode(beams)
    for step_got, step_expected in zip(got, expected):
        torch.testing.assert_close(step_got, step_expected, **EXACT)
    assert per_hypothesis["encoder_attn"]["key"].size(0) == 2 * beams
    assert per_sentence["encoder_attn"]["key"].size(0) == 2


def test_causal_self_attention_without_mask_equals_the_causal_mask():
    layer = _randomize_(MultiPathDecoderLayer(D, FFN, HEADS, 3)).double().eval()
    x, _ = _inputs(T=6)
    encoder_out, source_padding = _inputs(T=8)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    torch.testing.assert_close(
        layer(x, encoder_out, source_padding, self_attn_is_causal=True),
        layer(x, encoder_out, source_padding, future), **EXACT)
    with pytest.raises(ValueError, match="is_causal takes no attn_mask"):
        layer.self_attn(x, attn_mask=future, is_causal=True)
    with pytest.raises(ValueError, match="is_causal takes no attn_mask and a full sequence"):
        layer(x[:1], encoder_out, source_padding, cache={"self_attn": {
            "key": torch.zeros(3, 3 * HEADS, 2, D // HEADS, dtype=torch.float64),
            "value": torch.zeros(3, 3 * HEADS, 2, D // HEADS, dtype=torch.float64)}},
            self_attn_is_causal=True)
