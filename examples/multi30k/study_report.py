"""The Multi30k study's report (see study.py): study.md, its tables of the systems, against the
deep model and along the paper's ablation, and the text around them; and the README's tables,
quoted from the committed study.json files (``python study_report.py README.md`` rewrites them).
"""
import json
import re
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from multipath_nmt.atomic_files import write_text_atomically
from study_systems import (
    AVERAGE_LAST, BASELINE, BPE_MERGES, DEFAULT_TARGET, PLATEAU_TOLERANCE, PLATEAU_WINDOW,
    SHARED_MODEL, SHARED_RECIPE, SIGNIFICANCE_LEVEL, Budget, pair_name,
)
from study_statistics import holm, t_interval, valid_loss_over_seeds


def _cell(summary, metric, digits):
    mean, std = summary["mean"].get(metric), summary["std"].get(metric)
    if mean is None:
        return "-"
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def _plateau_cell(summary):
    check = summary.get("valid_plateau")
    return "-" if check is None else f"{100 * check['max_improvement']:.2f}%"


def _valid_versus_cell(versus: Optional[dict]) -> str:
    """The validation loss's mean relative difference to the other system's over the last 20% of
    training, and at how many of those validations (all seeds) it was lower."""
    versus = (versus or {}).get("valid_loss")
    if versus is None:
        return "-"
    return f"{100 * versus['mean_difference']:+.1f}% ({versus['lower']}/{versus['points']})"


def _versus_cells(versus: Optional[dict], metric: str = "") -> Tuple[str, str]:
    """The mean sacreBLEU difference (``metric`` "chrf_": chrF's) to the other system (± its std
    over seeds; † when p >= 0.05 in some seed) and the p-value of each seed."""
    if versus is None or f"{metric}delta_mean" not in versus:
        return "-", "-"
    std = versus[f"{metric}delta_std"]
    delta = f"{versus[f'{metric}delta_mean']:+.2f}" + (f" ± {std:.2f}" if std is not None else "")
    mark = "" if versus[f"{metric}significant"] else " †"
    return delta + mark, ", ".join(f"{c[f'{metric}p_value']:.3f}" for c in versus["per_seed"])


def _t_test_cell(versus: Optional[dict], metric: str) -> str:
    """The paired t-test over seeds: p and t with its degrees of freedom, * when p < 0.05."""
    test = ((versus or {}).get("across_seeds") or {}).get(metric)
    if test is None:
        return "-"
    return (f"{test['p_value']:.3f}{' *' if test['significant'] else ''} "
            f"(t({test['df']}) = {test['t']:+.2f})")


def markdown_table(summaries: List[dict]) -> str:
    lines = ["| system | params (M) | active (M) | updates | epochs | train tok/s | "
             "train wall (min) | valid loss | loss gain, last 20% | valid loss vs deep, "
             "last 20% | valid BLEU | test BLEU | test sacreBLEU | test chrF | vs deep | "
             "p per seed |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        delta, p_values = _versus_cells(s.get("vs_deep"))
        lines.append(
            f"| {s['system']}: {s['label']} | {s['params'] / 1e6:.2f} | "
            f"{s['active_params'] / 1e6:.2f} | {_cell(s, 'updates', 0)} | "
            f"{_cell(s, 'epochs', 2)} | {_cell(s, 'train_tokens_per_second', 0)} | "
            f"{_cell(s, 'train_wall_minutes', 1)} | {_cell(s, 'valid_loss', 3)} | "
            f"{_plateau_cell(s)} | {_valid_versus_cell(s.get('vs_deep'))} | "
            f"{_cell(s, 'valid_bleu', 2)} | {_cell(s, 'test_bleu', 2)} | "
            f"{_cell(s, 'test_sacrebleu', 2)} | {_cell(s, 'test_chrf', 2)} | {delta} | "
            f"{p_values} |")
    return "\n".join(lines) + "\n"


# Both metrics against deep: the mean difference over seeds, each seed's bootstrap p, the t-test
VERSUS_DEEP_HEADER = ["sacreBLEU vs deep", "p per seed", "p over seeds", "chrF vs deep",
                      "p per seed", "p over seeds"]


def _versus_deep_cells(versus: Optional[dict]) -> List[str]:
    """The cells of VERSUS_DEEP_HEADER for one system's comparison with deep."""
    return [*_versus_cells(versus), _t_test_cell(versus, "bleu"),
            *_versus_cells(versus, "chrf_"), _t_test_cell(versus, "chrf")]


def versus_deep_table(summaries: List[dict]) -> str:
    """Each system against deep in sacreBLEU and chrF: the mean difference over seeds, each
    seed's paired bootstrap and the paired t-test over seeds; empty when no system was
    compared."""
    rows = [s for s in summaries if s.get("vs_deep")]
    if not rows:
        return ""
    lines = ["| " + " | ".join(["system", *VERSUS_DEEP_HEADER]) + " |",
             "|---|" + "---:|" * len(VERSUS_DEEP_HEADER)]
    lines += ["| " + " | ".join([s["system"], *_versus_deep_cells(s["vs_deep"])]) + " |"
              for s in rows]
    return "\n".join(lines) + "\n"


def _setting(report: dict) -> str:
    """Where a study ran, for a table that quotes several: its language pair and its GPU."""
    gpu = report["machine"].get("gpu")
    return (f"{pair_name(report['config'].get('target', DEFAULT_TARGET))}, "
            + (gpu.removeprefix("NVIDIA ") if gpu else "CPU"))


def _valid_seeds_summary(versus: Optional[dict]) -> str:
    """The validation loss against deep's with the seed as the unit: the mean relative
    difference over the last 20% and in how many seeds it was lower."""
    valid = valid_loss_over_seeds((versus or {}).get("valid_loss"))
    if valid is None:
        return "-"
    mean = 100 * versus["valid_loss"]["mean_difference"]
    return f"{mean:+.1f}% (lower in {valid['lower']}/{valid['seeds']} seeds)"


def readme_table(*reports: dict) -> str:
    """The README's table of one or more study.json files: per system its seeds, size, test scores
    (mean ± std over seeds), validation loss against deep's, and both metrics against deep (each
    seed's bootstrap p, the t-test's p over seeds); a column with nothing in any row is left out
    (chrF in runs scored before it, the test over seeds with one seed). Rows of several studies
    (seed 1 on a GPU, on another language pair) start with where they ran."""
    several = len(reports) > 1
    label_columns = 2 if several else 1  # setting and system, or system: always kept, left-aligned
    header = (["setting"] if several else []) + [
        "system", "seeds", "params (M)", "test sacreBLEU", "test chrF",
        "valid loss vs deep, last 20%", *VERSUS_DEEP_HEADER]
    rows = []  # the valid-loss column counts seeds: a run's late validations are correlated
    for report in reports:
        setting = [_setting(report)] if several else []
        for s in report["systems"]:
            versus = s.get("vs_deep")
            rows.append(setting + [
                s["system"], ", ".join(map(str, s["seeds"])), f"{s['params'] / 1e6:.2f}",
                _cell(s, "test_sacrebleu", 2), _cell(s, "test_chrf", 2),
                _valid_seeds_summary(versus), *_versus_deep_cells(versus)])
    kept = [i for i in range(len(header))
            if i < label_columns or any(row[i] != "-" for row in rows)]
    lines = ["| " + " | ".join(header[i] for i in kept) + " |",
             "|" + "---|" * label_columns + "---:|" * (len(kept) - label_columns)]
    lines += ["| " + " | ".join(row[i] for i in kept) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- corrected statistics: every family of tests Holm-adjusted, intervals over seeds ---------

def _families(report: dict) -> dict:
    """Per system compared with deep: the per-seed differences, their 95% t interval, the t-test
    over seeds (raw and Holm-adjusted over the systems of this study.json that have one), each
    seed's bootstrap p (raw and Holm-adjusted over the systems compared with deep in that seed),
    for sacreBLEU ("") and chrF ("chrf_"), and the validation loss with the seed as the unit."""
    rows = {s["system"]: s["vs_deep"] for s in report["systems"] if s.get("vs_deep")}
    out = {name: {} for name in rows}
    for prefix, metric in (("", "bleu"), ("chrf_", "chrf")):
        tested = {name: v["across_seeds"][metric]["p_value"] for name, v in rows.items()
                  if (v.get("across_seeds") or {}).get(metric)}
        adjusted = dict(zip(tested, holm(list(tested.values()))))
        seeds = sorted({c["seed"] for v in rows.values() for c in v["per_seed"]})
        per_seed = {}
        for seed in seeds:
            family = {name: c[f"{prefix}p_value"] for name, v in rows.items()
                      for c in v["per_seed"] if c["seed"] == seed and f"{prefix}p_value" in c}
            per_seed[seed] = (len(family), dict(zip(family, holm(list(family.values())))))
        for name, versus in rows.items():
            if f"{prefix}delta" not in versus["per_seed"][0]:
                continue
            deltas = [c[f"{prefix}delta"] for c in versus["per_seed"]]
            out[name][metric] = {
                "deltas": deltas, "interval": t_interval(deltas),
                "t_p": tested.get(name), "t_p_holm": adjusted.get(name), "t_family": len(tested),
                "bootstrap": [(c[f"{prefix}p_value"], per_seed[c["seed"]][1][name],
                               per_seed[c["seed"]][0]) for c in versus["per_seed"]]}
        for name, versus in rows.items():
            out[name]["valid"] = valid_loss_over_seeds(versus.get("valid_loss"))
    return out


def _difference_cell(result: Optional[dict]) -> str:
    if not result:
        return "-"
    interval = result["interval"]
    if interval is None:
        return f"{result['deltas'][0]:+.2f}"
    return (f"{interval['mean']:+.2f} [{interval['low']:+.2f}, {interval['high']:+.2f}]")


def _t_cell(result: Optional[dict]) -> str:
    if not result or result["t_p"] is None:
        return "-"
    return f"{result['t_p']:.3f} / {result['t_p_holm']:.3f} ({result['t_family']})"


def _bootstrap_cell(result: Optional[dict]) -> str:
    if not result:
        return "-"
    return ", ".join(f"{raw:.3f} / {holm_p:.3f} ({k})" for raw, holm_p, k in result["bootstrap"])


def _valid_seeds_cell(valid: Optional[dict]) -> str:
    if not valid:
        return "-"
    signs = "".join("-" if d < 0 else "+" for d in valid["differences"])
    t_p = "" if valid["t_p"] is None else f"; t-test p = {valid['t_p']:.3f}"
    return f"{valid['lower']}/{valid['seeds']} ({signs}; sign test p = {valid['sign_p']:.2f}{t_p})"


STATISTICS_HEADER = ["system", "seeds", "sacreBLEU vs deep [95% CI]", "t-test p: raw / Holm (k)",
                     "bootstrap p per seed: raw / Holm (k)", "chrF vs deep [95% CI]",
                     "t-test p: raw / Holm (k)", "bootstrap p per seed: raw / Holm (k)",
                     "valid loss lower than deep's, seeds"]


def statistics_table(*reports: dict) -> str:
    """The corrected statistics of one or more study.json files against deep (see _families);
    rows of several studies start with where they ran. Columns empty in every row are dropped."""
    several = len(reports) > 1
    label_columns = 2 if several else 1
    header = (["setting"] if several else []) + STATISTICS_HEADER
    rows = []
    for report in reports:
        families = _families(report)
        for s in report["systems"]:
            if s["system"] not in families:
                continue
            f = families[s["system"]]
            rows.append(([_setting(report)] if several else []) + [
                s["system"], ", ".join(map(str, s["seeds"])),
                _difference_cell(f.get("bleu")), _t_cell(f.get("bleu")),
                _bootstrap_cell(f.get("bleu")), _difference_cell(f.get("chrf")),
                _t_cell(f.get("chrf")), _bootstrap_cell(f.get("chrf")),
                _valid_seeds_cell(f.get("valid"))])
    kept = [i for i in range(len(header))
            if i < label_columns or any(row[i] != "-" for row in rows)]
    lines = ["| " + " | ".join(header[i] for i in kept) + " |",
             "|" + "---|" * label_columns + "---:|" * (len(kept) - label_columns)]
    lines += ["| " + " | ".join(row[i] for i in kept) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def ablation_statistics_table(report: dict) -> str:
    """Table 4's steps (each row against the row it changes) with the bootstrap p Holm-adjusted
    over the steps tested in each seed, and the validation loss per seed."""
    rows = [s for s in report["systems"] if s.get("vs_ablation_step")]
    seeds = sorted({c["seed"] for s in rows for c in s["vs_ablation_step"]["per_seed"]})
    adjusted = {}
    for seed in seeds:
        family = {s["system"]: c["p_value"] for s in rows
                  for c in s["vs_ablation_step"]["per_seed"] if c["seed"] == seed}
        adjusted[seed] = (len(family), dict(zip(family, holm(list(family.values())))))
    lines = ["| step | sacreBLEU difference | bootstrap p: raw / Holm (k) | "
             "valid loss, last 20% (lower at validations) |", "|---|---:|---:|---:|"]
    for s in rows:
        versus = s["vs_ablation_step"]
        cells = ", ".join(f"{c['p_value']:.3f} / {adjusted[c['seed']][1][s['system']]:.3f} "
                          f"({adjusted[c['seed']][0]})" for c in versus["per_seed"])
        deltas = ", ".join(f"{c['delta']:+.2f}" for c in versus["per_seed"])
        lines.append(f"| `{versus['baseline']}` -> `{s['system']}` | {deltas} | {cells} | "
                     f"{_valid_versus_cell(versus)} |")
    return "\n".join(lines) + "\n"


# Where, with what and how each study's runs trained. Runs record it themselves (result.json's
# "environment", from study_run.run_environment); for runs made before they did, what could be
# recovered from the committed files and git history is in the results folder's provenance.json.
NOT_RECORDED = "not recorded"


def _environments(report: dict, folder: Path) -> dict:
    runs = [r for s in report["systems"] for r in s["runs"]]
    recorded = [r.get("environment") for r in runs]
    if recorded and all(recorded):
        def values(key):
            return ", ".join(sorted({str(e.get(key) or "-") for e in recorded}))
        dates = sorted(d for e in recorded for d in (e["started_utc"], e["ended_utc"]))
        machine = values("gpu") if any(e.get("gpu") for e in recorded) else values("cpu")
        return {"machine": machine, "torch": values("torch"), "precision": values("precision"),
                "dates": f"{dates[0][:10]} to {dates[-1][:10]} (trained)",
                "commit": values("commit")}
    provenance = folder / "provenance.json"
    known = json.loads(provenance.read_text()) if provenance.is_file() else {}
    machine = report["machine"]
    return {"machine": known.get("machine") or (machine.get("gpu") or machine["cpu"]),
            "torch": known.get("torch") or machine.get("torch") or NOT_RECORDED,
            "precision": known.get("precision", NOT_RECORDED),
            "dates": known.get("dates", NOT_RECORDED),
            "commit": known.get("commit", NOT_RECORDED)}


def records_table(readme_dir: Path, paths: List[str]) -> str:
    """Per study.json: runs, machine, torch, training precision, dates and code commit."""
    lines = ["| results | runs | machine | torch | precision | dates | code commit |",
             "|---|---:|---|---|---|---|---|"]
    for path in paths:
        report = json.loads((readme_dir / path).read_text())
        env = _environments(report, (readme_dir / path).parent)
        runs = sum(len(s["runs"]) for s in report["systems"])
        lines.append(f"| `{Path(path).parent.name}/` | {runs} | {env['machine']} | "
                     f"{env['torch']} | {env['precision']} | {env['dates']} | "
                     f"{env['commit']} |")
    return "\n".join(lines) + "\n"


# The README quotes tables of study.json files between these lines, the paths (one or more,
# separated by spaces) relative to it: "table" (scores, readme_table), "statistics" (the
# corrected tests, statistics_table), "ablation" (ablation_statistics_table, one file) and
# "records" (records_table)
README_TABLE = re.compile(
    r"(<!-- (table|statistics|ablation|records): ([^>]+?) -->\n)(.*?)(<!-- end table -->)", re.S)


def readme_with_tables(readme: Path) -> str:
    """``readme`` with every marked table rendered again from the study.json files it names."""
    def render(match):
        kind, paths = match.group(2), match.group(3).split()
        if kind == "records":
            table = records_table(readme.parent, paths)
        else:
            reports = [json.loads((readme.parent / path).read_text()) for path in paths]
            table = {"table": readme_table, "statistics": statistics_table,
                     "ablation": ablation_statistics_table}[kind](*reports)
        return match.group(1) + "\n" + table + "\n" + match.group(5)
    return README_TABLE.sub(render, readme.read_text())


def ablation_table(summaries: List[dict]) -> str:
    """Table 4's steps: each multi-path row that ran against the row it changes; empty when
    no step ran."""
    rows = [s for s in summaries if s.get("vs_ablation_step")]
    if not rows:
        return ""
    lines = ["| row | against | test sacreBLEU | difference | p per seed | "
             "valid loss difference, last 20% |",
             "|---|---|---:|---:|---:|---:|"]
    for s in rows:
        versus = s["vs_ablation_step"]
        delta, p_values = _versus_cells(versus)
        lines.append(f"| {s['system']}: {s['label']} | {versus['baseline']} | "
                     f"{_cell(s, 'test_sacrebleu', 2)} | {delta} | {p_values} | "
                     f"{_valid_versus_cell(versus)} |")
    return "\n".join(lines) + "\n"


def _budget_text(config: dict) -> str:
    if config.get("budget_updates"):
        return Budget(updates=config["budget_updates"]).describe()
    return Budget(minutes=config["budget_minutes"]).describe()


def _convergence_text(summaries: List[dict]) -> str:
    """Whether the deep baseline's validation loss stopped improving, in every seed."""
    deep = next((s for s in summaries if s["system"] == BASELINE), None)
    check = deep and deep.get("valid_plateau")
    if not check:
        return ""
    gain = f"{100 * check['max_improvement']:.2f}%"
    if check["plateaued"]:
        return (f"The deep baseline's validation loss improved by at most {gain} over the last "
                f"{PLATEAU_WINDOW:.0%} of training (every seed): it had stopped improving by "
                f"more than {PLATEAU_TOLERANCE:.0%}.")
    return (f"**The deep baseline's validation loss still improved by up to {gain} over the last "
            f"{PLATEAU_WINDOW:.0%} of training** (more than {PLATEAU_TOLERANCE:.0%}): the budget "
            "is too short for a converged comparison; raise --budget-updates.")


def markdown_report(report: dict) -> str:
    config, machine = report["config"], report["machine"]
    seeds = config["seeds"]
    seed_list = config.get("seed_list", list(range(1, seeds + 1)))
    seed_text = (f"{seeds} seed(s)" if seed_list == list(range(1, seeds + 1))
                 else f"seed(s) {', '.join(map(str, seed_list))}")
    spread = " (mean ± sample std over seeds)" if seeds > 1 else ""
    signature = next((r["sacrebleu_signature"] for s in report["systems"] for r in s["runs"]),
                     "")
    chrf_signature = next((r["chrf_signature"] for s in report["systems"] for r in s["runs"]
                           if r.get("chrf_signature")), "")
    chrf_text = f"; chrF: sacreBLEU's, `{chrf_signature}`" if chrf_signature else ""
    bootstrap = next((s["vs_deep"]["per_seed"][0]["signature"] for s in report["systems"]
                      if s.get("vs_deep")), "")
    usable = machine.get("usable_cpus", machine["cpus"])
    usable = f" ({usable} usable by the study)" if usable < machine["cpus"] else ""
    threads = machine["torch_threads"]
    threads = f"{threads} thread" + ("s" if threads != 1 else "")
    gpu = f", {machine['gpu']} (half precision)" if machine.get("gpu") else ""
    parallel = config.get("parallel", 1)
    parallel = (f", {parallel} runs at a time ({report['elapsed_seconds'] / 60:.1f} min "
                "elapsed)" if parallel > 1 else "")
    lines = [
        f"# Multi30k {pair_name(config.get('target', DEFAULT_TARGET))}: width vs depth at equal "
        "parameters", "",
        f"Budget: {_budget_text(config)}; {seed_text}{spread}; data {config['data_tag']} "
        f"(BPE {BPE_MERGES} merges, joined dictionary of {config['dict_size']} types). "
        f"Machine: {machine['cpu']}, {machine['cpus']} CPUs{usable}, torch {machine['torch']} "
        f"with {threads}{gpu}{parallel}. Wall time of all runs (training, averaging, "
        f"translation, scoring): {report['runs_wall_seconds'] / 60:.1f} min.", "",
        markdown_table(report["systems"]),
        "BLEU: tokenized multi-bleu (`multipath-score`, no compound split) of the averaged last "
        f"checkpoints (up to {AVERAGE_LAST}, the final partial epoch included); sacreBLEU on "
        f"Moses-detokenized text, `{signature}`{chrf_text}. Train tok/s: target tokens per "
        "second of training (fairseq's wps); train wall: the whole fairseq-train process (for a "
        "resumed run all its invocations, the earlier ones from their first to last log line). "
        "Valid loss: the "
        "last validation's cross-entropy (fairseq's nll_loss, bits per token, no label "
        "smoothing); loss gain, last 20%: how much the best validation loss improved over the "
        f"last {PLATEAU_WINDOW:.0%} of the updates (the largest over seeds); valid loss vs "
        f"deep, last {PLATEAU_WINDOW:.0%}: the mean relative difference to the deep model's "
        "validation loss at the validations both made in that window (the mean over seeds) "
        "and, in brackets, at how many of them (all seeds) it was lower.", "",
        f"vs deep: the test sacreBLEU difference to the deep model with the same seed; p per "
        f"seed: sacreBLEU's paired bootstrap resampling of the two systems' test translations"
        f"{f' (`{bootstrap}`)' if bootstrap else ''}; † marks a difference that is not significant (p >= "
        f"{SIGNIFICANCE_LEVEL}, or no difference) in at least one seed.", ""]
    versus = versus_deep_table(report["systems"])
    if versus:
        lines += ["Against deep in both metrics: the mean difference over seeds (± std), each "
                  "seed's paired bootstrap (the same for chrF) and, over the seeds, the paired "
                  "t-test of the per-seed differences (two-sided; * p < "
                  f"{SIGNIFICANCE_LEVEL}; from two seeds on). The bootstrap asks whether the "
                  "test set could have produced the difference by chance for these two models; "
                  "the t-test whether another seed would likely give it again.", "", versus]
    convergence = _convergence_text(report["systems"])
    if convergence:
        lines += [convergence, ""]
    steps = ablation_table(report["systems"])
    if steps:
        lines += ["The paper's ablation (Table 4) step by step: each multi-path row against the "
                  "row it changes, with the same paired bootstrap (difference of test sacreBLEU, "
                  "† not significant) and validation-loss comparison as against deep:", "",
                  steps]
    lines += ["Systems and flags (shared: `" + " ".join(SHARED_MODEL + SHARED_RECIPE) + "`):",
              ""]
    for s in report["systems"]:
        own = s["flags"][len(SHARED_MODEL):]
        lines.append(f"- `{s['system']}`: `--arch {s['arch']} {' '.join(own)}`")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for path in map(Path, sys.argv[1:]):
        write_text_atomically(path, readme_with_tables(path))
