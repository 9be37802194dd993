"""The Multi30k study (examples/multi30k/study.sh, multipath_nmt/study.py)."""
import json
import os
import re
import sys

import pytest

from conftest import ROOT, clean_env, run_cli
from multipath_nmt import study
from multipath_nmt.cli import params

STUDY_SH = ROOT / "examples" / "multi30k" / "study.sh"


def test_training_stats_sum_tokens_and_step_time_over_epochs():
    log = "\n".join([
        "2026-11-22 | INFO | fairseq.data.iterators | grouped total_num_itrs = 10",
        "2026-11-22 | INFO | train_inner | epoch 001:  5 / 10 loss=9, wpb=99, num_updates=5",
        "2026-11-22 | INFO | train | epoch 001 | loss 7.6 | wps 100 | wpb 300 | bsz 49.3 | "
        "num_updates 10 | lr 0.0006 | train_wall 20 | wall 29",
        "2026-11-22 | INFO | valid | epoch 001 | loss 7.1 | wpb 50 | num_updates 10",
        "2026-11-22 | INFO | train | epoch 002 | loss 7.2 | wps 40 | wpb 200 | bsz 49.3 | "
        "num_updates 14 | lr 1e-05 | train_wall 5 | wall 47",
    ])
    # 300 x 10 target tokens at 100/s, then 200 x 4 at 40/s: 3800 tokens in 50 s
    assert study.training_stats(log) == {"updates": 14, "last_epoch": 2, "epochs": 1.4,
                                         "train_tokens_per_second": 76.0}


def test_matched_ffn_gives_the_deep_models_parameters():
    systems = {s.name: s for s in study.SYSTEMS}
    deep = study.count_parameters("transformer_prenorm_wmt_en_de",
                                  study.model_flags(systems["deep"]), 8000)["total"]
    flags = study.resolve_flags([systems["wide"], systems["mp_cheap"]], 8000)
    for name in ("wide", "mp_cheap"):
        ffn = int(flags[name][flags[name].index("--encoder-ffn-embed-dim") + 1])
        assert flags[name].count("--encoder-ffn-embed-dim") == 1 and ffn % 8 == 0
        total = study.count_parameters(systems[name].arch, flags[name], 8000)["total"]
        # one step of 8 FFN units in every encoder layer and path is the rounding error
        step = (study.count_parameters(systems[name].arch,
                                       study.model_flags(systems[name], ffn + 8), 8000)["total"]
                - total)
        assert abs(total - deep) <= step / 2, (name, ffn, total, deep)
    # every other system of the study is within 5% of the deep model's size
    resolved = study.resolve_flags(study.SYSTEMS, 8000)
    for system in study.SYSTEMS[1:]:
        total = study.count_parameters(system.arch, resolved[system.name], 8000)["total"]
        assert abs(total - deep) / deep < 0.05, (system.name, total, deep)


def test_missing_data_and_unknown_systems_are_refused(tmp_path):
    (tmp_path / "train.en.gz").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        study.cli_main(["--data", str(tmp_path), "--work", str(tmp_path / "w"),
                        "--results", str(tmp_path / "r")])
    message = str(exit_info.value)
    assert message.startswith(f"study: error: Multi30k not found in {tmp_path}: missing "
                              f"{tmp_path}/train.de[.gz], {tmp_path}/val.en[.gz]")
    assert "https://github.com/multi30k/dataset" in message
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()
    with pytest.raises(study.StudyError, match="unknown system.*deeper; choose from base, deep"):
        study.select_systems("base,deeper")


def _model_counts(checkpoint):
    """Total and active parameters of a trained checkpoint, counted on the loaded model."""
    from fairseq import checkpoint_utils
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    return params.parameter_counts(model)


@pytest.mark.slow
def test_study_end_to_end_at_a_toy_budget(multi30k, tmp_path, capsys):
    work, results = tmp_path / "work", tmp_path / "results"
    args = [STUDY_SH, "--data", multi30k, "--work", work, "--results", results,
            "--systems", "ewa", "--budget-minutes", "0.05", "--max-train-lines", "40",
            "--max-eval-lines", "20"]
    env = clean_env(PYTHON=sys.executable)
    first = run_cli(args, env=env, timeout=300)
    assert "ewa takes its --max-update from the base model's run: adding base" in first.stdout

    report = json.loads((results / "study.json").read_text())
    assert [s["system"] for s in report["systems"]] == ["base", "ewa"]
    assert report["config"]["budget_minutes"] == 0.05
    dict_size = report["config"]["dict_size"]
    for summary in report["systems"]:
        (run,) = summary["runs"]
        assert run["updates"] >= 1 and run["train_tokens_per_second"] > 0
        for key in ("valid_bleu", "valid_sacrebleu", "test_bleu", "test_sacrebleu"):
            assert 0 <= run[key] <= 100
        assert run["test_multi_bleu"].startswith(f"BLEU = {run['test_bleu']:.2f}, ")
        # the counts are multipath-params' for the trained flags ...
        counts = params.parameter_counts(params.build_model(summary["arch"], dict_size,
                                                            summary["flags"]))
        assert (summary["params"], summary["active_params"]) == (counts["total"],
                                                                 counts["active"])
        # ... and those of the model in the checkpoints the study trained and tested
        run_dir = work / "train40-eval20" / "runs-0.05min" / summary["system"] / "seed1"
        trained = _model_counts(run_dir / "checkpoints" / "checkpoint_last.pt")
        assert (trained["total"], trained["active"]) == (counts["total"], counts["active"])
        # averaged: the final partial epoch (checkpoint_last.pt) when the budget ran out inside
        # an epoch, then the newest epoch checkpoints, 5 in all at most (40 pairs are 2 batches)
        complete = int(run["epochs"])
        partial = ["checkpoint_last.pt"] if run["epochs"] > complete else []
        assert run["averaged"] == (partial + [f"checkpoint{e}.pt"
                                              for e in range(complete, 0, -1)])[:5]
    base, ewa = (s["runs"][0] for s in report["systems"])
    # EWA shares the base model's update count as its schedule length and is tested folded:
    # the dense model has exactly the EWA model's active parameters, the base model's size
    assert f"--max-update {base['updates']}" in (work / "train40-eval20" / "runs-0.05min" /
                                                 "ewa" / "seed1" / "train.log").read_text()
    assert ewa["test_checkpoint"].endswith("checkpoint_avg_dense.pt")
    dense = _model_counts(ewa["test_checkpoint"])
    assert dense["total"] == dense["active"] == report["systems"][1]["active_params"] \
        == report["systems"][0]["params"]
    assert report["systems"][1]["params"] > report["systems"][1]["active_params"]

    table = (results / "study.md").read_text()
    rows = [line for line in table.splitlines() if re.match(r"\| (base|ewa): ", line)]
    assert len(rows) == 2
    for row, summary in zip(rows, report["systems"]):
        cells = [c.strip() for c in row.strip("|").split("|")]
        run = summary["runs"][0]
        numbers = [float(c) for c in cells[1:]]
        assert numbers == [round(summary["params"] / 1e6, 2),
                           round(summary["active_params"] / 1e6, 2),
                           run["updates"], pytest.approx(run["epochs"], abs=0.005),
                           round(run["train_tokens_per_second"]),
                           pytest.approx(run["train_wall_minutes"], abs=0.05),
                           pytest.approx(run["valid_bleu"], abs=0.005),
                           pytest.approx(run["test_bleu"], abs=0.005),
                           pytest.approx(run["test_sacrebleu"], abs=0.005)]
    png = (results / "study.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000

    # a rerun (here in-process, to save an interpreter start) skips the finished systems and
    # rewrites the same results
    before = {s["system"]: s["runs"] for s in report["systems"]}
    capsys.readouterr()
    study.cli_main([str(a) for a in args[1:]])
    second = capsys.readouterr().out
    assert "base seed 1: already done" in second and "ewa seed 1: already done" in second
    assert "already prepared" in second and "training" not in second
    again = json.loads((results / "study.json").read_text())
    assert {s["system"]: s["runs"] for s in again["systems"]} == before


@pytest.mark.parametrize("usable,threads,expected", [
    (1, 1, "Machine: AMD EPYC, 2 CPUs (1 usable by the study), torch 2.13.0 with 1 thread."),
    (2, 2, "Machine: AMD EPYC, 2 CPUs, torch 2.13.0 with 2 threads."),
])
def test_report_says_how_many_cpus_and_threads_the_study_had(usable, threads, expected):
    report = {"config": {"budget_minutes": 8.0, "seeds": 1, "data_tag": "full", "dict_size": 10},
              "machine": {"cpu": "AMD EPYC", "cpus": 2, "usable_cpus": usable,
                          "torch": "2.13.0", "torch_threads": threads},
              "runs_wall_seconds": 60.0, "systems": []}
    assert expected in study.markdown_report(report)
    assert study.machine_info()["usable_cpus"] == len(os.sched_getaffinity(0))
