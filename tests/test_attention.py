"""multipath_nmt.fairseq_patches.attention: decoder self-attention with is_causal instead of mask
tensors, exact against fairseq's masked path; and what every attention call site passes to SDPA
(multipath_nmt.benchmark.attention_calls)."""
import warnings

import pytest
import torch
from conftest import TINY_MODEL

from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import SequenceGenerator
from multipath_nmt.benchmark.attention_calls import (
    attention_calls,
    flash_attention_verdict,
    format_attention_calls,
)
from multipath_nmt.fairseq_patches.attention import mark_decoder_self_attention
from multipath_nmt.params import build_model
from multipath_nmt.modules.multipath import MultiPathAttention

PAD = 1
NO_SDPA = "no SDPA (explicit softmax)"
ARCHS = {
    "stock": ("transformer_prenorm_wmt_en_de", []),
    "multipath encoder": ("multipath_transformer", ["--encoder-paths", "3"]),
    "multipath decoder": ("multipath_transformer", ["--decoder-paths", "2"]),
}


def _model(name, *flags):
    arch, arch_flags = ARCHS[name]
    torch.manual_seed(0)
    # two decoder layers: fairseq's last one returns its cross-attention weights (alignment)
    model = build_model(arch, 100, [*TINY_MODEL, *arch_flags, "--decoder-layers", "2",
                                    "--dropout", "0", *flags], device="cpu").double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _batch(source_padding=True, target_padding=True):
    src = torch.randint(4, 100, (3, 7))
    if source_padding:
        src[1, :2] = PAD  # fairseq left-pads sources
    prev = torch.randint(4, 100, (3, 6))
    prev[:, 0] = 2
    if target_padding:
        prev[2, -2:] = PAD  # and right-pads targets
    return src, prev


def _outputs_and_gradients(model, src, prev):
    """Decoder output at the non-padded target positions and every parameter's gradient of a
    loss over those positions (what the criterion sees)."""
    model.train()
    model.zero_grad()
    out = model(src, src.ne(PAD).sum(1), prev)[0]
    kept = out[prev.ne(PAD)]
    (kept * torch.randn(kept.shape, generator=torch.Generator().manual_seed(1),
                        dtype=kept.dtype)).sum().backward()
    return kept.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _causal_masks(model):
    """The self-attentions given fairseq's causal mask as a tensor again (the code before
    is_causal): fairseq's attentions unmarked, multi-path ones given a bool mask."""
    mark_decoder_self_attention(model.decoder, trailing_padding=False)
    for module in model.modules():
        if isinstance(module, MultiheadAttention):
            module.mask_is_causal = False
        if isinstance(module, MultiPathAttention) and not module.encoder_decoder_attention:
            module.forward = _causal_mask_tensor(module.forward)


def _causal_mask_tensor(forward):
    def masked(query, *args, is_causal=False, **kwargs):
        if is_causal:
            kwargs["attn_mask"] = torch.ones(len(query), len(query), dtype=torch.bool).triu(1)
        return forward(query, *args, **kwargs)

    return masked


@pytest.mark.parametrize("name", ["stock", "multipath decoder"])
@pytest.mark.parametrize("target_padding", [True, False])
def test_causal_self_attention_is_exact_at_every_unpadded_position(name, target_padding):
    model = _model(name)
    src, prev = _batch(target_padding=target_padding)
    calls = attention_calls(model, lambda: _outputs_and_gradients(model, src, prev))
    site = "decoder self-attn" + (" (multi-path)" if name != "stock" else "")
    assert set(calls[site]) == {"is_causal"}
    out, grads = _outputs_and_gradients(model, src, prev)
    _causal_masks(model)
    calls = attention_calls(model, lambda: _outputs_and_gradients(model, src, prev))
    assert "is_causal" not in calls[site]
    expected_out, expected_grads = _outputs_and_gradients(model, src, prev)
    torch.testing.assert_close(out, expected_out, atol=1e-10, rtol=1e-10)
    for n, g in grads.items():
        torch.testing.assert_close(g, expected_grads[n], atol=1e-10, rtol=1e-10, msg=n)


@pytest.mark.parametrize("source_padding", [True, False])
def test_encoder_decoder_attention_takes_the_sdpa_path_with_fairseqs_numbers(source_padding,
                                                                             monkeypatch):
    # fairseq's own path computes the softmax in fp32 (utils.softmax) even for a float64
    # model: the same numbers up to fp32 rounding. The encoder's padding mask reaches the
    # decoder even when nothing is padded (fairseq's encoder returns it either way), so the
    # cross-attention always gets a mask.
    model = _model("stock")
    src, prev = _batch(source_padding=source_padding)
    calls = attention_calls(model, lambda: _outputs_and_gradients(model, src, prev))
    assert set(calls["decoder cross-attn"]) == {"float mask", NO_SDPA}
    out, grads = _outputs_and_gradients(model, src, prev)
    monkeypatch.setattr(MultiheadAttention, "forward", MultiheadAttention.fairseq_forward)
    expected_out, expected_grads = _outputs_and_gradients(model, src, prev)
    torch.testing.assert_close(out, expected_out, atol=1e-6, rtol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(g, expected_grads[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("name", ["stock", "multipath decoder"])
def test_left_padded_targets_keep_the_masks(name):
    model = _model(name, "--left-pad-target")
    src, prev = _batch(target_padding=False)
    prev = torch.cat([torch.full((3, 2), PAD), prev[:, :-2]], 1)
    prev[:2] = torch.randint(4, 100, (2, 6))
    calls = attention_calls(model, lambda: model(src, src.ne(PAD).sum(1), prev))
    site = "decoder self-attn" + (" (multi-path)" if name != "stock" else "")
    assert "is_causal" not in calls[site]
    # without padding is_causal is exact whatever the side
    src, prev = _batch(target_padding=False)
    calls = attention_calls(model, lambda: model(src, src.ne(PAD).sum(1), prev))
    assert set(calls[site]) == {"is_causal"}


def _call_sites(model, source_padding):
    src, prev = _batch(source_padding=source_padding)
    model.train()
    training = attention_calls(model, lambda: model(src, src.ne(PAD).sum(1), prev))
    model.eval()
    generator = SequenceGenerator([model], model.decoder.dictionary, beam_size=2, max_len_b=3)
    sample = {"net_input": {"src_tokens": src, "src_lengths": src.ne(PAD).sum(1)}}
    inference = attention_calls(model, lambda: generator.generate([model], sample))
    return {"training": training, "inference": inference}



@pytest.mark.parametrize("name,source_padding,expected", [
    ("stock", True, {
        "training": {"encoder self-attn": {"float mask"},
                     "decoder self-attn": {"is_causal"},
                     # fairseq's last decoder layer returns its attention weights (alignment)
                     "decoder cross-attn": {"float mask", NO_SDPA}},
        # fairseq's incremental decoding computes attention itself
        "inference": {"encoder self-attn": {"float mask"}, "decoder self-attn": {NO_SDPA},
                      "decoder cross-attn": {NO_SDPA}}}),
    ("stock", False, {
        "training": {"encoder self-attn": {"no mask"}, "decoder self-attn": {"is_causal"},
                     "decoder cross-attn": {"float mask", NO_SDPA}},
        "inference": {"encoder self-attn": {"no mask"}, "decoder self-attn": {NO_SDPA},
                      "decoder cross-attn": {NO_SDPA}}}),
    ("multipath encoder", True, {
        "training": {"encoder self-attn (multi-path)": {"bool mask"},
                     "decoder self-attn": {"is_causal"},
                     "decoder cross-attn": {"float mask", NO_SDPA}},
        "inference": {"encoder self-attn (multi-path)": {"bool mask"},
                      "decoder self-attn": {NO_SDPA}, "decoder cross-attn": {NO_SDPA}}}),
    ("multipath decoder", True, {
        "training": {"encoder self-attn (multi-path)": {"bool mask"},
                     "decoder self-attn (multi-path)": {"is_causal"},
                     "decoder cross-attn (multi-path)": {"bool mask"}},
        "inference": {"encoder self-attn (multi-path)": {"bool mask"},
                      "decoder self-attn (multi-path)": {"no mask"},
                      "decoder cross-attn (multi-path)": {"bool mask"}}}),
    ("multipath decoder", False, {
        "training": {"encoder self-attn (multi-path)": {"no mask"},
                     "decoder self-attn (multi-path)": {"is_causal"},
                     "decoder cross-attn (multi-path)": {"bool mask"}},
        "inference": {"encoder self-attn (multi-path)": {"no mask"},
                      "decoder self-attn (multi-path)": {"no mask"},
                      "decoder cross-attn (multi-path)": {"bool mask"}}}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_mask_passed_to_sdpa_per_call_site(name, source_padding, expected):
    calls = _call_sites(_model(name), source_padding)
    assert {phase: {site: set(kinds) for site, kinds in sites.items()}
            for phase, sites in calls.items()} == expected
    table = format_attention_calls(calls)
    assert table[0] == "| call site | phase | mask passed to SDPA | fused kernels it allows |"
    assert any("| decoder self-attn" in row and "| is_causal | flash, efficient |" in row
               for row in table)


def test_flash_verdict_gives_torchs_reasons(monkeypatch):
    """On a GPU, a call site where flash attention cannot run says why, in torch's words (the
    warnings of can_use_flash_attention(debug=True)); the table prints it for the masks that
    would allow flash."""
    def refuse(params, debug=False):
        assert debug
        warnings.warn("Flash attention requires q, k and v to be 4-dimensional")
        warnings.warn("Flash attention does not support float32")
        return False

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", refuse)
    reason = flash_attention_verdict(params=None)
    assert reason == ("Flash attention requires q, k and v to be 4-dimensional; "
                      "Flash attention does not support float32")
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention",
                        lambda params, debug=False: True)
    assert flash_attention_verdict(params=None) is True
    table = format_attention_calls({"training": {
        "encoder self-attn": {"no mask": reason}, "decoder self-attn": {"is_causal": True},
        "decoder cross-attn": {"float mask": reason}}})
    assert table[2:] == [
        "| decoder cross-attn | training | float mask | efficient |",
        "| decoder self-attn | training | is_causal | flash, efficient (flash: yes) |",
        f"| encoder self-attn | training | no mask | flash, efficient (flash: no, {reason}) |"]
