"""Export a fairseq checkpoint of this package to a Hugging Face ``transformers`` model folder (the
library of ``multipath-export-hf``; docs/serving.md).

:func:`export_to_transformers` writes a folder that
``AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True)`` loads:

- dense models (fairseq's ``transformer``: the pre-norm, deep and wide baselines, an EWA model
  folded by ``multipath-convert-ewa``) as ``M2M100ForConditionalGeneration``, which computes
  fairseq's pre-norm Transformer (sinusoidal positions from padding_idx + 1, embeddings scaled by
  sqrt(d), final LayerNorms, decoding from </s>) with no code of ours;
- multi-path models (``multipath_transformer``, multi-path encoder, fairseq decoder) as remote
  code: :mod:`multipath_nmt.hf_export.modeling_multipath`, a subclass of M2M100's model whose
  encoder layers are :class:`multipath_nmt.modules.multipath.MultiPathEncoderLayer`, written into
  the folder together with the package's module source (:func:`remote_code`);
- every other model is refused with one line that says why (:func:`export_obstacle`).

Token ids are the fairseq dictionary's; ``generation_config.json`` holds fairseq-generate's search
as translate.sh runs it (:func:`generation_settings`). The model card (README.md) comes from
:func:`model_card`.
"""
import re
from pathlib import Path
from typing import Optional

import torch

from multipath_nmt.atomic_files import (FolderNotWritten, folder_written_atomically,
                                        unwritable_folder)
from multipath_nmt.checkpoint_io.reading import model_config
from multipath_nmt.serving import (config_setting, data_bin_dictionaries, language_pair, model_name,
                                   read_unless_refused)

PACKAGE = Path(__file__).resolve().parents[1]

# fairseq's --activation-fn names -> transformers' ACT2FN names of the same function
# (gelu_accurate is the tanh approximation, transformers' gelu_new, term by term)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_accurate": "gelu_new",
               "gelu_fast": "gelu_new", "tanh": "tanh", "swish": "silu", "linear": "linear",
               "relu_squared": "relu2"}

# translate.sh's search (multipath_nmt/recipe/commands.py, DECODING) and fairseq-generate's
# length limit (--max-len-a 0 --max-len-b 200)
BEAM, LENPEN, MAX_LEN_B = 4, 0.6, 200

# Families that are not exported, and why (one line each).
REFUSED = {
    "widenet_transformer": (
        "its encoder shares one attention and one top-k routed mixture-of-experts FFN across "
        "layers; no transformers model holds that and multipath-export-hf has no remote code "
        "for it yet: serve it with fairseq"),
    "ewa": ("an EWA model is a dense Transformer once its experts are averaged: fold it first "
            "with multipath-convert-ewa, then export the folded checkpoint"),
    "parameternet": (
        "ParameterNet's FFN mixes its M weight matrices per sentence or routes each token to "
        "one with a learned router; multipath-export-hf has no remote code for it yet: serve it "
        "with fairseq"),
    "moe": ("a routed mixture-of-experts FFN; multipath-export-hf has no remote code for it "
            "yet: serve it with fairseq"),
}


class NotExportable(ValueError):
    """A model that cannot be exported; the message says why, in one line."""


def _flag(name):
    return "--" + name.replace("_", "-")


def export_obstacle(model_cfg) -> Optional[str]:
    """Why the model of ``model_cfg`` (a checkpoint's ``cfg.model`` or ``args``) cannot be exported,
    or None."""
    name = model_name(model_cfg)
    get = lambda key, default=None: (  # noqa: E731
        default if config_setting(model_cfg, key) is None else config_setting(model_cfg, key))
    if name == "moe_transformer":
        ffn = get("encoder_ffn")
        if ffn == "ewa" and get("ewa_stop_at") is not None:
            return ("an early-EWA model keeps a routed mixture of experts at inference "
                    "(--ewa-stop-at): " + REFUSED["moe"])
        return REFUSED.get(ffn, f"moe_transformer with encoder FFN {ffn!r} is not a model "
                                "multipath-export-hf knows")
    if name in REFUSED:
        return REFUSED[name]
    if name not in ("transformer", "multipath_transformer"):
        return f"{name} is not a model multipath-export-hf knows"
    if name == "multipath_transformer" and get("decoder_paths", 1) > 1:
        return ("--decoder-paths > 1: the exported model keeps transformers' M2M100 decoder, "
                "whose layers have one path; only multi-path encoders are exported")
    if not (get("encoder_normalize_before", False) and get("decoder_normalize_before", False)):
        return ("a post-norm Transformer (no --encoder-normalize-before / "
                "--decoder-normalize-before): M2M100 is pre-norm only; export a pre-norm model")
    if not get("share_all_embeddings", False):
        return ("M2M100 keeps one embedding matrix for the source, the target and the output "
                "projection; this model was trained without --share-all-embeddings")
    for key in ("encoder_learned_pos", "decoder_learned_pos", "layernorm_embedding",
                "no_token_positional_embeddings", "cross_self_attention",
                "adaptive_softmax_cutoff", "adaptive_input", "no_decoder_final_norm",
                "quant_noise_pq", "decoder_learned_sinusoidal"):
        if get(key):
            return f"{_flag(key)} is not what M2M100 computes"
    dims = {get(key) for key in ("encoder_embed_dim", "decoder_embed_dim", "decoder_output_dim",
                                 "decoder_input_dim") if get(key) is not None}
    if len(dims) > 1:
        return (f"embedding and output sizes differ ({sorted(dims)}): M2M100 has one model "
                "dimension and no projections between them")
    if get("activation_fn", "relu") not in ACTIVATIONS:
        return f"--activation-fn {get('activation_fn')} has no transformers equivalent"
    return None


def _languages(state, data_bin, source_lang, target_lang):
    """The language pair (:func:`multipath_nmt.serving.language_pair`)."""
    source_lang, target_lang = language_pair(state, data_bin, source_lang, target_lang)
    if not (source_lang and target_lang):
        raise NotExportable(f"{data_bin}: neither the checkpoint nor the data-bin's file names "
                            "give the language pair; give --source-lang and --target-lang")
    return source_lang, target_lang


def m2m100_settings(model_cfg, dictionary):
    """The keyword arguments of ``M2M100Config`` for the dense fairseq model ``model_cfg`` with the
    (joined) ``dictionary``."""
    get = lambda key, default=None: (  # noqa: E731
        default if config_setting(model_cfg, key) is None else config_setting(model_cfg, key))
    return dict(
        vocab_size=len(dictionary), d_model=get("encoder_embed_dim"),
        encoder_layers=get("encoder_layers"), decoder_layers=get("decoder_layers"),
        encoder_attention_heads=get("encoder_attention_heads"),
        decoder_attention_heads=get("decoder_attention_heads"),
        encoder_ffn_dim=get("encoder_ffn_embed_dim"), decoder_ffn_dim=get("decoder_ffn_embed_dim"),
        activation_function=ACTIVATIONS[get("activation_fn", "relu")],
        dropout=get("dropout", 0.0), attention_dropout=get("attention_dropout", 0.0),
        activation_dropout=get("activation_dropout", 0.0) or get("relu_dropout", 0.0) or 0.0,
        encoder_layerdrop=get("encoder_layerdrop", 0.0),
        decoder_layerdrop=get("decoder_layerdrop", 0.0),
        # sinusoidal positions grow on demand in M2M100 as in fairseq; this is where fairseq's
        # generator stops (fairseq-generate skips longer inputs)
        max_position_embeddings=max(get("max_source_positions", 1024),
                                    get("max_target_positions", 1024)),
        scale_embedding=not get("no_scale_embedding", False),
        pad_token_id=dictionary.pad(), bos_token_id=dictionary.bos(),
        eos_token_id=dictionary.eos(), decoder_start_token_id=dictionary.eos(),
        forced_eos_token_id=None, tie_word_embeddings=True, is_encoder_decoder=True)


def generation_settings(model_cfg, dictionary):
    """``GenerationConfig`` keyword arguments for fairseq-generate's search as translate.sh runs it:
    beam 4, scores divided by length ** 0.6 where both count the tokens generated including </s>
    (fairseq's ``(step + 1) ** lenpen``, transformers' ``(cur_len + 1 - prompt) ** lenpen``), a
    sentence done when it has ``beam`` finished hypotheses (``early_stopping=True``), <pad> never
    produced, no </s> as the first token (fairseq's min_len 1 counts generated tokens; transformers'
    ``min_length`` counts the decoder start too, so ``min_new_tokens=1``), at most 200 tokens and
    then </s> (``--max-len-b 200``, capped by the decoder's positions as fairseq caps it)."""
    max_len = min(MAX_LEN_B, (config_setting(model_cfg, "max_target_positions") or 1024) - 1)
    return dict(decoder_start_token_id=dictionary.eos(), bos_token_id=dictionary.bos(),
                eos_token_id=dictionary.eos(), pad_token_id=dictionary.pad(),
                forced_eos_token_id=dictionary.eos(), num_beams=BEAM, length_penalty=LENPEN,
                early_stopping=True, min_new_tokens=1, max_new_tokens=max_len + 1,
                suppress_tokens=[dictionary.pad()], do_sample=False)


def _is_multipath(model_cfg):
    return model_name(model_cfg) == "multipath_transformer"


def _config(model_cfg, dictionary):
    settings = m2m100_settings(model_cfg, dictionary)
    if not _is_multipath(model_cfg):
        from transformers import M2M100Config

        return M2M100Config(**settings)
    from multipath_nmt.hf_export.modeling_multipath import MultiPathM2M100Config

    config = MultiPathM2M100Config(
        encoder_paths=config_setting(model_cfg, "encoder_paths"),
        path_norm=not config_setting(model_cfg, "no_path_norm"),
        learnable_weights=config_setting(model_cfg, "path_weights") == "learnable",
        cheap_features=bool(config_setting(model_cfg, "cheap_features")),
        fairseq_activation_fn=config_setting(model_cfg, "activation_fn") or "relu", **settings)
    module = REMOTE_MODELING_FILE[:-3]
    config.auto_map = {"AutoConfig": f"{module}.MultiPathM2M100Config",
                       "AutoModelForSeq2SeqLM": f"{module}.MultiPathM2M100ForConditionalGeneration"}
    return config


def _model_class(model_cfg):
    if _is_multipath(model_cfg):
        from multipath_nmt.hf_export.modeling_multipath import (
            MultiPathM2M100ForConditionalGeneration,
        )

        return MultiPathM2M100ForConditionalGeneration
    from transformers import M2M100ForConditionalGeneration

    return M2M100ForConditionalGeneration


# fairseq entries that carry no weights of their own: version markers, the sinusoidal tables'
# device probes, and the decoder's input embeddings and output projection, which
# --share-all-embeddings ties to the encoder's embeddings (M2M100's ``shared``)
_NOT_COPIED = re.compile(r"(encoder|decoder)\.version$|\._float_tensor$|"
                         r"decoder\.(embed_tokens|output_projection)\.weight$")
TIED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
        "lm_head.weight")


def transformers_state_dict(fairseq_state):
    """The fairseq model's weights under M2M100's names: the layers and final LayerNorms keep
    fairseq's names under ``model.``, the shared embeddings become ``model.shared``."""
    shared = fairseq_state["encoder.embed_tokens.weight"]
    for tied in ("decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        if tied in fairseq_state and not torch.equal(fairseq_state[tied], shared):
            raise NotExportable(f"{tied} differs from encoder.embed_tokens.weight, which "
                                "--share-all-embeddings ties it to: M2M100 holds one matrix")
    mapped = {"model.shared.weight": shared}
    for key, value in fairseq_state.items():
        if not key.startswith("encoder.embed_tokens") and not _NOT_COPIED.search(key):
            mapped["model." + key] = value
    return mapped


def build_transformers_model(state, dictionary):
    """The ``transformers`` model of the fairseq checkpoint ``state`` (read by
    :func:`~multipath_nmt.checkpoint_io.reading.read_checkpoint`), in fp32 and eval mode; every weight is
    the checkpoint's (load_state_dict: nothing missing but the tied copies, nothing left over)."""
    model_cfg = model_config(state)
    config = _config(model_cfg, dictionary)
    model = _model_class(model_cfg)(config)
    weights = {k: v.float() for k, v in transformers_state_dict(state["model"]).items()}
    result = model.load_state_dict(weights, strict=False)
    missing = set(result.missing_keys) - set(TIED)
    if missing or result.unexpected_keys:
        raise NotExportable(f"the checkpoint's weights do not fit {type(model).__name__}: "
                            f"missing {sorted(missing)}, "
                            f"left over {sorted(result.unexpected_keys)}")
    model.tie_weights()
    return model.eval()


REMOTE_MODELING_FILE = "modeling_multipath.py"
# the package modules the remote code imports -> their file names in the model folder
REMOTE_MODULES = {"multipath_nmt.modules.multipath": "multipath.py",
                  "multipath_nmt.modules": "activations.py"}


def remote_code(out_dir):
    """Write the remote code of a multi-path model into ``out_dir``: this package's
    ``modeling_multipath.py`` and the ``multipath_nmt.modules`` files it imports, with the
    imports of the package turned into imports of the copies next to it. Returns the file names."""
    source = (PACKAGE / "hf_export" / "modeling_multipath.py").read_text(encoding="utf-8")
    written = [REMOTE_MODELING_FILE]
    for module, filename in REMOTE_MODULES.items():
        pattern = re.compile(rf"^from {re.escape(module)} import", re.M)
        source, count = pattern.subn(f"from .{filename[:-3]} import", source)
        if count != 1:
            raise RuntimeError(f"modeling_multipath.py no longer imports {module}: update "
                               "REMOTE_MODULES in multipath_nmt/hf_export/__init__.py")
        path = PACKAGE / (module.split(".", 1)[1].replace(".", "/"))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        copied = path.read_text(encoding="utf-8")
        if re.search(r"^\s*(from|import) (multipath_nmt|fairseq)\b", copied, re.M):
            raise RuntimeError(f"{path} imports the package or fairseq: it cannot be remote code")
        Path(out_dir, filename).write_text(copied, encoding="utf-8")
        written.append(filename)
    Path(out_dir, REMOTE_MODELING_FILE).write_text(source, encoding="utf-8")
    return written


def export_to_transformers(checkpoint, data_bin, out_dir, bpe_codes=None, source_lang=None,
                           target_lang=None, force=False):
    """Write the ``transformers`` model folder ``out_dir`` for the fairseq checkpoint
    ``checkpoint`` (dictionaries in ``data_bin``): config.json, model.safetensors,
    generation_config.json, README.md (the model card) and, for a multi-path model, its remote
    code; with ``bpe_codes`` (subword-nmt's codes of the data-bin), the tokenizer
    (:mod:`multipath_nmt.hf_export.tokenizer`). The folder appears whole or not at all
    (:func:`~multipath_nmt.atomic_files.folder_written_atomically`); with ``force`` an existing
    one is replaced once the new one is complete. Raises :class:`NotExportable` (one line) for a
    model it cannot export or codes that are not subword-nmt's,
    :class:`~multipath_nmt.checkpoint_io.CheckpointError` for a file that cannot be read or a
    data-bin that is not the model's (fairseq-generate's check),
    :class:`~multipath_nmt.atomic_files.FolderNotWritten` for an ``out_dir`` that cannot be
    written (checked first). Returns ``out_dir``."""
    from transformers import GenerationConfig

    from multipath_nmt.hf_export.card import model_card
    from multipath_nmt.hf_export.tokenizer import bpe_merges, save_tokenizer

    problem = unwritable_folder(out_dir)
    if problem:
        raise FolderNotWritten(problem)
    checkpoint = str(checkpoint)
    state, model_cfg = read_unless_refused(checkpoint, export_obstacle, NotExportable,
                                           "cannot be exported to transformers")
    source_lang, target_lang = _languages(state, data_bin, source_lang, target_lang)
    dictionary, target_dictionary = data_bin_dictionaries(checkpoint, data_bin, source_lang,
                                                          target_lang, NotExportable)
    if target_dictionary.symbols != dictionary.symbols:
        raise NotExportable(f"{data_bin}: dict.{source_lang}.txt and dict.{target_lang}.txt "
                            "differ: M2M100 holds one vocabulary (--share-all-embeddings needs a "
                            "joined dictionary)")
    rows = state["model"]["encoder.embed_tokens.weight"].size(0)
    if rows != len(dictionary):
        raise NotExportable(f"{data_bin}: its dictionary has {len(dictionary)} entries, the "
                            f"model's embeddings {rows}: give the data-bin the model was "
                            "trained on")
    merges = bpe_merges(bpe_codes) if bpe_codes is not None else None
    model = build_transformers_model(state, dictionary)
    card = model_card(checkpoint, state, model, source_lang, target_lang)
    # everything is read: from here on the export only writes, into a folder that takes the
    # place of out_dir once complete
    with folder_written_atomically(out_dir, replace=force) as folder:
        model.save_pretrained(folder)
        if _is_multipath(model_cfg):
            remote_code(folder)
        GenerationConfig(**generation_settings(model_cfg, dictionary)).save_pretrained(folder)
        if merges is not None:
            save_tokenizer(folder, dictionary, merges, source_lang, target_lang)
        Path(folder, "README.md").write_text(card, encoding="utf-8")
    return out_dir
