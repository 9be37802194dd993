"""multipath-params: parameters and forward FLOPs of every architecture of this plug-in.

Models are built through fairseq's registry for a translation task with a joined dictionary of
``--dict-size`` types and ``--share-all-embeddings`` (the paper's set-up: 34,880 types give the
base model's 62M). Parameters are counted on the ``meta`` device (no memory, no initialisation);
FLOPs are measured with ``torch.utils.flop_counter.FlopCounterMode`` on one synthetic sentence
pair (uninitialised weights: the count depends on shapes only).
"""
import argparse
import sys
from typing import Dict, List, Optional, Sequence

import torch
from torch.utils.flop_counter import FlopCounterMode

import multipath_nmt  # noqa: F401  (registers the architectures)
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


def build_model(arch: str, dict_size: int, extra_args: Sequence[str] = (), device="meta"):
    """``arch`` built as fairseq-train builds it, for a joined dictionary of ``dict_size``
    types with shared embeddings; ``extra_args`` are more command-line flags."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        "unused-data-dir", "--task", "translation", "--arch", arch, "--share-all-embeddings",
        *extra_args])
    dictionary = Dictionary()
    if dict_size < len(dictionary):
        raise ValueError(f"--dict-size must be at least {len(dictionary)} (the special symbols)")
    for i in range(dict_size - len(dictionary)):
        dictionary.add_symbol(f"w{i}")
    task = TranslationTask(args, dictionary, dictionary)
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
    target token; ``model`` may live on the meta device (it is materialised uninitialised)."""
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device="cpu")
    model.eval()
    dictionary = model.encoder.dictionary
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (1, length))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(tokens, torch.tensor([length]), tokens)
    return counter.get_total_flops() / length


def architecture_table(dict_size: int, archs: Optional[Sequence[str]] = None) -> List[dict]:
    """One row per architecture: arch, model, total and active parameters, FLOPs per token."""
    known = plugin_architectures()
    archs = list(archs) if archs else known
    unknown = [a for a in archs if a not in known]
    if unknown:
        raise ValueError(f"unknown architecture(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(known)}")
    rows = []
    for arch in archs:
        model = build_model(arch, dict_size)
        rows.append({"arch": arch, "model": type(model).__name__, **parameter_counts(model),
                     "flops_per_token": forward_flops_per_token(model)})
        del model
    return rows


def format_markdown(rows: List[dict], dict_size: int) -> str:
    lines = [f"Joined dictionary of {dict_size:,} types, shared embeddings; FLOPs: forward, per "
             f"target token, {FLOP_SEQUENCE_LENGTH}-token source and target.", "",
             "| arch | params (M) | active params (M) | GFLOPs/token |",
             "|---|---:|---:|---:|"]
    for row in rows:
        active = f"{row['active'] / 1e6:.2f}" if row["active"] != row["total"] else "="
        lines.append(f"| {row['arch']} | {row['total'] / 1e6:.2f} | {active} | "
                     f"{row['flops_per_token'] / 1e9:.3f} |")
    return "\n".join(lines) + "\n"


def cli_main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dict-size", type=int, default=34880,
                        help="joined (shared) dictionary size, special symbols included "
                             "(default: 34880, the paper's WMT14 En-De)")
    parser.add_argument("--arch", action="append",
                        help="only this architecture (repeatable; default: all of this plug-in)")
    args = parser.parse_args(argv)
    try:
        rows = architecture_table(args.dict_size, args.arch)
    except ValueError as error:
        sys.exit(f"multipath-params: {error}")
    sys.stdout.write(format_markdown(rows, args.dict_size))


if __name__ == "__main__":
    cli_main()
