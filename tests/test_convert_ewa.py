"""multipath-convert-ewa: an EWA model folds into a stock transformer checkpoint that plain
fairseq-generate (no --user-dir) loads and that translates exactly like the EWA model in eval
mode; non-EWA checkpoints are refused. Also --ewa-init-from (EWA fine-tuning from a dense model)."""
import os

import pytest
import torch

from conftest import TINY_MODEL, run_fairseq, run_tool
from helpers.models import build_like_fairseq_train

from multipath_nmt.cli.convert_ewa import main
from multipath_nmt.ewa.folding import NotAnEWACheckpoint, convert_ewa_checkpoint, fold_state_dict

GENERATE = ["--gen-subset", "test", "--beam", "2", "--max-len-a", "0", "--max-len-b", "8",
            "--batch-size", "20", "--cpu", "--no-progress-bar"]


@pytest.fixture(scope="module")
def ewa_checkpoint(toy_ewa_run):
    """A tiny EWA model (both encoder layers EWA) after 100 fp32 updates (the session's)."""
    return toy_ewa_run / "checkpoint_last.pt"  # read only


@pytest.fixture(scope="module")
def converted(ewa_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "stock.pt"  # not next to the shared checkpoint
    run_tool("multipath-convert-ewa", ewa_checkpoint, out)
    return out


def _hypotheses(output):
    return sorted(line for line in output.splitlines() if line.startswith("H-"))


@pytest.mark.slow
def test_generate_without_user_dir_matches_the_ewa_model(toy_data_bin, ewa_checkpoint, converted):
    ewa = run_fairseq("generate", toy_data_bin, "--path", ewa_checkpoint, *GENERATE)
    stock = run_fairseq("generate", toy_data_bin, "--path", converted, *GENERATE, user_dir=False)
    ewa_lines, stock_lines = _hypotheses(ewa.stdout), _hypotheses(stock.stdout)
    assert len(ewa_lines) == 40
    assert stock_lines == ewa_lines


@pytest.mark.slow
def test_converted_checkpoint_is_a_stock_transformer(ewa_checkpoint, converted):
    from fairseq import checkpoint_utils

    # plain torch.load (weights_only=True, no allow-list) reads it, as plain fairseq does
    state = torch.load(converted)
    model_cfg, cfg = state["cfg"]["model"], state["cfg"]
    assert (model_cfg["arch"], model_cfg["_name"]) == ("transformer", "transformer")
    assert model_cfg["encoder_normalize_before"] and model_cfg["decoder_normalize_before"]
    assert (model_cfg["encoder_embed_dim"], model_cfg["encoder_ffn_embed_dim"]) == (32, 64)
    assert not any(k.startswith(("ewa_", "moe_", "parameternet_")) for k in model_cfg)
    assert "encoder_ffn" not in model_cfg and "user_dir" not in model_cfg
    assert cfg["common"]["user_dir"] is None
    assert cfg["criterion"]["_name"] == "label_smoothed_cross_entropy"

    ewa = checkpoint_utils.load_checkpoint_to_cpu(str(ewa_checkpoint))["model"]
    stock = state["model"]
    assert not any(".ffn." in k for k in stock)
    for layer in (0, 1):
        for fc, kind in (("fc1", "weight"), ("fc1", "bias"), ("fc2", "weight"), ("fc2", "bias")):
            experts = ewa[f"encoder.layers.{layer}.ffn.{fc}_{kind}"]
            assert torch.equal(stock[f"encoder.layers.{layer}.{fc}.{kind}"], experts.mean(0))
    untouched = [k for k in ewa if ".ffn." not in k]
    assert all(torch.equal(stock[k], ewa[k]) for k in untouched)
    # folding changes no token: the dictionaries' symbols stay, for fairseq-generate's check
    assert state["dictionaries"] == checkpoint_utils.load_checkpoint_to_cpu(str(ewa_checkpoint))["dictionaries"]


def _rewritten(ewa_checkpoint, path, **model_changes):
    state = torch.load(ewa_checkpoint, weights_only=False)
    for key, value in model_changes.items():
        setattr(state["cfg"]["model"], key, value)
    torch.save(state, path)
    return path


@pytest.mark.slow
def test_refuses_a_non_ewa_checkpoint(ewa_checkpoint, tmp_path, capsys):
    other = _rewritten(ewa_checkpoint, tmp_path / "multipath.pt", arch="multipath_transformer",
                       _name="multipath_transformer", encoder_ffn=None)
    out = tmp_path / "out.pt"
    with pytest.raises(SystemExit) as exit_info:
        main([str(other), str(out)])
    assert "is not an EWA model" in str(exit_info.value)
    assert "multipath_transformer" in str(exit_info.value)
    assert not out.exists() and os.listdir(tmp_path) == ["multipath.pt"]


@pytest.mark.slow
def test_refuses_an_early_ewa_checkpoint(ewa_checkpoint, tmp_path):
    early = _rewritten(ewa_checkpoint, tmp_path / "early.pt", ewa_stop_at=0.5)
    with pytest.raises(NotAnEWACheckpoint, match="early EWA"):
        convert_ewa_checkpoint(early, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_missing_input_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no such checkpoint file"):
        main([str(tmp_path / "nope.pt"), str(tmp_path / "out.pt")])


def _build_model(data, *flags, with_cfg=False):
    return build_like_fairseq_train(data, "ewa_transformer_wmt_en_de", *flags, with_cfg=with_cfg)


@pytest.mark.slow
def test_ewa_init_from_copies_the_dense_ffn_into_every_expert(toy_data_bin, converted):
    model, cfg = _build_model(toy_data_bin, *TINY_MODEL, "--share-all-embeddings",
                              "--ewa-init-from", converted, with_cfg=True)
    # checkpoints of this run record the origin but do not need the dense file to load
    assert cfg.model.ewa_init_from is None and cfg.model.ewa_initialized_from == str(converted)
    dense = torch.load(converted)["model"]
    ffn = model.encoder.layers[1].ffn
    for stacked, key in ((ffn.fc1_weight, "fc1.weight"), (ffn.fc1_bias, "fc1.bias"),
                         (ffn.fc2_weight, "fc2.weight"), (ffn.fc2_bias, "fc2.bias")):
        for expert in stacked:
            assert torch.equal(expert, dense[f"encoder.layers.1.{key}"])


@pytest.mark.slow
def test_ewa_init_from_a_mismatched_model_is_a_clear_error(toy_data_bin, converted):
    flags = [f if f != "64" else "48" for f in TINY_MODEL]  # other FFN width
    with pytest.raises(ValueError, match="--encoder-ffn-embed-dim"):
        _build_model(toy_data_bin, *flags, "--share-all-embeddings", "--ewa-init-from", converted)


def test_fold_drops_the_fp32_copies_of_half_precision_experts():
    experts = torch.arange(8.0).view(2, 4).half()  # E = 2 experts of 4 values
    dense = torch.ones(4)
    folded = fold_state_dict({
        "encoder.layers.0.fc1.bias": dense,
        "encoder.layers.1.ffn.fc1_bias": experts,
        # training state of --memory-efficient-fp16: not an expert, nothing to fold
        "encoder.layers.1.ffn.fp32_experts.fc1_bias": experts.float() + 1e-4,
    })
    assert set(folded) == {"encoder.layers.0.fc1.bias", "encoder.layers.1.fc1.bias"}
    # the folded FFN is the mean of the experts the EWA model evaluates with
    assert torch.equal(folded["encoder.layers.1.fc1.bias"], experts.float().mean(0).half())
