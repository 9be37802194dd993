"""``fairseq-train --arch A --help`` lists the flags of A (and of the task, optimizer, ...).

fairseq 0.12 parses once to learn ``--arch``/``--task``/``--optimizer``..., adds their flags, and
parses again; ``--help`` acted in the first parse, so no model flag was ever listed. Here it is
held back and printed from fairseq's second ``modify_parser`` call (every flag is on the parser
then), each model flag followed by the default its ``--arch`` gives it.

Reach beyond the plug-in's own models: every fairseq tool's ``--help`` lists the model's flags; the
help strings are edited through argparse's private ``_actions`` on a parser that exits right after
printing (not narrowed: argparse has no public list of a parser's actions).
Does nothing when: ``-h``/``--help`` is not on the command line.

A bad command line (an unknown flag, a missing value) is refused in one line,
``fairseq-train: error: ... (--help lists the options)``, where argparse printed the whole usage of
every flag first (hundreds of lines): ``error`` of the parser that fairseq's tool hands to
``parse_args_and_arch``, set on that parser object alone.
"""
import argparse
import functools
import sys

from multipath_nmt.fairseq_patches.wrapping import wrap


def _arch_defaults(arch):
    """The values an architecture function gives the flags a command line leaves unset."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    defaults = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](defaults)
    return vars(defaults)


def _one_line_error(parser, message):
    sys.stderr.write(f"{parser.prog}: error: {message} (--help lists the options)\n")
    sys.exit(2)


def _help_after_model_flags(parse_args_and_arch):
    @functools.wraps(parse_args_and_arch)
    def parse_args_and_arch_with_full_help(parser, input_args=None, parse_known=False,
                                           suppress_defaults=False, modify_parser=None):
        parser.error = functools.partial(_one_line_error, parser)
        argv = sys.argv[1:] if input_args is None else list(input_args)
        rest = [a for a in argv if a not in ("-h", "--help")]
        if len(rest) == len(argv) or suppress_defaults or not parser.add_help:
            return parse_args_and_arch(parser, input_args, parse_known, suppress_defaults,
                                       modify_parser)
        first_parse = []

        def modify_then_help(p):
            if modify_parser is not None:
                modify_parser(p)
            if not first_parse:  # first call: only the generic flags are on the parser
                first_parse.append(p.parse_known_args(rest)[0])
                if getattr(first_parse[0], "arch", "") is None:  # fairseq needs an --arch to go on
                    p.print_help()
                    p.exit()
                return
            arch = getattr(first_parse[0], "arch", None)
            try:
                defaults = _arch_defaults(arch) if arch is not None else {}
            except AttributeError:  # an arch reading a flag it does not set (fairseq's lightconv_lm)
                defaults = {}
            for action in p._actions:
                if action.default is argparse.SUPPRESS and action.dest in defaults:
                    value = str(defaults[action.dest]).replace("%", "%%")
                    action.help = f"{action.help or ''} (default for {arch}: {value})"
            p.print_help()
            p.exit()

        return parse_args_and_arch(parser, rest, parse_known, suppress_defaults, modify_then_help)

    return parse_args_and_arch_with_full_help


def install():
    from fairseq import options

    wrap(options, "parse_args_and_arch", _help_after_model_flags)
