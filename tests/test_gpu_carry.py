"""`make gpu-carry` (scripts/gpu-carry.sh) and the offline install from .gpu-carry/ that
scripts/gpu-bench.sh and scripts/gpu-check.sh make where fairseq is missing
(scripts/gpu-carry-install.sh): what the carry lists, the install's logic on a fake carry (no
network), and, where .gpu-carry/ is built and GPU_CARRY_TEST_PYTHONS names interpreters whose
environment holds only torch (with numpy and scikit-learn, as a CUDA torch image does), the real
carry installed offline into each and imported."""
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-carry"
NEVER = {"torch", "torchaudio", "scikit-learn", "numpy"}


def carried_requirements():
    """GPU_CARRY_REQS and ANTLR of scripts/gpu-carry.sh, as bash reads them."""
    script = (ROOT / "scripts" / "gpu-carry.sh").read_text()
    arrays = "\n".join(re.findall(r"^(?:GPU_CARRY_REQS=\([^)]*\)|ANTLR=\S+|PYTHONS=\([^)]*\))",
                                  script, flags=re.M))
    out = subprocess.run(["bash", "-c", arrays + '\nprintf "%s\\n" "${GPU_CARRY_REQS[@]}" '
                          '"$ANTLR"; echo "${PYTHONS[*]}"'],
                         capture_output=True, text=True, check=True).stdout.split("\n")
    return out[:-2], out[-2]


def test_the_carry_lists_pinned_wheels_for_the_devices_pythons_and_no_torch():
    requirements, pythons = carried_requirements()
    assert pythons == "3.12 3.13"
    names = {r.split("==")[0].lower() for r in requirements}
    assert all("==" in r for r in requirements)
    assert not names & NEVER
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "bitarray", "sacrebleu"} <= names
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"^FAIRSEQ := fairseq-fixed==(\S+)", makefile, flags=re.M).group(1)
    assert f"FAIRSEQ_VERSION={version}\n" in (ROOT / "scripts" / "gpu-carry.sh").read_text()
    assert "/.gpu-carry/" in (ROOT / ".gitignore").read_text().split()


def _wheel(folder, name, version, files):
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for file, text in files.items():
            whl.writestr(file, text)
        whl.writestr(f"{dist}.dist-info/METADATA",
                     f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                     "Requires-Dist: torch\nRequires-Dist: torchaudio\n")
        whl.writestr(f"{dist}.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _install(python, carry, site, check="import fairseq"):
    return subprocess.run(
        ["bash", "-c", 'python=$1; source scripts/gpu-carry-install.sh; echo "PYTHONPATH=$PYTHONPATH"',
         "gpu-bench.sh", str(python)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "GPU_CARRY": str(carry), "GPU_CARRY_SITE": str(site),
             "GPU_CARRY_CHECK": check, "PYTHONPATH": ""})


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv with pip and nothing else: no fairseq, no index to reach (--no-index)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)],
                   check=True, timeout=300)
    return venv / "bin" / "python"


@pytest.mark.process  # other interpreters' venvs
def test_a_python_without_fairseq_installs_it_from_the_carry_with_no_index(tmp_path, bare_python):
    carry = tmp_path / "carry"
    carry.mkdir()
    _wheel(carry, "fairseq-fixed", "0.12.3.1", {"fairseq/__init__.py": "CARRIED = True\n"})
    _wheel(carry, "carried-dep", "1.0", {"carried_dep.py": ""})
    pip_version = subprocess.run([str(bare_python), "-m", "pip", "--version"], capture_output=True,
                                 text=True, check=True).stdout.split()[1]
    (carry / "requirements.txt").write_text(
        f"# a comment\nfairseq-fixed==0.12.3.1\ncarried-dep==1.0\npip=={pip_version}\n")
    site = tmp_path / "site"
    done = _install(bare_python, carry, site, "import fairseq, carried_dep; assert fairseq.CARRIED")
    assert done.returncode == 0, done.stderr
    # only what the interpreter lacks, with --no-deps (the fake metadata asks for torch)
    assert "installing from" in done.stderr and "carried-dep==1.0" in done.stderr
    assert f"pip=={pip_version}" not in done.stderr
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith("dist-info")) == \
        ["carried_dep.py", "fairseq"]
    assert f"PYTHONPATH={site}:{ROOT}" in done.stdout
    # the interpreter's own environment is left as it was
    listed = subprocess.run([str(bare_python), "-m", "pip", "list"], capture_output=True,
                            text=True, check=True).stdout
    assert "fairseq" not in listed and "carried" not in listed


def test_no_carry_is_one_line_and_a_python_with_fairseq_installs_nothing(tmp_path, bare_python):
    missing = _install(bare_python, tmp_path / "none", tmp_path / "site")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"gpu-bench.sh: {bare_python} has no fairseq and {tmp_path / 'none'} has no wheels: run "
        "`make gpu-carry` where pip works and carry .gpu-carry (docs/gpu.md)"]
    present = _install(sys.executable, tmp_path / "none", tmp_path / "site",
                       "import fairseq, multipath_nmt")
    assert present.returncode == 0 and "installing" not in present.stderr, present.stderr
    assert not (tmp_path / "site").exists()


def test_both_scripts_install_from_the_carry_before_they_run():
    for script in ("gpu-bench.sh", "gpu-check.sh"):
        text = (ROOT / "scripts" / script).read_text()
        source = text.index('source "$(dirname "${BASH_SOURCE[0]}")/gpu-carry-install.sh"')
        assert text.index("no CUDA device is visible") < source < text.index("-m multipath_nmt.cli")


@pytest.mark.slow
@pytest.mark.skipif(not (CARRY / "requirements.txt").exists()
                    or not os.environ.get("GPU_CARRY_TEST_PYTHONS"),
                    reason="needs `make gpu-carry` and GPU_CARRY_TEST_PYTHONS (interpreters whose "
                           "environment holds only torch, numpy and scikit-learn)")
@pytest.mark.parametrize("python", os.environ.get("GPU_CARRY_TEST_PYTHONS", "").split() or [None])
@pytest.mark.process
def test_the_real_carry_installs_offline_and_imports_fairseq_and_the_gpu_tools(tmp_path, python):
    listed = [str(python), "-m", "pip", "list", "--format", "freeze"]
    before = subprocess.run(listed, capture_output=True, text=True, check=True).stdout
    assert "fairseq" not in before and "torch==" in before
    site = tmp_path / "site"
    done = _install(python, CARRY, site, "import fairseq, multipath_nmt")
    assert done.returncode == 0, done.stderr[-3000:]
    assert not {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")} & \
        {"torch", "torchaudio", "scikit_learn", "numpy"}
    pythonpath = done.stdout.strip().split("PYTHONPATH=")[-1]
    imported = subprocess.run(
        [str(python), "-c", "import fairseq, fairseq_cli.train, multipath_nmt, "
         "multipath_nmt.benchmark.gpu_bench, multipath_nmt.cli.gpu_bench, "
         "multipath_nmt.cli.gpu_check; print(fairseq.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": pythonpath})
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip() == str(site / "fairseq" / "__init__.py")
    assert subprocess.run(listed, capture_output=True, text=True, check=True).stdout == before
