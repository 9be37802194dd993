"""fairseq stays fairseq (issue #34): the cases of fairseq v0.12.3's own test suite that passed
without the plug-in and failed with its patches installed, reproduced here (fairseq's test files
are in no package; ``scripts/fairseq-tests.sh`` runs them, ``docs/fairseq-tests.md``).

* TorchScript (fairseq's tests/test_export.py, 4 tests, and
  tests/test_sequence_generator.py::TestJitSequenceGenerator, 3): ``torch.jit.script`` of
  fairseq's MultiheadAttention, of a Transformer built by ``build_model`` and of its
  SequenceGenerator failed on the attention patch's wrapper of ``MultiheadAttention.forward``.
* Resume (tests/test_train.py::TestLoadCheckpoint, 4): ``checkpoint_utils.load_checkpoint``
  asked ``os.path`` instead of fairseq's ``PathManager`` whether ``checkpoint_last.pt`` exists,
  and stopped on a path it could not check, so fairseq's first-launch, fine-tune and resume
  logic (and storage served by ``PathManager``) was bypassed.
* Incremental decoding (tests/test_roberta.py::test_roberta_incremental_decoder, 1): a decoder
  fairseq builds outside ``TransformerModelBase.build_model`` (RoBERTa's encoder-decoder) gave a
  full pass that differed in the last bits from incremental decoding, because every
  encoder-decoder attention took the SDPA path.
* Asynchronous saves (tests/test_checkpoint_utils.py::test_torch_persistent_save_async, 1): the
  first fix of ``--write-checkpoints-asynchronously`` called ``torch.save`` itself instead of
  fairseq's ``_torch_persistent_save`` (its three attempts).

And the script itself: it tells a test that passes only without the plug-in from one that passes
only with it.
"""
import io
import sys
from unittest.mock import MagicMock, patch

import pytest
import torch
from conftest import ROOT, TINY_MODEL, clean_env, run_cli
from omegaconf import OmegaConf

from fairseq import checkpoint_utils, options
from fairseq.data import Dictionary, EpochBatchIterator, LanguagePairDataset, TokenBlockDataset
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


# --- checkpoint_utils.load_checkpoint through fairseq's PathManager -------------------------

def _trainer_and_iterator(epoch, epoch_size, num_updates, iterations_in_epoch):
    """A trainer whose load_checkpoint returns these iterator positions, as fairseq's test."""
    trainer = MagicMock()
    trainer.load_checkpoint.return_value = {"train_iterator": {
        "epoch": epoch, "iterations_in_epoch": iterations_in_epoch, "shuffle": False}}
    trainer.get_num_updates.return_value = num_updates
    dictionary = MagicMock()
    dictionary.pad.return_value, dictionary.eos.return_value, dictionary.unk.return_value = 1, 2, 3
    tokens = torch.arange(epoch_size).view(1, -1)
    blocks = TokenBlockDataset(tokens, sizes=[tokens.size(-1)], block_size=1, pad=0, eos=1,
                               include_targets=False)
    dataset = LanguagePairDataset(blocks, blocks.sizes, dictionary, shuffle=False)
    iterator = EpochBatchIterator(dataset=dataset, collate_fn=dataset.collater,
                                  batch_sampler=[[i] for i in range(epoch_size)])
    trainer.get_train_iterator = MagicMock(return_value=iterator)
    return trainer


def _checkpoint_cfg(finetune_from_model=None):
    return OmegaConf.create({
        "save_dir": None, "optimizer_overrides": "{}", "reset_dataloader": False,
        "reset_meters": False, "reset_optimizer": False, "reset_lr_scheduler": False,
        "finetune_from_model": finetune_from_model, "model_parallel_size": 1,
        "restore_file": "checkpoint_last.pt"})


@pytest.fixture
def fairseqs_file_system():
    """The file system as fairseq's test mocks it: os.path says every file exists,
    fairseq's PathManager says none does (a first launch)."""
    mocks = {"os.makedirs": MagicMock(), "os.path.join": MagicMock(),
             "os.path.isfile": MagicMock(return_value=True),
             "os.path.isabs": MagicMock(return_value=False),
             "fairseq.file_io.PathManager.exists": MagicMock(return_value=False)}
    patches = [patch(target, mock) for target, mock in mocks.items()]
    for p in patches:
        p.start()
    yield mocks
    for p in patches:
        p.stop()


@pytest.mark.parametrize("num_updates,iterations,epoch,position", [
    (200, 50, 2, 50),   # saved in the middle of epoch 2: resumes there
    (300, 150, 3, 0),   # saved at its end: epoch 3 from its start
], ids=["partial", "full"])
def test_resume_decides_through_pathmanager_and_restores_the_iterator(
        fairseqs_file_system, num_updates, iterations, epoch, position):
    trainer = _trainer_and_iterator(2, 150, num_updates, iterations)
    _, iterator = checkpoint_utils.load_checkpoint(_checkpoint_cfg(), trainer)
    batches = iterator.next_epoch_itr(shuffle=False)
    assert (iterator.epoch, iterator.iterations_in_epoch) == (epoch, position)
    assert next(batches)["net_input"]["src_tokens"][0].item() == position


def test_finetune_from_model_on_a_first_launch_resets_everything(fairseqs_file_system):
    pretrained = "/temp/checkpoint_pretrained.pt"
    fairseqs_file_system["fairseq.file_io.PathManager.exists"].side_effect = (
        lambda path: path == pretrained)
    trainer = _trainer_and_iterator(1, 150, 0, 0)
    checkpoint_utils.load_checkpoint(_checkpoint_cfg(pretrained), trainer)
    path, reset_optimizer, reset_lr_scheduler, _ = trainer.load_checkpoint.call_args[0]
    assert path == pretrained
    assert reset_optimizer and reset_lr_scheduler
    assert trainer.load_checkpoint.call_args[1]["reset_meters"]


def test_finetune_from_model_with_a_checkpoint_last_resumes_it(fairseqs_file_system):
    # PathManager says checkpoint_last.pt exists, at a path (os.path.join is mocked) that the
    # plug-in cannot open: fairseq resumes it, as without the plug-in
    fairseqs_file_system["fairseq.file_io.PathManager.exists"].return_value = True
    trainer = _trainer_and_iterator(1, 150, 0, 0)
    checkpoint_utils.load_checkpoint(_checkpoint_cfg("/temp/checkpoint_pretrained.pt"), trainer)
    path, reset_optimizer, reset_lr_scheduler, _ = trainer.load_checkpoint.call_args[0]
    assert path is fairseqs_file_system["os.path.join"].return_value
    assert not (reset_optimizer or reset_lr_scheduler)
    assert not trainer.load_checkpoint.call_args[1]["reset_meters"]


# --- checkpoint_utils.torch_persistent_save(async_write=True) ------------------------------

def test_asynchronous_save_goes_through_fairseqs_save_and_iopaths_writer():
    """fairseq's own test: the file is opened with PathManager.opena, the checkpoint is saved by
    _torch_persistent_save (into memory first here, for a readable file: test_checkpoints.py)."""
    state = {"weight": torch.ones(2)}
    with patch("fairseq.checkpoint_utils.PathManager.opena") as opena, \
            patch("fairseq.checkpoint_utils._torch_persistent_save",
                  side_effect=checkpoint_utils._torch_persistent_save) as save:
        checkpoint_utils.torch_persistent_save(state, "async_checkpoint.pt", async_write=True)
    opena.assert_called_with("async_checkpoint.pt", "wb")
    assert save.call_count == 1 and save.call_args[0][0] is state
    written = opena.return_value.__enter__.return_value.write.call_args[0][0]
    assert torch.equal(torch.load(io.BytesIO(bytes(written)))["weight"], torch.ones(2))


# --- scripts/fairseq-tests.sh ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.process
def test_fairseq_tests_script_names_what_passes_only_without_or_only_with_the_plug_in(tmp_path):
    checkout = tmp_path / "fairseq"
    (checkout / "tests").mkdir(parents=True)
    (checkout / "tests" / "__init__.py").write_text("")
    (checkout / "tests" / "test_probe.py").write_text(
        "import sys\n\n\n"
        "def test_without_the_plug_in():\n    assert 'multipath_nmt' not in sys.modules\n\n\n"
        "def test_with_the_plug_in():\n"
        "    from fairseq.modules.multihead_attention import MultiheadAttention\n"
        "    assert hasattr(MultiheadAttention, 'fairseq_forward')  # the patches are in\n\n\n"
        "def test_either():\n    pass\n")
    # an inherited MULTIPATH_NMT_PATCHES=off does not empty the plug-in run
    proc = run_cli(["bash", ROOT / "scripts" / "fairseq-tests.sh", checkout], check=False,
                   env=clean_env(PYTHON=sys.executable, OUT=str(tmp_path / "out"),
                                 MULTIPATH_NMT_PATCHES="off"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "plain:   1 failed, 2 passed" in proc.stdout
    assert "plug-in: 1 failed, 2 passed" in proc.stdout
    assert ("passes only without the plug-in (a regression): "
            "tests/test_probe.py::test_without_the_plug_in") in proc.stdout
    assert "passes only with the plug-in: tests/test_probe.py::test_with_the_plug_in" in proc.stdout
    assert (tmp_path / "out" / "plain.passed").read_text().splitlines() == [
        "tests/test_probe.py::test_either", "tests/test_probe.py::test_without_the_plug_in"]


def test_a_checkpoint_config_without_the_asynchronous_flag_saves_as_fairseq_does():
    """fairseq's tests/test_checkpoint_utils_for_task_level_attributes.py builds a checkpoint config
    by hand without ``write_checkpoints_asynchronously``; the patch read the key and raised, and
    the mocks that test had started stayed in place for every later test of fairseq's suite."""
    from multipath_nmt.fairseq_patches import checkpoints as checkpoint_patches

    saved = []
    save = checkpoint_patches._copies_written_asynchronously(lambda *args: saved.append(args))
    cfg = OmegaConf.create({"save_dir": "/tmp/ckpt"})
    OmegaConf.set_struct(cfg, True)  # a missing key raises, as in fairseq's configs
    save(cfg, "trainer", "epoch_itr", 1.0)
    assert saved == [(cfg, "trainer", "epoch_itr", 1.0)]
