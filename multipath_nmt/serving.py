"""Serving a trained model outside fairseq's Python generator: CTranslate2 (the library of
``multipath-ctranslate2``) and what TorchScript can script (``docs/serving.md``).

CTranslate2 (``pip install ctranslate2``) runs fairseq's own ``transformer`` model: the plug-in's
dense architectures (``transformer_prenorm_wmt_en_de``, ``transformer_deep*_wmt_en_de``,
``transformer_wide_wmt_en_de``) and an EWA model folded by ``multipath-convert-ewa``.
:func:`convert_to_ctranslate2` reads the checkpoint with the plug-in's one reader
(:func:`multipath_nmt.checkpoint_io.reading.read_checkpoint`: one clear line for every way a file fails),
refuses the models CTranslate2 cannot express (:func:`ctranslate2_obstacle` says why), and hands
CTranslate2's own fairseq converter the checkpoint in the layout it reads (the model config as
``args``; a folded EWA checkpoint keeps it as a plain dict, which the converter does not take).
:func:`translate` runs the converted model on subword-tokenized sentences with fairseq-generate's
search settings, so that its output is fairseq-generate's (tests/test_serving.py).
"""
import argparse
import os
import tempfile
import time
from types import SimpleNamespace
from typing import List, NamedTuple, Optional, Sequence

import torch

from multipath_nmt.atomic_files import (FolderNotWritten, folder_written_atomically,
                                        unwritable_folder)
from multipath_nmt.checkpoint_io.dictionaries import check_dictionaries
from multipath_nmt.checkpoint_io.reading import architecture, model_config, read_checkpoint


class NotServable(ValueError):
    """A model that the serving runtime cannot run; the message says why, in one line."""


# What CTranslate2's encoder-decoder Transformer (TransformerSpec, ctranslate2 4.x) cannot
# express: one self-attention (and one encoder-decoder attention) and one dense FFN per layer,
# each layer with weights of its own.
CTRANSLATE2_LIMITS = {
    "multipath_transformer": (
        "every sublayer sums n parallel paths (attentions or FFNs), each through its own PathNorm "
        "(a LayerNorm at the end of each path), with learned path weights and, with "
        "--cheap-features, the averages of the other paths; a CTranslate2 layer has one "
        "attention and one FFN and no normalization between a sublayer and the residual sum"),
    "widenet_transformer": (
        "the encoder shares one attention and one top-k routed mixture-of-experts FFN across "
        "its layers; CTranslate2's encoder-decoder layers have a dense FFN only, no router and "
        "no experts"),
}
MOE_LIMITS = {
    "ewa": ("an EWA model is a dense Transformer once its experts are averaged: fold it first "
            "with multipath-convert-ewa, then convert the folded checkpoint"),
    "parameternet": (
        "ParameterNet's FFN mixes its M weight matrices per sentence (dynamic) or routes each "
        "token to one (routed), with a learned router; CTranslate2's FFN has one fixed weight "
        "matrix per projection"),
    "moe": ("a routed mixture-of-experts FFN (a router picking experts per token): "
            "CTranslate2's encoder-decoder layers have a dense FFN only"),
}


def config_setting(cfg, key):
    return cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)


def model_name(model_cfg):
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY

    arch = config_setting(model_cfg, "arch") or config_setting(model_cfg, "_name")
    return ARCH_MODEL_NAME_REGISTRY.get(arch, arch)


def ctranslate2_obstacle(model_cfg) -> Optional[str]:
    """Why CTranslate2 cannot run the model of ``model_cfg`` (a checkpoint's ``cfg.model`` or
    ``args``), or None for fairseq's ``transformer`` (CTranslate2's converter checks the rest:
    activation, matching pre-norm settings, positional embeddings)."""
    name = model_name(model_cfg)
    if name in CTRANSLATE2_LIMITS:
        return CTRANSLATE2_LIMITS[name]
    if name == "moe_transformer":
        ffn = config_setting(model_cfg, "encoder_ffn")
        if ffn == "ewa" and config_setting(model_cfg, "ewa_stop_at") is not None:
            return ("an early-EWA model keeps a routed mixture of experts at inference "
                    "(--ewa-stop-at): " + MOE_LIMITS["moe"])
        return MOE_LIMITS.get(ffn, "moe_transformer with encoder FFN "
                                   f"{ffn!r} is not a model CTranslate2's converter knows")
    return None


def _as_namespace(model_cfg):
    if isinstance(model_cfg, argparse.Namespace):
        return argparse.Namespace(**vars(model_cfg))
    if isinstance(model_cfg, dict):
        return argparse.Namespace(**model_cfg)
    from omegaconf import OmegaConf

    return argparse.Namespace(**OmegaConf.to_container(model_cfg, resolve=True))


def read_unless_refused(checkpoint, obstacle, error, refusal):
    """The state and model config of ``checkpoint``, read by
    :func:`~multipath_nmt.checkpoint_io.reading.read_checkpoint`; raises ``error`` with the line
    "CHECKPOINT: ARCH ``refusal``: REASON" when ``obstacle(model_cfg)`` gives a reason."""
    state = read_checkpoint(checkpoint)
    model_cfg = model_config(state)
    reason = obstacle(model_cfg)
    if reason:
        raise error(f"{checkpoint}: {architecture(state)} {refusal}: {reason}")
    return state, model_cfg


def language_pair(state, data_bin, source_lang=None, target_lang=None):
    """The language pair of a model: given, else the checkpoint's task's, else what fairseq's
    translation task infers from the data-bin's file names (``train.SRC-TGT.LANG.bin``); either
    may be None when nothing says."""
    from fairseq.data.data_utils import infer_language_pair

    task = state["cfg"]["task"] if state.get("cfg") is not None else state.get("args")
    source_lang = source_lang or config_setting(task, "source_lang")
    target_lang = target_lang or config_setting(task, "target_lang")
    if not (source_lang and target_lang) and os.path.isdir(data_bin):
        source_lang, target_lang = infer_language_pair(str(data_bin))
    return source_lang, target_lang


def data_bin_dictionaries(checkpoint, data_bin, source_lang, target_lang, error):
    """The source and target dictionaries of ``data_bin``, checked against the checkpoint as
    fairseq-generate checks them
    (:func:`~multipath_nmt.checkpoint_io.dictionaries.check_dictionaries`: the size of the
    embeddings, and the symbols each save records): a data-bin whose dictionaries are not the
    model's raises :class:`~multipath_nmt.checkpoint_io.DictionaryMismatchError`
    with fairseq-generate's line, a missing dictionary ``error``."""
    from fairseq.data import Dictionary

    dictionaries = []
    for lang in (source_lang, target_lang):
        path = os.path.join(str(data_bin), f"dict.{lang}.txt")
        if not os.path.isfile(path):
            raise error(f"{data_bin}: no dict.{lang}.txt; give the data-bin the model was "
                        "trained on")
        dictionaries.append(Dictionary.load(path))
    task = SimpleNamespace(source_dictionary=dictionaries[0], target_dictionary=dictionaries[1],
                           cfg=SimpleNamespace(data=str(data_bin), source_lang=source_lang,
                                               target_lang=target_lang))
    check_dictionaries(checkpoint, task)
    return dictionaries


def convert_to_ctranslate2(checkpoint, data_bin, output_dir, quantization=None,
                           source_lang=None, target_lang=None, force=False):
    """Convert the fairseq checkpoint ``checkpoint`` (dictionaries in ``data_bin``) into a
    CTranslate2 model folder ``output_dir`` with CTranslate2's fairseq converter; ``quantization``
    as CTranslate2's (None keeps float32, "int8" ...). Raises :class:`NotServable` for a model
    CTranslate2 cannot express, :class:`~multipath_nmt.checkpoint_io.CheckpointError` for a file
    that cannot be read or a data-bin that is not the model's,
    :class:`~multipath_nmt.atomic_files.FolderNotWritten` for an ``output_dir`` that cannot be
    written (checked first). The folder appears whole or not at all; with ``force`` an existing
    one is replaced once the new one is complete. Returns ``output_dir``."""
    try:
        from ctranslate2.converters import FairseqConverter
    except ImportError:
        raise NotServable("CTranslate2 is not installed: pip install ctranslate2") from None
    problem = unwritable_folder(output_dir)
    if problem:
        raise FolderNotWritten(problem)
    checkpoint = str(checkpoint)
    state, model_cfg = read_unless_refused(checkpoint, ctranslate2_obstacle, NotServable,
                                           "cannot run in CTranslate2")
    source_lang, target_lang = language_pair(state, data_bin, source_lang, target_lang)
    if source_lang and target_lang:  # else the converter says what it misses
        data_bin_dictionaries(checkpoint, data_bin, source_lang, target_lang, NotServable)
    with tempfile.TemporaryDirectory(prefix="multipath-ctranslate2-") as scratch:
        # the layout the converter reads (torch.load(weights_only=True): the Namespace is on
        # the safe-loading allow-list the plug-in installs)
        path = os.path.join(scratch, "checkpoint.pt")
        torch.save({"args": _as_namespace(model_cfg), "cfg": None, "model": state["model"]}, path)
        converter = FairseqConverter(path, str(data_bin), source_lang=source_lang,
                                     target_lang=target_lang)
        with folder_written_atomically(output_dir, replace=force) as folder:
            # force: the converter empties the fresh temporary folder it is given
            converter.convert(folder, quantization=quantization, force=True)
    return output_dir


class Translations(NamedTuple):
    hypotheses: List[List[str]]
    seconds: float  # translation alone, the model loaded

    @property
    def sentences_per_second(self) -> float:
        return len(self.hypotheses) / self.seconds if self.seconds > 0 else float("inf")


_CONVERT_ONE = "give a folder written by multipath-ctranslate2 convert"


def ctranslate2_model_problem(model_dir) -> Optional[str]:
    """Why ``model_dir`` is not a CTranslate2 model folder, in one line, or None: a missing
    folder, or one without the ``model.bin`` that convert writes (a damaged one is found when
    CTranslate2 loads it, :func:`translate`)."""
    if not os.path.isdir(model_dir):
        return f"{model_dir}: no such folder; {_CONVERT_ONE}"
    if not os.path.isfile(os.path.join(model_dir, "model.bin")):
        return f"{model_dir}: not a CTranslate2 model folder (no model.bin); {_CONVERT_ONE}"
    return None


def translate(model_dir, sentences: Sequence[Sequence[str]], beam=4, lenpen=1.0, max_len_b=200,
              batch_size=64, compute_type="default", threads=0, device="cpu") -> Translations:
    """The best hypothesis of each tokenized sentence of ``sentences`` under the CTranslate2 model
    ``model_dir``, with fairseq-generate's search: beam ``beam``, scores divided by
    length ** ``lenpen``, at most ``max_len_b`` tokens (fairseq's --max-len-a 0), the source
    followed by </s> (the converter sets that). ``compute_type``: CTranslate2's ("float32",
    "int8", ...; "default" is the type the model was converted with). ``threads``: 0 lets
    CTranslate2 choose. Raises :class:`NotServable` (one line) for a folder that is not a model
    or that CTranslate2 cannot load."""
    import ctranslate2

    problem = ctranslate2_model_problem(model_dir)
    if problem:
        raise NotServable(problem)
    try:
        translator = ctranslate2.Translator(str(model_dir), device=device,
                                            compute_type=compute_type, intra_threads=threads)
    except (RuntimeError, ValueError) as error:  # a damaged or foreign model.bin, a bad type
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise NotServable(f"{model_dir}: CTranslate2 cannot load it ({reason})") from None
    start = time.perf_counter()
    results = translator.translate_batch([list(s) for s in sentences], beam_size=beam,
                                         length_penalty=lenpen, max_decoding_length=max_len_b,
                                         max_batch_size=batch_size)
    seconds = time.perf_counter() - start
    return Translations([r.hypotheses[0] for r in results], seconds)
