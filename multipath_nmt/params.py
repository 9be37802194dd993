"""Parameters and forward FLOPs of every architecture of this plug-in (``multipath-params``).

Models are built through fairseq's registry for a translation task with a joined dictionary of
``--dict-size`` types and ``--share-all-embeddings`` (the paper's En-De: 34,880 types give the
base model's 62M), or with ``--tgt-dict-size`` for separate dictionaries and no embedding shared
(the paper's En-Fr: 43,616 types on each side give Table 3's 111M; docs/fidelity.md), or with the
dictionaries and the sharing ``scripts/train.sh`` uses for a ``--data-bin``. Parameters are
counted on the ``meta`` device (no memory, no initialisation); FLOPs are measured with
``torch.utils.flop_counter.FlopCounterMode`` on one synthetic sentence pair (uninitialised
weights: the count depends on shapes only).
"""
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from multipath_nmt import recipe
from multipath_nmt.modules.parameternet import DynamicLinear
from fairseq import options
from fairseq.data import Dictionary
from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
from fairseq.tasks.translation import TranslationTask

# Sentence-pair length of the FLOP measurement; FLOPs are reported per target token.
FLOP_SEQUENCE_LENGTH = 20


def plugin_architectures() -> List[str]:
    """Every architecture registered by a module of ``multipath_nmt.models``, sorted."""
    return sorted(name for name, fn in ARCH_CONFIG_REGISTRY.items()
                  if getattr(fn, "__module__", "").startswith("multipath_nmt.models"))


def _dictionary(size: int, flag: str) -> Dictionary:
    dictionary = Dictionary()
    if size < len(dictionary):
        raise ValueError(f"{flag} must be at least {len(dictionary)} (the special symbols)")
    for i in range(size - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    return dictionary


def build_model(arch: str, dict_size: int, extra_args: Sequence[str] = (), device="meta",
                tgt_dict_size: Optional[int] = None):
    """``arch`` built as fairseq-train builds it; ``extra_args`` are more command-line flags.

    Without ``tgt_dict_size``: one joined dictionary of ``dict_size`` types and
    ``--share-all-embeddings`` (Table 2). With it: a source dictionary of ``dict_size`` and a
    target one of ``tgt_dict_size`` types and no embedding shared (encoder input, decoder input
    and output projection are three matrices: the En-Fr reading of Table 3)."""
    parser = options.get_training_parser()
    sharing = ["--share-all-embeddings"] if tgt_dict_size is None else []
    args = options.parse_args_and_arch(parser, [
        "unused-data-dir", "--task", "translation", "--arch", arch, *sharing, *extra_args])
    source = _dictionary(dict_size, "--dict-size")
    target = source if tgt_dict_size is None else _dictionary(tgt_dict_size, "--tgt-dict-size")
    task = TranslationTask(args, source, target)
    with torch.device(device):
        return ARCH_MODEL_REGISTRY[arch].build_model(args, task)


def parameter_counts(model) -> Dict[str, int]:
    """Total parameters (shared ones once) and active ones: total minus what modules report
    through ``inactive_parameter_count()`` (parameters a token does not touch)."""
    total = sum(p.numel() for p in model.parameters())
    inactive = sum(m.inactive_parameter_count() for m in model.modules()
                   if hasattr(m, "inactive_parameter_count"))
    return {"total": total, "active": total - inactive}


def forward_flops_per_token(model, length: int = FLOP_SEQUENCE_LENGTH) -> float:
    """Forward FLOPs of one source/target pair of ``length`` tokens each (no padding), per
    target token; ``model`` may live on the meta device (it is materialised uninitialised).

    Counted as the methods compute, which is what we run, except for dynamic ParameterNet
    layers (:class:`DynamicLinear`): ParameterNet builds each sentence's W' and then makes one
    product per token (about 1x a dense layer's FLOPs, the paper's premise), where our layer
    makes M products per token. Their count is the method's (``method_matmul_flops``)."""
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device="cpu")
    model.eval()
    source, target = (torch.randint(d.nspecial, len(d), (1, length))
                      for d in (model.encoder.dictionary, model.decoder.dictionary))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(source, torch.tensor([length]), target)
    by_module = counter.get_flop_counts()
    prefix = type(model).__name__
    total = counter.get_total_flops()
    for name, module in model.named_modules():
        if isinstance(module, DynamicLinear):
            as_run = sum(by_module[f"{prefix}.{name}"].values())
            mixing = sum(by_module.get(f"{prefix}.{name}.coefficients", {}).values())
            total += module.method_matmul_flops(length, 1) - (as_run - mixing)
    return total / length


def architecture_table(dict_size: int, archs: Optional[Sequence[str]] = None,
                       tgt_dict_size: Optional[int] = None) -> List[dict]:
    """One row per architecture: arch, model, total and active parameters, FLOPs per token
    (dictionaries and sharing as :func:`build_model`)."""
    known = plugin_architectures()
    archs = list(archs) if archs else known
    unknown = [a for a in archs if a not in known]
    if unknown:
        raise ValueError(f"unknown architecture(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(known)}")
    rows = []
    for arch in archs:
        model = build_model(arch, dict_size, tgt_dict_size=tgt_dict_size)
        rows.append({"arch": arch, "model": type(model).__name__, **parameter_counts(model),
                     "flops_per_token": forward_flops_per_token(model)})
        del model
    return rows


def data_bin_dictionaries(data_bin: Path) -> Tuple[int, Optional[int]]:
    """(source or joined size, target size or None when shared) as train.sh builds the model
    for ``data_bin``: its dictionaries and its embedding sharing (``--embeddings auto``)."""
    try:
        files = recipe.dictionary_files(Path(data_bin))
        shared = recipe.embedding_sharing(files) == ["--share-all-embeddings"]
    except recipe.RecipeError as error:
        raise ValueError(str(error)) from error
    sizes = [len(Dictionary.load(str(f))) for f in files]
    return (sizes[0], None) if shared else (sizes[0], sizes[-1])


def format_markdown(rows: List[dict], dict_size: int, tgt_dict_size: Optional[int] = None) -> str:
    if tgt_dict_size is None:
        vocabulary = f"Joined dictionary of {dict_size:,} types, shared embeddings"
    else:
        vocabulary = (f"Dictionaries of {dict_size:,} (source) and {tgt_dict_size:,} (target) "
                      f"types, no embedding shared")
    lines = [f"{vocabulary}; FLOPs: forward, per target token, {FLOP_SEQUENCE_LENGTH}-token "
             f"source and target (dynamic ParameterNet: the method's, W' built per sentence, not "
             f"the M products per token our layer makes).", "",
             "| arch | params (M) | active params (M) | GFLOPs/token |",
             "|---|---:|---:|---:|"]
    for row in rows:
        active = f"{row['active'] / 1e6:.2f}" if row["active"] != row["total"] else "="
        lines.append(f"| {row['arch']} | {row['total'] / 1e6:.2f} | {active} | "
                     f"{row['flops_per_token'] / 1e9:.3f} |")
    return "\n".join(lines) + "\n"
