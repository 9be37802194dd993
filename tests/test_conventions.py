"""The command-line conventions (README, "Tools"): every console tool and script prints its usage
on stdout and exits 0 for ``--help``; the console tools print their version for ``--version``; a
bad command line is refused in one line, fairseq-train's too; the plug-in's import prints nothing
in a tool's fresh interpreter. The console tools are called in-process (``main(argv)``); the
scripts, and the fresh interpreter, are processes because the process is what is tested."""
import importlib
import multiprocessing
import subprocess
import sys
import tomllib

import pytest
from conftest import ROOT, clean_env, script_env

from multipath_nmt.cli import package_version
from multipath_nmt.pipeline import text

CONSOLE_SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# every script a user runs: those with a #! line (the others, as usage.sh, are sourced by them)
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.sh")
                 if p.read_text().startswith("#!"))


def _main(entry_point):
    module, function = entry_point.split(":")
    return getattr(importlib.import_module(module), function)


def _exit_status(main, argv):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code


@pytest.mark.parametrize("name", CONSOLE_SCRIPTS)
def test_console_tools_print_usage_and_version_on_stdout(name, capsys):
    main = _main(CONSOLE_SCRIPTS[name])
    assert _exit_status(main, ["--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: {name}") and err == ""
    assert _exit_status(main, ["--version"]) == 0
    out, err = capsys.readouterr()
    assert (out, err) == (f"{name} (multipath_nmt {package_version()})\n", "")


@pytest.mark.parametrize("name", CONSOLE_SCRIPTS)
def test_console_tools_refuse_an_unknown_option_in_one_line(name, capsys):
    assert _exit_status(_main(CONSOLE_SCRIPTS[name]), ["--no-such-option"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"{name}") and err.endswith(" (--help lists the options)\n")
    assert err.count("\n") == 1  # the unknown option, or the arguments missing beside it


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.process  # the scripts' own --help
def test_scripts_print_their_usage_on_stdout_for_help(script):
    proc = subprocess.run(["bash", ROOT / "scripts" / script, "--help"], capture_output=True,
                          text=True, env=script_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower() or script.removesuffix(".sh") in proc.stdout
    assert proc.stderr in ("", "score.sh: multipath-score --help\n")


@pytest.mark.process
def test_quickstart_refuses_an_option_in_one_line(tmp_path):
    proc = subprocess.run(["bash", ROOT / "scripts" / "quickstart.sh", "--fast"],
                          capture_output=True, text=True, env=script_env(), cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("quickstart.sh: error: it takes one WORK_DIR and no options, got: "
                           "--fast (--help says more)\n")
    assert not (tmp_path / "--fast").exists()


@pytest.mark.parametrize("tool, argv", [
    ("train", ["DATA", "--arch", "transformer", "--no-such-flag"]),
    ("generate", ["DATA", "--path", "x.pt", "--beam"]),  # a flag without its value
])
def test_fairseq_refuses_a_bad_command_line_in_one_line(tool, argv, capsys):
    from fairseq import options

    parser = {"train": options.get_training_parser,
              "generate": options.get_generation_parser}[tool]()
    with pytest.raises(SystemExit) as stopped:
        options.parse_args_and_arch(parser, argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(" (--help lists the options)\n"), err


@pytest.mark.process  # a fresh interpreter's output
def test_a_tools_fresh_interpreter_prints_only_its_one_line():
    """No INFO line of the plug-in's import before the tool's own (fairseq's speech modules turn
    INFO logging on when fairseq is imported)."""
    proc = subprocess.run([sys.executable, "-m", "multipath_nmt.cli.average", "--inputs", "x.pt",
                           "--output", "/nonexistent/avg.pt"], capture_output=True, text=True,
                          env=clean_env(), cwd=ROOT, timeout=300)
    assert (proc.returncode, proc.stdout) == (1, "averaging 1 checkpoints: x.pt\n")
    assert proc.stderr == "multipath-average: error: x.pt: no such checkpoint file (no .pt files in .)\n"


def test_the_tokenizer_pools_fork_whatever_the_default_start_method(tmp_path, monkeypatch):
    """Python 3.14 makes forkserver the default; the pools' workers must be forked to inherit
    the lifeline (multipath_nmt/pipeline/tethered.py)."""
    asked = []
    get_context = multiprocessing.get_context
    monkeypatch.setattr(multiprocessing, "get_context",
                        lambda method=None: asked.append(method) or get_context(method))
    src = tmp_path / "in.txt"
    src.write_text("".join(f"line {i}\n" for i in range(50)))
    text.map_file(src, tmp_path / "out.txt", _upper, _no_init, (), workers=2, label="test",
                  chunk_lines=7)
    assert asked == ["fork"]
    assert (tmp_path / "out.txt").read_text() == src.read_text().upper()


def _no_init():
    pass


def _upper(lines):
    return [line.upper() for line in lines]
