"""scripts/train.sh: the paper's recipe per architecture family, update-freq from the GPU count,
the CPU fallback, pass-through overrides, bad input, and one real 2-update run."""
import shlex
import sys

import pytest

from conftest import ROOT, TINY_MODEL, USER_DIR, clean_env, run_cli

import multipath_nmt  # noqa: F401  (safe checkpoint loading on torch >= 2.6)
from fairseq import checkpoint_utils

TRAIN_SH = ROOT / "scripts" / "train.sh"


@pytest.fixture
def fake_data_bin(tmp_path):
    (tmp_path / "dict.en.txt").write_text("a 1\n")
    return tmp_path


def _dry_run(data_bin, *args, gpus="0", check=True, **env):
    env = clean_env(PYTHON=sys.executable, MULTIPATH_NMT_NUM_GPUS=gpus, **env)
    return run_cli(["bash", TRAIN_SH, data_bin, "save", *args, "--dry-run"], env=env, check=check)


def _flags(proc):
    """The printed fairseq-train command as {flag: last value} (fairseq keeps the last one)."""
    line = [l for l in proc.stdout.splitlines() if "fairseq_cli.train" in l][-1]
    words = shlex.split(line.split("train.sh: ", 1)[1])
    flags = {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
            flags[word] = words[i + 1] if has_value else True
    return words, flags


def test_base_recipe_on_cpu(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_prenorm_wmt_en_de")
    assert "no CUDA device found, training in fp32 on the CPU" in proc.stdout
    words, flags = _flags(proc)
    assert words[1:3] == ["-m", "fairseq_cli.train"] and words[3] == str(fake_data_bin)
    assert flags["--user-dir"] == str(USER_DIR)
    assert flags["--adam-betas"] == "(0.9, 0.997)" and flags["--optimizer"] == "adam"
    assert flags["--lr-scheduler"] == "inverse_sqrt"
    assert (flags["--lr"], flags["--warmup-updates"]) == ("0.001", "8000")
    assert (flags["--max-tokens"], flags["--update-freq"]) == ("4096", "1")
    assert flags["--criterion"] == "label_smoothed_cross_entropy" and flags["--label-smoothing"] == "0.1"
    assert flags["--share-all-embeddings"] is True and flags["--cpu"] is True
    assert "--fp16" not in flags and flags["--keep-last-epochs"] == "10"
    assert not (fake_data_bin / "save").exists()  # --dry-run runs nothing


@pytest.mark.parametrize("arch,gpus,max_tokens,update_freq", [
    ("transformer_deep24_wmt_en_de", "1", None, "2"),
    ("multipath_transformer_wmt_en_de", "2", None, "1"),
    ("multipath_l12_p2_wmt_en_de", "1", "2048", "4"),
    ("widenet_transformer_wmt_en_de", "4", "1024", "2"),
    ("ewa_transformer_wmt_en_de", "0", "4096", "2"),
])
def test_deep_and_multipath_recipe(fake_data_bin, arch, gpus, max_tokens, update_freq):
    args = ["--arch", arch] + (["--max-tokens", max_tokens] if max_tokens else [])
    proc = _dry_run(fake_data_bin, *args, gpus=gpus)
    _, flags = _flags(proc)
    assert (flags["--lr"], flags["--warmup-updates"]) == ("0.002", "16000")
    assert flags["--max-tokens"] == (max_tokens or "4096") and flags["--update-freq"] == update_freq
    workers = max(int(gpus), 1)
    assert int(flags["--max-tokens"]) * int(update_freq) * workers == 8192
    moe = arch.startswith(("widenet", "ewa"))
    assert flags["--criterion"] == ("label_smoothed_cross_entropy_with_moe" if moe else "label_smoothed_cross_entropy")
    if gpus == "0":
        assert "--cpu" in flags and "--fp16" not in flags
    else:
        assert flags["--fp16"] is True and "--cpu" not in flags
        assert flags["--distributed-world-size"] == gpus


def test_max_tokens_from_env_and_overrides_win(fake_data_bin):
    proc = _dry_run(fake_data_bin, "--arch", "transformer_wmt_en_de", "--lr", "0.0007",
                    "--max-update", "300000", gpus="1", MAX_TOKENS="2048")
    words, flags = _flags(proc)
    assert (flags["--max-tokens"], flags["--update-freq"]) == ("2048", "2")
    assert flags["--lr"] == "0.0007" and flags["--max-update"] == "300000"
    assert words.index("0.0007") > words.index("0.001")  # after the recipe: the user's value wins


@pytest.mark.parametrize("args,message", [
    (["--lr", "0.1"], "--arch ARCH is required"),
    (["--arch", "transformer_wmt_en_de", "--max-tokens", "many"], "max-tokens must be a positive integer"),
])
def test_bad_arguments(fake_data_bin, args, message):
    proc = _dry_run(fake_data_bin, *args, check=False)
    assert proc.returncode == 1 and message in proc.stderr


def test_missing_data_bin(tmp_path):
    proc = _dry_run(tmp_path / "nope", "--arch", "transformer_wmt_en_de", check=False)
    assert proc.returncode == 1 and "has no dict.*.txt" in proc.stderr


@pytest.mark.slow
def test_real_two_update_run(toy_data_bin, tmp_path):
    save_dir = tmp_path / "ckpt"
    proc = run_cli(["bash", TRAIN_SH, toy_data_bin, save_dir, "--arch", "transformer_prenorm_wmt_en_de",
                    *TINY_MODEL, "--max-tokens", "400", "--max-update", "2", "--num-workers", "0",
                    "--no-progress-bar", "--log-format", "simple", "--disable-validation", "--seed", "1"],
                   env=clean_env(PYTHON=sys.executable))
    assert "training in fp32 on the CPU" in proc.stdout
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save_dir / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 2
    cfg = state["cfg"]
    assert cfg["model"].arch == "transformer_prenorm_wmt_en_de"
    assert tuple(cfg["optimization"]["lr"]) == (0.001,) and cfg["optimizer"]["adam_betas"] == "(0.9, 0.997)"
    assert cfg["lr_scheduler"]["warmup_updates"] == 8000 and cfg["criterion"]["label_smoothing"] == 0.1
    assert cfg["common"]["cpu"] and not cfg["common"]["fp16"]
