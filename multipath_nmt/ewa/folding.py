"""Folding an EWA model into a stock fairseq ``transformer`` checkpoint (the library of
``multipath-convert-ewa``).

Each EWA MoE becomes one FFN whose weights and biases are the experts' means (Huang et al., 2023:
the deployed model), under fairseq's own ``fc1``/``fc2`` keys; the config names fairseq's
``transformer`` arch with every dimension and ``normalize_before`` kept, no ``--user-dir`` and a
stock criterion, so ``fairseq-generate`` loads it without the plug-in and translates exactly as
the EWA model does in eval mode.
"""
import re

from multipath_nmt.checkpoint_io.dictionaries import DICTIONARIES
from multipath_nmt.checkpoint_io.reading import read_checkpoint
from multipath_nmt.checkpoint_io.writing import save_atomically

EWA_KEY = re.compile(r"^(encoder\.layers\.\d+\.)ffn\.(fc[12])_(weight|bias)$")
# fp32 copies of half-precision experts (--memory-efficient-fp16 training state)
FP32_COPY_KEY = re.compile(r"^encoder\.layers\.\d+\.ffn\.fp32_experts\.")
# cfg.model entries that only moe_transformer knows
PLUGIN_MODEL_KEYS = ("encoder_ffn", "encoder_moe_freq", "user_dir")
PLUGIN_MODEL_PREFIXES = ("moe_", "ewa_", "parameternet_")  # every flag of these families


class NotAnEWACheckpoint(ValueError):
    """A checkpoint that is not an EWA model, or whose experts cannot be folded into one FFN."""


def _model_cfg(state):
    cfg = state.get("cfg")
    if cfg is not None and cfg.get("model") is not None:
        return cfg["model"]
    if state.get("args") is not None:
        return state["args"]
    raise NotAnEWACheckpoint("the checkpoint has no model configuration (cfg.model or args)")


def check_ewa(model_cfg, path):
    name = getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None)
    if getattr(model_cfg, "encoder_ffn", None) != "ewa":
        raise NotAnEWACheckpoint(
            f"{path} is not an EWA model (arch {name!r}, encoder FFN "
            f"{getattr(model_cfg, 'encoder_ffn', None)!r}); multipath-convert-ewa only folds "
            f"moe_transformer checkpoints trained with --encoder-ffn ewa")
    if getattr(model_cfg, "ewa_stop_at", None) is not None:
        raise NotAnEWACheckpoint(
            f"{path} was trained with early EWA (--ewa-stop-at): its experts are a routed MoE "
            f"at inference, not copies to average; it cannot become a dense transformer")


def fold_state_dict(model_state):
    """Replace every ``...ffn.fcN_{weight,bias}`` [E, ...] by fairseq's ``...fcN.{weight,bias}``
    holding the mean over the experts; the fp32 copies training kept of half-precision experts
    are dropped (the model in eval mode, which the folded one must equal, uses the experts)."""
    folded = {}
    count = 0
    for key, value in model_state.items():
        match = EWA_KEY.match(key)
        if FP32_COPY_KEY.match(key):
            continue
        if match:
            prefix, fc, kind = match.groups()
            folded[f"{prefix}{fc}.{kind}"] = value.float().mean(0).to(value.dtype)
            count += 1
        elif ".ffn." in key:
            raise NotAnEWACheckpoint(f"unexpected parameter {key}: not an EWA expert FFN")
        else:
            folded[key] = value
    if count == 0:
        raise NotAnEWACheckpoint("the checkpoint has no EWA expert parameters")
    return folded


def stock_model_cfg(model_cfg):
    """The same model config under fairseq's own ``transformer`` arch, as a plain dict: unlike
    the Namespace fairseq pickles, it loads under ``torch.load(weights_only=True)`` (the default
    since PyTorch 2.6), so plain fairseq reads the file without any allow-list."""
    stock = {k: v for k, v in vars(model_cfg).items()
             if k not in PLUGIN_MODEL_KEYS and not k.startswith(PLUGIN_MODEL_PREFIXES)}
    stock.update(arch="transformer", _name="transformer", criterion="label_smoothed_cross_entropy")
    return stock


def stock_criterion_cfg(criterion_cfg):
    label_smoothing = (criterion_cfg or {}).get("label_smoothing", 0.0) or 0.0
    return {"_name": "label_smoothed_cross_entropy", "label_smoothing": label_smoothing,
            "report_accuracy": False, "ignore_prefix_size": 0, "sentence_avg": False}


def convert_ewa_checkpoint(src, dst):
    """Write the folded stock-transformer checkpoint of EWA checkpoint ``src`` to ``dst``."""
    state = read_checkpoint(src)
    model_cfg = _model_cfg(state)
    check_ewa(model_cfg, src)
    out = {
        "args": None,
        "model": fold_state_dict(state["model"]),
        "optimizer_history": state.get("optimizer_history", []),
        "extra_state": state.get("extra_state"),
        # optimizer state refers to the expert parameters, which no longer exist
        "last_optimizer_state": None,
    }
    if DICTIONARIES in state:  # folding changes no token: the check of the data-bin stays exact
        out[DICTIONARIES] = state[DICTIONARIES]
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(state["cfg"], resolve=True)
    cfg["model"] = stock_model_cfg(model_cfg)
    cfg["common"]["user_dir"] = None
    cfg["criterion"] = stock_criterion_cfg(cfg.get("criterion"))
    out["cfg"] = cfg
    save_atomically(out, dst)
    return dst
