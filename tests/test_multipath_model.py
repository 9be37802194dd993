"""The multipath_transformer fairseq model: presets, flags, parameter counts, decoding, training."""
import copy
import math
import re
from collections import Counter

import pytest
import multipath_nmt.modules
import torch
from conftest import TINY_MODEL, TRAIN_FLAGS, run_fairseq
from torch.utils._python_dispatch import TorchDispatchMode

from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.sequence_generator import SequenceGenerator
from fairseq.modules.transformer_layer import TransformerDecoderLayerBase
from multipath_nmt.params import build_model, parameter_counts
from multipath_nmt.arch_table import MULTIPATH_PRESETS
from multipath_nmt.modules.multipath import MultiPathDecoderLayer, MultiPathEncoderLayer

PAPER_DICT_SIZE = 34880
# Table 2 of Lin et al. (2022): parameters in millions.
TABLE_2 = {
    "transformer_prenorm_wmt_en_de": 62,
    "multipath_transformer_wmt_en_de": 80,
    "multipath_l6_p2_wmt_en_de": 80,
    "multipath_l12_p2_wmt_en_de": 118,
    "multipath_l6_p4_wmt_en_de": 118,
    "multipath_l12_p3_wmt_en_de": 156,
    "multipath_l6_p6_wmt_en_de": 156,
    "multipath_l24_p2_wmt_en_de": 193,
    "multipath_l12_p4_wmt_en_de": 193,
    "multipath_l6_p8_wmt_en_de": 193,
    "transformer_deep12_wmt_en_de": 80,
    "transformer_deep24_wmt_en_de": 118,
    "transformer_deep36_wmt_en_de": 156,
    "transformer_deep48_wmt_en_de": 193,
}


def _tiny(arch="multipath_transformer", *flags):
    return build_model(arch, 100, [*TINY_MODEL, *flags], device="cpu").eval()


def _perturbed_paths_model(scale):
    """3 encoder paths with cheap features, 2 decoder paths, weights moved off their init so
    that paths and beams differ."""
    model = _tiny("multipath_transformer", "--encoder-paths", "3", "--cheap-features",
                  "--decoder-paths", "2")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


@pytest.mark.parametrize("arch", sorted(TABLE_2))
def test_parameter_counts_within_1_5_percent_of_table_2(arch):
    total = parameter_counts(build_model(arch, PAPER_DICT_SIZE))["total"]
    assert abs(total / 1e6 - TABLE_2[arch]) / TABLE_2[arch] <= 0.015, total


def test_base_model_has_the_papers_62m_parameters():
    total = parameter_counts(build_model("transformer_prenorm_wmt_en_de", PAPER_DICT_SIZE))
    assert round(total["total"] / 1e6) == 62


@pytest.mark.parametrize("layers,paths", MULTIPATH_PRESETS)
def test_presets_set_layers_paths_and_ours(layers, paths):
    model = build_model(f"multipath_l{layers}_p{paths}_wmt_en_de", 100)
    assert len(model.encoder.layers) == layers
    assert len(model.decoder.layers) == 6
    layer = model.encoder.layers[0]
    assert isinstance(layer, MultiPathEncoderLayer)
    assert layer.self_attn.num_paths == paths and layer.ffn.num_paths == paths
    assert layer.self_attn.embed_dim == 512 and layer.ffn.ffn_dim == 2048
    assert layer.self_attn.num_heads == 8
    # "+ Ours": PathNorm and learnable weights, no cheap features.
    assert layer.ffn_mixer.path_norm is not None and not layer.ffn_mixer.cheap_features
    assert layer.ffn_mixer.path_weights.requires_grad
    assert model.encoder.layer_norm is not None  # pre-norm: final encoder LayerNorm


def test_command_line_overrides_preset_dimensions():
    model = _tiny("multipath_l12_p4_wmt_en_de", "--encoder-paths", "3")
    assert len(model.encoder.layers) == 2 and len(model.decoder.layers) == 1
    layer = model.encoder.layers[0]
    assert layer.self_attn.num_paths == 3 and layer.self_attn.embed_dim == 32
    assert layer.ffn.ffn_dim == 64 and layer.self_attn.num_heads == 2


@pytest.mark.parametrize("flags,norm,weights,features", [
    (["--path-weights", "fixed", "--no-path-norm"], False, [1 / 4] * 4, 4),  # Multi-Path
    (["--path-weights", "fixed"], True, [1 / 2] * 4, 4),  # + PathNorm
    ([], True, None, 4),  # + Learnable Weights (Ours)
    (["--no-path-norm"], False, None, 4),  # - PathNorm
    (["--cheap-features"], True, None, 8),  # + More Features
])
def test_table_4_ablation_flags(flags, norm, weights, features):
    model = _tiny("multipath_l6_p4_wmt_en_de", *flags)
    for mixer in (model.encoder.layers[1].self_attn_mixer, model.encoder.layers[1].ffn_mixer):
        assert (mixer.path_norm is not None) == norm
        assert len(mixer.path_weights) == features
        if weights is None:
            assert mixer.path_weights.requires_grad and mixer.residual_weight.requires_grad
            torch.testing.assert_close(mixer.path_weights,
                                       torch.full((features,), 1 / math.sqrt(8)))
        else:
            assert not mixer.path_weights.requires_grad
            assert mixer.path_weights.tolist() == weights
        assert mixer.residual_weight.item() == 1.0


def test_activation_fn_names_the_multipath_layers_activation():
    layer = _tiny("multipath_transformer", "--activation-fn", "gelu", "--decoder-paths",
                  "2").decoder.layers[0]
    assert layer.ffn.activation_fn is multipath_nmt.modules.gelu  # fairseq's: fp32, cast back
    assert _tiny().encoder.layers[0].ffn.activation_fn is torch.nn.functional.relu


def test_decoder_paths():
    assert all(isinstance(layer, TransformerDecoderLayerBase)
               for layer in _tiny().decoder.layers)
    layer = _tiny("multipath_transformer", "--decoder-paths", "3").decoder.layers[0]
    assert isinstance(layer, MultiPathDecoderLayer)
    assert layer.encoder_attn.num_paths == 3 and layer.ffn.num_paths == 3


def test_encoder_layerdrop_skips_multipath_layers():
    from fairseq.modules import LayerDropModuleList

    model = _tiny("multipath_transformer", "--encoder-layerdrop", "1.0", "--dropout", "0")
    model.train()
    assert isinstance(model.encoder.layers, LayerDropModuleList)
    src = torch.randint(4, 100, (2, 5))
    out = model.encoder(src, src_lengths=torch.full((2,), 5))["encoder_out"][0]
    # Every layer dropped: the output is the final LayerNorm of the embeddings.
    embedded = model.encoder.forward_embedding(src)[0].transpose(0, 1)
    torch.testing.assert_close(out, model.encoder.layer_norm(embedded))


def test_invalid_path_count_is_a_clear_error():
    with pytest.raises(ValueError, match="--encoder-paths must be at least 1, got 0"):
        _tiny("multipath_transformer", "--encoder-paths", "0")


def test_incremental_decoding_with_beam_reordering_equals_full_forward():
    model = _perturbed_paths_model(0.1)
    pad = model.encoder.padding_idx
    src = torch.randint(4, 100, (2, 7))
    src[1, :2] = pad  # fairseq left-pads sources
    prev = torch.randint(4, 100, (2, 6))
    prev[:, 0] = model.decoder.dictionary.eos()
    new_order = torch.tensor([1, 0])
    with torch.no_grad():
        encoder_out = model.encoder(src, src_lengths=src.ne(pad).sum(1))
        full = model.decoder(prev, encoder_out)[0]
        full_swapped = model.decoder(prev[new_order], model.encoder.reorder_encoder_out(
            encoder_out, new_order))[0]
        state, steps = {}, []
        for t in range(6):
            if t == 3:  # a beam search step reorders hypotheses
                model.decoder.reorder_incremental_state_scripting(state, new_order)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, new_order)
                prev = prev[new_order]
            steps.append(model.decoder(prev[:, :t + 1], encoder_out, incremental_state=state)[0])
    torch.testing.assert_close(torch.cat(steps[:3], 1), full[:, :3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps[3:], 1), full_swapped[:, 3:], atol=1e-5,
                               rtol=1e-5)


class _Gathers(TorchDispatchMode):
    """The output shape of every index_select (how beam search reorders its caches)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.index_select.default:
            self.shapes.append(tuple(out.shape))
        return out


def _beam_search(model, sample, share_encoder_keys):
    generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=4, max_len_b=12)
    if not share_encoder_keys:  # the encoder keys/values per hypothesis, reordered every step
        model.set_beam_size(1)
    with torch.no_grad(), _Gathers() as gathers:
        hypotheses = generator.generate([model], sample)
    return hypotheses, gathers.shapes


def test_beam_search_keeps_encoder_keys_per_sentence_and_does_not_reorder_them():
    model = _perturbed_paths_model(0.3)
    pad = model.encoder.padding_idx
    src = torch.randint(4, 100, (4, 9))
    src[1, :3] = pad
    src[3, :5] = pad
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(pad).sum(1)}}
    before, gathers_before = _beam_search(model, sample, share_encoder_keys=False)
    after, gathers_after = _beam_search(model, sample, share_encoder_keys=True)
    for sentence_before, sentence_after in zip(before, after):
        for hypothesis_before, hypothesis_after in zip(sentence_before, sentence_after):
            assert torch.equal(hypothesis_before["tokens"], hypothesis_after["tokens"])
            torch.testing.assert_close(hypothesis_before["score"], hypothesis_after["score"])
    # per step, the only gathers that go are those of the encoder keys and values
    # [hypotheses, paths x heads, source length, head dim]: two per step and decoder layer
    encoder_keys = (4 * 4, 2 * 2, 9, 16)
    removed = Counter(gathers_before) - Counter(gathers_after)
    steps = len(before[0][0]["tokens"])
    assert removed == {encoder_keys: 2 * (steps - 1)}
    assert not Counter(gathers_after) - Counter(gathers_before)


def _translate(model, sample, beam):
    generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=beam, max_len_b=12)
    with torch.no_grad():
        return [(h[0]["tokens"], h[0]["score"]) for h in generator.generate([model], sample)]


def test_beam_1_after_beam_4_decodes_as_a_fresh_model():
    """fairseq tells the model its beam size only for beams > 1
    (EnsembleModel.set_decoder_beam_size), so a model that has decoded with beam 4 must not keep
    grouping the rows of a beam-1 search by 4, treating 4 sentences as one sentence's beams."""
    model = _perturbed_paths_model(0.3)
    fresh = copy.deepcopy(model)
    pad = model.encoder.padding_idx
    src = torch.randint(4, 100, (4, 9), generator=torch.Generator().manual_seed(0))
    src[1, :3] = pad
    src[3, :5] = pad
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(pad).sum(1)}}
    expected = _translate(fresh, sample, beam=1)
    _translate(model, sample, beam=4)
    for (tokens, score), (expected_tokens, expected_score) in zip(
            _translate(model, sample, beam=1), expected):
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(score, expected_score)
    # and beam 4 again after beam 1 (and 2) decodes as a fresh model's beam 4
    _translate(model, sample, beam=2)
    for (tokens, score), (expected_tokens, expected_score) in zip(
            _translate(model, sample, beam=4), _translate(copy.deepcopy(fresh), sample, beam=4)):
        assert torch.equal(tokens, expected_tokens)
        torch.testing.assert_close(score, expected_score)


@pytest.mark.parametrize("arch", ["multipath_transformer_wmt_en_de"] + [
    f"multipath_l{layers}_p{paths}_wmt_en_de" for layers, paths in MULTIPATH_PRESETS])
def test_every_arch_trains_with_tiny_overrides(arch):
    """One optimizer step of each preset (tiny dimensions from the command line) lowers the
    loss on its batch and moves the path weights."""
    model = _tiny(arch).train()
    model.encoder.dropout_module.p = model.decoder.dropout_module.p = 0.0
    src = torch.randint(4, 100, (3, 6))
    prev = torch.randint(4, 100, (3, 5))
    target = torch.randint(4, 100, (3, 5))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss():
        logits = model(src, torch.full((3,), 6), prev)[0]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 target.reshape(-1))

    before = loss()
    weights = model.encoder.layers[0].ffn_mixer.path_weights.detach().clone()
    optimizer.zero_grad()
    before.backward()
    optimizer.step()
    assert loss().item() < before.item()
    assert not torch.equal(model.encoder.layers[0].ffn_mixer.path_weights, weights)


GRADIENT_GROUPS = (("alpha", "path_weights"), ("beta", "residual_weight"),
                   ("PathNorm", "path_norm."), ("embeddings", "embed_tokens"),
                   ("LayerNorm", "layer_norm"), ("attention", "attn"), ("FFN", ""))


def _gradients_at_init(arch, precision="fp32", loss_scale=1.0):
    """Parameter gradients of ``arch`` at d 256 (FFN 1024, 4 heads; 2 encoder layers, 1 decoder
    layer) on one fixed batch of 32 x 32 tokens, with fairseq's summed label-smoothed loss times
    ``loss_scale``; precision "fp16" is fairseq's --fp16 (the model in half precision), "amp"
    its --amp (fp32 parameters, fp16 autocast). d 256 rather than the paper's 512: half
    precision runs slowly on CPUs (the four calls took 275 s at d 512, 70 s at d 256), and
    alpha and beta lead the gradients at both sizes."""
    torch.manual_seed(1)
    width = ["--encoder-embed-dim", "256", "--decoder-embed-dim", "256",
             "--encoder-ffn-embed-dim", "1024", "--decoder-ffn-embed-dim", "1024",
             "--encoder-attention-heads", "4", "--decoder-attention-heads", "4"]
    model = build_model(arch, 1000, ["--encoder-layers", "2", "--decoder-layers", "1",
                                     "--dropout", "0", *width], device="cpu").train()
    if precision == "fp16":
        model = model.half()
    batch = torch.Generator().manual_seed(0)
    src, prev, target = (torch.randint(4, 1000, (32, 32), generator=batch) for _ in range(3))
    prev[:, 0] = model.decoder.dictionary.eos()
    with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "amp"):
        logits = model(src, torch.full((32,), 32), prev)[0]
    lprobs = torch.log_softmax(logits.float(), -1).view(-1, logits.size(-1))
    loss, _ = label_smoothed_nll_loss(lprobs, target.view(-1), 0.1, ignore_index=1)
    (loss * loss_scale).backward()
    groups = {}
    for name, parameter in model.named_parameters():
        group = next(group for group, part in GRADIENT_GROUPS if part in name)
        groups.setdefault(group, []).append(parameter.grad)
    return groups


def _max_abs(gradients):
    return max(g.abs().max().item() for g in gradients)


@pytest.mark.slow
def test_alpha_beta_gradients_cap_the_fp16_loss_scale_but_not_amps():
    # alpha and beta sum their gradients over every token and channel: at init they are the
    # largest in the model, several times the stock Transformer's largest, so in a half
    # precision model (--fp16) they overflow fp16 at a loss scale the stock model takes.
    # Under --amp (fp32 parameters) they are reduced in fp32 and do not overflow: the
    # precision docs/fidelity.md recommends for multi-path models on GPUs.
    stock = {group: _max_abs(g) for group, g in
             _gradients_at_init("transformer_prenorm_wmt_en_de").items()}
    multipath = {group: _max_abs(g) for group, g in
                 _gradients_at_init("multipath_transformer").items()}
    largest_stock = max(stock.values())
    largest_alpha_beta = max(multipath["alpha"], multipath["beta"])
    assert largest_alpha_beta > 2 * largest_stock, (multipath, stock)
    assert all(value <= 2 * largest_stock for group, value in multipath.items()
               if group not in ("alpha", "beta")), (multipath, stock)
    fp16_max = torch.finfo(torch.float16).max
    # the smallest power-of-two loss scale at which alpha/beta overflow fp16; the stock model
    # has twice the headroom there
    loss_scale = 2.0 ** math.ceil(math.log2(fp16_max / largest_alpha_beta))
    assert loss_scale * largest_stock < fp16_max / 2
    half = _gradients_at_init("multipath_transformer", "fp16", loss_scale)
    assert not all(torch.isfinite(g).all() for g in half["alpha"] + half["beta"])
    assert all(torch.isfinite(g).all() for group, gradients in half.items()
               if group not in ("alpha", "beta") for g in gradients)
    amp = _gradients_at_init("multipath_transformer", "amp", loss_scale)
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all()
               for gradients in amp.values() for g in gradients)


def test_fp16_with_learnable_weights_recommends_amp(caplog):
    _tiny("multipath_transformer", "--fp16")
    assert "--amp keeps them in fp32" in caplog.text
    caplog.clear()
    _tiny("multipath_transformer", "--amp")
    _tiny("multipath_transformer", "--fp16", "--path-weights", "fixed")
    assert "--amp" not in caplog.text


def _train(data, save_dir, *flags, updates):
    return run_fairseq("train", data, "--arch", "multipath_transformer", *TINY_MODEL,
                       *TRAIN_FLAGS, "--save-dir", save_dir, "--max-update", str(updates),
                       "--no-epoch-checkpoints", *flags)


def _generate(data, checkpoint, *flags):
    proc = run_fairseq("generate", data, "--path", checkpoint, "--beam", "2", "--cpu",
                       "--max-tokens", "400", "--gen-subset", "test", *flags)
    hypotheses = [line for line in proc.stdout.splitlines() if line.startswith("H-")]
    assert len(hypotheses) == 40, proc.stdout[-2000:]
    assert "Generate test with beam=2" in proc.stdout + proc.stderr
    return hypotheses


@pytest.mark.slow
def test_train_resume_generate_with_paths_cheap_features_and_decoder_paths(toy_data_bin,
                                                                          tmp_path):
    flags = ["--encoder-paths", "3", "--cheap-features", "--decoder-paths", "2"]
    _train(toy_data_bin, tmp_path, *flags, updates=3)
    proc = _train(toy_data_bin, tmp_path, *flags, updates=5)
    log = proc.stdout + proc.stderr
    assert re.search(r"[Ll]oaded checkpoint .*checkpoint_last\.pt \(epoch 1 @ 3 updates\)", log)
    assert "num_updates=5" in log and "num_updates=1," not in log
    _generate(toy_data_bin, tmp_path / "checkpoint_last.pt")


@pytest.mark.slow
def test_memory_efficient_fp16_trains_and_decodes_on_cpu(toy_data_bin, tmp_path):
    _train(toy_data_bin, tmp_path, "--encoder-paths", "2", "--decoder-paths", "2",
           "--memory-efficient-fp16", updates=2)
    checkpoint = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu",
                            weights_only=False)
    assert all(torch.isfinite(v.float()).all() for v in checkpoint["model"].values())
    _generate(toy_data_bin, tmp_path / "checkpoint_last.pt", "--fp16")
