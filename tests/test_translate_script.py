"""scripts/translate.sh --dry-run: fp16 decoding on a GPU (as the models are trained), --fp32 to
keep fp32, the CPU without CUDA (MULTIPATH_NMT_NUM_GPUS stands in for the detected count)."""
import os
import shlex
import sys

import pytest

from conftest import ROOT, USER_DIR, run_cli
from helpers import in_process
from multipath_nmt.cli import recipe_scripts


def _dry_run(tmp_path, *args, gpus, check=True):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")  # --dry-run only checks that it exists
    # what translate.sh runs (scripts/run-recipe.sh), in this process
    proc = in_process.call(recipe_scripts.main, ["translate.sh", tmp_path, checkpoint,
                                                 tmp_path / "out", *args, "--dry-run"],
                           env={"MULTIPATH_NMT_NUM_GPUS": gpus})
    if check and proc.returncode != 0:
        pytest.fail(f"translate.sh --dry-run exited {proc.returncode}: {proc.stderr}")
    return proc


def _words(proc):
    line = [printed for printed in proc.stdout.splitlines() if "fairseq_cli.generate" in printed][-1]
    return shlex.split(line.split("translate.sh: ", 1)[1].rsplit(">", 1)[0])


@pytest.mark.parametrize("gpus,args,device_flags,message", [
    ("1", [], ["--fp16"], "decoding on the GPU in fp16 (--fp16)"),
    ("8", ["--beam", "5"], ["--fp16"], "decoding on the GPU in fp16 (--fp16)"),
    ("1", ["--fp32"], [], "decoding on the GPU in fp32 (--fp32)"),
    ("0", [], ["--cpu"], "no CUDA device, decoding on the CPU"),
])
def test_device_and_precision(tmp_path, gpus, args, device_flags, message):
    proc = _dry_run(tmp_path, *args, gpus=gpus)
    assert f"translate.sh: {message}" in proc.stdout
    words = _words(proc)
    assert words[1:4] == ["-m", "fairseq_cli.generate", str(tmp_path)]
    assert words[words.index("--user-dir") + 1] == str(USER_DIR)
    assert words[words.index("--lenpen") + 1] == "0.6" and "--remove-bpe" in words
    assert [w for w in words if w in ("--fp16", "--cpu")] == device_flags
    assert "--dry-run" not in words and "--fp32" not in words  # translate.sh's own flags
    if args[:1] == ["--beam"]:
        assert words[-2:] == ["--beam", "5"]  # after the defaults: the user's value wins
    assert not (tmp_path / "out.generate").exists() and not (tmp_path / "out.generate.tmp").exists()


def test_bad_gpu_count(tmp_path):
    proc = _dry_run(tmp_path, gpus="two", check=False)
    assert proc.returncode == 1
    assert "MULTIPATH_NMT_NUM_GPUS must be a number, got 'two'" in proc.stderr


@pytest.mark.process  # translate.sh's own check, before its Python
def test_translate_sh_missing_checkpoint(tmp_path):
    proc = run_cli(["bash", ROOT / "scripts" / "translate.sh", tmp_path, tmp_path / "none.pt",
                    tmp_path / "out"], check=False)
    assert proc.returncode == 1 and "none.pt: no such checkpoint" in proc.stderr
    assert not list(tmp_path.iterdir())


# --- OUT_PREFIX whose folder cannot hold the output: one line before any work -----------------

def _translate_sh_main(tmp_path, out, monkeypatch, *args):
    """translate.sh's main in this process (``recipe_scripts.main``) on a checkpoint that exists;
    the message it exits with (None when it returned)."""
    from multipath_nmt.cli import recipe_scripts

    monkeypatch.setenv("MULTIPATH_NMT_NUM_GPUS", "0")
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")
    try:
        recipe_scripts.main(["translate.sh", str(tmp_path), str(checkpoint), str(out), *args])
    except SystemExit as stop:
        return stop.code
    return None


def _bad_folders(tmp_path):
    """(OUT_PREFIX, what the line says) for each kind of folder that cannot hold the output.
    The tests run as root, for whom a chmod'ed read-only folder is writable: those are covered
    by the monkeypatched refusals below, these by real paths."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "mp.hyp").mkdir()
    return [
        (tmp_path / "missing" / "mp", f"its folder {tmp_path}/missing does not exist: create it "
                                      f"(mkdir -p {tmp_path}/missing) or give another OUT_PREFIX"),
        (tmp_path / "a-file" / "mp", f"its folder {tmp_path}/a-file is a file, not a folder; "
                                     "give another OUT_PREFIX"),
        (tmp_path / "a-file" / "sub" / "mp", f"its folder {tmp_path}/a-file/sub cannot exist: "
                                             f"{tmp_path}/a-file is a file, not a folder; give "
                                             "another OUT_PREFIX"),
        (tmp_path / "dangling" / "mp", f"its folder {tmp_path}/dangling is a symbolic link to "
                                       f"{tmp_path}/gone, which does not exist; give another "
                                       "OUT_PREFIX"),
        (tmp_path / "mp", f"{tmp_path}/mp.hyp is a folder, where translate.sh writes a file; "
                          "give another OUT_PREFIX"),
    ]


@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_an_out_prefix_whose_folder_cannot_hold_the_output_is_one_line(tmp_path, monkeypatch,
                                                                       capsys, dry_run):
    for out, problem in _bad_folders(tmp_path):
        message = _translate_sh_main(tmp_path, out, monkeypatch, *dry_run)
        assert message == f"translate.sh: error: OUT_PREFIX {out}: {problem}"
        assert capsys.readouterr().out == ""  # before the plan: nothing ran
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "checkpoint.pt", "dangling",
                                                          "mp.hyp"]


def test_an_out_prefix_in_a_folder_that_refuses_writes_is_one_line(tmp_path, monkeypatch, capsys):
    """A folder this process may not write in (as a user, chmod a-w; root is exempt, so here
    os.access says no), and one whose files cannot be opened for writing although os.access
    says yes (a read-only file system, an access rule: EACCES when the decoder's output is
    opened)."""
    import errno

    from multipath_nmt.recipe import translation

    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if path == str(tmp_path) else
                        real_access(path, mode))
    message = _translate_sh_main(tmp_path, tmp_path / "mp", monkeypatch)
    assert message == (f"translate.sh: error: OUT_PREFIX {tmp_path}/mp: cannot write in its folder "
                       f"{tmp_path} (permission denied); give another OUT_PREFIX")
    assert not (tmp_path / "mp.generate.tmp").exists()
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(os, "access", real_access)

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(translation, "open", refused, raising=False)
    with pytest.raises(translation.RecipeError) as refusal:
        translation.run_decoder([sys.executable, "-c", "pass"], tmp_path / "mp")
    assert str(refusal.value) == (f"OUT_PREFIX {tmp_path}/mp: cannot write in its folder "
                                  f"{tmp_path} (Permission denied); give another OUT_PREFIX")


def test_translate_sh_with_a_missing_out_folder_says_so_in_one_line(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")
    proc = in_process.call(recipe_scripts.main, ["translate.sh", tmp_path, checkpoint,
                                                 tmp_path / "results" / "mp"],
                           env={"MULTIPATH_NMT_NUM_GPUS": "0"})
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"translate.sh: error: OUT_PREFIX {tmp_path}/results/mp: its folder "
                           f"{tmp_path}/results does not exist: create it (mkdir -p "
                           f"{tmp_path}/results) or give another OUT_PREFIX\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
