"""The recipe as installed commands: multipath-train and multipath-translate are train.sh and
translate.sh under their own names, and multipath-user-dir prints a --user-dir that works from
any folder."""
import importlib
import os
import sys

import pytest

from helpers import in_process
from multipath_nmt.cli import recipe_scripts, user_dir


@pytest.fixture
def data_bin(tmp_path):
    for lang in ("en", "de"):
        (tmp_path / f"dict.{lang}.txt").write_text("".join(f"w{i} 1\n" for i in range(100)))
    return tmp_path


def test_multipath_train_prints_the_train_sh_plan_under_its_own_name(data_bin, tmp_path):
    env = {"MULTIPATH_NMT_NUM_GPUS": "0", "MAX_TOKENS": None}
    ours = in_process.call(recipe_scripts.main, ["multipath-train", data_bin, tmp_path / "save",
                                                 "--arch", "transformer_prenorm_wmt_en_de", "--dry-run"],
                           env=env)
    script = in_process.call(recipe_scripts.main, ["train.sh", data_bin, tmp_path / "save",
                                                   "--arch", "transformer_prenorm_wmt_en_de", "--dry-run"],
                             env=env)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == script.stdout.replace("train.sh: ", "multipath-train: ")


def test_the_installed_commands_answer_usage_and_help_in_one_line(data_bin):
    short = in_process.call(recipe_scripts.main, ["multipath-train", data_bin])
    assert (short.returncode, short.stderr) == (
        2, "multipath-train: error: SAVE_DIR missing (--help lists the options)\n")
    helped = in_process.call(recipe_scripts.main, ["multipath-translate", "--help"])
    assert helped.returncode == 0
    assert helped.stdout.startswith("usage: multipath-translate DATA_BIN CHECKPOINT OUT_PREFIX")
    missing = in_process.call(recipe_scripts.main, ["multipath-translate", data_bin,
                                                    data_bin / "nothing.pt", data_bin / "out"])
    assert (missing.returncode, missing.stderr) == (
        1, f"multipath-translate: error: {data_bin / 'nothing.pt'}: no such checkpoint\n")


def test_the_printed_user_dir_imports_from_another_folder(tmp_path, capsys, monkeypatch):
    user_dir.main([])
    printed = capsys.readouterr().out.strip()
    assert os.path.isabs(printed) and os.path.isfile(os.path.join(printed, "__init__.py"))
    # fairseq's import_user_module with that path, from a folder that has no multipath_nmt
    monkeypatch.chdir(tmp_path)
    from fairseq.utils import import_user_module

    class Args:
        user_dir = printed
    import_user_module(Args)
    assert sys.modules["multipath_nmt"] is importlib.import_module("multipath_nmt")
