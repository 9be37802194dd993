"""``fairseq-train --user-dir multipath_nmt --arch A --help`` lists the model's own flags with
their help and the architecture's defaults (fairseq 0.12 alone exits before the model adds them),
and the README's "Model flags" table lists exactly the flags the models add."""
import argparse
import functools
import re

import pytest

import multipath_nmt  # noqa: F401  (installs the --help fix, registers the models)
from conftest import ROOT, USER_DIR
from helpers import in_process


@functools.lru_cache(maxsize=None)  # one fairseq-train start per command line
def train_help(*args):
    proc = in_process.console_script("fairseq-train", [*args, "--help", "--user-dir", USER_DIR])
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "usage: fairseq-train" in out, out[-2000:]
    return out[out.index("usage: fairseq-train"):]  # after fairseq's import-time log lines


def flag_help(help_text, flag):
    """The help paragraph of one option, whitespace collapsed."""
    match = re.search(rf"^  {re.escape(flag)}(?=\s)(.*?)(?=^  -|^\S|\Z)", help_text, re.M | re.S)
    assert match, f"{flag} is not in the help"
    return " ".join(match.group(1).split())


@pytest.mark.parametrize("arch, flag, words, default", [
    ("multipath_transformer_wmt_en_de", "--encoder-paths", "paths per encoder sublayer", "2"),
    ("multipath_l12_p4_wmt_en_de", "--encoder-paths", "paths per encoder sublayer", "4"),
    ("multipath_transformer_wmt_en_de", "--path-weights", "learnable: path weights alpha",
     "learnable"),
    ("widenet_transformer_wmt_en_de", "--moe-capacity-factor", "each expert keeps at most",
     "1.2"),
    ("ewa_transformer_wmt_en_de", "--encoder-ffn", "encoder FFN type", "ewa"),
    ("parameternet_transformer_wmt_en_de", "--parameternet-mode", "ParameterNet: routed",
     "routed"),  # the paper's method for language models (docs/fidelity.md)
    # fairseq's own transformer flags come with the same fix (and the plug-in's baselines' sizes)
    ("transformer_deep24_wmt_en_de", "--encoder-layers", "encoder: number of layers", "24"),
])
def test_help_lists_the_architectures_flags_with_help_and_default(arch, flag, words, default):
    text = flag_help(train_help("--arch", arch), flag)
    assert words in text
    assert text.endswith(f"(default for {arch}: {default})")


def test_help_without_arch_is_fairseqs_generic_help():
    text = train_help()
    assert "--arch ARCH" in text and "--encoder-paths" not in text


def test_help_lists_the_task_and_optimizer_flags_too():
    text = train_help("--arch", "multipath_transformer_wmt_en_de", "--optimizer", "adam")
    assert "--adam-betas" in text and "--source-lang" in text


def test_training_still_parses_after_the_help_fix():
    from fairseq import options

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, ["data", "--arch", "multipath_l6_p4_wmt_en_de",
                                                "--decoder-paths", "2"])
    assert (args.encoder_paths, args.decoder_paths, args.encoder_layers) == (4, 2, 6)


def test_every_path_flag_has_help_in_fairseq_train_parser():
    from fairseq import options

    parser = options.get_training_parser()
    options.parse_args_and_arch(parser, ["data", "--arch", "multipath_l6_p4_wmt_en_de"])
    helps = {flag: action.help for action in parser._actions for flag in action.option_strings}
    for flag in ("--encoder-paths", "--decoder-paths", "--no-path-norm", "--path-weights",
                 "--cheap-features"):
        assert helps.get(flag), flag
    assert "1/sqrt(m) with PathNorm" in helps["--path-weights"]
    assert "1/m without PathNorm" in helps["--path-weights"]


# --- the README's table -------------------------------------------------------------------------

def readme_model_flags():
    """{model: (arch names or patterns, flags)} from the README's "### Model flags" table."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Model flags", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") \
            else []
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        flags = re.sub(r"\([^()]*\)", "", " ".join(cells[1:]))  # not the flags named in notes
        rows[names[0]] = (names[1:], set(re.findall(r"--[a-z][a-z0-9-]*", flags)))
    return rows


def added_flags(model_cls):
    from fairseq.models.transformer import TransformerModel

    def flags(add_args):
        parser = argparse.ArgumentParser(add_help=False)
        add_args(parser)
        return {s for a in parser._actions for s in a.option_strings}

    return flags(model_cls.add_args) - flags(TransformerModel.add_args)


def test_readme_model_flags_table_lists_exactly_each_models_flags_and_archs():
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, MODEL_REGISTRY

    rows = readme_model_flags()
    ours = {name for name, cls in MODEL_REGISTRY.items()
            if cls.__module__.startswith("multipath_nmt.")}
    assert set(rows) == ours
    for model, (archs, flags) in rows.items():
        assert flags == added_flags(MODEL_REGISTRY[model]), model
        patterns = [re.compile(re.sub(r"\\\{\w+\\\}", r"\\d+", re.escape(a)) + "$") for a in archs]
        registered = {a for a, m in ARCH_MODEL_NAME_REGISTRY.items() if m == model and a != model}
        assert {a for a in registered if not any(p.match(a) for p in patterns)} == set(), model
        assert all(any(p.match(a) for a in registered) for p in patterns), model


def test_the_routing_flags_are_one_declaration_shared_by_the_routed_models():
    from multipath_nmt.models.moe_transformer import MoETransformerModel
    from multipath_nmt.models.widenet_transformer import WideNetTransformerModel

    def routing_flags(model_cls):
        parser = argparse.ArgumentParser(add_help=False)
        model_cls.add_args(parser)
        return {flag: (a.help, a.type, a.metavar) for a in parser._actions
                for flag in a.option_strings
                if flag.startswith("--moe-") and a.dest != "moe_routing_groups"}

    shared = routing_flags(WideNetTransformerModel)
    assert set(shared) == {"--moe-experts", "--moe-top-k", "--moe-capacity-factor",
                           "--moe-capacity-at-inference"}
    assert routing_flags(MoETransformerModel) == shared
