"""The model card (README.md) of an exported model: architecture, parameters, the training command
and the scores, where the run left them.

fairseq's checkpoints keep the model's settings but not the command line, and
``multipath-score`` prints its scores: the card reads what ``scripts/quickstart.sh``'s layout
leaves next to the checkpoint's folder, ``train.log`` (train.sh's ``train.sh: <command>`` line)
and ``score.txt`` (multipath-score's output, sacreBLEU with its signature), in the checkpoint's
folder or the one above it. What is not found is said to be missing.
"""
from pathlib import Path

from multipath_nmt.checkpoint_io.reading import architecture, model_config
from multipath_nmt.serving import config_setting

MODEL_SETTINGS = ("encoder_layers", "decoder_layers", "encoder_embed_dim", "encoder_ffn_embed_dim",
                  "decoder_ffn_embed_dim", "encoder_attention_heads", "decoder_attention_heads",
                  "encoder_paths", "decoder_paths", "path_weights", "no_path_norm",
                  "cheap_features", "activation_fn", "dropout", "share_all_embeddings")


def _found_next_to(checkpoint, name):
    folder = Path(checkpoint).resolve().parent
    for candidate in (folder / name, folder.parent / name):
        if candidate.is_file():
            return candidate
    return None


def recorded_training_command(checkpoint):
    log = _found_next_to(checkpoint, "train.log")
    if log is None:
        return None
    commands = [line[len("train.sh: "):].strip() for line in
                log.read_text(encoding="utf-8", errors="replace").splitlines()
                if line.startswith("train.sh: ") and " -m " in line]
    return commands[-1] if commands else None


def recorded_scores(checkpoint):
    scores = _found_next_to(checkpoint, "score.txt")
    if scores is None:
        return []
    return [line.strip() for line in scores.read_text(encoding="utf-8").splitlines()
            if line.startswith(("sacreBLEU", "chrF", "BLEU"))]


def model_card(checkpoint, state, model, source_lang, target_lang):
    """The README.md of the folder exported from ``checkpoint`` (its ``state``) as ``model``."""
    cfg = model_config(state)
    params = sum(p.numel() for p in model.parameters())
    settings = "\n".join(f"| {key} | {config_setting(cfg, key)} |" for key in MODEL_SETTINGS
                         if config_setting(cfg, key) is not None)
    command = recorded_training_command(checkpoint)
    scores = recorded_scores(checkpoint)
    remote = bool(getattr(model.config, "auto_map", None))
    lines = [
        "---", "library_name: transformers", f"language: [{source_lang}, {target_lang}]",
        "pipeline_tag: translation", "---", "",
        f"# {architecture(state)} ({source_lang}->{target_lang})", "",
        f"Exported by `multipath-export-hf` from the fairseq checkpoint `{Path(checkpoint).name}` "
        f"as `{type(model).__name__}`" + (" (remote code in this folder: load with "
                                           "`trust_remote_code=True`)." if remote else "."),
        "", f"Parameters: {params:,} (embeddings shared by the encoder, the decoder and the "
            "output projection, counted once).", "",
        "Token ids are the fairseq dictionary's. `generation_config.json` holds the search of "
        "the project's translate.sh: beam 4, length penalty 0.6.", "",
        "## Architecture", "", "| setting | value |", "|---|---|", settings, "",
        "## Training", "",
        f"```\n{command}\n```" if command else
        "The training command was not recorded next to the checkpoint (no train.log with "
        "train.sh's command line).", "",
        "## Scores", "",
        "\n".join(f"- {s}" for s in scores) if scores else
        "No scores were recorded next to the checkpoint (no score.txt from multipath-score).",
        "",
    ]
    return "\n".join(lines)
