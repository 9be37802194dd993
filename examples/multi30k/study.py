"""The Multi30k study, En-De or En-Fr: does width beat depth at equal parameters?

Every system trains with one recipe and one batch (2,048 tokens per update) for the same budget:
the same number of updates (fairseq's ``--max-update``, the default; the validation loss is
logged along the way and checked for a plateau) or the same training time (``--stop-time-hours``).
Then the last epoch checkpoints (and the final partial epoch) are averaged, valid and test are
translated and scored with tokenized multi-bleu, sacreBLEU and chrF, and every system is compared
with the deep model, seed by seed, by sacreBLEU's paired bootstrap resampling on the test set
(BLEU and chrF), and over the seeds by a paired t-test of the seeds' scores.
Systems: a small pre-norm base model (L = 3 encoder layers), its 2L-deep version, a dense model
with a wider encoder FFN, the multi-path L x n forms of the paper's ablation (Table 4), WideNet,
EWA and ParameterNet, all but the base at about the parameters of the 2L model. Everything is
restartable: finished stages are skipped. Results: ``study.md`` (table), ``study.json``,
``study.png`` (BLEU vs parameters) and ``study-valid-loss.png`` (validation loss vs updates).

It calls the multipath_nmt library (an installed package is enough, no source checkout): the
data preparation, averaging, EWA folding, scoring and parameter counts run in this process, and
fairseq-train and fairseq-generate as subprocesses with the recipe of scripts/train.sh and
scripts/translate.sh (``multipath_nmt.recipe``). Run it as ``examples/multi30k/study.sh`` or
``python examples/multi30k/study.py``.
"""
import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# The study's parts are the study_*.py modules beside this script: systems, data, run,
# statistics, report and plots. A script's folder is on sys.path when it runs; an importer (the
# tests) may not have put it there. Their names are imported here too, where the tests use them;
# the functions the tests replace on this module are called from here.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from study_data import (  # noqa: E402,F401
    _read_lines, check_multi30k, data_tag, dictionary_size, find_text, prepare, subsample,
)
from study_plots import (  # noqa: E402,F401
    FAMILY_STYLE, LABEL_SIZE_POINTS, PLOT_MIN_SPAN_BLEU, PLOT_MIN_SPAN_PARAMS,
    VALID_PLOT_ZOOM_FROM, VALID_PLOT_ZOOM_MARGIN, _label_points, _spanning, bleu_figure,
    mean_curve, validation_loss_figure,
)
from study_plots import save_figure as _save_figure  # noqa: E402
from study_report import (  # noqa: E402,F401
    _budget_text, _cell, _convergence_text, _plateau_cell, _t_test_cell, _valid_versus_cell,
    _versus_cells, ablation_table, markdown_report, markdown_table, readme_table,
    readme_with_tables, versus_deep_table,
)
from study_run import (  # noqa: E402,F401
    _KEY_VALUE, DEVICE_GPUS, IN_PROCESS, _same_flags, archive_run, bleu_scores,
    checkpoint_updates, checkpoints_to_average, detokenized_translations, machine_info,
    resolve_device, restore_run, run, run_folder, run_system, train_command, training_stats,
    translate, validation_curve, write_json,
)
from study_statistics import (  # noqa: E402,F401
    METRICS, _compare_valid_curves, ablation_step, compare_curves, paired_bootstrap,
    paired_t_test, plateau, summarize,
)
from study_systems import (  # noqa: E402,F401
    ABLATION_STEPS, AVERAGE_LAST, BASE_FFN, BASE_LAYERS, BASELINE, BOOTSTRAP_SAMPLES,
    BPE_MERGES, DECODING, DEFAULT_BUDGET_UPDATES, DEFAULT_SYSTEMS, DEFAULT_TARGET,
    PLATEAU_TOLERANCE, PLATEAU_WINDOW, SHARED_MODEL, SHARED_RECIPE, SIGNIFICANCE_LEVEL, SOURCE,
    SPLITS, SYSTEM_NAMES, SYSTEMS, TARGETS, VALIDATIONS, Budget, StudyError, System, _encoder,
    count_parameters, log, matched_ffn, model_flags, pair_name, resolve_flags, select_systems,
    validation_interval,
)

from multipath_nmt.atomic_files import write_text_atomically  # noqa: E402


def compare_systems(summary: dict, baseline: dict, runs_root: Path, cache: dict,
                    target: str = DEFAULT_TARGET) -> Optional[dict]:
    """``summary`` against ``baseline``: per seed that both ran, the paired bootstrap of the
    system's test translations against the baseline's (sacreBLEU and chrF on detokenized text,
    cached in ``cache``); the difference of the means over seeds; ``significant`` when every
    seed's difference is (``chrf_significant`` for chrF); over the seeds, the paired t-test of
    the per-seed differences (``across_seeds``, BLEU and chrF, from two seeds on); and the
    validation losses compared (``_compare_valid_curves``). None when they share no seed.

    Why a t-test over seeds: the bootstrap measures how much one model's score depends on which
    test sentences were drawn, not how much it depends on the seed, which is what several seeds
    measure; the seed is the unit that is replicated, and pairing by seed keeps the data order
    (fairseq's seed) common to both systems. With three seeds it has 2 degrees of freedom, so
    only a difference that is consistent across seeds can reach p < 0.05."""
    seeds = [seed for seed in summary["seeds"] if seed in baseline["seeds"]]
    per_seed = []
    for seed in seeds:
        key = (baseline["system"], summary["system"], seed)
        if key not in cache:
            base_hyps, refs = detokenized_translations(
                run_folder(runs_root, baseline["system"], seed) / "test.generate", target)
            hyps, _ = detokenized_translations(
                run_folder(runs_root, summary["system"], seed) / "test.generate", target)
            cache[key] = {"seed": seed, **paired_bootstrap(base_hyps, hyps, refs)}
        per_seed.append(cache[key])
    if not per_seed:
        return None
    deltas = [c["delta"] for c in per_seed]
    chrf_deltas = [c["chrf_delta"] for c in per_seed]
    return {
        "baseline": baseline["system"], "per_seed": per_seed,
        "delta_mean": statistics.fmean(deltas),
        "delta_std": statistics.stdev(deltas) if len(deltas) > 1 else None,
        "significant": all(c["significant"] for c in per_seed),
        "chrf_delta_mean": statistics.fmean(chrf_deltas),
        "chrf_delta_std": statistics.stdev(chrf_deltas) if len(chrf_deltas) > 1 else None,
        "chrf_significant": all(c["chrf_significant"] for c in per_seed),
        "across_seeds": {"test": "paired t-test over seeds", "bleu": paired_t_test(deltas),
                         "chrf": paired_t_test(chrf_deltas)},
        "valid_loss": _compare_valid_curves(summary, baseline, seeds)}


def summaries_of(systems: Sequence[System], finished: Dict[Tuple[str, int], dict],
                 seeds: Sequence[int], runs_root: Path, cache: dict,
                 target: str = DEFAULT_TARGET) -> List[dict]:
    """The summaries of the systems whose seeds have all finished, each compared with the deep
    model and each Table 4 row with the row it changes, when those have finished."""
    summaries = [summarize(system, [finished[system.name, seed] for seed in seeds])
                 for system in systems
                 if all((system.name, seed) in finished for seed in seeds)]
    by_name = {s["system"]: s for s in summaries}
    for summary in summaries:
        comparisons = [("vs_deep", by_name.get(BASELINE)),
                       ("vs_ablation_step", by_name.get(ablation_step(summary["system"],
                                                                      by_name)))]
        for key, other in comparisons:
            versus = (compare_systems(summary, other, runs_root, cache, target)
                      if other is not None and other is not summary else None)
            if versus is not None:
                summary[key] = versus
    return summaries


def plot(summaries: List[dict], path: Path, title: str) -> None:
    """BLEU vs parameters (``study_plots.bleu_figure``), saved as ``path``."""
    _save_figure(bleu_figure(summaries, title), path)


def plot_validation_loss(summaries: List[dict], path: Path, title: str) -> bool:
    """Validation loss vs updates (``study_plots.validation_loss_figure``), saved as ``path``;
    False (nothing drawn) when no run has a validation curve."""
    figure = validation_loss_figure(summaries, title)
    if figure is None:
        return False
    _save_figure(figure, path)
    return True


def write_reports(report: dict, results: Path) -> None:
    pair = pair_name(report["config"].get("target", DEFAULT_TARGET))
    results.mkdir(parents=True, exist_ok=True)
    write_json(results / "study.json", report)
    write_text_atomically(results / "study.md", markdown_report(report))
    if not report["systems"]:  # no system has finished all its seeds yet
        return
    budget = ("equal updates" if report["config"].get("budget_updates")
              else "equal training time")
    plot(report["systems"], results / "study.png", f"Multi30k {pair}, {budget} per system")
    plot_validation_loss(report["systems"], results / "study-valid-loss.png",
                         f"Multi30k {pair}, {budget}")


def run_study(args) -> dict:
    """Prepare, run every system and seed (``--parallel`` at a time), and rewrite the reports
    after each run (so an interrupted study leaves the table of the systems that finished)."""
    budget = (Budget(minutes=args.budget_minutes) if args.budget_minutes
              else Budget(updates=args.budget_updates))
    systems = select_systems(args.systems, budget)
    device = resolve_device(args.device, args.parallel, budget)
    results = Path(args.results)
    data_bin = prepare(Path(args.data), Path(args.work), args.max_train_lines,
                       args.max_eval_lines, args.workers, args.target)
    dict_size = dictionary_size(data_bin)
    flags = resolve_flags(systems, dict_size)
    runs_root = data_bin.parent / budget.runs_dirname
    seeds = args.seeds
    report = {
        "config": {"budget_minutes": budget.minutes, "budget_updates": budget.updates,
                   "validation_interval": budget.updates and validation_interval(budget.updates),
                   "seeds": len(seeds), "seed_list": seeds, "target": args.target,
                   "compile_layers": args.compile_layers,
                   "systems": [s.name for s in systems],
                   "data": str(args.data), "data_tag": data_bin.parent.name,
                   "max_train_lines": args.max_train_lines,
                   "max_eval_lines": args.max_eval_lines, "dict_size": dict_size,
                   "bpe_merges": BPE_MERGES, "shared_model": SHARED_MODEL,
                   "shared_recipe": SHARED_RECIPE, "budget_flags": budget.training_flags(),
                   "decoding": DECODING, "device": device, "parallel": args.parallel,
                   "plateau": {"window": PLATEAU_WINDOW, "tolerance": PLATEAU_TOLERANCE},
                   "bootstrap": {"samples": BOOTSTRAP_SAMPLES,
                                 "significance_level": SIGNIFICANCE_LEVEL,
                                 "baseline": BASELINE}},
        "machine": machine_info(device),
        "runs_wall_seconds": 0.0,
        "systems": [],
    }
    start = time.monotonic()
    finished: Dict[Tuple[str, int], dict] = {}
    cache: dict = {}
    # finished runs are kept beside the results (study_run.archive_run) in the layout of --work,
    # so that another data set or budget never reads them back
    archive_root = results / "runs" / data_bin.parent.name / runs_root.name
    for seed in seeds:
        for system in systems:
            restore_run(run_folder(archive_root, system.name, seed),
                        run_folder(runs_root, system.name, seed))
    # jobs start seed by seed, each seed's systems in the study's order (base before EWA, which
    # reads its update count under a time budget; there --parallel is 1, so each job ends
    # before the next starts): an interrupted study has compared its systems on the first seeds
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        jobs = {pool.submit(run_system, system, flags[system.name], seed, data_bin,
                            run_folder(runs_root, system.name, seed), budget, dict_size,
                            runs_root, device, args.target,
                            args.compile_layers): (system.name, seed)
                for seed in seeds for system in systems}
        try:
            for job in as_completed(jobs):
                name, seed = jobs[job]
                finished[name, seed] = job.result()
                archive_run(run_folder(runs_root, name, seed), run_folder(archive_root, name, seed))
                report["systems"] = summaries_of(systems, finished, seeds, runs_root, cache,
                                                 args.target)
                report["runs_wall_seconds"] = round(sum(
                    r["run_wall_seconds"] for r in finished.values()), 1)
                report["elapsed_seconds"] = round(time.monotonic() - start, 1)
                write_reports(report, results)
        except BaseException:
            for job in jobs:  # the runs under way finish, the others do not start
                job.cancel()
            raise
    log(f"wrote {results}/study.md, study.json, study.png and study-valid-loss.png")
    return report


def _positive_int(value):
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def seed_list(value: str) -> List[int]:
    """``--seeds``: N (seeds 1 to N) or FIRST-LAST (e.g. 2-3)."""
    first, _, last = value.partition("-")
    try:
        seeds = list(range(int(first), int(last) + 1)) if last else list(range(1, int(first) + 1))
    except ValueError:
        seeds = []
    if not seeds or seeds[0] < 1:
        raise argparse.ArgumentTypeError(
            f"give N (seeds 1 to N) or FIRST-LAST with 1 <= FIRST <= LAST, got {value!r}")
    return seeds


def _positive_float(value):
    number = float(value)
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def build_parser():
    parser = argparse.ArgumentParser(prog="study.sh", description=__doc__.split("\n")[0])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-updates", type=_positive_int, default=DEFAULT_BUDGET_UPDATES,
                        help="updates of 2,048 tokens per system and seed (fairseq "
                             f"--max-update; default {DEFAULT_BUDGET_UPDATES}, about 25 epochs), "
                             "with the validation loss logged along the way")
    budget.add_argument("--budget-minutes", type=_positive_float,
                        help="instead of equal updates: the same training time per system and "
                             "seed (fairseq --stop-time-hours), without validation")
    parser.add_argument("--seeds", type=seed_list, default=[1],
                        help="N: runs per system with seeds 1..N; FIRST-LAST: those seeds only "
                             "(a study spread over machines or sessions); the table shows mean "
                             "and spread")
    parser.add_argument("--target", choices=TARGETS, default=DEFAULT_TARGET,
                        help="the language pair: English into German (default) or French, "
                             "from the same Multi30k images' captions")
    parser.add_argument("--compile-layers", nargs="?", const="inductor", metavar="BACKEND",
                        help="train every system with fairseq-train --compile-layers (torch."
                             "compile of the encoder and decoder layers; backend inductor unless "
                             "named): worth it for runs of an hour or more, after a compile of "
                             "a minute or two")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="cuda: train in train.sh's mixed precision (--amp --bf16 where the "
                             "GPU has bfloat16, else --amp; the same for every system) and "
                             "decode in fp16 on one GPU (the first visible one); auto "
                             "(default): cuda when torch sees a GPU, else cpu")
    parser.add_argument("--parallel", type=_positive_int, default=1,
                        help="runs (training, averaging, decoding) at a time on the GPU "
                             "(default 1; the CPU runs one at a time)")
    parser.add_argument("--data", default=os.environ.get("MULTI30K_DIR", "data/multi30k"),
                        help="folder with Multi30k's train/val/test_2016_flickr.{en,de}[.gz] "
                             "(default: $MULTI30K_DIR or data/multi30k)")
    parser.add_argument("--work", default="work/multi30k",
                        help="prepared data, checkpoints and translations (default: "
                             "work/multi30k)")
    parser.add_argument("--results", default="results/multi30k",
                        help="where study.md, study.json, study.png and study-valid-loss.png "
                             "go (default: results/multi30k)")
    parser.add_argument("--systems",
                        help=f"comma-separated subset of {', '.join(SYSTEM_NAMES)} (default: "
                             f"{','.join(DEFAULT_SYSTEMS)})")
    parser.add_argument("--max-train-lines", type=_positive_int,
                        help="only the first N training pairs (quick runs and tests)")
    parser.add_argument("--max-eval-lines", type=_positive_int,
                        help="only the first N valid and test pairs (quick runs and tests)")
    parser.add_argument("--workers", type=_positive_int, default=2,
                        help="processes for data preparation (default 2)")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        run_study(args)
    except StudyError as err:
        sys.exit(f"study: error: {err}")


if __name__ == "__main__":
    main()
