"""The Multi30k study's set-up (see study.py): the language pair, the shared model and recipe,
the systems and the rows of the paper's ablation, the budget, and the parameter counts that size
the systems alike.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from multipath_nmt import params

SOURCE = "en"
# Multi30k's target languages with the 2016 test set; En-De is the study's default pair
TARGETS = ("de", "fr")
DEFAULT_TARGET = "de"
# Multi30k task 1 file names (github.com/multi30k/dataset, data/task1/raw)
SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
BPE_MERGES = 8000

# The shared model: d 128, 4 heads, 3 decoder layers (FFN 512). d 256 trains at about a third of
# the tokens per second on 2 CPU cores, less than one Multi30k epoch in the default budget.
BASE_LAYERS = 3
BASE_FFN = 512
SHARED_MODEL = [
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--decoder-layers", "3", "--decoder-ffn-embed-dim", "512", "--dropout", "0.1",
    # train.sh's recipe adds attention and activation dropout 0.1 since the 10,000-update results
    # were trained; 0 keeps new seeds comparable with them
    "--attention-dropout", "0", "--activation-dropout", "0",
]
# One recipe for every system (train.sh's per-family recipes are overridden): a short warmup and
# a high learning rate because the budget allows thousands, not 100k, updates. These are
# train.sh's arguments (recipe.train_command): --update-freq replaces its batch arithmetic,
# 2,048 max-tokens x 1 process x 1 = 2,048 tokens per update (the study runs every training on
# one device, see DEVICE_GPUS).
SHARED_RECIPE = [
    "--max-tokens", "2048", "--update-freq", "1", "--lr", "0.002", "--warmup-updates", "100",
    "--keep-last-epochs", "5", "--num-workers", "0",
    "--no-progress-bar", "--log-format", "simple", "--log-interval", "50",
]
# Equal updates: about 41 Multi30k epochs of 242 updates. The deep model's best validation loss
# gained 1.19% over the last 20% at 8,000 updates, then none: its best (at 7,744) was still the
# best at 13,440, so the 1% bar holds from 10,000 on (README, "The budget").
DEFAULT_BUDGET_UPDATES = 10000
# Validations per run under the updates budget (plus fairseq's one at every epoch end).
VALIDATIONS = 25
# The plateau criterion: the validation loss improved by at most 1% over the last 20% of training.
PLATEAU_WINDOW = 0.2
PLATEAU_TOLERANCE = 0.01
# sacreBLEU's default number of bootstrap resamples, and the significance level of the marks.
BOOTSTRAP_SAMPLES = 1000
SIGNIFICANCE_LEVEL = 0.05
BASELINE = "deep"
# Our decoding settings (beam 4, lenpen 0.6, recipe.generate_command: the paper gives none; these are
# the authors' group's Transformer-deep script's) with a length cap, so that an undertrained model
# cannot spend minutes emitting 200-token hypotheses.
DECODING = ["--batch-size", "128", "--max-len-a", "1.2", "--max-len-b", "10"]
AVERAGE_LAST = 5


@dataclass
class System:
    name: str
    label: str
    arch: str
    flags: List[str]
    family: str
    # solve --encoder-ffn-embed-dim so that the total parameters equal the deep model's
    match_ffn: bool = False


def _encoder(layers, ffn=BASE_FFN):
    return ["--encoder-layers", str(layers), "--encoder-ffn-embed-dim", str(ffn)]


SYSTEMS = [
    System("base", "Transformer, 3 layers", "transformer_prenorm_wmt_en_de",
           _encoder(BASE_LAYERS), "base"),
    System("deep", "Transformer, 6 layers (2L)", "transformer_prenorm_wmt_en_de",
           _encoder(2 * BASE_LAYERS), "deep"),
    System("wide", "Transformer, 3 layers, wider FFN", "transformer_prenorm_wmt_en_de",
           _encoder(BASE_LAYERS), "wide", match_ffn=True),
    # The rows of the paper's ablation (Table 4), each adding one part to the row before it
    System("mp_original", "Multi-path 3x2, original (fixed 1/n, no PathNorm)",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "fixed",
                                    "--no-path-norm"], "multi-path"),
    System("mp_pathnorm", "Multi-path 3x2 + PathNorm (fixed 1/sqrt(n))",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "fixed"],
           "multi-path"),
    System("mp_learnable", "Multi-path 3x2 + PathNorm + learnable weights",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "learnable"],
           "multi-path"),
    System("mp_cheap", "Multi-path 3x3 + PathNorm + learnable + cheap features",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "3", "--path-weights", "learnable",
                                    "--cheap-features"], "multi-path", match_ffn=True),
    System("mp_no_pathnorm", "Multi-path 3x2, learnable weights without PathNorm",
           "multipath_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--encoder-paths", "2", "--path-weights", "learnable",
                                    "--no-path-norm"], "multi-path"),
    System("widenet", "WideNet, 6 shared layers, 8 experts top-2",
           "widenet_transformer_wmt_en_de",
           _encoder(2 * BASE_LAYERS) + ["--moe-experts", "8", "--moe-top-k", "2"], "MoE-style"),
    System("ewa", "EWA, 5 experts in layer 2 (dense at test)", "ewa_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--ewa-layers", "every-2", "--ewa-experts", "5"], "MoE-style"),
    System("parameternet", "ParameterNet, dynamic, 4 up-projections",
           "parameternet_transformer_wmt_en_de",
           _encoder(BASE_LAYERS) + ["--parameternet-mode", "dynamic", "--parameternet-proj",
                                    "up", "--parameternet-experts", "4"], "MoE-style"),
]
SYSTEM_NAMES = [s.name for s in SYSTEMS]
# Table 4 of the paper (Sec. 5.2) as steps: each multi-path row and the row it changes. "- PathNorm"
# takes PathNorm out of "+ Learnable Weights"; "+ More Features" is read as added to "+ Learnable
# Weights" (the method, with PathNorm; "- PathNorm" is the paper's side experiment), as
# docs/fidelity.md does; here it also goes from 2 to 3 paths, which cheap features need.
ABLATION_STEPS = {"mp_pathnorm": "mp_original", "mp_learnable": "mp_pathnorm",
                  "mp_no_pathnorm": "mp_learnable", "mp_cheap": "mp_learnable"}
# The default systems: the base model as the small reference, the deep baseline, the wide dense
# model and the multi-path rows of Table 4 in its order; the others run when named (--systems).
DEFAULT_SYSTEMS = ["base", "deep", "wide", "mp_original", "mp_pathnorm", "mp_learnable",
                   "mp_cheap"]


class StudyError(Exception):
    pass


@dataclass(frozen=True)
class Budget:
    """What every system gets: ``updates`` (fairseq --max-update, the same batch for everyone, so
    the same epochs too) or ``minutes`` of training (--stop-time-hours)."""
    updates: Optional[int] = None
    minutes: Optional[float] = None

    @property
    def runs_dirname(self) -> str:
        return f"runs-{self.updates}updates" if self.updates else f"runs-{self.minutes:g}min"

    def describe(self) -> str:
        if self.updates:
            return (f"{self.updates} updates of 2,048 tokens per system and seed (fairseq "
                    f"--max-update), validated every {validation_interval(self.updates)} updates")
        return f"{self.minutes:g} min of training per system and seed (fairseq --stop-time-hours)"

    def training_flags(self) -> List[str]:
        if self.updates:
            return ["--max-update", str(self.updates),
                    "--validate-interval-updates", str(validation_interval(self.updates))]
        # as measured in the committed equal-time study: no validation inside the time budget
        return ["--disable-validation", "--stop-time-hours", repr(self.minutes / 60)]


def validation_interval(updates: int) -> int:
    """Updates between validations: about VALIDATIONS points per curve."""
    return max(1, updates // VALIDATIONS)


def log(message):
    print(f"study: {message}", flush=True)


def pair_name(target: str) -> str:
    return f"{SOURCE.capitalize()}-{target.capitalize()}"


# ------------------------------------------------------------------------------ model sizes

def model_flags(system: System, ffn: Optional[int] = None) -> List[str]:
    """The shared flags, then the system's (with the encoder FFN size replaced by ``ffn``)."""
    flags = list(system.flags)
    if ffn is not None:
        flags[flags.index("--encoder-ffn-embed-dim") + 1] = str(ffn)
    return SHARED_MODEL + flags


def count_parameters(arch: str, flags: Sequence[str], dict_size: int) -> Dict[str, int]:
    """Total and active parameters as ``multipath-params`` counts them."""
    return params.parameter_counts(params.build_model(arch, dict_size, flags))


def matched_ffn(system: System, target: int, dict_size: int) -> int:
    """The encoder FFN size (a multiple of 8) giving ``system`` the ``target`` parameters; the
    count is affine in it, so two model builds determine it."""
    low, high = 64, 1024
    p_low = count_parameters(system.arch, model_flags(system, low), dict_size)["total"]
    p_high = count_parameters(system.arch, model_flags(system, high), dict_size)["total"]
    per_unit = (p_high - p_low) / (high - low)
    return max(8, int(round((low + (target - p_low) / per_unit) / 8)) * 8)


def resolve_flags(systems: Sequence[System], dict_size: int) -> Dict[str, List[str]]:
    """Final model flags per system (FFN sizes matched to the deep model where asked)."""
    deep = next(s for s in SYSTEMS if s.name == "deep")
    target = None
    resolved = {}
    for system in systems:
        if system.match_ffn:
            if target is None:
                target = count_parameters(deep.arch, model_flags(deep), dict_size)["total"]
            resolved[system.name] = model_flags(system, matched_ffn(system, target, dict_size))
        else:
            resolved[system.name] = model_flags(system)
    return resolved


def select_systems(names: Optional[str],
                   budget: Budget = Budget(updates=DEFAULT_BUDGET_UPDATES)) -> List[System]:
    """The named systems (default: DEFAULT_SYSTEMS) in the study's order."""
    if not names:
        return [s for s in SYSTEMS if s.name in DEFAULT_SYSTEMS]
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in SYSTEM_NAMES]
    if unknown:
        raise StudyError(f"unknown system(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(SYSTEM_NAMES)}")
    if "ewa" in wanted and "base" not in wanted and budget.minutes:
        log("ewa takes its --max-update from the base model's run: adding base")
        wanted.append("base")
    if BASELINE not in wanted:
        log(f"no {BASELINE} model among the systems: no significance tests against it")
    return [s for s in SYSTEMS if s.name in wanted]
