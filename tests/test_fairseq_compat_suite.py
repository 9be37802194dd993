"""fairseq stays fairseq (issue #34): the cases of fairseq v0.12.3's own test suite that passed
without the plug-in and failed with its patches installed, reproduced here (fairseq's test files
are in no package; ``scripts/fairseq-tests.sh`` runs them, ``docs/fairseq-tests.md``).

* TorchScript (fairseq's tests/test_export.py, 4 tests, and
  tests/test_sequence_generator.py::TestJitSequenceGenerator, 3): ``torch.jit.script`` of
  fairseq's MultiheadAttention, of a Transformer built by ``build_model`` and of its
  SequenceGenerator failed on the attention patch's wrapper of ``MultiheadAttention.forward``.
* Incremental decoding (tests/test_roberta.py::test_roberta_incremental_decoder, 1): a decoder
  fairseq builds outside ``TransformerModelBase.build_model`` (RoBERTa's encoder-decoder) gave a
  full pass that differed in the last bits from incremental decoding, because every
  encoder-decoder attention took the SDPA path.
"""

import pytest
import torch
from conftest import TINY_MODEL

from fairseq import options
from fairseq.data import Dictionary
from fairseq.models.transformer import TransformerDecoder
from fairseq.modules.multihead_attention import MultiheadAttention
from fairseq.sequence_generator import EnsembleModel, SequenceGenerator
from multipath_nmt.params import build_model

# --- TorchScript --------------------------------------------------------------------------


def _scripted_round_trip(module, tmp_path):
    scripted = torch.jit.script(module)
    scripted.save(str(tmp_path / "scripted.pt"))
    return scripted, torch.jit.load(str(tmp_path / "scripted.pt"))


def _transformer(*flags):
    torch.manual_seed(0)
    model = build_model("transformer", 60, [*TINY_MODEL, "--dropout", "0", *flags], device="cpu")
    # built by TransformerModelBase.build_model: the attention patch's dispatch is in place
    assert model.decoder.layers[0].self_attn.mask_is_causal
    return model.eval()


def _source():
    src = torch.randint(4, 60, (2, 7))
    src[0, :2] = 1  # left padding
    src[:, -1] = 2
    return {"net_input": {"src_tokens": src, "src_lengths": src.ne(1).sum(1)}}


def test_multihead_attention_scripts_saves_and_loads(tmp_path):
    module = MultiheadAttention(embed_dim=8, num_heads=2)
    scripted, loaded = _scripted_round_trip(module, tmp_path)
    x = torch.randn(5, 3, 8)
    expected = module(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(loaded(x, x, x, need_weights=False)[0], expected)


def test_scripted_attentions_keep_their_own_incremental_state():
    first = torch.jit.script(MultiheadAttention(embed_dim=8, num_heads=2))
    second = torch.jit.script(MultiheadAttention(embed_dim=8, num_heads=2))
    state = first.set_incremental_state({}, "key", {"a": torch.tensor([1])})
    state = second.set_incremental_state(state, "key", {"a": torch.tensor([2])})
    assert first.get_incremental_state(state, "key")["a"].item() == 1
    assert second.get_incremental_state(state, "key")["a"].item() == 2


@pytest.mark.parametrize("flags", [[], ["--no-token-positional-embeddings"]], ids=["", "no-pos"])
def test_transformer_scripts_as_fairseqs_and_computes_the_same(flags, tmp_path):
    model = _transformer(*flags)
    _, loaded = _scripted_round_trip(model, tmp_path)
    sample = _source()["net_input"]
    prev = torch.randint(4, 60, (2, 5))
    expected = model(sample["src_tokens"], sample["src_lengths"], prev)[0]
    actual = loaded(sample["src_tokens"], sample["src_lengths"], prev)[0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_sequence_generator_and_ensemble_script_and_translate_as_eager(tmp_path):
    model = _transformer()
    torch.jit.script(EnsembleModel([model]))
    dictionary = model.decoder.dictionary
    generator = SequenceGenerator([model], dictionary, beam_size=2, no_repeat_ngram_size=2,
                                  max_len_b=10)
    _, loaded = _scripted_round_trip(generator, tmp_path)
    sample = _source()
    eager = generator.generate([model], sample)
    scripted = loaded(sample)
    for eager_hypos, scripted_hypos in zip(eager, scripted):
        for e, s in zip(eager_hypos, scripted_hypos):
            assert torch.equal(e["tokens"], s["tokens"])
            torch.testing.assert_close(e["positional_scores"], s["positional_scores"],
                                       atol=1e-4, rtol=1e-4)


def test_scripting_leaves_the_eager_model_its_attention_dispatch():
    model = _transformer()
    torch.jit.script(model)
    assert model.decoder.layers[0].self_attn.mask_is_causal
    assert type(model.decoder.layers[0].self_attn) is MultiheadAttention


# --- incremental decoding of a decoder built outside build_model --------------------------

def test_decoder_built_outside_build_model_computes_fairseqs_numbers(monkeypatch):
    # RoBERTa's toy encoder-decoder of fairseq's test (12 dims, 4 heads, 3 layers), in training
    # mode with dropout 0, as there: fairseq's test compares incremental decoding with a full
    # pass bit for bit, so the full pass has to be fairseq's own to the last bit
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "unused", "--arch", "transformer", "--decoder-embed-dim", "12",
        "--decoder-ffn-embed-dim", "14", "--decoder-attention-heads", "4", "--decoder-layers", "3",
        "--encoder-embed-dim", "12", "--dropout", "0", "--attention-dropout", "0"])
    dictionary = Dictionary()
    for i in range(40):
        dictionary.add_symbol(f"w{i}")
    torch.manual_seed(0)
    decoder = TransformerDecoder(args, dictionary,
                                 torch.nn.Embedding(len(dictionary), 12, dictionary.pad()))
    encoder_out = {"encoder_out": [torch.randn(9, 2, 12)],
                   "encoder_padding_mask": [torch.zeros(2, 9, dtype=torch.bool)]}
    tokens = torch.randint(4, len(dictionary), (2, 6))
    full = decoder(tokens, encoder_out=encoder_out)[0]
    monkeypatch.setattr(MultiheadAttention, "forward", MultiheadAttention.fairseq_forward)
    assert torch.equal(full, decoder(tokens, encoder_out=encoder_out)[0])


def test_unmarked_encoder_decoder_attention_is_fairseqs_own():
    torch.manual_seed(0)
    attention = MultiheadAttention(16, 4, kdim=16, vdim=16, encoder_decoder_attention=True)
    query, memory = torch.randn(5, 3, 16), torch.randn(9, 3, 16)
    padding = torch.zeros(3, 9, dtype=torch.bool)
    padding[1, -3:] = True
    out = attention(query, memory, memory, key_padding_mask=padding, static_kv=True,
                    need_weights=False)[0]
    expected = attention.fairseq_forward(query, memory, memory, key_padding_mask=padding,
                                         static_kv=True, need_weights=False)[0]
    assert torch.equal(out, expected)

