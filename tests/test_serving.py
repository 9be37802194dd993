"""Serving paths (docs/serving.md, multipath_nmt.serving).

TorchScript: the stock baselines and a folded EWA model script as in fairseq and compute what the
eager model computes; the multi-path, WideNet, EWA (unfolded) and ParameterNet models do not
script, for the reasons docs/serving.md gives.

CTranslate2: the dense models (pre-norm and deep baselines, a folded EWA model), converted by
``multipath-ctranslate2 convert``, translate the toy test set to exactly fairseq-generate's
output at beam 1 and 4 in fp32; the models CTranslate2 cannot express are refused with the
reason."""
import argparse

import pytest
import torch
from conftest import (FAST_LEARNING, TINY_MODEL, TRAIN_FLAGS, generate_hypotheses, run_fairseq,
                      run_tool)
from helpers import in_process

from multipath_nmt.ewa.folding import fold_state_dict
from multipath_nmt.params import build_model
from multipath_nmt.serving import CTRANSLATE2_LIMITS, MOE_LIMITS, ctranslate2_obstacle, translate

NO_CTRANSLATE2 = "CTranslate2 is not installed (pip install ctranslate2): no round trip"


@pytest.fixture
def ctranslate2():
    return pytest.importorskip("ctranslate2", reason=NO_CTRANSLATE2)


# --- TorchScript --------------------------------------------------------------------------

def _inputs():
    torch.manual_seed(1)
    src = torch.randint(4, 60, (2, 7))
    src[0, :2] = 1  # left padding
    src[:, -1] = 2
    return src, src.ne(1).sum(1), torch.randint(4, 60, (2, 5))


def _eager(model):
    return model.eval()(*_inputs())[0]


def _scripted(model):
    return torch.jit.script(model.eval())(*_inputs())[0]


@pytest.mark.parametrize("arch,flags", [
    ("transformer_prenorm_wmt_en_de", []),
    ("transformer_deep12_wmt_en_de", ["--encoder-layers", "4"]),
], ids=["prenorm", "deep"])
def test_stock_baselines_script_and_compute_what_the_eager_model_does(arch, flags):
    torch.manual_seed(0)
    model = build_model(arch, 60, [*TINY_MODEL, *flags], device="cpu")
    torch.testing.assert_close(_scripted(model), _eager(model), atol=1e-5, rtol=1e-5)


def test_folded_ewa_model_scripts_and_computes_what_the_ewa_model_does():
    torch.manual_seed(0)
    ewa = build_model("ewa_transformer_wmt_en_de", 60, [*TINY_MODEL, "--ewa-layers", "last-4"],
                      device="cpu")
    with torch.no_grad():  # experts that differ, so that folding averages something
        for name, p in ewa.named_parameters():
            if ".ffn." in name:
                p.add_(0.1 * torch.randn_like(p))
    stock = build_model("transformer_prenorm_wmt_en_de", 60, TINY_MODEL, device="cpu")
    stock.load_state_dict(fold_state_dict(ewa.state_dict()))
    torch.testing.assert_close(_scripted(stock), _eager(ewa), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,flags,error", [
    # TorchScript compiles both branches of MultiPathAttention.forward, and a self-attention
    # has no q_proj (its projections are one in_proj); beyond that, PathNorm's fused sum is a
    # torch.autograd.Function, which TorchScript cannot compile
    ("multipath_transformer_wmt_en_de", ["--encoder-paths", "2", "--decoder-paths", "2"],
     "has no attribute 'q_proj'"),
    # the MoE family's models carry a Python forward hook (routing statistics dropped at
    # backward), which TorchScript compiles too; beyond that, expert dispatch and combine
    # (and ParameterNet's mixed projection) are torch.autograd.Functions
    ("widenet_transformer_wmt_en_de", [], "Comprehension ifs are not supported"),
    ("ewa_transformer_wmt_en_de", [], "Comprehension ifs are not supported"),
    ("parameternet_transformer_wmt_en_de", [], "Comprehension ifs are not supported"),
], ids=["multipath", "widenet", "ewa", "parameternet"])
def test_plug_in_models_that_do_not_script(arch, flags, error):
    # docs/serving.md says which and why; a change that makes one script fails here first
    model = build_model(arch, 60, [*TINY_MODEL, *flags], device="cpu").eval()
    with pytest.raises(Exception, match=error):
        torch.jit.script(model)


# --- CTranslate2: what it cannot express ----------------------------------------------------

@pytest.mark.parametrize("cfg,expected", [
    ({"arch": "transformer_prenorm_wmt_en_de"}, None),
    ({"arch": "transformer_deep24_wmt_en_de"}, None),
    ({"arch": "transformer"}, None),  # a folded EWA checkpoint
    ({"arch": "multipath_transformer_wmt_en_de"}, CTRANSLATE2_LIMITS["multipath_transformer"]),
    ({"arch": "widenet_transformer_wmt_en_de"}, CTRANSLATE2_LIMITS["widenet_transformer"]),
    ({"arch": "ewa_transformer_wmt_en_de", "encoder_ffn": "ewa"}, MOE_LIMITS["ewa"]),
    ({"arch": "parameternet_transformer_wmt_en_de", "encoder_ffn": "parameternet"},
     MOE_LIMITS["parameternet"]),
    ({"arch": "moe_transformer_wmt_en_de", "encoder_ffn": "moe"}, MOE_LIMITS["moe"]),
], ids=lambda v: v["arch"] if isinstance(v, dict) else None)
def test_ctranslate2_obstacle_of_each_model_family(cfg, expected):
    assert ctranslate2_obstacle(cfg) == expected
    assert ctranslate2_obstacle(argparse.Namespace(**cfg)) == expected


def test_early_ewa_is_a_routed_moe_at_inference():
    cfg = {"arch": "ewa_early_transformer_wmt_en_de", "encoder_ffn": "ewa", "ewa_stop_at": 0.5}
    assert "--ewa-stop-at" in ctranslate2_obstacle(cfg)


# --- CTranslate2: the round trip ------------------------------------------------------------

# the baseline and the EWA model are the session's (toy_learned_baseline_run, toy_ewa_run)
DEEP = ["--arch", "transformer_deep12_wmt_en_de", *TINY_MODEL, "--encoder-layers", "4",
        "--max-update", "300"]


@pytest.fixture(scope="module")
def dense_checkpoints(trains, toy_data_bin, toy_learned_baseline_run, toy_ewa_run, tmp_path_factory):
    """The baseline, a deeper baseline and an EWA model folded by multipath-convert-ewa, trained
    briefly on the toy corpus."""
    found = {"baseline": toy_learned_baseline_run / "checkpoint_last.pt"}
    folder = tmp_path_factory.mktemp("deep")
    run_fairseq("train", toy_data_bin, *TRAIN_FLAGS, *DEEP, *FAST_LEARNING, "--save-dir", folder)
    found["deep"] = folder / "checkpoint_last.pt"
    folded = tmp_path_factory.mktemp("folded") / "folded.pt"  # not next to the shared checkpoint
    run_tool("multipath-convert-ewa", toy_ewa_run / "checkpoint_last.pt", folded)
    found["folded ewa"] = folded
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["baseline", "deep", "folded ewa"])
def test_dense_models_translate_exactly_like_fairseq_generate(name, ctranslate2, dense_checkpoints,
                                                              toy_data_bin, tmp_path):
    checkpoint = dense_checkpoints[name]
    run_tool("multipath-ctranslate2", "convert", checkpoint, toy_data_bin, tmp_path / "ct2")
    source = [line.split() for line in
              (toy_data_bin.parent / "text" / "test.en").read_text().splitlines()]
    for beam in (1, 4):
        expected = generate_hypotheses(toy_data_bin, checkpoint, beam)
        assert len({tuple(h) for h in expected}) > len(expected) // 2  # not one degenerate output
        got = translate(tmp_path / "ct2", source, beam=beam, batch_size=16,
                        compute_type="float32").hypotheses
        assert got == expected, f"beam {beam}"


@pytest.mark.slow
def test_int8_model_and_the_translate_command(ctranslate2, dense_checkpoints, toy_data_bin,
                                              tmp_path):
    run_tool("multipath-ctranslate2", "convert", dense_checkpoints["baseline"], toy_data_bin,
             tmp_path / "int8", "--quantization", "int8")
    source = toy_data_bin.parent / "text" / "test.en"
    proc = run_tool("multipath-ctranslate2", "translate", tmp_path / "int8", "--input", source,
                    "--beam", "4")
    assert len(proc.stdout.splitlines()) == len(source.read_text().splitlines())
    assert "sentences/s), beam 4, compute type default" in proc.stderr
    again = run_tool("multipath-ctranslate2", "convert", dense_checkpoints["baseline"],
                     toy_data_bin, tmp_path / "int8", check=False)
    assert again.returncode == 1 and "exists (--force overwrites it)" in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize("arch,encoder_ffn,family", [
    ("multipath_transformer_wmt_en_de", None, "multipath_transformer"),
    ("widenet_transformer_wmt_en_de", None, "widenet_transformer"),
    ("parameternet_transformer_wmt_en_de", "parameternet", "parameternet"),
    ("ewa_transformer_wmt_en_de", "ewa", "ewa"),
], ids=["multipath", "widenet", "parameternet", "ewa"])
def test_convert_refuses_what_ctranslate2_cannot_express(arch, encoder_ffn, family, ctranslate2,
                                                         dense_checkpoints, toy_data_bin,
                                                         tmp_path):
    # the baseline's file relabelled: the refusal reads the config, before any weight
    state = torch.load(dense_checkpoints["baseline"], weights_only=False)
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = arch
    state["cfg"]["model"].encoder_ffn = encoder_ffn
    torch.save(state, tmp_path / "model.pt")
    proc = run_tool("multipath-ctranslate2", "convert", tmp_path / "model.pt", toy_data_bin,
                    tmp_path / "ct2", check=False)
    reason = {**CTRANSLATE2_LIMITS, **MOE_LIMITS}[family]
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"multipath-ctranslate2: error: {tmp_path / 'model.pt'}: "
                                   f"{arch} cannot run in CTranslate2: {reason}")
    assert not (tmp_path / "ct2").exists()


# --- CTranslate2: what convert and translate refuse, a folder written whole or not at all ---

def _ct2(*argv):
    from multipath_nmt.cli.ctranslate2 import main

    main([str(a) for a in argv])


def _refusal(*argv):
    """The one line ``multipath-ctranslate2 ARGV`` exits with."""
    from multipath_nmt.cli.ctranslate2 import main

    return in_process.refusal(main, argv)


@pytest.fixture
def baseline_checkpoint(toy_baseline_run):
    return toy_baseline_run / "checkpoint_last.pt"


def test_convert_refuses_a_data_bin_with_other_symbols_as_fairseq_generate(
        ctranslate2, baseline_checkpoint, toy_data_bin, tmp_path):
    from fairseq.data import Dictionary
    from helpers.export_targets import data_bin_with_other_symbols

    other, first, second = data_bin_with_other_symbols(toy_data_bin, tmp_path)
    entries = len(Dictionary.load(str(other / "dict.en.txt")))
    out = tmp_path / "ct2"
    assert _refusal("convert", baseline_checkpoint, other, out) == (
        f"multipath-ctranslate2: error: {baseline_checkpoint}: its source dictionary is not "
        f"{other / 'dict.en.txt'}, although both have {entries} entries: token id 4 is "
        f"{first!r} in the checkpoint but {second!r} in the data-bin's; use the data-bin (and "
        "dictionaries) the model was trained on")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-symbols"]


def test_convert_force_replaces_the_old_folder_only_once_the_new_one_is_complete(
        ctranslate2, baseline_checkpoint, toy_data_bin, tmp_path, monkeypatch):
    from ctranslate2.specs import model_spec

    out = tmp_path / "ct2"
    out.mkdir()
    (out / "model.bin").write_text("the old model")
    save = model_spec.ModelSpec.save

    def interrupted(self, folder):
        save(self, folder)
        raise KeyboardInterrupt  # the new model written, the rename not done

    monkeypatch.setattr(model_spec.ModelSpec, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _ct2("convert", baseline_checkpoint, toy_data_bin, out, "--force")
    assert [p.name for p in tmp_path.iterdir()] == ["ct2"]  # no temporary folder left
    assert [p.name for p in out.iterdir()] == ["model.bin"]
    assert (out / "model.bin").read_text() == "the old model"
    monkeypatch.setattr(model_spec.ModelSpec, "save", save)
    _ct2("convert", baseline_checkpoint, toy_data_bin, out, "--force")
    assert (out / "model.bin").read_bytes() != b"the old model"
    assert [p.name for p in tmp_path.iterdir()] == ["ct2"]


@pytest.mark.parametrize("target", ["under-a-file", "dangling-symlink"])
def test_convert_refuses_an_output_folder_that_cannot_be_written_before_any_work(
        ctranslate2, target, tmp_path):
    # the checkpoint does not exist: the folder is checked before anything is read
    from helpers.export_targets import unwritable_targets

    out, reason = unwritable_targets(tmp_path)[target]
    assert _refusal("convert", tmp_path / "no.pt", tmp_path, out) == \
        f"multipath-ctranslate2: error: {reason}"


def test_translate_with_a_wrong_model_folder_or_input_says_so_in_one_line(ctranslate2, tmp_path):
    sentences = tmp_path / "test.bpe.en"
    sentences.write_text("w1 w2\n")
    assert _refusal("translate", tmp_path / "none", "--input", sentences) == (
        f"multipath-ctranslate2: error: {tmp_path / 'none'}: no such folder; give a folder "
        "written by multipath-ctranslate2 convert")
    (tmp_path / "empty").mkdir()
    assert _refusal("translate", tmp_path / "empty", "--input", sentences) == (
        f"multipath-ctranslate2: error: {tmp_path / 'empty'}: not a CTranslate2 model folder "
        "(no model.bin); give a folder written by multipath-ctranslate2 convert")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "model.bin").write_bytes(b"not a model")
    line = _refusal("translate", tmp_path / "damaged", "--input", sentences)
    assert line.startswith(f"multipath-ctranslate2: error: {tmp_path / 'damaged'}: CTranslate2 "
                           "cannot load it (")
    assert _refusal("translate", tmp_path / "damaged", "--input", tmp_path / "missing.en") == (
        f"multipath-ctranslate2: error: cannot read --input {tmp_path / 'missing.en'}: No such "
        "file or directory (errno 2)")
