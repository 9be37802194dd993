"""The Multi30k study's statistics (see study.py): the validation loss's plateau and its
comparison with the baseline's, sacreBLEU's paired bootstrap, the paired t-test over seeds, and
each system's mean and spread over its seeds.
"""
import statistics
from typing import Container, List, Optional, Sequence, Tuple

from study_systems import (
    ABLATION_STEPS, BOOTSTRAP_SAMPLES, PLATEAU_TOLERANCE, PLATEAU_WINDOW, SIGNIFICANCE_LEVEL,
    System,
)


def plateau(curve: Sequence[Tuple[int, float]], window: float = PLATEAU_WINDOW,
            tolerance: float = PLATEAU_TOLERANCE) -> Optional[dict]:
    """Has the validation loss stopped improving? ``improvement`` is how much the best loss of the
    whole run is below the best loss up to the last ``window`` of training, relative to the latter
    ((best before - best) / best before; 0 when the loss only rose); the run has plateaued when
    it is at most ``tolerance``. None without validations both up to and after the window start."""
    if not curve:
        return None
    start = (1 - window) * curve[-1][0]
    before = [loss for updates, loss in curve if updates <= start]
    after = [loss for updates, loss in curve if updates > start]
    if not before or not after:
        return None
    best_before = min(before)
    best = min(best_before, min(after))
    improvement = (best_before - best) / best_before
    return {"window_start_update": start, "best_loss_before": best_before, "best_loss": best,
            "improvement": improvement, "plateaued": improvement <= tolerance}


def compare_curves(curve: Sequence[Tuple[int, float]],
                   baseline_curve: Sequence[Tuple[int, float]],
                   window: float = PLATEAU_WINDOW) -> Optional[dict]:
    """The validation loss against the baseline's at the validations both runs made in the last
    ``window`` of training (where the plateau check looks): the mean relative difference
    ((loss - baseline) / baseline) and at how many of them it is lower. Averaging over the
    window steadies a comparison that one validation would make noisy (successive validations
    of one run differ by up to 1.4% on Multi30k). None when the runs share no validation there."""
    if not curve or not baseline_curve:
        return None
    baseline = dict(baseline_curve)
    start = (1 - window) * min(curve[-1][0], baseline_curve[-1][0])
    differences = [(loss - baseline[updates]) / baseline[updates]
                   for updates, loss in curve if updates > start and updates in baseline]
    if not differences:
        return None
    return {"window_start_update": start, "points": len(differences),
            "lower": sum(d < 0 for d in differences),
            "mean_difference": statistics.fmean(differences)}


def paired_bootstrap(baseline: Sequence[str], system: Sequence[str], references: Sequence[str],
                     samples: int = BOOTSTRAP_SAMPLES) -> dict:
    """sacreBLEU's paired bootstrap resampling (``sacrebleu --paired-bs -m bleu chrf``, Koehn
    2004, as Moses' bootstrap-hypothesis-difference-significance.pl) of ``system`` against
    ``baseline`` on the same test sentences, for BLEU and for chrF: both scores, the difference
    and its p-value, which sacreBLEU computes from resamples whose difference exceeds the
    observed one; with its default SACREBLEU_SEED the result is reproducible. BLEU's keys are
    unprefixed, chrF's start with ``chrf_``.

    ``significant`` needs p < SIGNIFICANCE_LEVEL and a nonzero difference: when both systems
    score exactly the same, every resampled difference is 0 too and sacreBLEU's (c + 1) / (n + 1)
    gives the smallest p-value, 1 / (n + 1), for what is no difference at all."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest
    signatures, scores = PairedTest([("baseline", list(baseline)), ("system", list(system))],
                                    {"BLEU": BLEU(), "chrF": CHRF()}, [list(references)],
                                    test_type="bs", n_samples=samples)()
    result = {}
    # sacreBLEU names the results by each metric's printed name (chrF with beta 2: "chrF2")
    for metric, prefix in (("BLEU", ""), ("chrF2", "chrf_")):
        base, other = scores[metric]
        delta = other.score - base.score
        name = prefix.rstrip("_") or "bleu"
        result.update({
            f"baseline_{name}": base.score, name: other.score, f"{prefix}delta": delta,
            f"{prefix}p_value": other.p_value,
            f"{prefix}significant": other.p_value < SIGNIFICANCE_LEVEL and delta != 0,
            f"{prefix}signature": str(signatures[metric])})
    return result


def paired_t_test(deltas: Sequence[float]) -> Optional[dict]:
    """The paired t-test over seeds of a system against the baseline (``deltas``: the
    per-seed score differences, same seed, so same data order): t, degrees of freedom and the
    two-sided p-value; None with fewer than two seeds or no spread."""
    if len(deltas) < 2 or statistics.stdev(deltas) == 0:
        return None
    from scipy import stats  # scikit-learn's dependency, installed with fairseq
    test = stats.ttest_1samp(list(deltas), 0.0)
    return {"t": float(test.statistic), "df": len(deltas) - 1, "p_value": float(test.pvalue),
            "significant": float(test.pvalue) < SIGNIFICANCE_LEVEL}


METRICS = ("train_tokens_per_second", "train_wall_minutes", "updates", "epochs", "valid_loss",
           "valid_bleu", "valid_sacrebleu", "test_bleu", "test_sacrebleu", "valid_chrf",
           "test_chrf")


def summarize(system: System, runs: List[dict]) -> dict:
    """Mean and (with more than one seed) sample standard deviation of each metric, and the
    largest validation-loss improvement over the last 20% of training among the seeds."""
    summary = {"system": system.name, "label": system.label, "family": system.family,
               "arch": system.arch, "flags": runs[0]["flags"], "params": runs[0]["params"],
               "active_params": runs[0]["active_params"], "seeds": [r["seed"] for r in runs],
               "mean": {}, "std": {}, "runs": runs}
    for metric in METRICS:
        values = [r[metric] for r in runs if r.get(metric) is not None]
        if values:
            summary["mean"][metric] = statistics.fmean(values)
            summary["std"][metric] = statistics.stdev(values) if len(values) > 1 else None
    checks = [r.get("valid_plateau") for r in runs]
    if checks and all(checks):
        summary["valid_plateau"] = {
            "max_improvement": max(c["improvement"] for c in checks),
            "plateaued": all(c["plateaued"] for c in checks)}
    return summary


def ablation_step(system: str, finished: Container[str]) -> Optional[str]:
    """The finished row of Table 4 that ``system`` changes (ABLATION_STEPS), skipping back over
    rows the study did not run; None for a system outside the ablation."""
    previous = ABLATION_STEPS.get(system)
    while previous is not None and previous not in finished:
        previous = ABLATION_STEPS.get(previous)
    return previous


def _compare_valid_curves(summary: dict, baseline: dict, seeds: Sequence[int]) -> Optional[dict]:
    """compare_curves per seed, and over the seeds: the mean of the mean differences and the
    validations where the system was lower; None unless every seed has a comparison."""
    curves = {r["seed"]: r.get("valid_curve") for r in summary["runs"]}
    baseline_curves = {r["seed"]: r.get("valid_curve") for r in baseline["runs"]}
    per_seed = [compare_curves(curves.get(seed), baseline_curves.get(seed)) for seed in seeds]
    if not per_seed or None in per_seed:
        return None
    return {"per_seed": [{"seed": seed, **c} for seed, c in zip(seeds, per_seed)],
            "mean_difference": statistics.fmean(c["mean_difference"] for c in per_seed),
            "lower": sum(c["lower"] for c in per_seed),
            "points": sum(c["points"] for c in per_seed)}


# --- corrections and intervals for the README (computed from study.json, never typed) --------

CONFIDENCE = 0.95


def holm(p_values: Sequence[float]) -> List[float]:
    """Holm's step-down adjustment of a family of p-values (same order as given): the i-th
    smallest is multiplied by (m - i + 1), made monotone and capped at 1. A hypothesis is
    rejected at level a when its adjusted p is below a; the family-wise error stays at most a."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def t_interval(values: Sequence[float], level: float = CONFIDENCE) -> Optional[dict]:
    """The mean of ``values`` (per-seed differences) and its two-sided t interval over seeds:
    mean +- t(level, n - 1) * sd / sqrt(n); None with fewer than two values."""
    if len(values) < 2:
        return None
    from scipy import stats
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = float(stats.t.ppf((1 + level) / 2, len(values) - 1)) * sd / len(values) ** 0.5
    return {"mean": mean, "half_width": half, "low": mean - half, "high": mean + half,
            "n": len(values), "level": level}


def sign_test(successes: int, trials: int) -> float:
    """Two-sided exact binomial (sign) test of ``successes`` in ``trials`` against 1/2."""
    from scipy import stats
    return float(stats.binomtest(successes, trials, 0.5).pvalue)


def valid_loss_over_seeds(valid_versus: Optional[dict]) -> Optional[dict]:
    """The validation-loss comparison with the seed as the unit (validations of one run are
    correlated): per seed the sign of the mean relative difference over the last 20%, in how
    many seeds the system was lower, the sign test of that count and the one-sample t-test of the
    per-seed mean differences (None with one seed)."""
    if not valid_versus or not valid_versus.get("per_seed"):
        return None
    differences = [s["mean_difference"] for s in valid_versus["per_seed"]]
    lower = sum(d < 0 for d in differences)
    t_test = paired_t_test(differences)
    return {"seeds": len(differences), "lower": lower, "differences": differences,
            "sign_p": sign_test(lower, len(differences)),
            "t_p": None if t_test is None else t_test["p_value"]}
