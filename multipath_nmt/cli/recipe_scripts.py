"""multipath-train and multipath-translate, and scripts/train.sh and scripts/translate.sh in a
checkout (``scripts/run-recipe.sh`` runs :func:`main`): print the plan and the command that
:mod:`multipath_nmt.recipe` builds, then run it. No argparse:
every argument but ``--dry-run`` goes to the library, which passes fairseq's on unread."""
import os
import shlex
import sys
from typing import List

from multipath_nmt.cli import ToolParser, version_line
from multipath_nmt.recipe import (LAUNCHER_MODULE, RecipeError, finish_translation,
                                  generate_command, run_launcher, train_command)
from multipath_nmt.recipe.save_dir import fairseq_train_environment
from multipath_nmt.recipe.translation import check_output_prefix, run_decoder


def _train_sh(args: List[str], dry_run: bool, name: str = "train.sh") -> None:
    data_bin, save_dir, args = args[0], args[1], args[2:]
    if os.environ.get("MAX_TOKENS"):  # a cap that the command line's --max-tokens replaces
        args = [f"--max-tokens={os.environ['MAX_TOKENS']}", *args]
    command = train_command(data_bin, save_dir, args)
    for line in command.notes + [shlex.join(command.argv)]:
        print(f"{name}: {line}", flush=True)
    if not dry_run:
        # the save dir checked, nothing written into it: fairseq-train's rank 0 writes the batch
        # record once it holds the save dir
        os.environ.update(fairseq_train_environment(save_dir, command.argv))
        if command.argv[1:3] == ["-m", LAUNCHER_MODULE]:
            sys.exit(run_launcher(command.argv))
        os.execv(command.argv[0], command.argv)


def _translate_sh(args: List[str], dry_run: bool, name: str = "translate.sh") -> None:
    data_bin, checkpoint, out, args = args[0], args[1], args[2], args[3:]
    if not os.path.isfile(checkpoint):
        raise RecipeError(f"{checkpoint}: no such checkpoint")
    check_output_prefix(out)
    command = generate_command(data_bin, checkpoint, args)
    for line in command.notes + [f"{shlex.join(command.argv)} > {out}.generate"]:
        print(f"{name}: {line}", flush=True)
    if dry_run:
        return
    code = run_decoder(command.argv, out)
    if code:
        sys.exit(code)
    count = finish_translation(out)
    print(f"{name}: wrote {out}.generate, {out}.hyp ({count} lines) and {out}.ref")


def main(argv=None):
    """train.sh and translate.sh (``train.sh DATA_BIN SAVE_DIR ARGS...`` or ``translate.sh
    DATA_BIN CHECKPOINT OUT ARGS...``): print the plan and the command, then run it (train.sh
    becomes fairseq-train; translate.sh writes OUT.generate, OUT.hyp and OUT.ref) unless
    ``--dry-run`` is among the arguments; one error line and exit 1 on a bad request, exit 2 on
    a command line short of its positional arguments."""
    tool, *args = sys.argv[1:] if argv is None else argv
    run, positional, usage = _TOOLS[tool]
    if args and args[0] in ("-h", "--help"):
        print(f"usage: {tool} {usage}")
        sys.exit(0)
    if args and args[0] == "--version":
        print(version_line(tool))
        sys.exit(0)
    given = [a for a in args if a != "--dry-run"]
    if len(given) < len(positional):
        ToolParser(prog=tool).error(f"{' '.join(positional[len(given):])} missing")
    try:
        run(given, "--dry-run" in args, tool)
    except RecipeError as error:
        sys.exit(f"{tool}: error: {error}")
    except ImportError as error:
        sys.exit(f"{tool}: error: cannot count GPUs ({error}); activate the environment or set "
                 "PYTHON")


_TRAIN = (_train_sh, ("DATA_BIN", "SAVE_DIR"),
          "DATA_BIN SAVE_DIR --arch ARCH [--dry-run] [recipe and fairseq-train args...] "
          "(docs: the README's \"Training a real model\", scripts/train.sh's header)")
_TRANSLATE = (_translate_sh, ("DATA_BIN", "CHECKPOINT", "OUT_PREFIX"),
              "DATA_BIN CHECKPOINT OUT_PREFIX [--fp32] [--dry-run] [fairseq-generate args...]")
# each by its installed name and by its script's name in a checkout
_TOOLS = {"multipath-train": _TRAIN, "train.sh": _TRAIN,
          "multipath-translate": _TRANSLATE, "translate.sh": _TRANSLATE}


def train_main(argv=None):
    """multipath-train: train.sh as an installed command."""
    main(["multipath-train", *(sys.argv[1:] if argv is None else argv)])


def translate_main(argv=None):
    """multipath-translate: translate.sh as an installed command."""
    main(["multipath-translate", *(sys.argv[1:] if argv is None else argv)])
