"""The Multi30k study (examples/multi30k/study.sh and study.py)."""
import argparse
import gzip
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, dictionaries_only_data_bin, run_cli, script_env
from helpers import in_process
import multipath_nmt
from multipath_nmt import params, recipe

STUDY_SH = ROOT / "examples" / "multi30k" / "study.sh"


def _import_study():
    """examples/multi30k/study.py, an experiment beside its example and not a module of the
    package, imported from its file (registered in sys.modules, as its dataclasses need)."""
    spec = importlib.util.spec_from_file_location("multi30k_study",
                                                  ROOT / "examples" / "multi30k" / "study.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


study = _import_study()


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


# two invocations of one run: the first killed 20 min 10 s after its first log line (a study
# stopped at a session's end), the second resumed from checkpoint_last.pt
RESUMED_TRAIN_LOG = """
$ python -m fairseq_cli.train data-bin --seed 2
recipe: 1 GPU(s), precision fp32
2026-11-26 21:10:03 | INFO | fairseq_cli.train | start
2026-11-26 21:30:13 | INFO | train_inner | epoch 014:  5 / 242 loss=3.9, num_updates=3300

$ python -m fairseq_cli.train data-bin --seed 2
2026-11-26 21:56:27 | INFO | fairseq.trainer | Loaded checkpoint_last.pt (epoch 14 @ 3146 updates)
2026-11-26 22:40:26 | INFO | fairseq_cli.train | done training
"""


def test_logged_training_seconds_span_each_invocation_from_first_to_last_log_line():
    assert study_run().logged_training_seconds(RESUMED_TRAIN_LOG) == (1210.0 + 2639.0, 2)
    # an invocation killed before fairseq logged anything counts, with no time
    assert study_run().logged_training_seconds("\n$ python -m fairseq_cli.train x\n") == (0.0, 1)
    assert study_run().logged_training_seconds("") == (0.0, 0)


def test_a_resumed_run_counts_the_training_time_of_its_earlier_invocations(tmp_path,
                                                                          monkeypatch):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    first_invocation = RESUMED_TRAIN_LOG.split("\n\n$")[0] + "\n"
    (run_dir / "train.log").write_text(first_invocation)

    def resume(command, log_path, stdout=None):
        with open(log_path, "a") as out:
            out.write("\n$ python -m fairseq_cli.train\n")
        return 100.0
    monkeypatch.setattr(study_run(), "run", resume)
    base = next(s for s in study.SYSTEMS if s.name == "base")
    # the resumed training wrote no checkpoint here, so the run stops after training
    with pytest.raises(study.StudyError, match="no checkpoint_last.pt"):
        study_run().run_system(base, study.model_flags(base), 2,
                               dictionaries_only_data_bin(tmp_path / "bin", "en", "de", True),
                               run_dir, study.Budget(updates=10), 100, tmp_path)
    done = json.loads((run_dir / "train.done.json").read_text())
    assert (done["wall_seconds"], done["invocations"]) == (1210.0 + 100.0, 2)
    # every run records where, with what, in which precision, when and from which commit
    environment = done["environment"]
    assert environment["precision"] == "fp32" and environment["device"] == "cpu"
    assert environment["torch"] == torch.__version__ and environment["cpu"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", environment["commit"])
    assert environment["started_utc"] <= environment["ended_utc"]


@pytest.mark.parametrize("argv, precision", [
    (["--amp", "--bf16"], "bf16 autocast (--amp --bf16)"), (["--amp"], "fp16 autocast (--amp)"),
    (["--fp16"], "fp16"), ([], "fp32"),
])
def test_run_records_name_the_training_precision(argv, precision):
    assert study_run().training_precision(["fairseq-train", "data", *argv]) == precision


def study_run():
    """examples/multi30k/study_run.py, as study.py imported it."""
    return sys.modules["study_run"]


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
        study.main(["--data", str(tmp_path), "--work", str(tmp_path / "w"),
                        "--results", str(tmp_path / "r")])
    message = str(exit_info.value)
    assert message.startswith(f"study: error: Multi30k not found in {tmp_path}: missing "
                              f"{tmp_path}/train.de[.gz], {tmp_path}/val.en[.gz]")
    assert "https://github.com/multi30k/dataset" in message
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()
    with pytest.raises(study.StudyError, match="unknown system.*deeper; choose from base, deep"):
        study.select_systems("base,deeper")


def test_under_a_time_budget_ewa_takes_its_length_from_the_base_models_run(capsys):
    """EWA's linear schedule needs --max-update: under a time budget it is the base model's
    update count, so the base model joins the study."""
    systems = study.select_systems("ewa", study.Budget(minutes=0.05))
    assert [s.name for s in systems] == ["base", "ewa"]
    assert "ewa takes its --max-update from the base model's run: adding base" in \
        capsys.readouterr().out
    assert [s.name for s in study.select_systems("ewa", study.Budget(updates=4))] == ["ewa"]


def _model_counts(checkpoint):
    """Total and active parameters of a trained checkpoint, counted on the loaded model."""
    from fairseq import checkpoint_utils
    (model,), _, _ = checkpoint_utils.load_model_ensemble_and_task([str(checkpoint)])
    return params.parameter_counts(model)


@pytest.mark.slow
@pytest.mark.process
def test_study_end_to_end_at_a_toy_budget(multi30k, tmp_path, capsys):
    work, results = tmp_path / "work", tmp_path / "results"
    args = [STUDY_SH, "--data", multi30k, "--work", work, "--results", results,
            "--systems", "base,ewa", "--budget-updates", "4", "--max-train-lines", "40",
            "--max-eval-lines", "20"]
    env = script_env()
    run_cli(args, env=env, timeout=300)

    report = json.loads((results / "study.json").read_text())
    assert [s["system"] for s in report["systems"]] == ["base", "ewa"]
    assert (report["config"]["budget_minutes"], report["config"]["budget_updates"]) == (None, 4)
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
        run_dir = work / "train40-eval20" / "runs-4updates" / summary["system"] / "seed1"
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
    assert base["updates"] == ewa["updates"] == 4
    assert "--max-update 4" in (work / "train40-eval20" / "runs-4updates" / "ewa" / "seed1" /
                                "train.log").read_text()
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
        assert float(cells.pop(13)) == pytest.approx(run["test_chrf"], abs=0.005)  # test chrF
        # validated every update (the budget's interval): the last valid loss and its gain over
        # the last 20% of the curve; no deep model to compare with
        assert float(cells[7]) == pytest.approx(run["valid_loss"], abs=0.0005)
        assert cells[8].endswith("%") and cells[9] == "-" and cells[13:] == ["-", "-"]
        numbers = [float(c) for c in cells[1:7] + cells[10:13]]
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
    study.main([str(a) for a in args[1:]])
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


def test_validation_curve_keeps_the_last_loss_of_each_update():
    log = "\n".join([
        "2026-11-25 | INFO | train | epoch 001 | loss 7.6 | nll_loss 7.5 | num_updates 10",
        "2026-11-25 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 7.1 | "
        "nll_loss 6.9 | ppl 119.4 | wps 100 | wpb 50 | bsz 20 | num_updates 10",
        "2026-11-25 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 6.1 | "
        "nll_loss 5.85 | ppl 57.7 | wps 100 | wpb 50 | bsz 20 | num_updates 20 | best_loss 6.1",
        # resumed from update 10: update 20 validated again
        "2026-11-25 | INFO | valid | epoch 002 | valid on 'valid' subset | loss 6.0 | "
        "nll_loss 5.8 | ppl 55.7 | wps 100 | wpb 50 | bsz 20 | num_updates 20 | best_loss 6.0",
    ])
    assert study.validation_curve(log) == [(10, 6.9), (20, 5.8)]


def test_plateau_is_the_best_loss_gain_over_the_last_fifth_of_training():
    # window from update 80: best before 4.0 (update 80), best after 3.95: 1.25% > 1%
    curve = [(20, 6.0), (40, 5.0), (60, 4.2), (80, 4.0), (100, 3.95)]
    check = study.plateau(curve)
    assert check == {"window_start_update": 80.0, "best_loss_before": 4.0, "best_loss": 3.95,
                     "improvement": pytest.approx(0.0125), "plateaued": False}
    # 3.97: 0.75%; a rising loss (overfitting) gains nothing and has plateaued
    assert study.plateau(curve[:-1] + [(100, 3.97)])["plateaued"] is True
    rising = study.plateau(curve[:-1] + [(90, 4.1), (100, 4.2)])
    assert rising["improvement"] == 0 and rising["plateaued"] is True
    # nothing to compare: no curve, or no validation inside (or before) the window
    assert study.plateau([]) is None
    assert study.plateau([(50, 5.0), (60, 4.0)]) is None
    assert study.plateau([(100, 4.0)]) is None


def test_valid_curves_are_compared_at_the_validations_both_made_in_the_last_fifth():
    # window from update 80 (of 100): shared validations at 90 and 100 (85 is the baseline's
    # alone, 80 is outside); 3.96 vs 4.0 is -1%, 4.04 vs 4.0 is +1%
    baseline = [(20, 6.0), (80, 4.0), (85, 4.1), (90, 4.0), (100, 4.0)]
    curve = [(20, 5.0), (80, 3.0), (90, 3.96), (100, 4.04)]
    check = study.compare_curves(curve, baseline)
    assert check == {"window_start_update": 80.0, "points": 2, "lower": 1,
                     "mean_difference": pytest.approx(0.0)}
    assert study.compare_curves([(90, 3.6), (100, 3.8)], baseline)["mean_difference"] == \
        pytest.approx(-0.075)
    # the window ends where the shorter run ends
    assert study.compare_curves([(80, 3.6), (85, 4.3)], baseline) == {
        "window_start_update": 68.0, "points": 2, "lower": 1,
        "mean_difference": pytest.approx((-0.1 + 0.2 / 4.1) / 2)}
    # nothing shared in the window, or no curve (a time budget without validation)
    assert study.compare_curves([(95, 4.0), (99, 4.0)], baseline) is None
    assert study.compare_curves([], baseline) is None


def test_table_gives_the_valid_loss_difference_to_deep_over_seeds():
    summary = _summary("wide", [1, 2], [0.5, 0.5], [0.3, 0.4])
    summary["vs_deep"]["valid_loss"] = {"mean_difference": -0.01234, "lower": 9, "points": 26}
    rows = study.markdown_table([_summary("deep", [1, 2]), summary]).splitlines()
    column = rows[0].split("|").index(" valid loss vs deep, last 20% ")
    assert [row.split("|")[column].strip() for row in rows[2:]] == ["-", "-1.2% (9/26)"]


REFS = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch.",
        "Kinder spielen am Strand.", "Ein Koch steht in der Küche."] * 8


def test_paired_bootstrap_is_sacrebleus_and_a_zero_difference_is_not_significant():
    from sacrebleu.metrics import BLEU
    worse = ["Ein Mann fährt.", "Hunde spielen.", "Frau liest.", "Kinder am Strand.",
             "Ein Koch steht."] * 8
    close = REFS[:-1] + ["Ein Koch in der Küche."]
    far = study.paired_bootstrap(REFS, worse, REFS)
    assert far["baseline_bleu"] == pytest.approx(100.0)
    assert far["bleu"] == pytest.approx(BLEU().corpus_score(worse, [REFS]).score)
    # no resample comes near a difference this large: sacreBLEU's smallest p, (0 + 1) / 1001
    assert far["p_value"] == pytest.approx(1 / 1001) and far["significant"]
    assert far["signature"].startswith("nrefs:1|bs:1000|seed:12345|")
    # one sentence of 40 differs: the resampled differences often exceed the observed one
    near = study.paired_bootstrap(REFS, close, REFS)
    assert 0 < -near["delta"] < 2 and near["p_value"] >= 0.05 and not near["significant"]
    # identical output: sacreBLEU still returns 1 / 1001 (no resampled difference exceeds 0)
    same = study.paired_bootstrap(worse, list(worse), REFS)
    assert same["delta"] == 0 and same["p_value"] == pytest.approx(1 / 1001)
    assert not same["significant"]


def test_paired_bootstrap_tests_chrf_beside_bleu():
    from sacrebleu.metrics import CHRF
    worse = ["Ein Mann fährt.", "Hunde spielen.", "Frau liest.", "Kinder am Strand.",
             "Ein Koch steht."] * 8
    result = study.paired_bootstrap(REFS, worse, REFS)
    assert result["baseline_chrf"] == pytest.approx(100.0)
    assert result["chrf"] == pytest.approx(CHRF().corpus_score(worse, [REFS]).score)
    assert result["chrf_delta"] == pytest.approx(result["chrf"] - 100.0)
    assert result["chrf_p_value"] == pytest.approx(1 / 1001) and result["chrf_significant"]
    assert result["chrf_signature"].startswith("nrefs:1|bs:1000|seed:12345|")
    assert "nc:6|nw:0" in result["chrf_signature"]


def test_paired_t_test_over_seeds_has_n_minus_1_degrees_of_freedom():
    # three seeds, differences 1.0, 1.2, 1.4: mean 1.2, std 0.2, t = 1.2 / (0.2 / sqrt 3); with
    # 2 degrees of freedom the two-sided p is 1 - t / sqrt(t^2 + 2)
    test = study.paired_t_test([1.0, 1.2, 1.4])
    t = 6 * 3 ** 0.5
    assert test["t"] == pytest.approx(t) and test["df"] == 2
    assert test["p_value"] == pytest.approx(1 - t / (t * t + 2) ** 0.5)
    assert test["significant"]  # p = 0.0091
    # 1, 2, 3: a larger mean but less consistent, t = 3.46, p = 0.074
    assert not study.paired_t_test([1.0, 2.0, 3.0])["significant"]
    assert study.paired_t_test([0.5]) is None and study.paired_t_test([0.5, 0.5]) is None


def test_table_against_deep_gives_both_metrics_and_the_test_over_seeds():
    summary = _summary("mp_pathnorm", [1, 2, 3], [0.9, 0.5, 0.7], [0.02, 0.2, 0.06])
    versus = summary["vs_deep"]
    for case, delta, p in zip(versus["per_seed"], [0.4, -0.1, 0.3], [0.01, 0.6, 0.04]):
        case.update(chrf_delta=delta, chrf_p_value=p, chrf_significant=p < 0.05)
    versus.update(chrf_delta_mean=0.2, chrf_delta_std=0.26, chrf_significant=False,
                  across_seeds={"bleu": study.paired_t_test([0.9, 0.5, 0.7]),
                                "chrf": study.paired_t_test([0.4, -0.1, 0.3])})
    rows = study.versus_deep_table([_summary("deep", [1, 2, 3]), summary]).splitlines()
    assert rows[0].split("|")[2:8] == [" sacreBLEU vs deep ", " p per seed ", " p over seeds ",
                                       " chrF vs deep ", " p per seed ", " p over seeds "]
    # t = 0.7 / (0.2 / sqrt 3) = 6.06: p = 0.026; chrF: t = 0.2 / (0.265 / sqrt 3) = 1.31, p = 0.321
    assert [c.strip() for c in rows[2].split("|")[1:8]] == [
        "mp_pathnorm", "+0.70 ± 0.50 †", "0.020, 0.200, 0.060", "0.026 * (t(2) = +6.06)",
        "+0.20 ± 0.26 †", "0.010, 0.600, 0.040", "0.321 (t(2) = +1.31)"]
    assert len(rows) == 3  # deep is not compared with itself
    assert study.versus_deep_table([_summary("deep", [1])]) == ""


def test_seeds_are_a_count_or_a_range():
    assert study.seed_list("3") == [1, 2, 3]
    assert study.seed_list("2-3") == [2, 3] and study.seed_list("2-2") == [2]
    for bad in ("0", "3-2", "x", "0-1", ""):
        with pytest.raises(argparse.ArgumentTypeError,
                           match=f"give N \\(seeds 1 to N\\) or FIRST-LAST .*got '{bad}'"):
            study.seed_list(bad)
    assert study.build_parser().parse_args(["--seeds", "2-3"]).seeds == [2, 3]


def test_en_fr_gets_its_own_data_folder_and_names_its_files(tmp_path):
    assert study.data_tag(None, None) == "full"
    assert study.data_tag(40, 20) == "train40-eval20"
    assert study.data_tag(None, None, "fr") == "en-fr-full"
    assert study.pair_name("fr") == "En-Fr"
    for stem in ("train", "val", "test_2016_flickr"):
        for lang in ("en", "de"):
            (tmp_path / f"{stem}.{lang}.gz").write_bytes(b"")
    study.check_multi30k(tmp_path, "de")
    with pytest.raises(study.StudyError, match=r"missing .*train\.fr\[\.gz\].*\{en,fr\}\.gz"):
        study.check_multi30k(tmp_path, "fr")


def _summary(name, seeds, deltas=None, p_values=None):
    summary = {"system": name, "label": name.title(), "params": 3e6, "active_params": 3e6,
               "seeds": seeds, "mean": {"test_bleu": 20.0}, "std": {"test_bleu": None},
               "runs": []}
    if deltas is not None:
        per_seed = [{"seed": s, "delta": d, "p_value": p, "significant": p < 0.05 and d != 0}
                    for s, d, p in zip(seeds, deltas, p_values)]
        summary["vs_deep"] = {"per_seed": per_seed, "delta_mean": sum(deltas) / len(deltas),
                              "delta_std": 0.5 if len(deltas) > 1 else None,
                              "significant": all(c["significant"] for c in per_seed)}
    return summary


def test_table_marks_differences_not_significant_in_some_seed():
    table = study.markdown_table([
        _summary("deep", [1, 2]),
        _summary("wide", [1, 2], [1.0, 2.0], [0.001, 0.03]),
        _summary("mp_original", [1, 2], [1.5, 0.5], [0.002, 0.2]),
        _summary("base", [1], [0.0], [1 / 1001]),
    ])
    cells = {row.split("|")[1].split(":")[0].strip(): [c.strip() for c in row.split("|")[-3:-1]]
             for row in table.splitlines()[2:]}
    assert cells == {"deep": ["-", "-"], "wide": ["+1.50 ± 0.50", "0.001, 0.030"],
                     "mp_original": ["+1.00 ± 0.50 †", "0.002, 0.200"],
                     "base": ["+0.00 †", "0.001"]}


def test_ablation_steps_follow_table_4_and_skip_rows_not_run():
    every = study.SYSTEM_NAMES
    assert study.ablation_step("mp_pathnorm", every) == "mp_original"
    assert study.ablation_step("mp_learnable", every) == "mp_pathnorm"
    assert study.ablation_step("mp_cheap", every) == "mp_learnable"
    assert study.ablation_step("mp_no_pathnorm", every) == "mp_learnable"
    # without + PathNorm, + learnable weights is a step from the original
    assert study.ablation_step("mp_learnable", ["deep", "mp_original"]) == "mp_original"
    assert study.ablation_step("mp_cheap", ["deep"]) is None
    assert study.ablation_step("mp_original", every) is None
    assert study.ablation_step("wide", every) is None


def test_each_table_4_row_is_tested_against_the_row_it_changes(monkeypatch, tmp_path):
    compared = []

    def fake_bootstrap(baseline, system, references):
        compared.append((baseline[0], system[0]))
        return {"baseline_bleu": 30.0, "bleu": 30.5, "delta": 0.5, "p_value": 0.2,
                "significant": False, "signature": "bs", "baseline_chrf": 60.0, "chrf": 60.2,
                "chrf_delta": 0.2, "chrf_p_value": 0.3, "chrf_significant": False,
                "chrf_signature": "bs"}
    monkeypatch.setattr(study, "detokenized_translations",
                        lambda path, target: ([path.parent.parent.name], ["ref"]))
    monkeypatch.setattr(study, "paired_bootstrap", fake_bootstrap)
    curves = {"deep": 3.0, "mp_original": 2.97, "mp_learnable": 3.03, "mp_cheap": 3.0}
    finished = {(name, 1): {"system": name, "seed": 1, "flags": [], "params": 3e6,
                            "active_params": 3e6, "test_sacrebleu": 36.0,
                            "valid_curve": [(80, 4.0), (100, loss)]}
                for name, loss in curves.items()}
    systems = [s for s in study.SYSTEMS if s.name in curves]
    summaries = study.summaries_of(systems, finished, [1], tmp_path, {})
    by_name = {s["system"]: s for s in summaries}
    # each system against deep; + learnable weights against the original (no + PathNorm run),
    # cheap features against + learnable weights
    assert sorted(compared) == sorted([("deep", "mp_original"), ("deep", "mp_learnable"),
                                       ("deep", "mp_cheap"), ("mp_original", "mp_learnable"),
                                       ("mp_learnable", "mp_cheap")])
    assert "vs_ablation_step" not in by_name["deep"] | by_name["mp_original"]
    step = by_name["mp_cheap"]["vs_ablation_step"]
    assert step["baseline"] == "mp_learnable" and step["valid_loss"]["lower"] == 1
    assert step["valid_loss"]["mean_difference"] == pytest.approx(-0.03 / 3.03)
    rows = study.ablation_table(summaries).splitlines()[2:]
    assert [r.split("|")[1:3] for r in rows] == [
        [" mp_learnable: Multi-path 3x2 + PathNorm + learnable weights ", " mp_original "],
        [" mp_cheap: Multi-path 3x3 + PathNorm + learnable + cheap features ", " mp_learnable "]]
    assert rows[0].split("|")[3:7] == [" 36.00 ", " +0.50 † ", " 0.200 ", " +2.0% (0/1) "]
    assert study.ablation_table([by_name["deep"], by_name["mp_original"]]) == ""


def _plotted_limits(monkeypatch, tmp_path, summaries):
    """The BLEU plot's axis limits, read where the study would save the figure."""
    import matplotlib.pyplot as plt
    limits = {}

    def capture(figure, path):
        limits.update(x=figure.axes[0].get_xlim(), y=figure.axes[0].get_ylim())
        plt.close(figure)
    monkeypatch.setattr(study, "_save_figure", capture)
    study.plot(summaries, tmp_path / "study.png", "title")
    return limits


def test_bleu_plot_does_not_magnify_a_small_difference(monkeypatch, tmp_path):
    # the 10,000-update results: equal sizes, 36.24 and 36.35 BLEU; autoscaling alone drew
    # 0.1 BLEU over the figure's whole height
    deep, multipath = _summary("deep", [1]), _summary("mp_learnable", [1])
    deep.update(family="deep", params=2_999_700, mean={"test_bleu": 36.24})
    multipath.update(family="multi-path", params=3_001_230, mean={"test_bleu": 36.35})
    limits = _plotted_limits(monkeypatch, tmp_path, [deep, multipath])
    assert limits["x"] == pytest.approx((3.000465 - 0.1, 3.000465 + 0.1))
    assert limits["y"] == pytest.approx((36.295 - 1.0, 36.295 + 1.0))
    # wider data keep matplotlib's own limits
    multipath["mean"] = {"test_bleu": 30.0}
    multipath["params"] = 2_400_000
    limits = _plotted_limits(monkeypatch, tmp_path, [deep, multipath])
    assert limits["y"][0] < 30.0 and limits["y"][1] > 36.24
    assert limits["y"][1] - limits["y"][0] < 7.0 and limits["x"][1] - limits["x"][0] < 0.7


def test_bleu_plot_labels_each_point_and_moves_only_overprinting_labels(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt
    offsets = {}

    def capture(figure, path):
        offsets.update((text.get_text(), text.xyann[1]) for text in figure.axes[0].texts)
        plt.close(figure)
    monkeypatch.setattr(study, "_save_figure", capture)
    # the 10,000-update results: wide and mp_original 0.02 BLEU apart, the others 0.11-0.58
    points = {"deep": ("deep", 36.24), "wide": ("wide", 36.50),
              "mp_original": ("multi-path", 36.52), "mp_pathnorm": ("multi-path", 37.10),
              "mp_learnable": ("multi-path", 36.35)}
    summaries = []
    for name, (family, bleu) in points.items():
        summary = _summary(name, [1])
        summary.update(family=family, mean={"test_bleu": bleu})
        summaries.append(summary)
    study.plot(summaries, tmp_path / "study.png", "title")
    # a label level with its point (4 points above) unless that overprints a lower one
    assert offsets == {"deep": 4, "mp_learnable": 4, "wide": 4, "mp_original": 14,
                       "mp_pathnorm": 4}


def test_validation_loss_plot_zooms_into_the_second_half(monkeypatch, tmp_path):
    import matplotlib.pyplot as plt
    panels = []

    def capture(figure, path):
        panels.extend((axes.get_xlim(), axes.get_ylim(), axes.get_title())
                      for axes in figure.axes)
        plt.close(figure)
    monkeypatch.setattr(study, "_save_figure", capture)
    deep, wide = _summary("deep", [1, 2]), _summary("wide", [1])
    deep["runs"] = [{"valid_curve": [(100, 6.0), (500, 3.0), (1000, 2.9)]},
                    {"valid_curve": [(100, 6.2), (500, 3.2), (1000, 2.8)]}]
    wide["runs"] = [{"valid_curve": [(100, 5.5), (500, 3.1), (1000, 3.0)]}]
    assert study.plot_validation_loss([deep, wide], tmp_path / "loss.png", "title")
    (whole_x, whole_y, whole_title), (zoom_x, zoom_y, zoom_title) = panels
    assert whole_y[0] < 2.8 and whole_y[1] > 6.2
    assert whole_title == "title: mean of 2 seeds, shaded min-max"
    # from update 500: deep's seeds span 2.8-3.2 (shaded), wide 3.0-3.1; 5% margins of 0.4
    assert zoom_x == (500, 1000) and zoom_title == "from update 500 on, zoomed"
    assert zoom_y == pytest.approx((2.78, 3.22))
    # no curves (a time budget without validation): no plot
    assert not study.plot_validation_loss([_summary("deep", [1])], tmp_path / "none.png", "t")


def test_parallel_runs_and_devices_that_cannot_work_are_refused(tmp_path):
    updates, minutes = study.Budget(updates=100), study.Budget(minutes=1.0)
    with pytest.raises(study.StudyError, match="^--parallel 2 runs several trainings on one "
                                               "GPU; on the CPU the runs go one at a time"):
        study.resolve_device("cpu", 2, updates)
    assert study.resolve_device("cpu", 1, minutes) == "cpu"
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(study.StudyError, match="^--device cuda: torch sees no CUDA device"):
            study.resolve_device("cuda", 1, updates)
        assert study.resolve_device("auto", 1, updates) == "cpu"
    else:
        with pytest.raises(study.StudyError, match="--parallel 2 needs the equal-updates budget"):
            study.resolve_device("cuda", 2, minutes)
    # each run sees one device: the study's batch (2,048 tokens) on any machine
    data_bin = dictionaries_only_data_bin(tmp_path / "bin", "en", "de", True)
    for device, unit, device_flags in (("cuda", "1 GPU(s)", ["--distributed-world-size", "1"]),
                                       ("cpu", "1 CPU process", ["--cpu"])):
        command = study.train_command("transformer_prenorm_wmt_en_de", study.SHARED_RECIPE,
                                      data_bin, tmp_path / "save", device)
        assert (f"batch: 2,048 max-tokens x {unit} x 1 update-freq = 2,048 tokens per update "
                "(--update-freq given: not the recipe's batch)") in command.notes
        start = command.argv.index(device_flags[0])
        assert command.argv[start:start + len(device_flags)] == device_flags


def test_budgets_give_fairseq_the_same_updates_or_time_and_separate_run_folders():
    assert study.Budget(updates=6000).training_flags() == [
        "--max-update", "6000", "--validate-interval-updates", "240"]
    assert study.Budget(minutes=8.0).training_flags() == [
        "--disable-validation", "--stop-time-hours", repr(8.0 / 60)]
    assert study.Budget(updates=6000).runs_dirname == "runs-6000updates"
    assert study.Budget(minutes=8.0).runs_dirname == "runs-8min"
    args = study.build_parser().parse_args([])
    assert (args.budget_updates, args.budget_minutes) == (study.DEFAULT_BUDGET_UPDATES, None)
    with pytest.raises(SystemExit):
        study.build_parser().parse_args(["--budget-updates", "5", "--budget-minutes", "1"])
    # the default systems are Table 4's multi-path rows with the dense references
    assert [s.name for s in study.select_systems(None, study.Budget(updates=10))] == [
        "base", "deep", "wide", "mp_original", "mp_pathnorm", "mp_learnable", "mp_cheap"]
    flags = {s.name: s.flags for s in study.SYSTEMS}
    assert flags["mp_original"][-3:] == ["--path-weights", "fixed", "--no-path-norm"]
    assert flags["mp_pathnorm"][-2:] == ["--path-weights", "fixed"]
    assert flags["mp_learnable"][-2:] == ["--path-weights", "learnable"]


def test_the_study_runs_fairseq_with_the_installed_plugin_not_the_source_trees_scripts(
        tmp_path):
    """From a pip install (no scripts/ folder): fairseq-train and fairseq-generate of this
    interpreter with the installed package as --user-dir, train.sh's recipe under the study's."""
    data_bin = dictionaries_only_data_bin(tmp_path / "bin", "en", "de", True)
    deep = next(s for s in study.SYSTEMS if s.name == "deep")
    train = study.train_command(deep.arch, study.model_flags(deep) + study.SHARED_RECIPE,
                                data_bin, tmp_path / "save")
    checkpoint = tmp_path / "checkpoint.pt"
    generate = recipe.generate_command(data_bin, checkpoint, ["--gen-subset", "valid",
                                                                    *study.DECODING], gpus=0)
    for command, tool in ((train, "fairseq_cli.train"), (generate, "fairseq_cli.generate")):
        assert command.argv[:4] == [sys.executable, "-m", tool, str(data_bin)]
        assert command.argv[command.argv.index("--user-dir") + 1] == multipath_nmt.USER_DIR
    # the study's recipe comes last, so it overrides train.sh's (fairseq keeps the last value);
    # its --max-tokens 2048 is train.sh's own cap, which the batch arithmetic applies
    assert study.SHARED_RECIPE[:2] == ["--max-tokens", "2048"]
    assert train.argv[-(len(study.SHARED_RECIPE) - 2):] == study.SHARED_RECIPE[2:]
    assert train.argv[train.argv.index("--max-tokens") + 1] == "2048"


def test_a_run_folder_from_other_flags_is_refused(tmp_path):
    deep = next(s for s in study.SYSTEMS if s.name == "deep")
    (tmp_path / "result.json").write_text(json.dumps({"flags": ["--encoder-layers", "3"]}))
    with pytest.raises(study.StudyError, match=f"^{tmp_path}/result.json was trained with other "
                                               "flags \\(--encoder-layers 3\\)"):
        study.run_system(deep, study.model_flags(deep), 1, tmp_path, tmp_path,
                         study.Budget(updates=5), 100, tmp_path)


def _finished_run(run_dir, flags):
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"system": "deep", "seed": 1,
                                                      "flags": flags, "test_sacrebleu": 36.5}))
    (run_dir / "train.done.json").write_text(json.dumps({"wall_seconds": 60.0, "flags": flags}))
    for subset in ("valid", "test"):
        (run_dir / f"{subset}.generate").write_text(
            f"S-0\tein {subset}\nH-0\t-0.1\ta\nP-0\t-0.2 -0.1\nGenerate {subset} with beam=4\n")


def test_a_finished_run_kept_with_the_results_is_read_back_without_training(tmp_path,
                                                                            monkeypatch):
    deep = next(s for s in study.SYSTEMS if s.name == "deep")
    flags = study.model_flags(deep)
    run_dir, archive = tmp_path / "work" / "seed1", tmp_path / "results" / "seed1"
    _finished_run(run_dir, flags)
    assert study.archive_run(run_dir, archive)
    kept = {p.name: p.read_bytes() for p in archive.iterdir()}
    assert sorted(kept) == ["result.json", "test.generate.gz", "train.done.json",
                            "valid.generate.gz"]
    study.archive_run(run_dir, archive)  # the same run gives the same bytes
    assert {p.name: p.read_bytes() for p in archive.iterdir()} == kept
    # an unfinished run is not archived; a finished one is not overwritten by a restore
    assert not study.archive_run(tmp_path / "unfinished", tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()
    assert not study.restore_run(archive, run_dir)

    fresh = tmp_path / "fresh" / "seed1"
    assert study.restore_run(archive, fresh)
    assert sorted(p.name for p in fresh.iterdir()) == sorted(p.name for p in run_dir.iterdir())
    for path in run_dir.iterdir():  # all but the per-token scores, which no report reads
        kept_lines = [line for line in path.read_text().splitlines(keepends=True)
                      if not line.startswith("P-")]
        assert (fresh / path.name).read_text() == "".join(kept_lines)
    assert "P-0" not in (fresh / "test.generate").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a restored run was trained again")
    monkeypatch.setattr(sys.modules["study_run"], "run", no_training)
    assert study.run_system(deep, flags, 1, tmp_path, fresh, study.Budget(updates=5), 100,
                            tmp_path) == json.loads((run_dir / "result.json").read_text())


def test_the_study_keeps_each_finished_run_and_restores_it_in_a_new_work_folder(tmp_path,
                                                                               monkeypatch):
    """--results keeps every finished run under runs/DATA_TAG/RUNS_FOLDER/SYSTEM/seedN; a study
    with a new --work finds them in place and does not run them."""
    found = []

    def fake_run(system, flags, seed, data_bin, run_dir, budget, dict_size, runs_root, device,
                 target, compile_layers):
        found.append((run_dir / "result.json").is_file())
        if not found[-1]:
            _finished_run(run_dir, flags)
        return {"system": system.name, "seed": seed, "flags": flags, "params": 1,
                "active_params": 1, "test_sacrebleu": 36.5, "run_wall_seconds": 0.2}

    _replace_the_runs(monkeypatch, tmp_path / "first", fake_run)
    monkeypatch.setattr(study, "write_reports", lambda report, results: None)

    def argv(updates=10):
        return study.build_parser().parse_args([
            "--systems", "deep,mp_pathnorm", "--seeds", "1", "--budget-updates", str(updates),
            "--device", "cpu", "--results", str(tmp_path / "results")])
    study.run_study(argv())
    kept = tmp_path / "results" / "runs" / "full" / "runs-10updates"
    assert sorted(p.name for p in kept.iterdir()) == ["deep", "mp_pathnorm"]
    assert (kept / "mp_pathnorm" / "seed1" / "test.generate.gz").is_file()
    _replace_the_runs(monkeypatch, tmp_path / "second", fake_run)
    study.run_study(argv())
    assert found == [False, False, True, True]
    # another budget has its own runs: nothing is restored for it
    study.run_study(argv(updates=20))
    assert found[-2:] == [False, False]


@pytest.mark.slow
def test_study_at_equal_updates_with_seeds_and_significance(multi30k, tmp_path, monkeypatch):
    # the study and its fairseq commands in this process (study.sh and its processes are
    # test_study_end_to_end_at_a_toy_budget's); --workers 1: no tokenizer pool forked from here
    work, results = tmp_path / "work", tmp_path / "results"
    monkeypatch.setattr(subprocess, "call", in_process.subprocess_call)
    study.main([str(a) for a in [
        "--data", multi30k, "--work", work, "--results", results,
        "--systems", "deep,mp_original", "--seeds", "2", "--budget-updates", "2",
        "--max-train-lines", "40", "--max-eval-lines", "20", "--device", "cpu",
        "--workers", "1"]])
    report = json.loads((results / "study.json").read_text())
    assert report["config"]["budget_updates"] == 2 and report["config"]["budget_minutes"] is None
    runs_root = work / "train40-eval20" / "runs-2updates"
    # every finished run is kept beside the results, its translations gzipped
    kept = results / "runs" / "train40-eval20" / "runs-2updates"
    for system in ("deep", "mp_original"):
        for seed in (1, 2):
            generated = (runs_root / system / f"seed{seed}" / "test.generate").read_text()
            with gzip.open(kept / system / f"seed{seed}" / "test.generate.gz", "rt") as archived:
                assert archived.read() == "".join(
                    line for line in generated.splitlines(keepends=True)
                    if not line.startswith("P-"))
    # every system and seed ends at the same update, the same epoch, with 2,048 tokens a batch
    for summary in report["systems"]:
        assert summary["seeds"] == [1, 2]
        for run in summary["runs"]:
            assert (run["updates"], run["epochs"]) == (2, 1.0)
            # validated at every update (2 // 25 -> every update): a curve to the last update
            assert [u for u, _ in run["valid_curve"]] == [1, 2]
            assert run["valid_loss"] == run["valid_curve"][-1][1]
            assert run["valid_plateau"] == study.plateau(run["valid_curve"])
            log = (runs_root / run["system"] / f"seed{run['seed']}" / "train.log").read_text()
            assert "--max-update 2 --validate-interval-updates 1" in log
            assert "2,048 max-tokens x 1 CPU process x 1 update-freq = 2,048 tokens" in log
        assert summary["mean"]["test_sacrebleu"] == pytest.approx(
            sum(r["test_sacrebleu"] for r in summary["runs"]) / 2)
    deep, multipath = report["systems"]
    assert "vs_deep" not in deep
    # the paired bootstrap per seed on the detokenized test translations of the same seed
    for check in multipath["vs_deep"]["per_seed"]:
        seed_dir = f"seed{check['seed']}"
        base_hyps, refs = study.detokenized_translations(runs_root / "deep" / seed_dir /
                                                         "test.generate")
        hyps, _ = study.detokenized_translations(runs_root / "mp_original" / seed_dir /
                                                 "test.generate")
        assert check == {"seed": check["seed"], **study.paired_bootstrap(base_hyps, hyps, refs)}
    versus = multipath["vs_deep"]
    assert versus["significant"] == all(c["significant"] for c in versus["per_seed"])
    # the validation losses against deep's, per seed, at the validations of the last 20%
    deep_curves = {r["seed"]: r["valid_curve"] for r in deep["runs"]}
    per_seed = [{"seed": r["seed"], **study.compare_curves(r["valid_curve"],
                                                            deep_curves[r["seed"]])}
                for r in multipath["runs"]]
    assert [c["points"] for c in per_seed] == [1, 1]
    assert versus["valid_loss"] == {
        "per_seed": per_seed, "lower": sum(c["lower"] for c in per_seed), "points": 2,
        "mean_difference": pytest.approx(sum(c["mean_difference"] for c in per_seed) / 2)}
    row = next(line for line in (results / "study.md").read_text().splitlines()
               if line.startswith("| mp_original: "))
    delta, p_values = [c.strip() for c in row.split("|")[-3:-1]]
    assert delta.endswith(" †") == (not versus["significant"])
    assert p_values == ", ".join(f"{c['p_value']:.3f}" for c in versus["per_seed"])
    for png in ("study.png", "study-valid-loss.png"):
        assert (results / png).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def _replace_the_runs(monkeypatch, tmp_path, fake_run, data_tag="full"):
    """The study around ``fake_run`` (run_system's stand-in): no data preparation, model
    builds, machine probe or translations to read."""
    monkeypatch.setattr(study, "prepare", lambda *args: tmp_path / data_tag / "data-bin")
    monkeypatch.setattr(study, "dictionary_size", lambda data_bin: 100)
    monkeypatch.setattr(study, "resolve_flags", lambda systems, size: {
        s.name: study.model_flags(s) for s in systems})
    monkeypatch.setattr(study, "machine_info", lambda device: {"device": device})
    monkeypatch.setattr(study, "run_system", fake_run)
    monkeypatch.setattr(study, "detokenized_translations",
                        lambda path, target: (["a b c d"], ["a b c d"]))


def test_parallel_runs_go_k_at_a_time_and_reports_follow_finished_systems(tmp_path,
                                                                          monkeypatch):
    """--parallel 2 on a GPU: at most two runs at once, every run done once, and each report
    holds the systems whose seeds have all finished (the training itself is replaced)."""
    import threading
    import time
    running, most, lock, reports = [], [0], threading.Lock(), []

    def fake_run(system, flags, seed, data_bin, run_dir, budget, dict_size, runs_root, device,
                 target, compile_layers):
        with lock:
            running.append((system.name, seed))
            most[0] = max(most[0], len(running))
        time.sleep(0.2)
        with lock:
            running.remove((system.name, seed))
        return {"system": system.name, "seed": seed, "flags": flags, "params": 1,
                "active_params": 1, "test_sacrebleu": 10.0 + seed, "run_wall_seconds": 0.2}

    monkeypatch.setattr(study, "resolve_device", lambda device, parallel, budget: "cuda")
    _replace_the_runs(monkeypatch, tmp_path, fake_run)
    monkeypatch.setattr(study, "write_reports", lambda report, results: reports.append(
        [s["system"] for s in report["systems"]]))
    args = study.build_parser().parse_args(["--systems", "deep,wide,mp_original", "--seeds", "2",
                                          "--budget-updates", "10", "--parallel", "2",
                                          "--device", "cuda"])
    report = study.run_study(args)
    assert most[0] == 2 and len(reports) == 6
    # a system enters the report when its last seed finishes, and stays, in the study's order
    assert reports[-1] == ["deep", "wide", "mp_original"]
    assert all(r == n[:len(r)] or set(r) <= set(n) for r, n in zip(reports, reports[1:]))
    assert report["config"]["parallel"] == 2 and report["config"]["device"] == "cuda"
    assert [c["seed"] for c in report["systems"][1]["vs_deep"]["per_seed"]] == [1, 2]


def test_runs_go_seed_by_seed_so_an_interrupted_study_has_compared_its_first_seeds(
        tmp_path, monkeypatch):
    order, reports = [], []

    def fake_run(system, flags, seed, data_bin, run_dir, budget, dict_size, runs_root, device,
                 target, compile_layers):
        order.append((system.name, seed, target))
        return {"system": system.name, "seed": seed, "flags": flags, "params": 1,
                "active_params": 1, "test_sacrebleu": 10.0 + seed, "run_wall_seconds": 0.2}

    _replace_the_runs(monkeypatch, tmp_path, fake_run, "en-fr-full")
    monkeypatch.setattr(study, "paired_bootstrap", lambda base, system, refs: {
        "delta": 0.0, "p_value": 1.0, "significant": False, "chrf_delta": 0.0,
        "chrf_p_value": 1.0, "chrf_significant": False})
    monkeypatch.setattr(study, "write_reports", lambda report, results: reports.append(report))
    args = study.build_parser().parse_args(["--systems", "deep,mp_pathnorm", "--seeds", "2-3",
                                          "--target", "fr", "--device", "cpu"])
    report = study.run_study(args)
    assert order == [("deep", 2, "fr"), ("mp_pathnorm", 2, "fr"), ("deep", 3, "fr"),
                     ("mp_pathnorm", 3, "fr")]
    assert report["config"]["seeds"] == 2 and report["config"]["seed_list"] == [2, 3]
    assert report["config"]["target"] == "fr"
    assert report["systems"][1]["seeds"] == [2, 3]


def test_the_readme_quotes_its_tables_from_the_committed_study_json():
    readme = ROOT / "examples" / "multi30k" / "README.md"
    text = readme.read_text()
    assert re.findall(r"<!-- table: (\S+) -->", text), "no marked table in the README"
    assert study.readme_with_tables(readme) == text, (
        "a README table differs from its study.json: run "
        "python examples/multi30k/study_report.py examples/multi30k/README.md")


def test_readme_table_gives_seeds_scores_and_both_tests_against_deep():
    deep = _summary("deep", [2, 3])
    deep["mean"]["test_sacrebleu"], deep["std"]["test_sacrebleu"] = 36.5, 0.3
    other = _summary("mp_pathnorm", [2, 3], [0.9, 0.5], [0.02, 0.2])
    other["mean"].update(test_sacrebleu=37.2, test_chrf=61.25)
    other["std"].update(test_sacrebleu=0.28, test_chrf=0.1)
    rows = study.readme_table({"systems": [deep, other]}).splitlines()
    # no row has a test over seeds or a chrF comparison: those columns are left out
    assert rows[0] == ("| system | seeds | params (M) | test sacreBLEU | test chrF | "
                       "sacreBLEU vs deep | p per seed |")
    assert rows[2] == "| deep | 2, 3 | 3.00 | 36.50 ± 0.30 | - | - | - |"
    assert rows[3] == ("| mp_pathnorm | 2, 3 | 3.00 | 37.20 ± 0.28 | 61.25 ± 0.10 | "
                       "+0.70 ± 0.50 † | 0.020, 0.200 |")


def test_readme_table_of_several_studies_says_where_each_row_ran(tmp_path):
    on_a_gpu = {"config": {"target": "de"}, "machine": {"gpu": "NVIDIA H100 80GB HBM3"},
                "systems": [_summary("deep", [1]), _summary("mp_pathnorm", [1], [0.6], [0.1])]}
    en_fr = {"config": {"target": "fr"}, "machine": {"gpu": None},
             "systems": [_summary("deep", [1])]}
    rows = study.readme_table(on_a_gpu, en_fr).splitlines()
    assert rows[:2] == ["| setting | system | seeds | params (M) | sacreBLEU vs deep | p per seed |",
                        "|---|---|---:|---:|---:|---:|"]
    assert rows[2:] == ["| En-De, H100 80GB HBM3 | deep | 1 | 3.00 | - | - |",
                        "| En-De, H100 80GB HBM3 | mp_pathnorm | 1 | 3.00 | +0.60 † | 0.100 |",
                        "| En-Fr, CPU | deep | 1 | 3.00 | - | - |"]
    # the README names both files in one marker, each relative to it
    for name, report in (("gpu", on_a_gpu), ("fr", en_fr)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "study.json").write_text(json.dumps(report))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- table: gpu/study.json fr/study.json -->\nold\n<!-- end table -->\n")
    assert study.readme_with_tables(readme).splitlines()[2:7] == rows


def test_compile_layers_reaches_every_training_and_the_report(tmp_path, monkeypatch):
    received = []

    def fake_run(system, flags, seed, data_bin, run_dir, budget, dict_size, runs_root, device,
                 target, compile_layers=None):
        received.append(compile_layers)
        return {"system": system.name, "seed": seed, "flags": flags, "params": 1,
                "active_params": 1, "test_sacrebleu": 10.0, "run_wall_seconds": 0.2}

    _replace_the_runs(monkeypatch, tmp_path, fake_run)
    monkeypatch.setattr(study, "write_reports", lambda report, results: None)
    args = study.build_parser().parse_args(["--systems", "base", "--compile-layers",
                                          "--device", "cpu"])
    assert study.run_study(args)["config"]["compile_layers"] == "inductor"
    assert received == ["inductor"]

    # the flag reaches fairseq-train's command line (the run itself is stopped there)
    commands = []

    def stop(command, log_path, stdout=None):
        commands.append(command.argv)
        raise study.StudyError("stopped")
    monkeypatch.setattr(sys.modules["study_run"], "run", stop)
    base = next(s for s in study.SYSTEMS if s.name == "base")
    with pytest.raises(study.StudyError, match="stopped"):
        sys.modules["study_run"].run_system(
            base, study.model_flags(base), 1,
            dictionaries_only_data_bin(tmp_path / "bin", "en", "de", True), tmp_path / "run",
            study.Budget(updates=10), 100, tmp_path, compile_layers="aot_eager")
    assert commands[0][-2:] == ["--compile-layers", "aot_eager"]


# --- the corrected statistics of the README (study_report / study_statistics) ----------------

def test_holm_is_the_step_down_adjustment():
    # sorted 0.01, 0.03, 0.04: x3, x2, x1, made monotone
    assert study_statistics().holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert study_statistics().holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert study_statistics().holm([0.02]) == [0.02]


def test_interval_over_seeds_and_the_sign_test():
    stats = study_statistics()
    interval = stats.t_interval([0.98, -0.14, 0.45])
    sd = statistics.stdev([0.98, -0.14, 0.45])
    assert interval["half_width"] == pytest.approx(4.302653 * sd / 3 ** 0.5, rel=1e-6)
    assert stats.t_interval([0.5]) is None
    assert stats.sign_test(3, 3) == pytest.approx(0.25)  # three seeds cannot go below it
    assert stats.sign_test(2, 3) == pytest.approx(1.0)
    valid = stats.valid_loss_over_seeds({"per_seed": [{"mean_difference": d}
                                                      for d in (-0.01, -0.02, 0.005)]})
    assert (valid["lower"], valid["seeds"], valid["sign_p"]) == (2, 3, pytest.approx(1.0))


def _readme_studies():
    results = ROOT / "examples" / "multi30k" / "results"
    return {name: json.loads((results / name / "study.json").read_text())
            for name in ("10000updates-seeds", "10000updates")}


def test_the_readme_has_corrected_statistics_and_run_records_tables():
    text = (ROOT / "examples" / "multi30k" / "README.md").read_text()
    for kind in ("table", "statistics", "ablation", "records"):
        assert f"<!-- {kind}: " in text, kind
    # the records say what is not recorded rather than leaving it out
    assert "not recorded" in text and "bf16 autocast (--amp --bf16) by inference" in text


def test_the_readme_reading_quotes_the_computed_statistics():
    """The prose quotes numbers that study_report computes: each is checked here."""
    text = " ".join((ROOT / "examples" / "multi30k" / "README.md").read_text().split())
    report = sys.modules["study_report"]
    seeds, seven = (report._families(s) for s in _readme_studies().values())
    for system in ("mp_pathnorm", "mp_cheap", "base"):
        interval = seeds[system]["bleu"]["interval"]
        assert (f"{interval['mean']:+.2f} [{interval['low']:+.2f}, {interval['high']:+.2f}]"
                in text), system
        assert 1.3 < interval["half_width"] < 1.65  # "about +-1.4"
    valid = seeds["mp_pathnorm"]["valid"]
    assert (valid["lower"], valid["seeds"]) == (3, 3)
    assert f"sign test p = {valid['sign_p']:.2f}" in text
    assert f"t-test p = {valid['t_p']:.2f}" in text
    assert "-1.0%, -1.9%, -0.7%" in text and [f"{100 * d:.1f}" for d in valid["differences"]] == [
        "-1.0", "-1.9", "-0.7"]
    assert f"0.020 (six comparisons with deep) is {seven['mp_pathnorm']['bleu']['bootstrap'][0][1]:.2f}" in text
    assert f"is {seeds['mp_pathnorm']['bleu']['bootstrap'][0][1]:.3f}" in text
    assert f"Holm p = {seeds['mp_pathnorm']['bleu']['t_p_holm']:.2f}" in text
    steps = [s for s in _readme_studies()["10000updates"]["systems"]
             if s.get("vs_ablation_step")]
    adjusted = study_statistics().holm([s["vs_ablation_step"]["per_seed"][0]["p_value"]
                                        for s in steps])
    learnable = next(i for i, s in enumerate(steps) if s["system"] == "mp_learnable")
    assert f"is {adjusted[learnable]:.3f} among the three steps" in text
    assert f"chrF 0.008 is {seeds['mp_pathnorm']['chrf']['bootstrap'][0][1]:.3f}" in text
    # what the reading says survives the correction, and nothing else does
    surviving = {(name, metric, index) for family in (seeds, seven)
                 for name, system in family.items() for metric in ("bleu", "chrf")
                 if system.get(metric)
                 for index, (_, holm_p, _) in enumerate(system[metric]["bootstrap"])
                 if holm_p < 0.05}
    assert surviving == {("mp_pathnorm", "bleu", 0), ("mp_pathnorm", "chrf", 0)}
    assert all(system[metric]["t_p_holm"] is None or system[metric]["t_p_holm"] >= 0.05
               for family in (seeds, seven) for system in family.values()
               for metric in ("bleu", "chrf") if system.get(metric))


def test_run_records_fill_the_records_table_and_old_runs_say_not_recorded(tmp_path):
    report = sys.modules["study_report"]
    environment = {"cpu": "CPU X", "gpu": None, "torch": "2.13.0+cpu", "precision": "fp32",
                   "started_utc": "2027-01-02T03:04:05Z", "ended_utc": "2027-01-02T04:00:00Z",
                   "commit": "a" * 40}
    study_json = {"machine": {"cpu": "CPU X", "torch": "2.13.0+cpu", "gpu": None},
                  "systems": [{"runs": [{"environment": environment}]}]}
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "study.json").write_text(json.dumps(study_json))
    study_json["systems"][0]["runs"][0]["environment"] = None
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "study.json").write_text(json.dumps(study_json))
    rows = report.records_table(tmp_path, ["new/study.json", "old/study.json"]).splitlines()
    assert rows[2] == ("| `new/` | 1 | CPU X | 2.13.0+cpu | fp32 | 2027-01-02 to 2027-01-02 "
                       f"(trained) | {'a' * 40} |")
    assert rows[3] == ("| `old/` | 1 | CPU X | 2.13.0+cpu | not recorded | not recorded | "
                       "not recorded |")


def study_statistics():
    return sys.modules["study_statistics"]
