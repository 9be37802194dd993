"""multipath-export-hf (multipath_nmt.hf_export, docs/serving.md): fairseq checkpoints to
Hugging Face transformers folders, and ONNX Runtime for the dense ones.

- Teacher-forced logits of the exported model equal fairseq's within 1e-5 in fp32 for every
  family that exports (dense: pre-norm, deep, gelu, folded EWA; multi-path: the paper's options),
  the multi-path ones through the remote code the export writes, loaded with trust_remote_code.
- Trained toy models: greedy output identical to fairseq-generate --beam 1 (dense, multi-path,
  folded EWA); beam 4 with lenpen 0.6 reported (share of identical hypotheses, BLEU difference).
- The tokenizer: raw text to the ids of multipath-prepare's pipeline, and back to detokenized text.
- Refusals: one line each, with the reason.
- ONNX (optimum + ONNX Runtime): greedy output identical to PyTorch's on the toy test set, in
  make test-onnx's venv (optimum-onnx needs transformers < 4.58).
No Hub access: HF_HUB_OFFLINE, and the remote code's module cache under the test's tmp folder.
"""
import errno
import io
import os
import re
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch
from conftest import (FAST_LEARNING, TINY_MODEL, TRAIN_FLAGS, generate_hypotheses, run_fairseq,
                      run_tool)
from helpers import in_process

from multipath_nmt.ewa.folding import fold_state_dict
from multipath_nmt.params import build_model

transformers = pytest.importorskip("transformers", reason="transformers is not installed "
                                                          "(pip install -e '.[test]')")

from multipath_nmt.hf_export import (  # noqa: E402 (after the skip)
    REFUSED,
    build_transformers_model,
    export_obstacle,
    remote_code,
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    modules = tmp_path_factory.getbasetemp() / "hf_modules"
    monkeypatch.setenv("HF_MODULES_CACHE", str(modules))
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(modules))


def export_cli(*args, check=True):
    """``multipath-export-hf ARGS...`` in this process."""
    return run_tool("multipath-export-hf", *args, check=check)


# --- teacher-forced logits ------------------------------------------------------------------

def _perturbed(model):
    """Random weights off their initial values (LayerNorms, path weights and biases included),
    so that every parameter's mapping counts."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def _batch():
    torch.manual_seed(1)
    src = torch.randint(4, 60, (3, 7))
    src[0, :2] = 1  # fairseq pads sources on the left
    src[:, -1] = 2
    prev = torch.randint(4, 60, (3, 5))
    prev[:, 0] = 2
    prev[1, 3:] = 1  # and targets on the right
    return src, prev


def _logits_gap(fairseq_model, hf_model):
    src, prev = _batch()
    with torch.no_grad():
        expected = fairseq_model(src, src.ne(1).sum(1), prev)[0]
        got = hf_model(input_ids=src, attention_mask=src.ne(1).long(),
                       decoder_input_ids=prev).logits
    return (expected - got)[prev.ne(1)].abs().max().item()


def _loaded(hf_model, folder):
    """``hf_model`` written as the export writes it and read back by AutoModelForSeq2SeqLM (the
    remote code of a multi-path model through trust_remote_code)."""
    hf_model.save_pretrained(folder)
    if getattr(hf_model.config, "auto_map", None):
        remote_code(folder)
    return transformers.AutoModelForSeq2SeqLM.from_pretrained(folder,
                                                              trust_remote_code=True).eval()


FAMILIES = {
    "prenorm": ("transformer_prenorm_wmt_en_de", []),
    "deep": ("transformer_deep12_wmt_en_de", ["--encoder-layers", "4"]),
    "gelu": ("transformer_prenorm_wmt_en_de", ["--activation-fn", "gelu"]),
    "multipath": ("multipath_transformer_wmt_en_de", []),
    "multipath-4-cheap": ("multipath_transformer_wmt_en_de",
                          ["--encoder-paths", "4", "--cheap-features"]),
    "multipath-original": ("multipath_transformer_wmt_en_de",
                           ["--encoder-paths", "3", "--path-weights", "fixed", "--no-path-norm"]),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_teacher_forced_logits_equal_fairseqs(name, tmp_path):
    arch, flags = FAMILIES[name]
    torch.manual_seed(0)
    model = _perturbed(build_model(arch, 60, [*TINY_MODEL, *flags], device="cpu"))
    hf_model = build_transformers_model({"cfg": {"model": model.args}, "model":
                                         model.state_dict()}, model.encoder.dictionary)
    expected_class = ("MultiPathM2M100ForConditionalGeneration" if "multipath" in name
                      else "M2M100ForConditionalGeneration")
    loaded = _loaded(hf_model, tmp_path / "hf")
    assert type(loaded).__name__ == expected_class
    assert _logits_gap(model, loaded) < 1e-5


def test_folded_ewa_logits_equal_the_ewa_models(tmp_path):
    torch.manual_seed(0)
    ewa = _perturbed(build_model("ewa_transformer_wmt_en_de", 60,
                                 [*TINY_MODEL, "--ewa-layers", "last-4"], device="cpu"))
    stock = build_model("transformer_prenorm_wmt_en_de", 60, TINY_MODEL, device="cpu").eval()
    stock.load_state_dict(fold_state_dict(ewa.state_dict()))
    hf_model = build_transformers_model({"cfg": {"model": stock.args}, "model":
                                         stock.state_dict()}, stock.encoder.dictionary)
    assert _logits_gap(ewa, _loaded(hf_model, tmp_path / "hf")) < 1e-5


def test_remote_code_is_the_packages_source(tmp_path):

    import multipath_nmt.modules as modules
    import multipath_nmt.modules.multipath as multipath

    written = remote_code(tmp_path)
    assert written == ["modeling_multipath.py", "multipath.py", "activations.py"]
    assert (tmp_path / "multipath.py").read_text() == Path(multipath.__file__).read_text()
    assert (tmp_path / "activations.py").read_text() == Path(modules.__file__).read_text()
    modeling = (tmp_path / "modeling_multipath.py").read_text()
    assert "from .multipath import MultiPathEncoderLayer, PathMixer, others_matrix\n" in modeling
    assert "from .activations import get_activation_fn\n" in modeling
    assert not re.search(r"^\s*(from|import) (multipath_nmt|fairseq)\b", modeling, re.M)


# --- refusals -------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,expected", [
    ({"arch": "transformer_prenorm_wmt_en_de", "encoder_normalize_before": True,
      "decoder_normalize_before": True, "share_all_embeddings": True}, None),
    ({"arch": "widenet_transformer_wmt_en_de"}, REFUSED["widenet_transformer"]),
    ({"arch": "ewa_transformer_wmt_en_de", "encoder_ffn": "ewa"}, REFUSED["ewa"]),
    ({"arch": "parameternet_transformer_wmt_en_de", "encoder_ffn": "parameternet"},
     REFUSED["parameternet"]),
    ({"arch": "moe_transformer_wmt_en_de", "encoder_ffn": "moe"}, REFUSED["moe"]),
    ({"arch": "multipath_transformer_wmt_en_de", "decoder_paths": 2},
     "--decoder-paths > 1: the exported model keeps transformers' M2M100 decoder, whose layers "
     "have one path; only multi-path encoders are exported"),
    ({"arch": "transformer_wmt_en_de", "share_all_embeddings": True},
     "a post-norm Transformer (no --encoder-normalize-before / --decoder-normalize-before): "
     "M2M100 is pre-norm only; export a pre-norm model"),
    ({"arch": "transformer_prenorm_wmt_en_de", "encoder_normalize_before": True,
      "decoder_normalize_before": True, "share_decoder_input_output_embed": True},
     "M2M100 keeps one embedding matrix for the source, the target and the output projection; "
     "this model was trained without --share-all-embeddings"),
], ids=["prenorm", "widenet", "ewa", "parameternet", "moe", "decoder-paths", "post-norm",
        "unshared"])
def test_export_obstacle_of_each_model_family(cfg, expected):
    assert export_obstacle(cfg) == expected


def test_early_ewa_is_refused_as_a_routed_moe():
    cfg = {"arch": "ewa_early_transformer_wmt_en_de", "encoder_ffn": "ewa", "ewa_stop_at": 0.5}
    assert export_obstacle(cfg).startswith("an early-EWA model keeps a routed mixture of experts")


# --- the tokenizer --------------------------------------------------------------------------

RAW = [
    "The well-known co-operation of 1,000 people isn't \"easy\" -- or is it?",
    "Tom's e-mail (sent at 9:30 a.m.) said: prices rose 3.5% & more!",
    "A state-of-the-art system; it's <fast> and [small].",
    "Die Zusammenarbeit der Bürger-Initiative kostet 1.000 € pro Jahr.",
]


def test_tokenizer_gives_the_pipelines_ids_and_decodes_to_detokenized_text(tmp_path):
    from fairseq.data import Dictionary
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer
    from subword_nmt.apply_bpe import BPE
    from subword_nmt.learn_bpe import learn_bpe

    from multipath_nmt.hf_export.tokenizer import save_tokenizer
    from multipath_nmt.pipeline.text import moses_tokenize

    normalizer, moses = MosesPunctNormalizer("en"), MosesTokenizer("en")
    tokenized = [moses_tokenize(line, normalizer, moses) for line in RAW]
    codes = io.StringIO()
    learn_bpe(tokenized * 3, codes, 60)
    (tmp_path / "bpecodes").write_text(codes.getvalue())
    bpe = BPE(io.StringIO(codes.getvalue()))
    pieces = [bpe.process_line(line) for line in tokenized]
    dictionary = Dictionary()
    for line in pieces[:-1]:  # the last sentence's unseen pieces are <unk>, both ways
        for piece in line.split():
            dictionary.add_symbol(piece)
    save_tokenizer(tmp_path / "hf", dictionary, tmp_path / "bpecodes", "en", "de")

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert type(tokenizer).__name__ == "FSMTTokenizer"
    # decode() reads target text: Moses-detokenized for the target language, as multipath-score
    # --lang de detokenizes hypotheses
    detokenizer = MosesDetokenizer("de")
    for raw, line, tokens in zip(RAW, pieces, tokenized):
        expected = dictionary.encode_line(line, add_if_not_exist=False).tolist()
        ids = tokenizer(raw).input_ids
        assert ids == expected, raw
        if dictionary.unk() not in ids:
            assert tokenizer.decode(ids, skip_special_tokens=True) == \
                detokenizer.detokenize(tokens.split())
    assert dictionary.unk() in tokenizer(RAW[-1]).input_ids


# --- trained models: generation -------------------------------------------------------------

MULTIPATH = ["--arch", "multipath_transformer_wmt_en_de", *TINY_MODEL, "--encoder-paths", "2"]


@pytest.fixture(scope="module")
def exported(trains, toy_data_bin, toy_learned_baseline_run, toy_ewa_run, tmp_path_factory):
    """The toy models (the session's dense baseline, 300 updates; a multi-path model, 200 updates;
    the session's EWA model folded by multipath-convert-ewa), their checkpoints and their exported
    folders."""
    found = {"dense": toy_learned_baseline_run / "checkpoint_last.pt"}
    folder = tmp_path_factory.mktemp("multipath")
    run_fairseq("train", toy_data_bin, *TRAIN_FLAGS, *MULTIPATH, *FAST_LEARNING,
                "--max-update", "200", "--save-dir", folder / "ckpt")
    found["multipath"] = folder / "ckpt" / "checkpoint_last.pt"
    folded = tmp_path_factory.mktemp("folded") / "folded.pt"
    assert in_process.console_script("multipath-convert-ewa",
                                     [toy_ewa_run / "checkpoint_last.pt", folded]).returncode == 0
    found["folded ewa"] = folded
    out = {}
    for name, checkpoint in found.items():
        folder = tmp_path_factory.mktemp("hf") / name.replace(" ", "-")
        proc = export_cli(checkpoint, folder, "--data-bin", toy_data_bin)
        assert proc.stdout.strip() == f"wrote {folder}"
        # the pair from the data-bin's file names (the toy runs give no --source-lang)
        assert "(en->de)" in (folder / "README.md").read_text()
        out[name] = (checkpoint, folder)
    return out


def _sources(data_bin):
    from fairseq.data import Dictionary

    dictionary = Dictionary.load(str(data_bin / "dict.en.txt"))
    lines = (data_bin.parent / "text" / "test.en").read_text().splitlines()
    return dictionary, [dictionary.encode_line(line, add_if_not_exist=False).long()
                        for line in lines]


def _generate(model, dictionary, sources, batch_size=16, **options):
    """Hypotheses (tokens) of ``model.generate`` on ``sources``, left-padded batches as
    fairseq's."""
    hypotheses = []
    for start in range(0, len(sources), batch_size):
        batch = sources[start:start + batch_size]
        width = max(len(s) for s in batch)
        ids = torch.stack([torch.cat([torch.full((width - len(s),), dictionary.pad()), s])
                           for s in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=ids.ne(dictionary.pad()).long(),
                                 **options)
        for row in out.tolist():
            hypotheses.append([dictionary[t] for t in row[1:]
                               if t not in (dictionary.pad(), dictionary.eos())])
    return hypotheses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "multipath", "folded ewa"])
def test_greedy_output_is_fairseq_generates(name, exported, toy_data_bin):
    checkpoint, folder = exported[name]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
    dictionary, sources = _sources(toy_data_bin)
    expected = generate_hypotheses(toy_data_bin, checkpoint, 1)
    assert len({tuple(h) for h in expected}) > len(expected) // 2  # not one degenerate output
    assert _generate(model.eval(), dictionary, sources, num_beams=1) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "multipath"])
def test_beam_4_lenpen_0_6_against_fairseq_generate(name, exported, toy_data_bin):
    """The folder's own generation config (beam 4, lenpen 0.6, as translate.sh): the share of
    hypotheses identical to fairseq-generate's and the BLEU difference, printed (-s shows them).
    Ties in the beams may differ; on the toy test set every hypothesis is identical."""
    checkpoint, folder = exported[name]
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)
    dictionary, sources = _sources(toy_data_bin)
    expected = generate_hypotheses(toy_data_bin, checkpoint, 4, "--lenpen", "0.6")
    got = _generate(model.eval(), dictionary, sources)
    same = sum(a == b for a, b in zip(got, expected)) / len(expected)
    references = [(toy_data_bin.parent / "text" / "test.de").read_text().splitlines()]
    bleu = [sacrebleu.corpus_bleu([" ".join(h) for h in hyps], references).score
            for hyps in (expected, got)]
    print(f"\n{name}: beam 4 lenpen 0.6: {same:.1%} of {len(expected)} hypotheses identical to "
          f"fairseq-generate's; BLEU {bleu[0]:.2f} (fairseq) vs {bleu[1]:.2f} (transformers)")
    assert same >= 0.95 and abs(bleu[0] - bleu[1]) <= 0.5


@pytest.mark.slow
def test_onnx_runtime_greedy_output_is_pytorchs(exported, toy_data_bin, tmp_path):
    onnx_runtime = pytest.importorskip(
        "optimum.onnxruntime", reason="optimum-onnx is not installed: it needs transformers < 4.58, "
                                      "make test-onnx runs this test in a venv of its own")
    _, folder = exported["dense"]
    ort_model = onnx_runtime.ORTModelForSeq2SeqLM.from_pretrained(folder, export=True)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    dictionary, sources = _sources(toy_data_bin)
    assert _generate(ort_model, dictionary, sources, num_beams=1) == \
        _generate(model, dictionary, sources, num_beams=1)


@pytest.mark.slow
@pytest.mark.parametrize("arch,encoder_ffn,family", [
    ("widenet_transformer_wmt_en_de", None, "widenet_transformer"),
    ("ewa_transformer_wmt_en_de", "ewa", "ewa"),
], ids=["widenet", "ewa"])
def test_cli_refuses_in_one_line(arch, encoder_ffn, family, exported, toy_data_bin, tmp_path):
    # the dense model's file relabelled: the refusal reads the config, before any weight
    checkpoint, _ = exported["dense"]
    state = torch.load(checkpoint, weights_only=False)
    state["cfg"]["model"].arch = state["cfg"]["model"]._name = arch
    state["cfg"]["model"].encoder_ffn = encoder_ffn
    torch.save(state, tmp_path / "model.pt")
    proc = export_cli(tmp_path / "model.pt", tmp_path / "hf", "--data-bin", toy_data_bin,
                      check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"multipath-export-hf: error: {tmp_path / 'model.pt'}: "
                                   f"{arch} cannot be exported to transformers: "
                                   f"{REFUSED[family]}")
    assert not (tmp_path / "hf").exists()


# --- the model card -------------------------------------------------------------------------

def test_model_card_reads_what_the_quickstart_leaves_next_to_the_checkpoint(tmp_path):
    from multipath_nmt.hf_export.card import recorded_scores, recorded_training_command

    checkpoint = tmp_path / "checkpoints" / "checkpoint_avg.pt"
    checkpoint.parent.mkdir()
    assert recorded_training_command(checkpoint) is None and recorded_scores(checkpoint) == []
    (tmp_path / "train.log").write_text(
        "train.sh: 1 GPU(s) ...\n"
        "train.sh: /venv/bin/python -m fairseq_cli.train data-bin --arch multipath_transformer\n"
        "epoch 001 ...\n")
    (tmp_path / "score.txt").write_text(
        "BLEU = 91.01, 95.2/92.5/89.7/86.9 (BP=1.000)\n"
        "sacreBLEU = 91.04 | nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0 | x\n")
    assert recorded_training_command(checkpoint) == (
        "/venv/bin/python -m fairseq_cli.train data-bin --arch multipath_transformer")
    assert recorded_scores(checkpoint)[1].startswith("sacreBLEU = 91.04 | nrefs:1|case:mixed")


def test_cli_refuses_an_existing_folder_and_missing_codes_in_one_line(tmp_path, capsys):
    from multipath_nmt.cli.export_hf import main

    (tmp_path / "hf").mkdir()
    with pytest.raises(SystemExit) as exists:
        main(["model.pt", str(tmp_path / "hf"), "--data-bin", "data-bin"])
    assert exists.value.code == (f"multipath-export-hf: error: {tmp_path / 'hf'} exists "
                                 "(--force replaces it)")
    with pytest.raises(SystemExit) as no_codes:
        main(["model.pt", str(tmp_path / "new"), "--data-bin", "data-bin", "--bpe-codes",
              str(tmp_path / "codes")])
    assert no_codes.value.code == (f"multipath-export-hf: error: --bpe-codes "
                                   f"{tmp_path / 'codes'} is not a file")


# --- what the export refuses, and a folder written whole or not at all -----------------------

def _export(*argv):
    from multipath_nmt.cli.export_hf import main

    main([str(a) for a in argv])


def _refusal(*argv):
    """The one line ``multipath-export-hf ARGV`` exits with."""
    from multipath_nmt.cli.export_hf import main

    return in_process.refusal(main, argv)


def _siblings(folder):
    return sorted(p.name for p in folder.parent.iterdir())


@pytest.fixture
def baseline_checkpoint(toy_baseline_run):
    return toy_baseline_run / "checkpoint_last.pt"


@pytest.fixture
def bpe_codes(tmp_path):
    codes = tmp_path / "bpecodes"
    codes.write_text("#version: 0.2\nw 1\nx 1\n", encoding="utf-8")
    return codes


def test_a_data_bin_with_other_symbols_is_refused_as_fairseq_generate_refuses_it(
        baseline_checkpoint, toy_data_bin, tmp_path):
    from fairseq.data import Dictionary
    from helpers.export_targets import data_bin_with_other_symbols

    other, first, second = data_bin_with_other_symbols(toy_data_bin, tmp_path)
    entries = len(Dictionary.load(str(other / "dict.en.txt")))
    line = (f"{baseline_checkpoint}: its source dictionary is not {other / 'dict.en.txt'}, "
            f"although both have {entries} entries: token id 4 is {first!r} in the checkpoint "
            f"but {second!r} in the data-bin's; use the data-bin (and dictionaries) the model "
            "was trained on")
    out = tmp_path / "hf"
    assert _refusal(baseline_checkpoint, out, "--data-bin", other) == \
        f"multipath-export-hf: error: {line}"
    assert _siblings(out) == ["other-symbols"]
    generate = run_fairseq("generate", other, "--path", baseline_checkpoint, "--gen-subset",
                           "test", "--beam", "1", check=False)
    assert generate.returncode == 1 and line in generate.stderr


def test_force_replaces_the_old_folder_whole(baseline_checkpoint, toy_data_bin, bpe_codes,
                                             tmp_path):
    out, fresh = tmp_path / "hf", tmp_path / "fresh"
    _export(baseline_checkpoint, out, "--data-bin", toy_data_bin, "--bpe-codes", bpe_codes)
    assert (out / "tokenizer_config.json").is_file()
    _export(baseline_checkpoint, out, "--data-bin", toy_data_bin, "--force")
    _export(baseline_checkpoint, fresh, "--data-bin", toy_data_bin)
    # the last model's tokenizer files are gone with the old folder
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    assert _siblings(out) == ["bpecodes", "fresh", "hf"]  # no temporary folder left


def _an_old_export(out):
    """A folder standing for an earlier export, with files that no new export writes the same:
    its files and their bytes."""
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (out / name).write_text(f"the old {name}")
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("force", [False, True], ids=["fresh", "force"])
def test_an_export_interrupted_after_the_weights_leaves_no_folder_or_the_old_one(
        force, baseline_checkpoint, toy_data_bin, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) where the generation config is written, the weights already
    saved: no folder at all, or the old one as it was; no temporary folder left."""
    out = tmp_path / "hf"
    if force:
        before = _an_old_export(out)

    save = transformers.GenerationConfig.save_pretrained
    interruptions = []

    def interrupted(self, folder, *args, **kwargs):
        # the model's save_pretrained writes a default generation config before its weights
        if not (Path(folder) / "model.safetensors").is_file():
            return save(self, folder, *args, **kwargs)
        interruptions.append(folder)
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.GenerationConfig, "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _export(baseline_checkpoint, out, "--data-bin", toy_data_bin, *["--force"] * force)
    assert len(interruptions) == 1
    if force:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    else:
        assert not out.exists()
    assert _siblings(out) == (["hf"] if force else [])


# killed with SIGKILL at the moment it writes the search's generation config, the weights written
# (the model's save_pretrained writes a default one before its weights)
KILLED_AFTER_THE_WEIGHTS = """
import os, signal, sys
import transformers
save = transformers.GenerationConfig.save_pretrained
def killed(self, folder, *args, **kwargs):
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        return save(self, folder, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)
transformers.GenerationConfig.save_pretrained = killed
from multipath_nmt.cli.export_hf import main
main(sys.argv[1:])
"""


@pytest.mark.process
def test_kill_9_after_the_weights_leaves_the_old_folder_whole(baseline_checkpoint, toy_data_bin,
                                                              tmp_path):
    import subprocess

    out = tmp_path / "hf"
    before = _an_old_export(out)
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_THE_WEIGHTS, str(baseline_checkpoint),
                           str(out), "--data-bin", str(toy_data_bin), "--force"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # what the kill left: the unfinished new folder beside it, under a temporary name
    left = [p for p in tmp_path.iterdir() if p.name != "hf"]
    assert len(left) == 1 and re.fullmatch(r"hf\.[0-9a-f]{8}\.tmp", left[0].name), left
    assert (left[0] / "model.safetensors").is_file()


def test_gzipped_bpe_codes_are_refused_in_one_line_and_leave_no_folder(
        baseline_checkpoint, toy_data_bin, bpe_codes, tmp_path):
    import gzip

    gzipped = tmp_path / "bpecodes.gz"
    gzipped.write_bytes(gzip.compress(bpe_codes.read_bytes()))
    out = tmp_path / "hf"
    assert _refusal(baseline_checkpoint, out, "--data-bin", toy_data_bin, "--bpe-codes",
                    gzipped) == (f"multipath-export-hf: error: --bpe-codes {gzipped} is "
                                 "gzipped: gunzip it (subword-nmt's codes are plain text)")
    assert not out.exists() and _siblings(out) == ["bpecodes", "bpecodes.gz"]


@pytest.mark.parametrize("target", ["under-a-file", "dangling-symlink"])
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(target, tmp_path):
    # the checkpoint does not exist: the folder is checked before anything is read
    from helpers.export_targets import unwritable_targets

    out, reason = unwritable_targets(tmp_path)[target]
    assert _refusal(tmp_path / "no.pt", out, "--data-bin", tmp_path) == \
        f"multipath-export-hf: error: {reason}"


def test_an_output_folder_on_a_read_only_file_system_is_refused_before_any_work(tmp_path,
                                                                                monkeypatch):
    """Simulated (the tests run as root, for whom chmod does not forbid writing): os.mkdir fails
    under ``ro/`` as on a read-only mount. This covers the probe and its line, not a real mount."""
    (tmp_path / "ro").mkdir()
    mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro") + os.sep):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    out = tmp_path / "ro" / "hf"
    assert _refusal(tmp_path / "no.pt", out, "--data-bin", tmp_path) == \
        f"multipath-export-hf: error: cannot write {out}: Read-only file system (errno 30)"


def test_a_full_disk_while_writing_the_weights_leaves_no_folder(baseline_checkpoint, toy_data_bin,
                                                                tmp_path, monkeypatch):
    """ENOSPC from save_pretrained after it wrote part of a file (simulated: the tests cannot
    fill a disk): one line, no folder, no temporary folder."""
    def disk_full(self, folder, *args, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"part of the weights")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", disk_full)
    out = tmp_path / "hf"
    assert _refusal(baseline_checkpoint, out, "--data-bin", toy_data_bin) == (
        f"multipath-export-hf: error: cannot write {out}: No space left on device (errno 28); "
        f"{out} is as it was")
    assert _siblings(out) == []
