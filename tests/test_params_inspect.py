"""multipath-params and multipath-inspect."""
import itertools

import pytest
import torch
from conftest import TINY_MODEL
from torch import nn

import multipath_nmt.analysis.layernorm_divergence as widenet
from multipath_nmt.analysis.paths import path_diversity, path_weight_rows
from multipath_nmt.cli import inspect as inspect_cli
from multipath_nmt import params
from multipath_nmt.modules.parameternet import DynamicLinear
from multipath_nmt.cli import params as params_cli

SMALL_DICT = 1000


def test_plugin_architectures_are_ours_only():
    archs = params.plugin_architectures()
    assert {"multipath_transformer_wmt_en_de", "multipath_l6_p8_wmt_en_de",
            "transformer_prenorm_wmt_en_de", "transformer_deep48_wmt_en_de",
            "transformer_wide_wmt_en_de"} <= set(archs)
    assert "transformer" not in archs and "transformer_wmt_en_de" not in archs


def test_active_parameters_subtract_inactive_parameter_count():
    class TopOneOfFour(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.Parameter(torch.zeros(4, 10))

        def inactive_parameter_count(self):
            return 30

    model = nn.Sequential(nn.Linear(3, 5), TopOneOfFour())
    assert params.parameter_counts(model) == {"total": 20 + 40, "active": 20 + 10}


def test_params_table_counts_and_flops(capsys):
    archs = ["transformer_prenorm_wmt_en_de", "transformer_deep12_wmt_en_de",
             "multipath_l6_p2_wmt_en_de"]
    params_cli.main(["--dict-size", str(SMALL_DICT), *itertools.chain.from_iterable(
        ("--arch", arch) for arch in archs)])
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]]
            for line in table.splitlines() if line.startswith("| ") and "_wmt_en_de" in line}
    assert list(rows) == archs
    base = params.parameter_counts(params.build_model(archs[0], SMALL_DICT))["total"]
    assert rows[archs[0]] == [f"{base / 1e6:.2f}", "=", rows[archs[0]][2]]
    # One more encoder layer's worth of weights per extra path or layer: the deep and the
    # multi-path encoder have the same size and the same matmuls, so the same FLOPs.
    deep, multipath = (float(rows[a][2]) for a in archs[1:])
    assert float(rows[archs[1]][0]) == pytest.approx(float(rows[archs[2]][0]), rel=1e-3)
    assert multipath == pytest.approx(deep, rel=0.01)
    assert multipath > 1.2 * float(rows[archs[0]][2])


DYNAMIC = ["--parameternet-mode", "dynamic"]


@pytest.mark.parametrize("dict_size, method_ratio, as_run_ratio", [
    (SMALL_DICT, 1.086, 1.876), (34880, 1.062, 1.631),
], ids=["1000-types", "34880-types"])
def test_dynamic_parameternet_flops_at_each_dictionary(dict_size, method_ratio, as_run_ratio):
    """docs/fidelity.md's numbers: FLOPs per token of dynamic ParameterNet (both projections,
    M 4) over the pre-norm base model's, 20-token sentences (``FLOP_SEQUENCE_LENGTH``), as the
    method computes them (what ``multipath-params`` prints) and as our layer runs."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    assert params.FLOP_SEQUENCE_LENGTH == 20
    dense = params.forward_flops_per_token(
        params.build_model("transformer_prenorm_wmt_en_de", dict_size))
    model = params.build_model("parameternet_transformer_wmt_en_de", dict_size, DYNAMIC)
    assert params.forward_flops_per_token(model) / dense == pytest.approx(method_ratio, abs=5e-4)
    model = model.to_empty(device="cpu").eval()
    length = params.FLOP_SEQUENCE_LENGTH
    tokens = torch.randint(4, dict_size, (1, length))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, torch.tensor([length]), tokens)
    assert counter.get_total_flops() / length / dense == pytest.approx(as_run_ratio, abs=5e-4)


def test_dynamic_parameternet_flops_are_the_methods():
    """ParameterNet's premise: M times the parameters at nearly the same FLOPs (W' built per
    sentence, then one product per token). Our layer makes M products per token instead; the
    table counts the method's products, the coefficient MLP included."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    dense = params.build_model("transformer_prenorm_wmt_en_de", SMALL_DICT)
    dynamic = params.build_model("parameternet_transformer_wmt_en_de", SMALL_DICT, DYNAMIC)
    method = params.forward_flops_per_token(dynamic)
    assert 1.0 < method / params.forward_flops_per_token(dense) < 1.15
    dynamic = dynamic.to_empty(device="cpu").eval()
    length = params.FLOP_SEQUENCE_LENGTH
    tokens = torch.randint(4, SMALL_DICT, (1, length))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        dynamic(tokens, torch.tensor([length]), tokens)
    layers = [m for m in dynamic.modules() if isinstance(m, DynamicLinear)]
    in_out = [m.weight.shape[0] * m.weight.shape[2] for m in layers]
    experts = layers[0].num_experts
    # as run: M products per token (and the M biases mixed per token); the method: M matrices
    # mixed once for the sentence, then one product per token
    as_run_products = sum(2 * io * experts * length + 2 * experts * m.weight.shape[2] * length
                          for io, m in zip(in_out, layers))
    method_products = sum(2 * io * (length + experts) for io in in_out)
    assert method * length == pytest.approx(
        counter.get_total_flops() - as_run_products + method_products, rel=1e-9)


# Table 3 (WMT14 En-Fr) and Tables 2/3 (En-De, De-En), in millions. En-Fr: separate dictionaries
# of 43,616 types and no embedding shared (docs/fidelity.md derives it); En-De: one joined
# dictionary of 34,880 types, every embedding shared.
EN_FR_TYPES = 43616
EN_DE_TYPES = 34880
TABLE_3 = {
    "transformer_prenorm_wmt_en_de": (111, 62),
    "transformer_deep24_wmt_en_de": (168, 118),
    "multipath_l12_p2_wmt_en_de": (168, 118),
    "multipath_l6_p4_wmt_en_de": (168, 118),
}


@pytest.mark.parametrize("arch", sorted(TABLE_3))
def test_en_fr_and_en_de_sizes_within_1_5_percent_of_table_3(arch):
    en_fr, en_de = TABLE_3[arch]
    separate = params.build_model(arch, EN_FR_TYPES, tgt_dict_size=EN_FR_TYPES)
    joined = params.build_model(arch, EN_DE_TYPES)
    for model, paper in ((separate, en_fr), (joined, en_de)):
        total = params.parameter_counts(model)["total"]
        assert abs(total / 1e6 - paper) / paper <= 0.015, (arch, total, paper)


def test_unshared_embeddings_are_three_matrices():
    """The arithmetic of docs/fidelity.md: 44,140,544 parameters outside the embeddings (base),
    plus 512 per row of the encoder input, decoder input and output projection matrices."""
    arch = "transformer_prenorm_wmt_en_de"
    model = params.build_model(arch, 43000, tgt_dict_size=EN_FR_TYPES)
    assert model.encoder.embed_tokens.weight.shape == (43000, 512)
    assert model.decoder.embed_tokens.weight.shape == (EN_FR_TYPES, 512)
    assert model.decoder.output_projection.weight is not model.decoder.embed_tokens.weight
    assert params.parameter_counts(model)["total"] == 44140544 + 512 * (43000 + 2 * EN_FR_TYPES)
    shared = params.build_model(arch, EN_DE_TYPES)
    assert shared.encoder.embed_tokens.weight is shared.decoder.output_projection.weight
    assert params.parameter_counts(shared)["total"] == 44140544 + 512 * EN_DE_TYPES


def _write_dictionary(path, types):
    path.write_text("".join(f"w{i} {types - i}\n" for i in range(types)))


@pytest.mark.parametrize("src,tgt,joined,header", [
    ("en", "fr", True, "Dictionaries of 1,004 (source) and 1,004 (target) types, no embedding shared"),
    ("en", "fr", False, "Dictionaries of 1,004 (source) and 504 (target) types, no embedding shared"),
    ("en", "de", True, "Joined dictionary of 1,004 types, shared embeddings"),
])
def test_params_from_a_data_bin_as_train_sh_builds_it(tmp_path, capsys, src, tgt, joined, header):
    _write_dictionary(tmp_path / f"dict.{src}.txt", 1000)  # + 4 special symbols
    _write_dictionary(tmp_path / f"dict.{tgt}.txt", 1000 if joined else 500)
    (tmp_path / f"train.{src}-{tgt}.{src}.idx").write_bytes(b"")
    params_cli.main(["--data-bin", str(tmp_path), "--arch", "transformer_prenorm_wmt_en_de"])
    out = capsys.readouterr().out
    assert out.startswith(header)
    unshared = 1004 + 2 * (1004 if joined else 504)
    total = 44140544 + 512 * (1004 if header.startswith("Joined") else unshared)
    assert f"| transformer_prenorm_wmt_en_de | {total / 1e6:.2f} | = |" in out


def test_params_from_a_data_bin_without_dictionaries_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="has no dict.*.txt: give the data-bin folder"):
        params_cli.main(["--data-bin", str(tmp_path), "--arch", "transformer_prenorm_wmt_en_de"])


def test_flops_are_measured_per_target_token():
    model = params.build_model("multipath_transformer", 100, TINY_MODEL, device="cpu")
    flops_10 = params.forward_flops_per_token(model, length=10)
    flops_20 = params.forward_flops_per_token(model, length=20)
    # Projections cost the same per token; only attention grows with the length.
    assert flops_10 < flops_20 < 1.5 * flops_10
    # The output projection alone is 2 * d * |V| per target token.
    assert flops_10 > 2 * 32 * 100


def test_params_unknown_arch_is_a_clear_error():
    with pytest.raises(SystemExit, match="unknown architecture.*no_such_arch"):
        params_cli.main(["--arch", "no_such_arch", "--dict-size", str(SMALL_DICT)])


def test_path_diversity():
    assert path_diversity([0.3, 0.1]) == pytest.approx(0.5)
    assert path_diversity([0.2, 0.2, 0.6]) == pytest.approx((0 + 0.5 + 0.5) / 3)
    assert path_diversity([0.4]) != path_diversity([0.4])  # NaN: undefined for one path


def _checkpoint(tmp_path, *flags):
    model = params.build_model("multipath_l6_p4_wmt_en_de", 100, [*TINY_MODEL, *flags],
                                   device="cpu")
    mixer = model.encoder.layers[1].ffn_mixer
    with torch.no_grad():
        mixer.path_weights[:4] = torch.tensor([0.3, 0.1, 0.2, 0.2])
        mixer.residual_weight.fill_(0.9)
    path = tmp_path / "checkpoint_best.pt"
    torch.save({"model": model.state_dict(), "cfg": None, "args": None,
                "optimizer_history": [{"criterion_name": "LabelSmoothedCrossEntropyCriterion",
                                       "optimizer_name": "Adam", "num_updates": 10,
                                       "lr_scheduler_state": {"best": None}}],
                "extra_state": {"train_iterator": {"epoch": 1}}}, path)
    return path


def test_inspect_reports_alphas_beta_and_diversity(tmp_path, capsys):
    path = _checkpoint(tmp_path, "--cheap-features", "--decoder-paths", "2")
    state_dict = torch.load(path, weights_only=False)["model"]
    rows = path_weight_rows(state_dict)
    # 2 encoder layers x 2 sublayers, 1 decoder layer x 3 sublayers.
    assert [(r["stack"], r["layer"], r["sublayer"]) for r in rows] == [
        ("encoder", 0, "self_attn"), ("encoder", 0, "ffn"), ("encoder", 1, "self_attn"),
        ("encoder", 1, "ffn"), ("decoder", 0, "self_attn"), ("decoder", 0, "encoder_attn"),
        ("decoder", 0, "ffn")]
    row = rows[3]
    assert row["num_paths"] == 4 and len(row["alphas"]) == 8  # 4 raw + 4 cheap features
    assert row["beta"] == pytest.approx(0.9)
    # Mean over the 6 pairs of raw paths: |.3-.1|/.4, |.3-.2|/.5 (x2), |.1-.2|/.3 (x2), 0.
    assert row["diversity"] == pytest.approx((0.5 + 0.2 * 2 + 1 / 3 * 2 + 0) / 6)
    assert rows[0]["diversity"] == pytest.approx(0.0)  # untrained: equal weights
    assert rows[4]["num_paths"] == 2

    plot = tmp_path / "diversity.png"
    inspect_cli.main([str(path), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "| encoder | 2 | ffn | 4 | 0.3000, 0.1000, 0.2000, 0.2000, 0.3536" in out
    assert f"| 0.9000 | {row['diversity']:.4f} |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_best.pt",
                                                          "diversity.png"]


def test_inspect_prints_widenet_rows_when_available(tmp_path, capsys, monkeypatch):
    path = _checkpoint(tmp_path)
    monkeypatch.setattr(widenet, "layernorm_divergence",
                        lambda state_dict: [{"stack": "encoder", "layer": 0,
                                             "attention_gamma": 0.125}])
    inspect_cli.main([str(path)])
    out = capsys.readouterr().out
    assert "LayerNorm divergence per encoder block" in out
    assert "| encoder | 0 | 0.1250 |" in out


def test_inspect_errors(tmp_path):
    with pytest.raises(SystemExit, match="no checkpoint file .*missing.pt"):
        inspect_cli.main([str(tmp_path / "missing.pt")])
    # post-norm: neither multi-path sublayers nor LayerNorms before the FFN (Eq. 9)
    model = params.build_model("transformer", 100, TINY_MODEL, device="cpu")
    path = tmp_path / "plain.pt"
    torch.save({"model": model.state_dict(), "cfg": None, "args": None,
                "optimizer_history": [{"criterion_name": "c", "optimizer_name": "Adam",
                                       "num_updates": 0, "lr_scheduler_state": {}}],
                "extra_state": {"train_iterator": {"epoch": 1}}}, path)
    with pytest.raises(SystemExit, match="no multi-path sublayers"):
        inspect_cli.main([str(path)])
