"""The Makefile's choice of interpreter for the venv (`make PYTHON=...`) and its install steps,
tried with fake interpreters on a PATH of their own and ``make -n``: nothing is installed."""
import os
import shutil
import subprocess

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine"),
              pytest.mark.process]  # make's own logic


def fake_pythons(folder, versions):
    """``folder`` as a PATH: make, and a fake interpreter NAME for each NAME: VERSION of
    ``versions`` that prints VERSION whatever it is asked (None: one that does not run, as a
    pyenv shim of a version not selected)."""
    folder.mkdir()
    os.symlink(shutil.which("make"), folder / "make")
    for name, version in versions.items():
        (folder / name).write_text("#!/bin/sh\n" + (f"echo {version}\n" if version else "exit 127\n"))
        (folder / name).chmod(0o755)
    return str(folder)


def make(tmp_path, versions, *args):
    env = {"PATH": fake_pythons(tmp_path / "bin", versions), "HOME": str(tmp_path)}
    return subprocess.run(["make", "-n", f"VENV={tmp_path / 'venv'}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)


@pytest.mark.parametrize("versions, chosen", [
    ({"python3.13": "3.13", "python3.12": "3.12", "python3.11": "3.11", "python3": "3.14"},
     "python3.13"),
    ({"python3.13": None, "python3.12": "3.12", "python3.11": "3.11"}, "python3.12"),
    ({"python3.13": None, "python3.12": None, "python3.11": "3.11", "python3": "3.14"},
     "python3.11"),
    ({"python3": "3.12"}, "python3"),
])
def test_the_venv_is_made_with_the_newest_supported_python_on_the_path(tmp_path, versions, chosen):
    proc = make(tmp_path, versions, "install")
    assert proc.returncode == 0, proc.stderr
    assert f"{chosen} -m venv {tmp_path / 'venv'}" in proc.stdout


def test_python_picks_the_interpreter(tmp_path):
    proc = make(tmp_path, {"python3.12": "3.12", "python3.11": "3.11"}, "PYTHON=python3.11", "install")
    assert proc.returncode == 0 and f"python3.11 -m venv {tmp_path / 'venv'}" in proc.stdout


@pytest.mark.parametrize("given, says", [
    (None, "python3 is Python 3.14"),
    ("PYTHON=python3.14", "python3.14 is Python 3.14"),
    ("PYTHON=python3.10", "python3.10 is not an interpreter found on the PATH"),
])
def test_an_unsupported_python_is_refused_before_any_download_in_one_line(tmp_path, given, says):
    proc = make(tmp_path, {"python3": "3.14", "python3.14": "3.14"}, *filter(None, [given]),
                "quickstart")
    assert proc.returncode == 2 and proc.stdout == ""  # nothing run, not even the venv
    line, = proc.stderr.splitlines()
    assert line.endswith(f"*** {says}, and multipath_nmt supports Python 3.11, 3.12, 3.13 only: "
                         "install one (e.g. `uv python install 3.13` or `pyenv install 3.13`) and "
                         "pick it with `make PYTHON=python3.13 quickstart`.  Stop.")


def test_fairseq_is_built_against_the_venvs_torch_without_build_isolation(tmp_path):
    """torch first, then fairseq's build tools, then fairseq from its source distribution with
    no isolated build environment (which would download another torch), then the package; the
    installed torch pinned in every step."""
    proc = make(tmp_path, {"python3.13": "3.13"}, "install")
    venv_python = f"{tmp_path / 'venv'}/bin/python"
    steps = [line.split(f"{venv_python} -m pip install -q ")[1]
             for line in proc.stdout.splitlines() if f"{venv_python} -m pip install -q " in line]
    assert [step.split()[0] for step in steps] == [
        "torch==2.13.0", "setuptools", "--no-build-isolation", "-e"]
    assert '"fairseq-fixed==0.12.3.1"' in steps[2] and '-e ".[test]"' in steps[3]
    pinned = f"\"$({venv_python} -c 'import torch; print(\"torch==\" + torch.__version__.split(\"+\")[0])')\""
    assert all(step.endswith(pinned) for step in steps[1:4])


def test_python_given_to_make_is_not_the_scripts_interpreter(tmp_path):
    """The scripts read PYTHON as their interpreter: under make they must take the venv's (first
    on the PATH), not the one the venv was made with."""
    proc = subprocess.run(["make", "--no-print-directory", "PYTHON=python3.11", "--eval",
                           "show-python: ; @echo \"[$$PYTHON]\"", "show-python"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "python3.11"})
    assert (proc.returncode, proc.stdout) == (0, "[]\n")
