"""multipath-plot-log: the loss curves of real fairseq-train logs (simple and json) and the PNG."""

import pytest

from conftest import ROOT, run_tool

from multipath_nmt.cli.plot_log import build_parser, plot
from multipath_nmt.training_log import PlotLogError, parse_log

FIXTURES = ROOT / "tests" / "fixtures"

# The numbers printed by the tiny run (6 updates per epoch, --log-interval 2, 3 epochs).
TRAIN_INNER = [(2, 7.647), (4, 7.635), (6, 7.614), (8, 7.593), (10, 7.274), (12, 6.932),
               (14, 7.063), (16, 6.604), (18, 6.506)]
TRAIN = [(6, 7.632), (12, 7.258), (18, 6.727)]
VALID = [(6, 7.632), (12, 6.963), (18, 6.564)]


@pytest.mark.parametrize("name", ["train_simple.log", "train_json.log"])
def test_parse_real_logs(name):
    curves = parse_log(FIXTURES / name)
    assert curves.train_inner == TRAIN_INNER
    assert curves.train == TRAIN
    assert curves.valid == {"valid": VALID}


def test_png_written(tmp_path):
    out = tmp_path / "curves.png"
    logs = plot(build_parser().parse_args([str(FIXTURES / "train_simple.log"), str(FIXTURES / "train_json.log"),
                                           "--labels", "Base", "Multi-Path", "--out", str(out)]))
    assert [label for label, _ in logs] == ["Base", "Multi-Path"]
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10000
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_log_without_losses_refused(tmp_path):
    log = tmp_path / "preprocess.log"
    log.write_text("2026-11-22 02:40:00 | INFO | fairseq_cli.preprocess | [en] Dictionary: 88 types\n")
    with pytest.raises(PlotLogError, match="preprocess.log: no train_inner/train/valid loss lines"):
        parse_log(log)
    out = tmp_path / "curves.png"
    proc = run_tool("multipath-plot-log", log, "--out", out, check=False)
    assert proc.returncode == 1 and "no train_inner/train/valid loss lines" in proc.stderr
    assert not out.exists()


def test_label_count_must_match(tmp_path):
    args = build_parser().parse_args([str(FIXTURES / "train_simple.log"), "--labels", "a", "b",
                                      "--out", str(tmp_path / "x.png")])
    with pytest.raises(PlotLogError, match="2 --labels for 1 logs"):
        plot(args)
