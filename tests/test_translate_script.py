"""scripts/translate.sh --dry-run: fp16 decoding on a GPU (as the models are trained), --fp32 to
keep fp32, the CPU without CUDA (MULTIPATH_NMT_NUM_GPUS stands in for the detected count)."""
import shlex

import pytest

from conftest import ROOT, USER_DIR, run_cli, script_env

TRANSLATE_SH = ROOT / "scripts" / "translate.sh"


def _dry_run(tmp_path, *args, gpus, check=True):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(b"")  # --dry-run only checks that it exists
    env = script_env(MULTIPATH_NMT_NUM_GPUS=gpus)
    return run_cli(["bash", TRANSLATE_SH, tmp_path, checkpoint, tmp_path / "out", *args,
                    "--dry-run"], env=env, check=check)


def _words(proc):
    line = [l for l in proc.stdout.splitlines() if "fairseq_cli.generate" in l][-1]
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


def test_translate_sh_missing_checkpoint(tmp_path):
    proc = run_cli(["bash", TRANSLATE_SH, tmp_path, tmp_path / "none.pt", tmp_path / "out"],
                   check=False)
    assert proc.returncode == 1 and "none.pt: no such checkpoint" in proc.stderr
    assert not list(tmp_path.iterdir())
